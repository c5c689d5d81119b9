//! One safetensors file of named tensors, with a CRC-32 of its data section in the header's
//! `__metadata__` (`fsdp.crc32`) so corruption is detected, not loaded. Files of earlier
//! builds carry the legacy 64-bit checksum under `fsdp.checksum` instead; it is still
//! checked.

use super::atomic::write_atomic;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use std::collections::HashMap;
use std::path::Path;

/// Metadata key holding the CRC-32 of the data section (8 hex digits).
const CRC32_KEY: &str = "fsdp.crc32";
/// Metadata key of earlier builds: the [legacy checksum](legacy_checksum) of the data
/// section.
const LEGACY_CHECKSUM_KEY: &str = "fsdp.checksum";

/// The checksum algorithm of this build's files, as recorded in a checkpoint index
/// (`checksum_algorithm`): CRC-32 (IEEE 802.3, the polynomial of zlib, gzip and PNG).
pub const CHECKSUM_ALGORITHM: &str = "crc32";

/// The CRC-32 (IEEE) of `bytes` as 8 lowercase hex digits: what `checksum_algorithm:
/// "crc32"` means. Detects accidental corruption, not tampering. Standard tools give the
/// same value for a whole file, e.g. `python3 -c 'import sys, zlib;
/// print("%08x" % zlib.crc32(open(sys.argv[1], "rb").read()))' FILE` or `crc32 FILE`.
pub fn checksum(bytes: &[u8]) -> String {
    format!("{:08x}", crc32fast::hash(bytes))
}

/// The 64-bit checksum of indexes of versions 1 and 2 and of files with `fsdp.checksum`
/// (word-wise multiply-xorshift), as 16 hex digits. Kept only to check checkpoints that
/// earlier builds wrote; nothing is written with it.
pub(crate) fn legacy_checksum(bytes: &[u8]) -> String {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ (bytes.len() as u64).wrapping_mul(K);
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        h = (h ^ u64::from_le_bytes(w)).wrapping_mul(K);
        h ^= h >> 29;
    }
    for &b in chunks.remainder() {
        h = (h ^ b as u64).wrapping_mul(K);
        h ^= h >> 29;
    }
    format!("{h:016x}")
}

fn to_st(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
        DType::I32 => Dtype::I32,
        DType::F64 => Dtype::F64,
        DType::I64 => Dtype::I64,
    }
}

fn from_st(d: Dtype) -> Option<DType> {
    match d {
        Dtype::F32 => Some(DType::F32),
        Dtype::BF16 => Some(DType::BF16),
        Dtype::F16 => Some(DType::F16),
        Dtype::I32 => Some(DType::I32),
        Dtype::F64 => Some(DType::F64),
        Dtype::I64 => Some(DType::I64),
        _ => None,
    }
}

/// The tensor's bytes; a tensor on a CUDA device is copied to the host first.
fn bytes_of(t: &Tensor) -> Result<Vec<u8>> {
    if t.device().is_cuda() {
        return bytes_of(&t.to_device(crate::backend::Device::Cpu)?);
    }
    Ok(match t.dtype() {
        DType::F32 => bytemuck::cast_slice(&t.data::<f32>()?).to_vec(),
        DType::BF16 => bytemuck::cast_slice(&t.data::<half::bf16>()?).to_vec(),
        DType::F16 => bytemuck::cast_slice(&t.data::<half::f16>()?).to_vec(),
        DType::I32 => bytemuck::cast_slice(&t.data::<i32>()?).to_vec(),
        DType::F64 => bytemuck::cast_slice(&t.data::<f64>()?).to_vec(),
        DType::I64 => bytemuck::cast_slice(&t.data::<i64>()?).to_vec(),
    })
}

/// The safetensors name of a dtype (`"F32"`, `"BF16"`, ...): what an index of version 4
/// records as an entry's dtype.
pub(super) fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "F32",
        DType::BF16 => "BF16",
        DType::F16 => "F16",
        DType::I32 => "I32",
        DType::F64 => "F64",
        DType::I64 => "I64",
    }
}

