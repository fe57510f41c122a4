//! Weights prepared on the device from the caller's own tensors ([`crate::device_io`]), the part
//! shared by the CUDA and HIP backends: where each prepared buffer sits in the caller's storage
//! ([`PreparedLayout`]) and the one `prepare_weights` launch that fills them ([`params`];
//! `common/prepare_weights.h`). The layouts and values are the host path's
//! ([`Backend::prepare`](crate::Backend::prepare) packs the same on the CPU), except that a
//! weight outside f16's range becomes NaN instead of an error: the device path cannot look at
//! values without waiting for the device.

use crate::backend::caller_workspace::SpanCarver;
use crate::backend::params::{
    io_dtype, FusedInputLayout, PrepSegment, PrepareParams, PREP_MAX_SEGMENTS, SEG_FUSED_B, SEG_FUSED_W, SEG_PLAIN,
};
use crate::device_io::{DType, DeviceLinear, DeviceTensor, DeviceWeights, SPAN_ALIGN};
use crate::error::{Error, Result};
use crate::problem::Config;

/// Where each prepared buffer sits in the storage span: byte offsets, 256-aligned.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct PreparedLayout {
    pub(crate) fused: Option<FusedInputLayout>,
    pub(crate) fused_w: u64,
    pub(crate) fused_b: Option<u64>,
    pub(crate) w_in: u64,
    pub(crate) w_out: u64,
    pub(crate) proj_bias: Option<u64>,
    pub(crate) out_bias: Option<u64>,
    pub(crate) norms: [u64; 4],
    pub(crate) bytes: u64,
}

impl PreparedLayout {
    /// The layout for a layer of `config` with (`input_bias`) biases on some input linear and
    /// (`out_bias`) on the output projection; `fused` is the fused kernel's layout where it runs.
    pub(crate) fn new(config: &Config, fused: Option<FusedInputLayout>, input_bias: bool, out_bias: bool) -> Self {
        let (c, h, p) = (config.c as u64, config.h as u64, config.fused_proj_width() as u64);
        let mut span = SpanCarver::default();
        let mut take = |bytes: u64| span.take(bytes);
        let rows = fused.map_or(0, |f| f.rows() as u64);
        let fused_w = take(fused.map_or(0, |f| rows * f.k_pad as u64 * 2));
        let fused_b = (fused.is_some() && input_bias).then(|| take(rows * 4));
        let w_in = take(p * c * 2);
        let w_out = take(c * h * 2);
        let proj_bias = input_bias.then(|| take(p * 4));
        let out_bias = out_bias.then(|| take(c * 4));
        let norms = [take(c * 4), take(c * 4), take(h * 4), take(h * 4)];
        let bytes = span.end().max(SPAN_ALIGN);
        PreparedLayout { fused, fused_w, fused_b, w_in, w_out, proj_bias, out_bias, norms, bytes }
    }
}

/// The kernels' element-type code (`TM_IO_*` in `common/params.h`) of a caller tensor. Here
/// rather than a method of [`DType`]: `device_io` sits below the backends and names no kernel
/// parameters.
fn dtype_code(d: DType) -> i32 {
    io_dtype(d.precision())
}

/// A converted copy of `src`, or zeros where there is none (an absent bias).
fn plain(src: Option<&DeviceTensor>, dst: u64, count: usize, dst_f16: bool) -> PrepSegment {
    PrepSegment {
        src: src.map_or(0, |t| t.ptr),
        dst,
        count: count as i64,
        kind: SEG_PLAIN,
        src_dtype: src.map_or(0, |t| dtype_code(t.dtype)),
        dst_f16: i32::from(dst_f16),
        // Without a source the kernel writes `scale` itself: 0 for an absent bias.
        scale: if src.is_some() { 1.0 } else { 0.0 },
    }
}

