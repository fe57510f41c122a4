//! One host forward of a layer: out of place into a NaN-filled `y`, or in place on a copy of `x`.
//! The tests that compare chunked, in-place and one-pass results run both ways through this, in
//! f32 ([`forward`]) and with 16-bit x and y ([`forward_half`]).

use trimul::{Backend, IoElement, Layer, Precision, Result, Shape};

pub fn forward<B: Backend>(
    layer: &mut Layer<B>,
    x: &[f32],
    mask: Option<&[f32]>,
    shape: Shape,
    in_place: bool,
) -> Result<Vec<f32>> {
    if in_place {
        let mut xy = x.to_vec();
        layer.forward_in_place(&mut xy, mask, shape)?;
        Ok(xy)
    } else {
        let mut y = vec![f32::NAN; x.len()];
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
    fn run<B: Backend, T: IoElement>(
        layer: &mut Layer<B>,
        bits: &[u16],
        mask: Option<&[f32]>,
        shape: Shape,
        in_place: bool,
        from_bits: fn(u16) -> T,
        to_bits: fn(T) -> u16,
    ) -> Result<Vec<u16>> {
        let mut xh: Vec<T> = bits.iter().map(|&v| from_bits(v)).collect();
        if in_place {
            layer.forward_in_place(&mut xh, mask, shape)?;
            return Ok(xh.into_iter().map(to_bits).collect());
        }
        let mut yh = vec![T::default(); xh.len()];
        layer.forward_into(&xh, mask, &mut yh, shape)?;
        Ok(yh.into_iter().map(to_bits).collect())
    }
    match io {
        Precision::Bf16Io => run(layer, bits, mask, shape, in_place, half::bf16::from_bits, half::bf16::to_bits),
        _ => run(layer, bits, mask, shape, in_place, half::f16::from_bits, half::f16::to_bits),
    }
}
