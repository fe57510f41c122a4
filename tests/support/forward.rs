//! One host forward of a layer: out of place into a NaN-filled `y`, or in place on a copy of `x`.
//! The tests that compare chunked, in-place and one-pass results run both ways through this.

use trimul::{Backend, Layer, Result, Shape};

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
