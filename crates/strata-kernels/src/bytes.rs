//! Weight bytes a [`crate::QuantMatrix`] reads from: an owned buffer, or a range of a buffer owned by
//! someone else (an expert-cache slot), so streamed experts are used where they were read, not copied.

use std::ops::Range;
use std::sync::Arc;

/// Immutable bytes shared by reference count: `owner`'s bytes in `range`.
#[derive(Clone)]
pub struct WeightBytes {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    range: Range<usize>,
}

impl WeightBytes {
    /// `range` of `owner`'s bytes. Errors when the range is outside them.
    pub fn new(
        owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
        range: Range<usize>,
    ) -> Result<Self, String> {
        let len = (*owner).as_ref().len();
        if range.start > range.end || range.end > len {
            return Err(format!("byte range {range:?} outside a buffer of {len} bytes"));
        }
        Ok(Self { owner, range })
    }

    pub fn as_slice(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.range.clone()]
    }

    pub fn len(&self) -> usize {
        self.range.len()
    }

    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }
}

impl From<Vec<u8>> for WeightBytes {
    fn from(v: Vec<u8>) -> Self {
        let range = 0..v.len();
        Self { owner: Arc::new(v), range }
    }
}

impl std::fmt::Debug for WeightBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WeightBytes({} bytes)", self.len())
    }
}
