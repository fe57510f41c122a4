//! One host forward of a layer: out of place into a NaN-filled `y`, or in place on a copy of `x`.
//! The tests that compare chunked, in-place and one-pass results run both ways through this, in
//! f32 ([`forward`]) and with 16-bit x and y ([`forward_half`]); [`forward_io`] is the out-of-place
//! one in any I/O precision, for the tests that compare bits across paths.

use trimul::{Backend, IoElement, Layer, Precision, Result, Shape};

pub fn forward<B: Backend>(
    layer: &mut Layer<B>,
    x: &[f32],
    mask: Option<&[f32]>,
    shape: Shape,
    in_place: bool,
) -> Result<Vec<f32>> {
    forward_as(layer, x, mask, shape, in_place, f32::NAN)
}

/// [`forward`] in x's element type, `y` filled with `nan` first.
fn forward_as<B: Backend, T: IoElement>(
    layer: &mut Layer<B>,
    x: &[T],
    mask: Option<&[f32]>,
    shape: Shape,
    in_place: bool,
    nan: T,
) -> Result<Vec<T>> {
    if in_place {
        let mut xy = x.to_vec();
        layer.forward_in_place(&mut xy, mask, shape)?;
        Ok(xy)
    } else {
        let mut y = vec![nan; x.len()];
        layer.forward_into(x, mask, &mut y, shape)?;
        Ok(y)
    }
}

/// [`forward`] with 16-bit x given as `io` bit patterns (bf16 or f16), returning y's bits.
pub fn forward_half<B: Backend>(
    layer: &mut Layer<B>,
    bits: &[u16],
    mask: Option<&[f32]>,
    shape: Shape,
    io: Precision,
    in_place: bool,
) -> Result<Vec<u16>> {
    use half::{bf16, f16};
    Ok(match io {
        Precision::Bf16Io => {
            let x: Vec<bf16> = bits.iter().map(|&v| bf16::from_bits(v)).collect();
            forward_as(layer, &x, mask, shape, in_place, bf16::NAN)?.into_iter().map(bf16::to_bits).collect()
        }
        _ => {
            let x: Vec<f16> = bits.iter().map(|&v| f16::from_bits(v)).collect();
            forward_as(layer, &x, mask, shape, in_place, f16::NAN)?.into_iter().map(f16::to_bits).collect()
        }
    })
}

/// One out-of-place forward with x rounded to `io` first: the x the layer saw and y, as f32, and
/// y's bits (16-bit ones widened).
pub fn forward_io<B: Backend>(
    layer: &mut Layer<B>,
    x: &[f32],
    mask: Option<&[f32]>,
    shape: Shape,
    io: Precision,
) -> Result<(Vec<f32>, Vec<f32>, Vec<u32>)> {
    if io == Precision::F32Io {
        let y = forward(layer, x, mask, shape, false)?;
        let bits = y.iter().map(|v| v.to_bits()).collect();
        return Ok((x.to_vec(), y, bits));
    }
    let xb: Vec<u16> = x.iter().map(|&v| io.encode_half(v)).collect();
    let yb = forward_half(layer, &xb, mask, shape, io, false)?;
    let values = |bits: &[u16]| bits.iter().map(|&v| io.decode_half(v)).collect();
    Ok((values(&xb), values(&yb), yb.iter().map(|&v| u32::from(v)).collect()))
}
