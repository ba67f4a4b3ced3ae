//! Model construction and forward errors.

use strata_formats::FormatError;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// Boxed: a load error is rare and large, `Result`s stay small on the hot path.
    #[error(transparent)]
    Format(Box<FormatError>),
    #[error("tensor `{name}`: {source}")]
    Tensor { name: String, source: candle_core::Error },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("context full: {needed} tokens needed but the KV cache holds {capacity}")]
    ContextFull { needed: usize, capacity: usize },
    #[error("token id {id} is outside the vocabulary ({vocab})")]
    BadToken { id: u32, vocab: usize },
    /// Rolling back to `to` tokens needs recurrent state from before the checkpoint held (or
    /// there is none).
    #[error("cannot roll the recurrent state back to {to} tokens (checkpoint: {checkpoint:?})")]
    Rollback { to: usize, checkpoint: Option<usize> },
    /// A forward pass was stopped between layers by its caller ([`crate::Transformer::forward_interruptible`]).
    #[error("the forward pass was interrupted")]
    Interrupted,
    /// Reading a streamed expert failed (I/O error, short read, file changed).
    #[error("expert {expert} of layer {layer}: {message}")]
    ExpertRead { layer: usize, expert: usize, message: String },
}

impl From<FormatError> for ModelError {
    fn from(e: FormatError) -> Self {
        ModelError::Format(Box::new(e))
    }
}

impl ModelError {
    pub(crate) fn tensor(name: &str, source: candle_core::Error) -> Self {
        ModelError::Tensor { name: name.to_string(), source }
    }
}

pub type Result<T> = std::result::Result<T, ModelError>;