/// The CRC-32 of `head` followed by the tensor's bytes (as [`serialize`] stores them), as
/// 8 hex digits; a tensor on a CUDA device is copied to the host first.
///
/// # Errors
/// A failed read of the tensor.
pub(super) fn tensor_checksum(head: &[u8], t: &Tensor) -> Result<String> {
    if t.device().is_cuda() {
        return tensor_checksum(head, &t.to_device(crate::backend::Device::Cpu)?);
    }
    let mut h = crc32fast::Hasher::new();
    h.update(head);
    match t.dtype() {
        DType::F32 => h.update(bytemuck::cast_slice(&t.data::<f32>()?)),
        DType::BF16 => h.update(bytemuck::cast_slice(&t.data::<half::bf16>()?)),
        DType::F16 => h.update(bytemuck::cast_slice(&t.data::<half::f16>()?)),
        DType::I32 => h.update(bytemuck::cast_slice(&t.data::<i32>()?)),
        DType::F64 => h.update(bytemuck::cast_slice(&t.data::<f64>()?)),
        DType::I64 => h.update(bytemuck::cast_slice(&t.data::<i64>()?)),
    }
    Ok(format!("{:08x}", h.finalize()))
}

/// The bytes of a safetensors file holding `tensors` (little-endian, row-major) and
/// `metadata` plus the data section's CRC-32 in `__metadata__` (`fsdp.crc32`).
///
/// # Errors
/// `Checkpoint` naming `path` when safetensors refuses (duplicate names, a header over
/// 100 MB); `NotMaterialized` for a meta tensor.
pub fn serialize(
    path: &Path,
    tensors: &[(String, Tensor)],
    metadata: &HashMap<String, String>,
) -> Result<Vec<u8>> {
    let bad = |detail: String| Error::Checkpoint {
        path: path.display().to_string(),
        detail,
    };
    let mut data: Vec<Owned> = Vec::with_capacity(tensors.len());
    for (n, t) in tensors {
        data.push((n.clone(), t.dtype(), t.shape().to_vec(), bytes_of(t)?));
    }
    // The checksum covers the data section, which does not depend on the metadata.
    let mut meta = metadata.clone();
    let probe = safetensors::serialize(views(&data, &bad)?, Some(meta.clone()))
        .map_err(|e| bad(e.to_string()))?;
    let n = header_len(&probe).unwrap_or(0);
    meta.insert(CRC32_KEY.into(), checksum(&probe[8 + n..]));
    let bytes = safetensors::serialize(views(&data, &bad)?, Some(meta.clone()))
        .map_err(|e| bad(e.to_string()))?;
    Ok(sort_metadata(bytes, &meta))
}

/// `bytes` with the header's `__metadata__` object rewritten with its keys sorted.
/// safetensors writes it in a `HashMap`'s order, which differs from map to map, so equal
/// tensors and metadata would give different files; sorted, they give equal bytes (the
/// same keys and values take the same length in any order). Returned unchanged when the
/// object is not found as expected.
fn sort_metadata(mut bytes: Vec<u8>, meta: &HashMap<String, String>) -> Vec<u8> {
    const KEY: &[u8] = b"\"__metadata__\":";
    let sorted: std::collections::BTreeMap<&String, &String> = meta.iter().collect();
    let (Some(n), Ok(want)) = (header_len(&bytes), serde_json::to_vec(&sorted)) else {
        return bytes;
    };
    let Some(header) = bytes.get(8..8 + n) else {
        return bytes;
    };
    let Some(at) = header.windows(KEY.len()).position(|w| w == KEY) else {
        return bytes;
    };
    let (start, end) = (8 + at + KEY.len(), 8 + at + KEY.len() + want.len());
    let same = bytes
        .get(start..end)
        .and_then(|s| serde_json::from_slice::<HashMap<String, String>>(s).ok())
        .is_some_and(|m| m == *meta);
    if same {
        bytes[start..end].copy_from_slice(&want);
    }
    bytes
}

/// Writes `tensors` and `metadata` to `path` as a safetensors file, atomically.
///
/// # Errors
/// As [`serialize`] and [`write_atomic`].
pub fn write_tensors(
    path: &Path,
    tensors: &[(String, Tensor)],
    metadata: &HashMap<String, String>,
) -> Result<()> {
    let bytes = serialize(path, tensors, metadata)?;
    write_atomic(path, &bytes)
}

type Owned = (String, DType, Vec<usize>, Vec<u8>);

fn views<'a>(
    data: &'a [Owned],
    bad: &dyn Fn(String) -> Error,
) -> Result<Vec<(String, TensorView<'a>)>> {
    data.iter()
        .map(|(n, d, s, b)| {
            TensorView::new(to_st(*d), s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| bad(format!("tensor '{n}': {e}")))
        })
        .collect()
}

