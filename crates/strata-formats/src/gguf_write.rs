//! Writing GGUF v3 files (the format of llama.cpp's `gguf-py` `GGUFWriter`: header, key/value
//! metadata, tensor infos with ggml dims innermost-first, data aligned to `general.alignment`).
//! Used by `strata synth` to make real-sized benchmark models; tensor data is produced in chunks by
//! a caller-supplied function, so a 17 GB file never needs 17 GB of memory.

use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::Path;

use candle_core::quantized::GgmlDType;

/// Data alignment (llama.cpp's default `general.alignment`).
pub const ALIGNMENT: u64 = 32;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U32(u32),
    F32(f32),
    Bool(bool),
    Str(String),
    StrArray(Vec<String>),
    I32Array(Vec<i32>),
}

/// One tensor to write: `shape` row-major (`[rows, cols]`, `[experts, rows, cols]`).
#[derive(Debug, Clone)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: GgmlDType,
}

impl TensorSpec {
    /// Bytes of the tensor's data. Errors when the last dim is not a multiple of the block size.
    pub fn bytes(&self) -> Result<u64, String> {
        let n: usize = self.shape.iter().product();
        let cols = *self.shape.last().unwrap_or(&1);
        let bs = self.dtype.block_size();
        if cols % bs != 0 {
            return Err(format!("tensor `{}`: last dim {cols} is not a multiple of {:?}'s block size {bs}", self.name, self.dtype));
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
    }
}

/// Writes a GGUF v3 file. `fill(tensor, offset, buf)` writes the bytes of `tensors[tensor]` starting
/// at byte `offset` of that tensor into `buf` (chunks of at most `chunk` bytes, in order).
/// `progress(bytes_done, bytes_total)` is called after each chunk.
///
/// Errors: I/O, or a tensor whose shape does not fit its block type.
pub fn write_gguf(
    path: &Path,
    metadata: &[(String, MetaValue)],
    tensors: &[TensorSpec],
    chunk: usize,
    fill: &mut dyn FnMut(usize, u64, &mut [u8]),
    progress: &mut dyn FnMut(u64, u64),
) -> Result<(), String> {
    let io = |e: std::io::Error| format!("{}: {e}", path.display());
    let sizes = tensors.iter().map(TensorSpec::bytes).collect::<Result<Vec<_>, _>>()?;
    let file = std::fs::File::create(path).map_err(io)?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    w.write_all(b"GGUF").map_err(io)?;
    w.write_all(&3u32.to_le_bytes()).map_err(io)?;
    w.write_all(&(tensors.len() as u64).to_le_bytes()).map_err(io)?;
    w.write_all(&(metadata.len() as u64).to_le_bytes()).map_err(io)?;
    for (k, v) in metadata {
        put_str(&mut w, k).map_err(io)?;
        put_value(&mut w, v).map_err(io)?;
    }
    let mut offset = 0u64;
    let mut offsets = Vec::with_capacity(tensors.len());
    for (t, &size) in tensors.iter().zip(&sizes) {
        put_str(&mut w, &t.name).map_err(io)?;
        w.write_all(&(t.shape.len() as u32).to_le_bytes()).map_err(io)?;
        for d in t.shape.iter().rev() {
            w.write_all(&(*d as u64).to_le_bytes()).map_err(io)?;
        }
        w.write_all(&ggml_type_id(t.dtype).to_le_bytes()).map_err(io)?;
        w.write_all(&offset.to_le_bytes()).map_err(io)?;
        offsets.push(offset);
        offset = (offset + size).div_ceil(ALIGNMENT) * ALIGNMENT;
    }
    let total = offset;
    let header = w.stream_position().map_err(io)?;
    let data_start = header.div_ceil(ALIGNMENT) * ALIGNMENT;
    w.write_all(&vec![0u8; (data_start - header) as usize]).map_err(io)?;
    let mut buf = vec![0u8; chunk.max(1)];
    let mut done = 0u64;
    for (i, &size) in sizes.iter().enumerate() {
        let pos = w.stream_position().map_err(io)?;
        if pos != data_start + offsets[i] {
            w.seek(SeekFrom::Start(data_start + offsets[i])).map_err(io)?;
        }
        // Whole blocks per chunk, so `fill` always starts at a block boundary.
        let ts = tensors[i].dtype.type_size();
        let step = (buf.len() / ts).max(1) * ts;
        if buf.len() < step {
            buf.resize(step, 0);
        }
        let mut at = 0u64;
        while at < size {
            let n = (size - at).min(step as u64) as usize;
            fill(i, at, &mut buf[..n]);
            w.write_all(&buf[..n]).map_err(io)?;
            at += n as u64;
            done += n as u64;
            progress(done, total);
        }
        let pad = (size.div_ceil(ALIGNMENT) * ALIGNMENT - size) as usize;
        w.write_all(&vec![0u8; pad]).map_err(io)?;
    }
    w.flush().map_err(io)?;
    Ok(())
}
