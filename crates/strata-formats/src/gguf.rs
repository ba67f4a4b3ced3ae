//! GGUF v2/v3 reader (spec: ggml's `docs/gguf.md`).
//!
//! We parse the header ourselves (rather than `candle_core::quantized::gguf_file::Content::read`) so
//! that every error names the tensor at fault (an unsupported ggml type, a tensor past the end of the
//! file) and so that the byte range of every tensor is known before any weight is read: expert
//! streaming reads those ranges on demand. Metadata values reuse candle's [`Value`] type.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::Device;

use crate::error::{FormatError, Result};

const GGUF_MAGIC: u32 = 0x4655_4747; // "GGUF" little-endian
const DEFAULT_ALIGNMENT: u64 = 32;
const MAX_STRING: u64 = 1 << 26;
const MAX_ARRAY: u64 = 1 << 28;

/// One tensor's entry in the GGUF tensor table.
#[derive(Debug, Clone)]
pub struct GgufTensorInfo {
    /// Row-major shape (GGUF stores dims innermost-first; this is reversed to `[rows, cols]` order).
    pub shape: Vec<usize>,
    pub dtype: GgmlDType,
    /// Absolute byte offset of the tensor's data in the file.
    pub offset: u64,
    /// Size of the tensor's data in bytes.
    pub size: u64,
}

/// An opened GGUF file: metadata, tensor table, and the file handle for reading tensor bytes.
#[derive(Debug)]
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: HashMap<String, Value>,
    pub tensors: HashMap<String, GgufTensorInfo>,
    /// Tensor names in file order.
    pub tensor_order: Vec<String>,
    pub file_len: u64,
}

