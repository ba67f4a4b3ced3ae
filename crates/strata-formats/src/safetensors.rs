//! Safetensors reader (format: huggingface/safetensors `README.md`): an 8-byte little-endian header
//! length, a JSON header `{name: {dtype, shape, data_offsets: [begin, end]}}`, then the data.
//!
//! Like [`crate::gguf`], the header is parsed up front so that every tensor's absolute byte range is
//! known (expert streaming reads ranges on demand) and errors name the tensor. Files are memory-mapped
//! for the resident loader.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use crate::error::{FormatError, Result};

/// One tensor of a safetensors file.
#[derive(Debug, Clone)]
pub struct SafetensorsInfo {
    /// Index into [`SafetensorsSet::files`].
    pub file: usize,
    pub dtype: String,
    pub shape: Vec<usize>,
    /// Absolute byte offset in the file.
    pub offset: u64,
    /// Size in bytes.
    pub size: u64,
}

/// One or more safetensors files (a sharded checkpoint) viewed as one tensor namespace.
#[derive(Debug)]
pub struct SafetensorsSet {
    pub files: Vec<PathBuf>,
    maps: Vec<Arc<memmap2::Mmap>>,
    pub tensors: HashMap<String, SafetensorsInfo>,
}

/// A tensor's entry in the header (`__metadata__` is skipped before this is parsed).
#[derive(serde::Deserialize)]
struct TensorHeader {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

fn elem_size(dtype: &str) -> Option<usize> {
    Some(match dtype {
        "F32" | "I32" | "U32" => 4,
        "F16" | "BF16" | "I16" | "U16" => 2,
        "F64" | "I64" | "U64" => 8,
        "I8" | "U8" | "BOOL" | "F8_E4M3" | "F8_E5M2" => 1,
        _ => return None,
    })
}

impl SafetensorsSet {
    /// Opens and validates each file's header; tensors must lie inside their file.
    pub fn open(files: Vec<PathBuf>) -> Result<Self> {
        let mut maps = Vec::with_capacity(files.len());
        let mut tensors = HashMap::new();
        for (fi, path) in files.iter().enumerate() {
            let file = File::open(path).map_err(|e| FormatError::io(path, e))?;
            // SAFETY: the mapping is read-only; like every mmap-based loader (candle, llama.cpp) we
            // assume the model file is not modified while it is loaded.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| FormatError::io(path, e))?;
            let file_len = map.len() as u64;
            if file_len < 8 {
                return Err(FormatError::invalid(
                    path,
                    "safetensors file is shorter than its 8-byte header length",
                ));
            }
            let n = u64::from_le_bytes(map[..8].try_into().unwrap_or([0; 8]));
            if n > file_len - 8 || n > 100 << 20 {
                return Err(FormatError::invalid(path, format!("safetensors header length {n} exceeds the file ({file_len} bytes): truncated or corrupt")));
            }
            // Borrowed raw values: a large header costs no more than its bytes and a map of names.
            let header: HashMap<String, &serde_json::value::RawValue> =
                serde_json::from_slice(&map[8..8 + n as usize]).map_err(|e| {
                    FormatError::invalid(path, format!("safetensors header is not valid JSON: {e}"))
                })?;
            let data_start = 8 + n;
            for (name, raw) in header {
                if name == "__metadata__" {
                    continue;
                }
                let h: TensorHeader = serde_json::from_str(raw.get())
                    .map_err(|e| FormatError::invalid(path, format!("tensor `{name}`: {e}")))?;
                let TensorHeader { dtype, shape, data_offsets: offs } = h;
                let es = elem_size(&dtype).ok_or_else(|| FormatError::UnsupportedTensorType {
                    path: path.clone(),
                    tensor: name.clone(),
                    dtype: dtype.clone(),
                })?;
                let bytes = shape.iter().try_fold(es as u64, |a, &d| a.checked_mul(d));
                let size = offs[1].checked_sub(offs[0]);
                if bytes.is_none() || bytes != size {
                    return Err(FormatError::invalid(path, format!("tensor `{name}`: data_offsets {offs:?} do not match shape {shape:?} of {dtype}")));
                }
                let size = size.unwrap_or(0);
                let (Some(start), Some(end)) =
                    (data_start.checked_add(offs[0]), data_start.checked_add(offs[1]))
                else {
                    return Err(FormatError::invalid(
                        path,
                        format!("tensor `{name}`: data_offsets {offs:?} overflow"),
                    ));
                };
                if end > file_len {
                    return Err(FormatError::Truncated {
                        path: path.clone(),
                        tensor: name,
                        start,
                        end,
                        file_len,
                    });
                }
                let shape = shape.iter().map(|&d| d as usize).collect();
                tensors
                    .insert(name, SafetensorsInfo { file: fi, dtype, shape, offset: start, size });
            }
            maps.push(Arc::new(map));
        }
        Ok(SafetensorsSet { files, maps, tensors })
    }

