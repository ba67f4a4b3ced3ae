//! Writing GGUF v3 files (the format of llama.cpp's `gguf-py` `GGUFWriter`: header, key/value
//! metadata, tensor infos with ggml dims innermost-first, data aligned to `general.alignment`).
//! Used by `strata synth` to make real-sized benchmark models; tensor data is produced in chunks by
//! a caller-supplied function, so a 17 GB file never needs 17 GB of memory. `strata repack` uses it
//! to rewrite a model with each expert's projections in one 4 KiB-aligned range
//! ([`TensorSpec::align`]).

use std::io::{BufWriter, Write};
use std::path::Path;

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::GgmlDType;

/// Data alignment (llama.cpp's default `general.alignment`).
pub const ALIGNMENT: u64 = 32;

/// A metadata value.
#[derive(Debug, Clone)]
pub enum MetaValue {
    U32(u32),
    F32(f32),
    Bool(bool),
    Str(String),
    StrArray(Vec<String>),
    I32Array(Vec<i32>),
    /// A value as read from a GGUF file (any type, arrays included): copies metadata verbatim.
    Gguf(candle_core::quantized::gguf_file::Value),
}

/// One tensor to write: `shape` row-major (`[rows, cols]`, `[experts, rows, cols]`).
#[derive(Debug, Clone)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: GgmlDType,
    /// Absolute file offset the tensor's data must start at a multiple of (bytes; 0: the file's
    /// `general.alignment`, or the format's default of 32). Must be a multiple of the file's
    /// alignment.
    pub align: u64,
}

impl TensorSpec {
    /// Bytes of the tensor's data. Errors when the last dim is not a multiple of the block size.
    pub fn bytes(&self) -> Result<u64, String> {
        let n: usize = self.shape.iter().product();
        let cols = *self.shape.last().unwrap_or(&1);
        let bs = self.dtype.block_size();
        if !cols.is_multiple_of(bs) {
            return Err(format!(
                "tensor `{}`: last dim {cols} is not a multiple of {:?}'s block size {bs}",
                self.name, self.dtype
            ));
        }
        Ok((n / bs * self.dtype.type_size()) as u64)
    }
}

/// ggml's type id (`enum ggml_type`).
pub fn ggml_type_id(dtype: GgmlDType) -> u32 {
    match dtype {
        GgmlDType::F32 => 0,
        GgmlDType::F16 => 1,
        GgmlDType::Q4_0 => 2,
        GgmlDType::Q4_1 => 3,
        GgmlDType::Q5_0 => 6,
        GgmlDType::Q5_1 => 7,
        GgmlDType::Q8_0 => 8,
        GgmlDType::Q8_1 => 9,
        GgmlDType::Q2K => 10,
        GgmlDType::Q3K => 11,
        GgmlDType::Q4K => 12,
        GgmlDType::Q5K => 13,
        GgmlDType::Q6K => 14,
        GgmlDType::Q8K => 15,
        GgmlDType::BF16 => 30,
    }
}

fn put_str(w: &mut impl Write, s: &str) -> std::io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

fn put_value(w: &mut impl Write, v: &MetaValue) -> std::io::Result<()> {
    const U32: u32 = 4;
    const I32: u32 = 5;
    const F32: u32 = 6;
    const BOOL: u32 = 7;
    const STR: u32 = 8;
    const ARR: u32 = 9;
    match v {
        MetaValue::U32(x) => {
            w.write_all(&U32.to_le_bytes())?;
            w.write_all(&x.to_le_bytes())
        }
        MetaValue::F32(x) => {
            w.write_all(&F32.to_le_bytes())?;
            w.write_all(&x.to_le_bytes())
        }
        MetaValue::Bool(x) => {
            w.write_all(&BOOL.to_le_bytes())?;
            w.write_all(&[*x as u8])
        }
        MetaValue::Str(s) => {
            w.write_all(&STR.to_le_bytes())?;
            put_str(w, s)
        }
        MetaValue::StrArray(a) => {
            w.write_all(&ARR.to_le_bytes())?;
            w.write_all(&STR.to_le_bytes())?;
            w.write_all(&(a.len() as u64).to_le_bytes())?;
            a.iter().try_for_each(|s| put_str(w, s))
        }
        MetaValue::I32Array(a) => {
            w.write_all(&ARR.to_le_bytes())?;
            w.write_all(&I32.to_le_bytes())?;
            w.write_all(&(a.len() as u64).to_le_bytes())?;
            a.iter().try_for_each(|x| w.write_all(&x.to_le_bytes()))
        }
        MetaValue::Gguf(v) => {
            w.write_all(&value_type(v).to_le_bytes())?;
            put_gguf_value(w, v)
        }
    }
}

