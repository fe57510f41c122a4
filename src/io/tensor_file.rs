//! safetensors files read and written as streams: the header parsed and checked against the file's
//! size, tensors read in chunks and decoded to f32, f32 tensors written through an atomic
//! replacement.

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype;

use super::files::{self, write_atomically};
use super::messages::{file_err, list, shown};
use crate::error::{Error, Result};

// ---------------------------------------------------------------------------------------------
// Decoding
// ---------------------------------------------------------------------------------------------

pub(super) const FLOAT_DTYPES: &str = "F32, F16, BF16 or F64";

/// Size in bytes of the float dtypes we decode; `None` for everything else.
pub(super) fn float_size(dtype: Dtype) -> Option<usize> {
    match dtype {
        Dtype::F32 => Some(4),
        Dtype::F16 | Dtype::BF16 => Some(2),
        Dtype::F64 => Some(8),
        _ => None,
    }
}

/// Appends the little-endian floats in `bytes` (whole elements of `dtype`) to `out` as f32.
/// `dtype` must be one `float_size` accepts; others append nothing.
pub(super) fn decode_floats(dtype: Dtype, bytes: &[u8], out: &mut Vec<f32>) {
    match dtype {
        Dtype::F32 => out.extend(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        Dtype::F16 => {
            out.extend(bytes.chunks_exact(2).map(|b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()))
        }
        Dtype::BF16 => {
            out.extend(bytes.chunks_exact(2).map(|b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()))
        }
        Dtype::F64 => out.extend(
            bytes.chunks_exact(8).map(|b| f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f32),
        ),
        _ => {}
    }
}

pub(super) const IN_MEMORY: &str = "<in-memory safetensors>";

// ---------------------------------------------------------------------------------------------
// Streamed files
// ---------------------------------------------------------------------------------------------

/// Bytes read or written per step when streaming a tensor.
const CHUNK_BYTES: usize = 1 << 20;

/// The safetensors crate's own header limit; a larger length means a corrupt file.
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// An open safetensors file (or the bytes of one) whose header has been parsed (by the
/// safetensors crate's own `Metadata` deserializer, which also checks that offsets are contiguous
/// and sizes match the dtypes) and checked against the file's size; its data is read on demand.
/// Nothing is read that the header does not declare, and the header's own length is bounded.
pub(super) struct TensorFile<R = File> {
    pub(super) path: String,
    file: R,
    data_start: u64,
    pub(super) meta: Metadata,
}

impl TensorFile<File> {
    pub(super) fn open(path: &Path) -> Result<Self> {
        let (file, len) = files::open_regular(path, "safetensors file")?;
        TensorFile::new(file, len, path.display().to_string())
    }
}

impl<'a> TensorFile<std::io::Cursor<&'a [u8]>> {
    pub(super) fn from_bytes(bytes: &'a [u8], label: &str) -> Result<Self> {
        TensorFile::new(std::io::Cursor::new(bytes), bytes.len() as u64, label.to_string())
    }
}

impl<R: Read + Seek> TensorFile<R> {
    /// Reads and checks the header of the `len`-byte file `file`, positioned at its start.
    fn new(mut file: R, len: u64, p: String) -> Result<Self> {
        if len < 8 {
            return Err(file_err(
                &p,
                format!("{len} bytes is too short for a safetensors file (it starts with an 8-byte header length)"),
            ));
        }
        let mut n8 = [0u8; 8];
        file.read_exact(&mut n8).map_err(|e| file_err(&p, format!("cannot read the header length: {e}")))?;
        let n = u64::from_le_bytes(n8);
        if n > MAX_HEADER_BYTES || n > len - 8 {
            return Err(file_err(&p, format!("not a safetensors file: header length {n} in a {len}-byte file")));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact(&mut header).map_err(|e| file_err(&p, format!("cannot read the header: {e}")))?;
        check_unique_names(&header).map_err(|m| file_err(&p, m))?;
        let meta: Metadata = serde_json::from_slice(&header)
            .map_err(|e| file_err(&p, format!("not a safetensors file: bad header: {e}")))?;
        let data_start = 8 + n;
        let described = data_start.saturating_add(meta.data_len() as u64);
        if described > len {
            return Err(file_err(
                &p,
                format!("the header describes {described} bytes but the file has {len}: truncated or corrupt"),
            ));
        }
        if described < len {
            return Err(file_err(
                &p,
                format!(
                    "the header describes {described} bytes but the file has {len}: {} bytes after the last tensor \
                     (not a safetensors file, or a corrupt one)",
                    len - described
                ),
            ));
        }
        Ok(TensorFile { path: p, file, data_start, meta })
    }

    pub(super) fn info(&self, name: &str) -> Option<TensorInfo> {
        self.meta.info(name).cloned()
    }

    pub(super) fn require(&self, name: &str) -> Result<TensorInfo> {
        self.info(name).ok_or_else(|| {
            let mut names = self.meta.offset_keys();
            names.sort_unstable();
            file_err(&self.path, format!("no tensor `{}` (tensors: {})", shown(name), list(&names, 8)))
        })
    }

    /// Feeds the tensor's bytes to `sink` in chunks of whole elements of `elem` bytes.
    pub(super) fn stream(
        &mut self,
        info: &TensorInfo,
        elem: usize,
        mut sink: impl FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let (start, end) = info.data_offsets;
        let read_err = |e: std::io::Error| file_err(&self.path, format!("read failed: {e}"));
        self.file.seek(SeekFrom::Start(self.data_start + start as u64)).map_err(read_err)?;
        let step = (CHUNK_BYTES / elem).max(1) * elem;
        let mut remaining = end - start;
        let mut buf = vec![0u8; step.min(remaining)];
        while remaining > 0 {
            let k = step.min(remaining);
            self.file.read_exact(&mut buf[..k]).map_err(read_err)?;
            sink(&buf[..k])?;
            remaining -= k;
        }
        Ok(())
    }

    pub(super) fn read_floats(&mut self, name: &str, info: &TensorInfo) -> Result<Vec<f32>> {
        let elem = float_size(info.dtype).ok_or_else(|| {
            Error::Dtype(format!("{}: tensor `{}` is {}; expected {FLOAT_DTYPES}", self.path, shown(name), info.dtype))
        })?;
        // The file's shape decides the size: a failed reservation is an error, not an abort.
        let len: usize = info.shape.iter().product();
        let mut out = Vec::new();
        reserve_values(&mut out, len, name, &self.path)?;
        self.stream(info, elem, |bytes| {
            decode_floats(info.dtype, bytes, &mut out);
            Ok(())
        })?;
        Ok(out)
    }
}

/// Reserves room for `len` f32 values of tensor `name`, or returns the out-of-memory error that
/// names them and what the host has available ([`crate::hostmem`]).
pub(super) fn reserve_values(out: &mut Vec<f32>, len: usize, name: &str, path: &str) -> Result<()> {
    crate::hostmem::try_reserve(out, len, &format!("{path}: tensor `{}` ({len} values as f32)", shown(name)))
}

/// Refuses a header that names a tensor twice. The safetensors crate's map keeps the last of two
/// equal names, so the first one's bytes would be unaccounted for and the file would read as
/// truncated or corrupt. A header that is not a JSON object passes here and is refused by the
/// full parse with its own message.
fn check_unique_names(header: &[u8]) -> std::result::Result<(), String> {
    struct Keys(Vec<String>);
    impl<'de> serde::Deserialize<'de> for Keys {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
            struct V;
            impl<'de> serde::de::Visitor<'de> for V {
                type Value = Keys;
                fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                    f.write_str("a JSON object")
                }
                fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> std::result::Result<Keys, A::Error> {
                    let mut keys = Vec::new();
                    while let Some(k) = map.next_key::<String>()? {
                        map.next_value::<serde::de::IgnoredAny>()?;
                        keys.push(k);
                    }
                    Ok(Keys(keys))
                }
            }
            d.deserialize_map(V)
        }
    }
    let Ok(Keys(mut keys)) = serde_json::from_slice::<Keys>(header) else { return Ok(()) };
    keys.sort_unstable();
    match keys.windows(2).find(|w| w[0] == w[1]) {
        Some(w) => Err(format!(
            "the header names tensor `{}` twice; a safetensors file names each tensor once (corrupt or hand-edited \
             header)",
            w[0]
        )),
        None => Ok(()),
    }
}

