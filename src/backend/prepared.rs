//! The prepared weights both GPU backends keep, in buffers of the backend's own type: the fused
//! input projections and the output projection as f16, the biases and the LayerNorm parameters
//! as f32 ([`PreparedTensors`]). Uploaded from host weights ([`PreparedTensors::upload`]) or
//! laid out over a caller's storage that `prepare_weights` fills on the device
//! ([`PreparedTensors::views`]); the addresses the kernels take are gathered here once
//! ([`PreparedTensors::addresses`], [`PreparedTensors::backward_weights`]).

use crate::backend::backward_steps::BackwardWeights;
use crate::backend::device_prepare::PreparedLayout;
use crate::backend::params::Addresses;
use crate::device_io::DeviceWeights;
use crate::error::{Error, Result};
use crate::weights::Weights;

/// A device buffer as the prepared weights need it: where it starts and how many bytes it holds.
pub(crate) trait DeviceBytes {
    fn address(&self) -> u64;
    fn byte_len(&self) -> u64;
}

/// `v` as f16 bit patterns, or the error naming `what` where a value is not finite or outside
/// f16's range (the GPU kernels read the weights as f16).
pub(crate) fn f16_words(what: &str, v: &[f32]) -> Result<Vec<u16>> {
    if let Some(bad) = v.iter().find(|w| !w.is_finite() || w.abs() > 65504.0) {
        return Err(Error::Weights(format!("{what} holds {bad}, outside the f16 range the GPU path uses")));
    }
    Ok(v.iter().map(|&w| half::f16::from_f32(w).to_bits()).collect())
}

/// One layer's prepared weights: `H` buffers of f16, `F` buffers of f32.
pub(crate) struct PreparedTensors<H, F> {
    /// f16 `[P, C]`: [left_proj; left_gate; right_proj; right_gate; out_gate].
    pub(crate) w_in: H,
    /// f16 `[C, H]`.
    pub(crate) w_out: H,
    /// f32 `[P]` in the order of `w_in`, when any input linear has a bias (af3).
    pub(crate) proj_bias: Option<F>,
    /// f32 `[C]`, af3's output-projection bias.
    pub(crate) out_bias: Option<F>,
    /// f32 LayerNorm weight and bias: the input's `[C]`, then the output's `[H]`.
    pub(crate) norms: [F; 4],
    /// Which linear layers have a bias, in [`Weights::linears`] order: the backward returns a
    /// bias gradient exactly for those.
    pub(crate) biases: [bool; 6],
}

impl<H: DeviceBytes, F: DeviceBytes> PreparedTensors<H, F> {
    /// `w` packed and uploaded with the backend's `half` (f16 words) and `single` (f32 values)
    /// uploads; a weight outside f16's range is an error naming it.
    pub(crate) fn upload(
        w: &Weights,
        half: impl Fn(&[u16]) -> Result<H>,
        single: impl Fn(&[f32]) -> Result<F>,
    ) -> Result<Self> {
        let config = w.config();
        let (fused, proj_bias) = w.fused_input()?;
        debug_assert_eq!(fused.len(), config.fused_proj_width() * config.c);
        Ok(PreparedTensors {
            w_in: half(&f16_words("the input projections", &fused)?)?,
            w_out: half(&f16_words("the output projection", &w.out_proj.weight)?)?,
            proj_bias: proj_bias.map(|b| single(&b)).transpose()?,
            out_bias: w.out_proj.bias.as_deref().map(&single).transpose()?,
            norms: [
                single(&w.norm_in.weight)?,
                single(&w.norm_in.bias)?,
                single(&w.norm_out.weight)?,
                single(&w.norm_out.bias)?,
            ],
            biases: w.linears().map(|(_, l)| l.bias.is_some()),
        })
    }

    /// Views of the storage at `base` laid out as `layout`, which `prepare_weights` fills from
    /// `w`: `half(address, elements)` and `single(address, elements)` make the backend's views.
    pub(crate) fn views(
        w: &DeviceWeights,
        layout: &PreparedLayout,
        base: u64,
        half: impl Fn(u64, usize) -> H,
        single: impl Fn(u64, usize) -> F,
    ) -> Self {
        let cfg = w.config;
        let (c, h, p) = (cfg.c, cfg.h, cfg.fused_proj_width());
        let [a, b, cc, d, e] = w.input_linears().map(|l| l.bias.is_some());
        PreparedTensors {
            w_in: half(base + layout.w_in, p * c),
            w_out: half(base + layout.w_out, c * h),
            proj_bias: layout.proj_bias.map(|off| single(base + off, p)),
            out_bias: layout.out_bias.map(|off| single(base + off, c)),
            norms: [(0, c), (1, c), (2, h), (3, h)].map(|(i, len)| single(base + layout.norms[i], len)),
            biases: [a, b, cc, d, e, w.out_proj.bias.is_some()],
        }
    }

    /// The weights' addresses among the kernels' common parameters (x, the mask and y zero).
    pub(crate) fn addresses(&self) -> Addresses {
        let [norm_in_w, norm_in_b, norm_out_w, norm_out_b] = self.norms.each_ref().map(DeviceBytes::address);
        Addresses {
            norm_in_w,
            norm_in_b,
            norm_out_w,
            norm_out_b,
            w_out: self.w_out.address(),
            out_bias: self.out_bias.as_ref().map_or(0, DeviceBytes::address),
            ..Addresses::default()
        }
    }

    /// The address of the input projections' biases, or 0.
    pub(crate) fn proj_bias_address(&self) -> u64 {
        self.proj_bias.as_ref().map_or(0, DeviceBytes::address)
    }

    /// What the backward reads of them.
    pub(crate) fn backward_weights(&self) -> BackwardWeights {
        BackwardWeights {
            w: [self.w_in.address(), self.w_out.address()],
            norms: self.norms.each_ref().map(DeviceBytes::address),
            bias: [self.proj_bias_address(), self.out_bias.as_ref().map_or(0, DeviceBytes::address)],
            biases: self.biases,
        }
    }

    /// The device memory they hold.
    pub(crate) fn bytes(&self) -> u64 {
        let opt = |b: &Option<F>| b.as_ref().map_or(0, DeviceBytes::byte_len);
        let norms: u64 = self.norms.iter().map(DeviceBytes::byte_len).sum();
        self.w_in.byte_len() + self.w_out.byte_len() + opt(&self.proj_bias) + opt(&self.out_bias) + norms
    }
}