/// GGUF's type id of a value.
fn value_type(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

/// A value's payload (without its type id). Arrays take their element type from the first element
/// (an empty array is written as an array of u8).
fn put_gguf_value(w: &mut impl Write, v: &Value) -> std::io::Result<()> {
    match v {
        Value::U8(x) => w.write_all(&[*x]),
        Value::I8(x) => w.write_all(&x.to_le_bytes()),
        Value::U16(x) => w.write_all(&x.to_le_bytes()),
        Value::I16(x) => w.write_all(&x.to_le_bytes()),
        Value::U32(x) => w.write_all(&x.to_le_bytes()),
        Value::I32(x) => w.write_all(&x.to_le_bytes()),
        Value::F32(x) => w.write_all(&x.to_le_bytes()),
        Value::Bool(x) => w.write_all(&[*x as u8]),
        Value::String(s) => put_str(w, s),
        Value::Array(a) => {
            w.write_all(&a.first().map_or(0, value_type).to_le_bytes())?;
            w.write_all(&(a.len() as u64).to_le_bytes())?;
            a.iter().try_for_each(|x| put_gguf_value(w, x))
        }
        Value::U64(x) => w.write_all(&x.to_le_bytes()),
        Value::I64(x) => w.write_all(&x.to_le_bytes()),
        Value::F64(x) => w.write_all(&x.to_le_bytes()),
    }
}

/// The header (magic through tensor table) with the given tensor offsets (relative to the data
/// start). Its length does not depend on the offsets' values.
fn header(
    metadata: &[(String, MetaValue)],
    tensors: &[TensorSpec],
    offsets: &[u64],
) -> std::io::Result<Vec<u8>> {
    let mut w = Vec::new();
    w.write_all(b"GGUF")?;
    w.write_all(&3u32.to_le_bytes())?;
    w.write_all(&(tensors.len() as u64).to_le_bytes())?;
    w.write_all(&(metadata.len() as u64).to_le_bytes())?;
    for (k, v) in metadata {
        put_str(&mut w, k)?;
        put_value(&mut w, v)?;
    }
    for (t, offset) in tensors.iter().zip(offsets) {
        put_str(&mut w, &t.name)?;
        w.write_all(&(t.shape.len() as u32).to_le_bytes())?;
        for d in t.shape.iter().rev() {
            w.write_all(&(*d as u64).to_le_bytes())?;
        }
        w.write_all(&ggml_type_id(t.dtype).to_le_bytes())?;
        w.write_all(&offset.to_le_bytes())?;
    }
    Ok(w)
}

/// `general.alignment` from `metadata` (the format's default when absent).
fn alignment(metadata: &[(String, MetaValue)]) -> u64 {
    metadata
        .iter()
        .find(|(k, _)| k == "general.alignment")
        .and_then(|(_, v)| match v {
            MetaValue::U32(a) | MetaValue::Gguf(Value::U32(a)) if *a > 0 => Some(*a as u64),
            _ => None,
        })
        .unwrap_or(ALIGNMENT)
}

/// Fills bytes of a tensor: `(tensor index, byte offset in the tensor, buffer)`.
pub type TensorFill<'a> = dyn FnMut(usize, u64, &mut [u8]) -> Result<(), String> + 'a;

/// Writes a GGUF v3 file. `fill(tensor, offset, buf)` writes the bytes of `tensors[tensor]` starting
/// at byte `offset` of that tensor into `buf` (chunks of at most `chunk` bytes, in order).
/// `progress(bytes_done, bytes_total)` is called after each chunk. Tensor data is aligned to
/// `general.alignment` from `metadata` (32 when absent), and to [`TensorSpec::align`] in the file.
///
/// Errors: I/O, a failing `fill`, a tensor whose shape does not fit its block type, or an `align`
/// that is not a multiple of the file's alignment.
pub fn write_gguf(
    path: &Path,
    metadata: &[(String, MetaValue)],
    tensors: &[TensorSpec],
    chunk: usize,
    fill: &mut TensorFill<'_>,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<(), String> {
    let io = |e: std::io::Error| format!("{}: {e}", path.display());
    let sizes = tensors.iter().map(TensorSpec::bytes).collect::<Result<Vec<_>, _>>()?;
    let align = alignment(metadata);
    // Offsets are fixed-width: the header's length is known before they are.
    let header_len = header(metadata, tensors, &vec![0; tensors.len()]).map_err(io)?.len() as u64;
    let data_start = header_len.div_ceil(align) * align;
    let mut offset = 0u64;
    let mut offsets = Vec::with_capacity(tensors.len());
    for (t, &size) in tensors.iter().zip(&sizes) {
        if t.align > 0 {
            if t.align % align != 0 {
                return Err(format!(
                    "tensor `{}`: alignment {} is not a multiple of general.alignment {align}",
                    t.name, t.align
                ));
            }
            offset = (data_start + offset).div_ceil(t.align) * t.align - data_start;
        }
        offsets.push(offset);
        offset = (offset + size).div_ceil(align) * align;
    }
    let total: u64 = sizes.iter().sum();
    let file = std::fs::File::create(path).map_err(io)?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    w.write_all(&header(metadata, tensors, &offsets).map_err(io)?).map_err(io)?;
    let mut buf = vec![0u8; chunk.max(1)];
    let mut done = 0u64;
    let mut pos = header_len;
    for (i, &size) in sizes.iter().enumerate() {
        let start = data_start + offsets[i];
        w.write_all(&vec![0u8; (start - pos) as usize]).map_err(io)?;
        // Whole blocks per chunk, so `fill` always starts at a block boundary.
        let ts = tensors[i].dtype.type_size();
        let step = (buf.len() / ts).max(1) * ts;
        if buf.len() < step {
            buf.resize(step, 0);
        }
        let mut at = 0u64;
        while at < size {
            let n = (size - at).min(step as u64) as usize;
            fill(i, at, &mut buf[..n])?;
            w.write_all(&buf[..n]).map_err(io)?;
            at += n as u64;
            done += n as u64;
            progress(done, total);
        }
        pos = start + size;
    }
    w.flush().map_err(io)?;
    Ok(())
}