/// Maps a raw ggml type id to candle's type; `None` for types candle has no kernels for.
fn ggml_dtype(id: u32) -> Option<GgmlDType> {
    Some(match id {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        9 => GgmlDType::Q8_1,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        15 => GgmlDType::Q8K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

/// Human-readable name of a ggml type id, for error messages.
fn ggml_type_name(id: u32) -> String {
    let known = [
        (16, "IQ2_XXS"),
        (17, "IQ2_XS"),
        (18, "IQ3_XXS"),
        (19, "IQ1_S"),
        (20, "IQ4_NL"),
        (21, "IQ3_S"),
        (22, "IQ2_S"),
        (23, "IQ4_XS"),
        (24, "I8"),
        (25, "I16"),
        (26, "I32"),
        (27, "I64"),
        (28, "F64"),
        (29, "IQ1_M"),
        (34, "TQ1_0"),
        (35, "TQ2_0"),
        (39, "MXFP4"),
    ];
    known
        .iter()
        .find(|(k, _)| *k == id)
        .map(|(_, n)| format!("{n} (ggml type {id})"))
        .unwrap_or_else(|| format!("ggml type {id}"))
}

struct Reader<R> {
    inner: R,
    path: PathBuf,
    file_len: u64,
    pos: u64,
    /// Metadata values still allowed (each costs `size_of::<Value>()` bytes of memory beside the
    /// file): `(32 MiB + file length) / size_of::<Value>()`, so a header that declares huge
    /// arrays of one-byte elements cannot take more than about the file's size in memory.
    values_left: u64,
}

impl<R: Read> Reader<R> {
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        self.inner.read_exact(&mut b).map_err(|e| self.eof(e))?;
        self.pos += N as u64;
        Ok(b)
    }
    fn eof(&self, e: std::io::Error) -> FormatError {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            FormatError::invalid(
                &self.path,
                format!("GGUF header is truncated at byte {} of {}", self.pos, self.file_len),
            )
        } else {
            FormatError::io(&self.path, e)
        }
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }
    fn len(&mut self, what: &str, max: u64) -> Result<u64> {
        let n = self.u64()?;
        if n > max
            || n > self.file_len.saturating_sub(self.pos).saturating_mul(8).max(max.min(1 << 16))
        {
            return Err(FormatError::invalid(
                &self.path,
                format!(
                    "GGUF {what} length {n} at byte {} is implausible (corrupt header?)",
                    self.pos
                ),
            ));
        }
        Ok(n)
    }
    fn string(&mut self) -> Result<String> {
        let n = self.len("string", MAX_STRING)? as usize;
        if n as u64 > self.file_len.saturating_sub(self.pos) {
            return Err(FormatError::invalid(
                &self.path,
                format!("GGUF header is truncated: string of {n} bytes at byte {}", self.pos),
            ));
        }
        let mut v = vec![0u8; n];
        self.inner.read_exact(&mut v).map_err(|e| self.eof(e))?;
        self.pos += n as u64;
        while v.last() == Some(&0) {
            v.pop();
        }
        Ok(String::from_utf8_lossy(&v).into_owned())
    }
    fn value(&mut self, ty: u32, depth: usize) -> Result<Value> {
        Ok(match ty {
            0 => Value::U8(self.bytes::<1>()?[0]),
            1 => Value::I8(self.bytes::<1>()?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.bytes()?)),
            3 => Value::I16(i16::from_le_bytes(self.bytes()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(self.u32()? as i32),
            6 => Value::F32(f32::from_le_bytes(self.bytes()?)),
            7 => Value::Bool(self.bytes::<1>()?[0] != 0),
            8 => Value::String(self.string()?),
            9 => {
                if depth > 2 {
                    return Err(FormatError::invalid(
                        &self.path,
                        "GGUF metadata arrays nested too deeply",
                    ));
                }
                let elem_ty = self.u32()?;
                let n = self.len("array", MAX_ARRAY)?;
                // Every element takes at least this many bytes of the file.
                let min_bytes = match elem_ty {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    9 => 12,
                    _ => 8,
                };
                if n.saturating_mul(min_bytes) > self.file_len.saturating_sub(self.pos) {
                    return Err(FormatError::invalid(&self.path, format!("GGUF header truncated or corrupt: an array of {n} elements at byte {} does not fit in the file", self.pos)));
                }
                if n > self.values_left {
                    return Err(FormatError::invalid(&self.path, format!("GGUF metadata declares more values than a {}-byte file can hold in memory (array of {n} at byte {})", self.file_len, self.pos)));
                }
                self.values_left -= n;
                let mut out = Vec::with_capacity(n.min(1 << 20) as usize);
                for _ in 0..n {
                    out.push(self.value(elem_ty, depth + 1)?);
                }
                Value::Array(out)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(self.u64()? as i64),
            12 => Value::F64(f64::from_le_bytes(self.bytes()?)),
            t => {
                return Err(FormatError::invalid(
                    &self.path,
                    format!("GGUF metadata value type {t} is unknown"),
                ))
            }
        })
    }
}

impl GgufFile {
    /// Opens `path` and parses the header and tensor table (no tensor data is read).
    ///
    /// Errors: missing file, bad magic/version, truncated header, an unsupported tensor type
    /// (named), a tensor whose data lies past the end of the file (named).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|e| FormatError::io(&path, e))?;
        let file_len = file.metadata().map_err(|e| FormatError::io(&path, e))?.len();
        let values_left = ((32 << 20) + file_len) / std::mem::size_of::<Value>() as u64;
        let mut r = Reader {
            inner: BufReader::with_capacity(1 << 20, file),
            path: path.clone(),
            file_len,
            pos: 0,
            values_left,
        };
        let magic = r.u32()?;
        if magic != GGUF_MAGIC {
            return Err(FormatError::UnknownFormat {
                path,
                reason: format!("bad magic {magic:#x}, not a GGUF file"),
            });
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(FormatError::invalid(
                &path,
                format!("GGUF version {version} is not supported (2 or 3)"),
            ));
        }
        let n_tensors = r.len("tensor count", 1 << 24)?;
        let n_kv = r.len("metadata count", 1 << 24)?;
        let mut metadata = HashMap::new();
        for _ in 0..n_kv {
            let key = r.string()?;
            let ty = r.u32()?;
            let value = r.value(ty, 0)?;
            metadata.insert(key, value);
        }
        let mut raw = Vec::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            let name = r.string()?;
            let n_dims = r.u32()?;
            if n_dims > 4 {
                return Err(FormatError::invalid(
                    &path,
                    format!("tensor `{name}` has {n_dims} dimensions (max 4)"),
                ));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64()? as usize);
            }
            dims.reverse();
            let ty = r.u32()?;
            let offset = r.u64()?;
            raw.push((name, dims, ty, offset));
        }
        let alignment = match metadata.get("general.alignment") {
            Some(Value::U32(a)) if *a > 0 => *a as u64,
            _ => DEFAULT_ALIGNMENT,
        };
        let data_start = r.pos.div_ceil(alignment) * alignment;
        let mut tensors = HashMap::with_capacity(raw.len());
        let mut tensor_order = Vec::with_capacity(raw.len());
        for (name, shape, ty, rel) in raw {
            let dtype = ggml_dtype(ty).ok_or_else(|| FormatError::UnsupportedTensorType {
                path: path.clone(),
                tensor: name.clone(),
                dtype: ggml_type_name(ty),
            })?;
            let elems =
                shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| {
                    FormatError::invalid(
                        &path,
                        format!("tensor `{name}`: shape {shape:?} overflows"),
                    )
                })?;
            if elems % dtype.block_size() != 0 {
                return Err(FormatError::invalid(&path, format!("tensor `{name}`: {elems} elements is not a multiple of the {dtype:?} block size")));
            }
            let size =
                (elems / dtype.block_size()).checked_mul(dtype.type_size()).map(|s| s as u64);
            let range = size
                .and_then(|size| Some((data_start.checked_add(rel)?, size)))
                .and_then(|(o, size)| Some((o, size, o.checked_add(size)?)));
            let Some((offset, size, end)) = range else {
                return Err(FormatError::invalid(
                    &path,
                    format!("tensor `{name}`: offset {rel} and shape {shape:?} overflow"),
                ));
            };
            if end > file_len {
                return Err(FormatError::Truncated {
                    path,
                    tensor: name,
                    start: offset,
                    end,
                    file_len,
                });
            }
            tensor_order.push(name.clone());
            tensors.insert(name, GgufTensorInfo { shape, dtype, offset, size });
        }
        Ok(GgufFile { path, version, metadata, tensors, tensor_order, file_len })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    fn missing(&self, key: &str) -> FormatError {
        FormatError::MissingKey { path: self.path.clone(), key: key.to_string() }
    }

    /// A metadata string, e.g. `general.architecture`.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        match self.metadata.get(key) {
            Some(Value::String(s)) => Ok(s),
            _ => Err(self.missing(key)),
        }
    }

    /// A metadata integer of any integer type.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        let v = self.metadata.get(key).ok_or_else(|| self.missing(key))?;
        value_u64(v).ok_or_else(|| self.missing(key))
    }

    /// A metadata float (f32/f64, or an integer).
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        match self.metadata.get(key) {
            Some(Value::F32(f)) => Ok(*f as f64),
            Some(Value::F64(f)) => Ok(*f),
            Some(v) => value_u64(v).map(|u| u as f64).ok_or_else(|| self.missing(key)),
            None => Err(self.missing(key)),
        }
    }

    pub fn get_bool(&self, key: &str) -> Option<bool> {
        match self.metadata.get(key) {
            Some(Value::Bool(b)) => Some(*b),
            _ => None,
        }
    }

    /// A metadata array of booleans (`{arch}.attention.recurrent_layers`).
    pub fn get_bool_array(&self, key: &str) -> Result<Vec<bool>> {
        match self.metadata.get(key) {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v {
                    Value::Bool(b) => Ok(*b),
                    other => value_u64(other).map(|u| u != 0).ok_or_else(|| self.missing(key)),
                })
                .collect(),
            _ => Err(self.missing(key)),
        }
    }

    /// A metadata array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        match self.metadata.get(key) {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.as_str()),
                    _ => Err(self.missing(key)),
                })
                .collect(),
            _ => Err(self.missing(key)),
        }
    }

    /// A metadata array of integers.
    pub fn get_u64_array(&self, key: &str) -> Result<Vec<u64>> {
        match self.metadata.get(key) {
            Some(Value::Array(a)) => {
                a.iter().map(|v| value_u64(v).ok_or_else(|| self.missing(key))).collect()
            }
            _ => Err(self.missing(key)),
        }
    }

    pub fn tensor_info(&self, name: &str) -> Result<&GgufTensorInfo> {
        self.tensors.get(name).ok_or_else(|| FormatError::MissingTensor {
            path: self.path.clone(),
            tensor: name.to_string(),
        })
    }

    /// Reads one tensor's bytes from disk into a [`QTensor`] on `device`.
    pub fn read_qtensor(&self, name: &str, device: &Device) -> Result<QTensor> {
        let info = self.tensor_info(name)?;
        let buf = self.read_range(info.offset, info.size)?;
        qtensor_from_bytes(&self.path, name, info.dtype, &info.shape, &buf, device)
    }

    /// Byte range `(offset, len)` of `tensor[index]`, a slice along the outermost dim (one expert of
    /// a 3-D `ffn_*_exps` tensor: ggml stores it contiguously).
    pub fn index_range(&self, name: &str, index: usize) -> Result<(u64, u64)> {
        let info = self.tensor_info(name)?;
        let n = info.shape.first().copied().unwrap_or(0);
        let per_elems: usize = info.shape[1..].iter().product();
        if index >= n || !per_elems.is_multiple_of(info.dtype.block_size()) {
            return Err(FormatError::invalid(
                &self.path,
                format!("tensor `{name}`: cannot take slice {index} of shape {:?}", info.shape),
            ));
        }
        let per = info.size / n as u64;
        Ok((info.offset + per * index as u64, per))
    }

    /// Reads `tensor[index]` (shape `shape[1..]`) into a [`QTensor`]: one expert, reading only its bytes.
    pub fn read_qtensor_index(&self, name: &str, index: usize, device: &Device) -> Result<QTensor> {
        let info = self.tensor_info(name)?;
        let (offset, len) = self.index_range(name, index)?;
        let buf = self.read_range(offset, len)?;
        qtensor_from_bytes(&self.path, name, info.dtype, &info.shape[1..], &buf, device)
    }

    fn read_range(&self, offset: u64, len: u64) -> Result<Vec<u8>> {
        let mut file = File::open(&self.path).map_err(|e| FormatError::io(&self.path, e))?;
        file.seek(SeekFrom::Start(offset)).map_err(|e| FormatError::io(&self.path, e))?;
        let mut buf = vec![0u8; len as usize];
        file.read_exact(&mut buf).map_err(|e| FormatError::io(&self.path, e))?;
        Ok(buf)
    }
}

/// Builds a [`QTensor`] from raw ggml bytes (used by the resident loader and expert streaming).
pub fn qtensor_from_bytes(
    path: &Path,
    name: &str,
    dtype: GgmlDType,
    shape: &[usize],
    bytes: &[u8],
    device: &Device,
) -> Result<QTensor> {
    let storage = QStorage::from_data(std::borrow::Cow::Borrowed(bytes), device, dtype)
        .map_err(|e| FormatError::invalid(path, format!("tensor `{name}`: {e}")))?;
    QTensor::new(storage, shape.to_vec())
        .map_err(|e| FormatError::invalid(path, format!("tensor `{name}`: {e}")))
}

fn value_u64(v: &Value) -> Option<u64> {
    Some(match v {
        Value::U8(x) => *x as u64,
        Value::I8(x) if *x >= 0 => *x as u64,
        Value::U16(x) => *x as u64,
        Value::I16(x) if *x >= 0 => *x as u64,
        Value::U32(x) => *x as u64,
        Value::I32(x) if *x >= 0 => *x as u64,
        Value::U64(x) => *x,
        Value::I64(x) if *x >= 0 => *x as u64,
        _ => return None,
    })
}