/// Writes f32 tensors, streaming their bytes. The header is the safetensors crate's own
/// `Metadata` serialization, padded to 8 bytes as the crate pads it.
pub(super) fn write_f32_file(path: &Path, tensors: &[(&str, Vec<usize>, &[f32])]) -> Result<()> {
    let p = path.display().to_string();
    let mut infos = Vec::with_capacity(tensors.len());
    let mut offset = 0usize;
    for (name, shape, data) in tensors {
        let bytes = data.len() * 4;
        infos.push((
            name.to_string(),
            TensorInfo { dtype: Dtype::F32, shape: shape.clone(), data_offsets: (offset, offset + bytes) },
        ));
        offset += bytes;
    }
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let meta = Metadata::new(Some(metadata), infos).map_err(|e| file_err(&p, format!("bad tensor layout: {e}")))?;
    let mut header = serde_json::to_vec(&meta).map_err(|e| file_err(&p, format!("cannot encode the header: {e}")))?;
    header.resize(header.len().next_multiple_of(8), b' ');
    write_atomically(path, |w| {
        w.write_all(&(header.len() as u64).to_le_bytes())?;
        w.write_all(&header)?;
        let mut buf = Vec::with_capacity(CHUNK_BYTES);
        for (_, _, data) in tensors {
            for chunk in data.chunks(CHUNK_BYTES / 4) {
                buf.clear();
                buf.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
                w.write_all(&buf)?;
            }
        }
        Ok(())
    })
}
