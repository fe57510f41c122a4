//! The pair tensors `x`, `mask` and `y`: [`PairInput`], read from and written to safetensors
//! files in chunks (shapes and dtypes in the [module docs](crate::io)).

use std::fmt;
use std::io::{Read, Seek};
use std::path::Path;

use safetensors::Dtype;

use super::messages::{in_file, shape_str, shown};
use super::tensor_file::{
    decode_floats, float_size, reserve_values, write_f32_file, TensorFile, FLOAT_DTYPES, IN_MEMORY,
};
use crate::error::{Error, Result};
use crate::problem::Shape;

/// The input of a forward call: `x` `[B, N, N, C]` and the optional `mask` `[B, N, N]` of 0/1
/// values, row-major, f32.
#[derive(Clone, Debug, PartialEq)]
pub struct PairInput {
    /// `[B, N, N, C]`.
    pub x: Vec<f32>,
    /// `[B, N, N]` of 0/1 values, when the file has one.
    pub mask: Option<Vec<f32>>,
    /// Batch size B.
    pub batch: usize,
    /// Sequence length N.
    pub n: usize,
    /// Pair channels C.
    pub c: usize,
}

/// `B·N·N` and `B·N·N·C`, or a shape error when they overflow.
fn pair_sizes(batch: usize, n: usize, c: usize) -> Result<(usize, usize)> {
    let rows = batch.checked_mul(n).and_then(|v| v.checked_mul(n));
    let elems = rows.and_then(|r| r.checked_mul(c));
    match (rows, elems) {
        (Some(r), Some(e)) => Ok((r, e)),
        _ => Err(Error::Shape(format!("B={batch} N={n} C={c} overflows the address space"))),
    }
}

/// Position `[b, i, j]` of flat mask index `k`.
fn mask_position(k: usize, n: usize) -> String {
    format!("[{}, {}, {}]", k / (n * n), (k / n) % n, k % n)
}

fn check_mask_values(mask: &[f32], n: usize) -> Result<()> {
    if let Some(k) = mask.iter().position(|&v| v != 0.0 && v != 1.0) {
        return Err(Error::InvalidArgument(format!(
            "mask{} = {}; mask values must be 0 or 1",
            mask_position(k, n),
            mask[k]
        )));
    }
    Ok(())
}

impl PairInput {
    /// Validated construction: lengths match the shape, the mask holds only 0 and 1.
    pub fn new(x: Vec<f32>, mask: Option<Vec<f32>>, batch: usize, n: usize, c: usize) -> Result<Self> {
        let input = PairInput { x, mask, batch, n, c };
        input.validate()?;
        Ok(input)
    }

    /// Checks lengths against `batch`, `n` and `c`, and that the mask holds only 0 and 1.
    pub fn validate(&self) -> Result<()> {
        let (b, n, c) = (self.batch, self.n, self.c);
        if b == 0 || n == 0 || c == 0 {
            return Err(Error::Shape(format!("B={b} N={n} C={c}: every dimension must be at least 1")));
        }
        let (rows, elems) = pair_sizes(b, n, c)?;
        if self.x.len() != elems {
            return Err(Error::Shape(format!(
                "x has {} elements, expected B·N·N·C = {b}·{n}·{n}·{c} = {elems}",
                self.x.len()
            )));
        }
        if let Some(m) = &self.mask {
            if m.len() != rows {
                return Err(Error::Shape(format!(
                    "mask has {} elements, expected B·N·N = {b}·{n}·{n} = {rows}",
                    m.len()
                )));
            }
            check_mask_values(m, n)?;
        }
        Ok(())
    }

    /// Batch and sequence length.
    pub fn shape(&self) -> Shape {
        Shape::new(self.batch, self.n)
    }
}

/// Reads `x` as `[B, N, N, C]` (rank 3 means `B = 1`) from `path`'s tensor `name`.
fn pair_shape(path: &str, name: &str, shape: &[usize]) -> Result<[usize; 4]> {
    let dims = match *shape {
        [b, n1, n2, c] => [b, n1, n2, c],
        [n1, n2, c] => [1, n1, n2, c],
        _ => {
            return Err(Error::Shape(format!(
                "{path}: `{name}` has shape {} (rank {}), expected [B, N, N, C] or [N, N, C]",
                shape_str(shape),
                shape.len()
            )))
        }
    };
    if dims[1] != dims[2] {
        return Err(Error::Shape(format!(
            "{path}: `{name}` has shape {}, whose pair dimensions {} and {} differ (expected N × N)",
            shape_str(shape),
            dims[1],
            dims[2]
        )));
    }
    if dims.contains(&0) {
        return Err(Error::Shape(format!(
            "{path}: `{}` has shape {}, with an empty dimension",
            shown(name),
            shape_str(shape)
        )));
    }
    Ok(dims)
}