    pub fn info(&self, name: &str) -> Option<&SafetensorsInfo> {
        self.tensors.get(name)
    }

    /// The raw bytes of one tensor (borrowed from the mapping).
    pub fn bytes(&self, info: &SafetensorsInfo) -> &[u8] {
        &self.maps[info.file][info.offset as usize..(info.offset + info.size) as usize]
    }

    /// Loads one tensor as f32 on `device` (F32/F16/BF16 sources).
    pub fn load_f32(&self, name: &str, device: &Device) -> Result<Tensor> {
        self.load_f32_part(name, None, device)
    }

    /// Loads `tensor[index]` (a slice along dim 0, shape `shape[1..]`) as f32: one expert of a fused
    /// `[experts, ..]` tensor. Reads only that slice's bytes.
    pub fn load_f32_index(&self, name: &str, index: usize, device: &Device) -> Result<Tensor> {
        self.load_f32_part(name, Some(index), device)
    }

    fn load_f32_part(&self, name: &str, index: Option<usize>, device: &Device) -> Result<Tensor> {
        let info = self.info(name).ok_or_else(|| FormatError::MissingTensor {
            path: self.files.first().cloned().unwrap_or_default(),
            tensor: name.to_string(),
        })?;
        let path = &self.files[info.file];
        let dtype = match info.dtype.as_str() {
            "F32" => DType::F32,
            "F16" => DType::F16,
            "BF16" => DType::BF16,
            other => {
                return Err(FormatError::UnsupportedTensorType {
                    path: path.clone(),
                    tensor: name.to_string(),
                    dtype: other.to_string(),
                })
            }
        };
        let all = self.bytes(info);
        let (bytes, shape) = match index {
            None => (all, info.shape.clone()),
            Some(i) => {
                let n = info.shape.first().copied().unwrap_or(0);
                if i >= n {
                    return Err(FormatError::invalid(
                        path,
                        format!("tensor `{name}`: index {i} out of {n}"),
                    ));
                }
                let per = all.len() / n;
                (&all[i * per..(i + 1) * per], info.shape[1..].to_vec())
            }
        };
        let t = Tensor::from_raw_buffer(bytes, dtype, &shape, &Device::Cpu)
            .and_then(|t| t.to_dtype(DType::F32))
            .and_then(|t| t.to_device(device))
            .map_err(|e| FormatError::candle(path, e))?;
        Ok(t)
    }
}

/// Files of an HF checkpoint directory: `model.safetensors`, or the shards listed by
/// `model.safetensors.index.json`.
pub fn hf_weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|e| FormatError::io(&index, e))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| FormatError::invalid(&index, e.to_string()))?;
        let map = v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| {
            FormatError::MissingKey { path: index.clone(), key: "weight_map".into() }
        })?;
        let mut files: Vec<String> =
            map.values().filter_map(|f| f.as_str().map(String::from)).collect();
        files.sort();
        files.dedup();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    Err(FormatError::MissingFile { path: single })
}