/// The `prepare_weights` launch that fills `layout` at `base` from `w`.
pub(crate) fn params(w: &DeviceWeights, layout: &PreparedLayout, base: u64, grid: u32) -> Result<PrepareParams> {
    let cfg = w.config;
    let (c, h, g) = (cfg.c, cfg.h, cfg.gate_width());
    let inputs = w.input_linears();
    let mut seg = Vec::with_capacity(PREP_MAX_SEGMENTS);
    let mut prep = PrepareParams { grid: grid as i32, c: c as i32, h: h as i32, g: g as i32, ..Default::default() };
    if let Some(f) = layout.fused {
        prep.k_pad = f.k_pad as i32;
        prep.h_pad = f.h_pad as i32;
        prep.g_pad = f.g_pad as i32;
        for (i, l) in inputs.iter().enumerate() {
            prep.fused_src[i] = l.weight.ptr;
            prep.fused_dtype[i] = dtype_code(l.weight.dtype);
            prep.fused_bias[i] = l.bias.map_or(0, |b| b.ptr);
            prep.fused_bias_dtype[i] = l.bias.map_or(0, |b| dtype_code(b.dtype));
        }
        let fused = |kind, dst, count: usize, dst_f16| PrepSegment {
            kind,
            dst,
            count: count as i64,
            dst_f16: i32::from(dst_f16),
            ..Default::default()
        };
        seg.push(fused(SEG_FUSED_W, base + layout.fused_w, f.rows() * f.k_pad, true));
        if let Some(off) = layout.fused_b {
            seg.push(fused(SEG_FUSED_B, base + off, f.rows(), false));
        }
    }
    // w_in [P, C] f16 and the projection bias [P] f32: the five input linears one after another.
    let mut row = 0;
    for l in inputs {
        let out = l.weight.len / c;
        seg.push(plain(Some(&l.weight), base + layout.w_in + (row * c * 2) as u64, out * c, true));
        if let Some(off) = layout.proj_bias {
            seg.push(plain(l.bias.as_ref(), base + off + (row * 4) as u64, out, false));
        }
        row += out;
    }
    let DeviceLinear { weight: w_out, bias: b_out } = &w.out_proj;
    seg.push(plain(Some(w_out), base + layout.w_out, c * h, true));
    if let Some(off) = layout.out_bias {
        seg.push(plain(b_out.as_ref(), base + off, c, false));
    }
    let norms = [(&w.norm_in.weight, c), (&w.norm_in.bias, c), (&w.norm_out.weight, h), (&w.norm_out.bias, h)];
    for ((t, n), off) in norms.into_iter().zip(layout.norms) {
        seg.push(plain(Some(t), base + off, n, false));
    }
    if seg.len() > PREP_MAX_SEGMENTS {
        return Err(Error::Internal(format!("{} preparation segments, at most {PREP_MAX_SEGMENTS}", seg.len())));
    }
    prep.segments = seg.len() as i32;
    prep.seg[..seg.len()].copy_from_slice(&seg);
    Ok(prep)
}

/// A launch that writes `value` into `count` f32 elements at `dst` (e.g. af3's vector of ones).
#[cfg(feature = "rocm")]
pub(crate) fn fill_params(dst: u64, count: usize, value: f32, grid: u32) -> PrepareParams {
    let mut p = PrepareParams { grid: grid as i32, segments: 1, ..Default::default() };
    p.seg[0] = PrepSegment { dst, count: count as i64, kind: SEG_PLAIN, scale: value, ..Default::default() };
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device_io::DType;
    use crate::problem::Formulation;

    /// `w`'s tensors as bf16 at made-up, well separated addresses (nothing is dereferenced).
    fn weights(cfg: Config, bias: bool) -> DeviceWeights {
        let w = crate::weights::Weights::random(cfg, bias, 1).unwrap();
        let mut next = 0x10_0000u64;
        DeviceWeights::place(&w, |v| {
            next += 0x10_0000;
            Ok(DeviceTensor::new(next, DType::Bf16, v.len()))
        })
        .unwrap()
    }

    /// Every destination of every segment lies inside the layout's bytes and no two overlap;
    /// w_in's segments tile it; the fused segments cover the fused matrix exactly.
    #[test]
    fn segments_fill_the_layout_without_overlap() {
        for (f, c, h, bias) in [
            (Formulation::GpuMode, 128, 128, false),
            (Formulation::Af3, 128, 128, true),
            (Formulation::Af3, 64, 40, true),
            (Formulation::GpuMode, 768, 128, false),
        ] {
            let cfg = Config::new(f, c, h).unwrap();
            let w = weights(cfg, bias);
            w.validate().unwrap();
            let layout = PreparedLayout::new(&cfg, FusedInputLayout::new(&cfg), bias, bias);
            let base = 1 << 32;
            let kp = params(&w, &layout, base, 7).unwrap();
            let mut spans: Vec<(u64, u64)> = kp.seg[..kp.segments as usize]
                .iter()
                .map(|s| {
                    let elem = if s.dst_f16 == 1 { 2 } else { 4 };
                    (s.dst, s.dst + s.count as u64 * elem)
                })
                .collect();
            spans.sort();
            for pair in spans.windows(2) {
                assert!(pair[0].1 <= pair[1].0, "{f} C={c}: overlap {pair:?}");
            }
            assert!(spans.iter().all(|&(a, b)| a >= base && b <= base + layout.bytes && a % 2 == 0));
            let w_in: i64 = kp
                .seg
                .iter()
                .filter(|s| s.dst >= base + layout.w_in && s.dst < base + layout.w_out)
                .map(|s| s.count)
                .sum();
            assert_eq!(w_in as usize, cfg.fused_proj_width() * c);
            assert_eq!(kp.grid, 7);
            if let Some(fl) = layout.fused {
                assert_eq!(kp.seg[0].kind, SEG_FUSED_W);
                assert_eq!(kp.seg[0].count as usize, fl.rows() * fl.k_pad);
                assert_eq!(kp.fused_src[4], w.out_gate.weight.ptr);
                assert_eq!(kp.fused_bias[1], w.left_gate.bias.map_or(0, |b| b.ptr));
            } else {
                assert!(kp.seg.iter().all(|s| s.kind == SEG_PLAIN));
            }
        }
    }
}