/// Appends the 0/1 mask values in `bytes` to `out`; on any other value, returns its index in
/// `bytes`' elements and its printed form.
fn decode_mask(dtype: Dtype, bytes: &[u8], out: &mut Vec<f32>) -> std::result::Result<(), (usize, String)> {
    fn push01<T: PartialEq + Default + fmt::Display>(
        out: &mut Vec<f32>,
        vals: impl Iterator<Item = T>,
        one: T,
    ) -> std::result::Result<(), (usize, String)> {
        for (k, v) in vals.enumerate() {
            if v == T::default() {
                out.push(0.0);
            } else if v == one {
                out.push(1.0);
            } else {
                return Err((k, v.to_string()));
            }
        }
        Ok(())
    }
    match dtype {
        Dtype::BOOL => push01(out, bytes.iter().copied(), 1u8).map_err(|(k, v)| (k, format!("{v} (not a valid bool)"))),
        Dtype::U8 => push01(out, bytes.iter().copied(), 1u8),
        Dtype::I32 => push01(out, bytes.chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]])), 1),
        Dtype::I64 => push01(
            out,
            bytes.chunks_exact(8).map(|b| i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])),
            1,
        ),
        _ => {
            let mut vals = Vec::with_capacity(bytes.len() / 2);
            decode_floats(dtype, bytes, &mut vals);
            push01(out, vals.into_iter(), 1.0f32)
        }
    }
}

/// Element size of the dtypes a mask may have.
fn mask_elem_size(dtype: Dtype) -> Option<usize> {
    match dtype {
        Dtype::BOOL | Dtype::U8 => Some(1),
        Dtype::I32 => Some(4),
        Dtype::I64 => Some(8),
        d => float_size(d),
    }
}

/// Reads `x` and the optional `mask` from a safetensors file (shapes and dtypes in the
/// [module docs](crate::io)).
pub fn read_input(path: impl AsRef<Path>) -> Result<PairInput> {
    read_pair_input(TensorFile::open(path.as_ref())?)
}

/// [`read_input`] on the bytes of a safetensors file.
pub fn read_input_bytes(bytes: &[u8]) -> Result<PairInput> {
    read_pair_input(TensorFile::from_bytes(bytes, IN_MEMORY)?)
}

fn read_pair_input<R: Read + Seek>(mut f: TensorFile<R>) -> Result<PairInput> {
    let p = f.path.clone();
    let xi = f.require("x")?;
    let [batch, n, _, c] = pair_shape(&p, "x", &xi.shape)?;
    let mask_info = f.info("mask");
    // Check the mask's shape and dtype before reading gigabytes of `x`.
    let mask_elem = match &mask_info {
        Some(mi) => {
            let ok = match *mi.shape.as_slice() {
                [b, n1, n2] => b == batch && n1 == n && n2 == n,
                [n1, n2] => batch == 1 && n1 == n && n2 == n,
                _ => false,
            };
            if !ok {
                return Err(Error::Shape(format!(
                    "{p}: `mask` has shape {} but `x` has shape {}; the mask must be [B, N, N] = [{batch}, {n}, {n}]{}",
                    shape_str(&mi.shape),
                    shape_str(&xi.shape),
                    if batch == 1 { format!(" or [N, N] = [{n}, {n}]") } else { String::new() }
                )));
            }
            Some(mask_elem_size(mi.dtype).ok_or_else(|| {
                Error::Dtype(format!(
                    "{p}: tensor `mask` is {}; expected {FLOAT_DTYPES}, BOOL, U8, I32 or I64",
                    mi.dtype
                ))
            })?)
        }
        None => None,
    };
    let x = f.read_floats("x", &xi)?;
    let mask = match (mask_info, mask_elem) {
        (Some(mi), Some(elem)) => {
            let mut out = Vec::new();
            reserve_values(&mut out, batch * n * n, "mask", &p)?;
            f.stream(&mi, elem, |bytes| {
                let base = out.len();
                decode_mask(mi.dtype, bytes, &mut out).map_err(|(k, v)| {
                    Error::InvalidArgument(format!(
                        "{p}: mask{} = {v}; mask values must be 0 or 1",
                        mask_position(base + k, n)
                    ))
                })
            })?;
            Some(out)
        }
        _ => None,
    };
    let input = PairInput { x, mask, batch, n, c };
    input.validate().map_err(|e| in_file(&p, e))?;
    Ok(input)
}

/// Writes `x` (`[B, N, N, C]`, F32) and, when present, `mask` (`[B, N, N]`, F32).
pub fn write_input(path: impl AsRef<Path>, input: &PairInput) -> Result<()> {
    input.validate()?;
    let PairInput { batch: b, n, c, .. } = *input;
    let mut tensors: Vec<(&str, Vec<usize>, &[f32])> = vec![("x", vec![b, n, n, c], &input.x)];
    if let Some(m) = &input.mask {
        tensors.push(("mask", vec![b, n, n], m));
    }
    write_f32_file(path.as_ref(), &tensors)
}

/// Writes `y` (`[B, N, N, C]`, F32).
pub fn write_output(path: impl AsRef<Path>, y: &[f32], batch: usize, n: usize, c: usize) -> Result<()> {
    let (_, elems) = pair_sizes(batch, n, c)?;
    if y.len() != elems {
        return Err(Error::Shape(format!(
            "y has {} elements, expected B·N·N·C = {batch}·{n}·{n}·{c} = {elems}",
            y.len()
        )));
    }
    write_f32_file(path.as_ref(), &[("y", vec![batch, n, n, c], y)])
}

/// Reads `y` and its shape `[B, N, N, C]` (a rank-3 `[N, N, C]` tensor reads as `B = 1`).
pub fn read_output(path: impl AsRef<Path>) -> Result<(Vec<f32>, [usize; 4])> {
    let mut f = TensorFile::open(path.as_ref())?;
    let yi = f.require("y")?;
    let dims = pair_shape(&f.path, "y", &yi.shape)?;
    let y = f.read_floats("y", &yi)?;
    Ok((y, dims))
}