/// A typed copy of little-endian bytes (any alignment).
fn from_bytes<T: bytemuck::Pod>(b: &[u8]) -> Vec<T> {
    let n = b.len() / std::mem::size_of::<T>();
    let mut out = vec![T::zeroed(); n];
    bytemuck::cast_slice_mut::<T, u8>(&mut out).copy_from_slice(&b[..n * std::mem::size_of::<T>()]);
    out
}

fn header_len(bytes: &[u8]) -> Option<usize> {
    let w: [u8; 8] = bytes.get(..8)?.try_into().ok()?;
    usize::try_from(u64::from_le_bytes(w)).ok()
}

/// The tensors and metadata of one safetensors file.
#[derive(Debug, Clone, Default)]
pub struct TensorFile {
    /// `(name, tensor)` pairs in the file's order (safetensors sorts by dtype then name).
    pub tensors: Vec<(String, Tensor)>,
    /// The `__metadata__` strings (the checksum included).
    pub metadata: HashMap<String, String>,
}

impl TensorFile {
    /// The tensor called `name`.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.tensors.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }
}

/// Reads a safetensors file: checks that it is complete and, when it carries one, that
/// its data matches its checksum; tensors come back as CPU tensors of f32, bf16, f16 or
/// i32.
///
/// # Errors
/// `Checkpoint` naming the file for a missing file, a truncated or malformed file (with
/// its size and what the header expected), a checksum mismatch, or a tensor of a dtype
/// this crate does not hold.
pub fn read_tensors(path: &Path) -> Result<TensorFile> {
    let bytes = std::fs::read(path).map_err(|e| Error::Checkpoint {
        path: path.display().to_string(),
        detail: format!("cannot read: {e}"),
    })?;
    parse_tensors(path, &bytes)
}

/// [`read_tensors`] on bytes already in memory; `path` is used in errors.
///
/// # Errors
/// As [`read_tensors`].
pub fn parse_tensors(path: &Path, bytes: &[u8]) -> Result<TensorFile> {
    let bad = |detail: String| Error::Checkpoint {
        path: path.display().to_string(),
        detail,
    };
    let st = SafeTensors::deserialize(bytes).map_err(|e| {
        let hint = match e {
            safetensors::SafeTensorError::MetadataIncompleteBuffer
            | safetensors::SafeTensorError::HeaderTooSmall
            | safetensors::SafeTensorError::InvalidHeaderLength => {
                "; the file is truncated (a save that did not finish?)"
            }
            _ => "; the file is corrupted or not a safetensors file",
        };
        bad(format!(
            "not a complete safetensors file ({} bytes): {e}{hint}",
            bytes.len()
        ))
    })?;
    let (n, meta) = SafeTensors::read_metadata(bytes).map_err(|e| bad(e.to_string()))?;
    let metadata = meta.metadata().clone().unwrap_or_default();
    let data = &bytes[8 + n..];
    let check = match (metadata.get(CRC32_KEY), metadata.get(LEGACY_CHECKSUM_KEY)) {
        (Some(want), _) => Some((checksum(data), want, "crc32")),
        (None, Some(want)) => Some((legacy_checksum(data), want, "legacy checksum")),
        (None, None) => None,
    };
    if let Some((got, want, what)) = check {
        if &got != want {
            return Err(bad(format!(
                "checksum mismatch: the data section's {what} is {got}, the header says {want}; the file is corrupted"
            )));
        }
    }
    let mut tensors = Vec::new();
    for (name, v) in st.iter() {
        let dtype = from_st(v.dtype()).ok_or_else(|| {
            bad(format!(
                "tensor '{name}' has dtype {:?}; expected F32 (BF16, F16 and I32 are also read)",
                v.dtype()
            ))
        })?;
        let shape = v.shape().to_vec();
        let t = match dtype {
            DType::F32 => Tensor::from_vec(from_bytes::<f32>(v.data()), &shape),
            DType::BF16 => Tensor::from_vec(from_bytes::<half::bf16>(v.data()), &shape),
            DType::F16 => Tensor::from_vec(from_bytes::<half::f16>(v.data()), &shape),
            DType::I32 => Tensor::from_vec(from_bytes::<i32>(v.data()), &shape),
            DType::F64 => Tensor::from_vec(from_bytes::<f64>(v.data()), &shape),
            DType::I64 => Tensor::from_vec(from_bytes::<i64>(v.data()), &shape),
        }?;
        tensors.push((name.to_string(), t));
    }
    Ok(TensorFile { tensors, metadata })
}
