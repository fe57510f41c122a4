//! Weights prepared on the device from the caller's own tensors ([`crate::device_io`]): the
//! buffers of [`CudaPrepared`] carved from one span of caller memory and filled by one launch of
//! `prepare_weights` (`common/prepare_weights.h`) on the caller's stream. Same layouts, same
//! values as the host path of [`Backend::prepare`](crate::Backend::prepare) (which packs on the
//! CPU and uploads), except that a weight outside f16's range becomes NaN instead of an error:
//! the device path cannot look at values without waiting for the device.

use cudarc::driver::sys::CUstream;

use super::driver::{DeviceBuffer, DriverResult};
use super::{CudaBackend, CudaPrepared, FusedInput};
use crate::backend::params::{
    FusedInputLayout, PrepSegment, PrepareParams, PREP_MAX_SEGMENTS, PREP_THREADS, SEG_FUSED_B, SEG_FUSED_W, SEG_PLAIN,
};
use crate::device_io::{DeviceLinear, DeviceSpan, DeviceTensor, DeviceWeights, SPAN_ALIGN};
use crate::error::{Error, Result};
use crate::problem::Config;

/// Where each prepared buffer sits in the storage span: byte offsets, 256-aligned.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) struct PreparedLayout {
    fused: Option<FusedInputLayout>,
    fused_w: u64,
    fused_b: Option<u64>,
    w_in: u64,
    w_out: u64,
    proj_bias: Option<u64>,
    out_bias: Option<u64>,
    norms: [u64; 4],
    pub(super) bytes: u64,
}

impl PreparedLayout {
    /// The layout for a layer of `config` with (`input_bias`) biases on some input linear and
    /// (`out_bias`) on the output projection; `fused` is the fused kernel's layout where it runs.
    pub(super) fn new(config: &Config, fused: Option<FusedInputLayout>, input_bias: bool, out_bias: bool) -> Self {
        let (c, h, p) = (config.c as u64, config.h as u64, config.fused_proj_width() as u64);
        let mut end = 0u64;
        let mut take = |bytes: u64| {
            let at = end;
            end = (at + bytes).div_ceil(SPAN_ALIGN) * SPAN_ALIGN;
            at
        };
        let rows = fused.map_or(0, |f| f.rows() as u64);
        let fused_w = take(fused.map_or(0, |f| rows * f.k_pad as u64 * 2));
        let fused_b = (fused.is_some() && input_bias).then(|| take(rows * 4));
        let w_in = take(p * c * 2);
        let w_out = take(c * h * 2);
        let proj_bias = input_bias.then(|| take(p * 4));
        let out_bias = out_bias.then(|| take(c * 4));
        let norms = [take(c * 4), take(c * 4), take(h * 4), take(h * 4)];
        PreparedLayout { fused, fused_w, fused_b, w_in, w_out, proj_bias, out_bias, norms, bytes: end.max(SPAN_ALIGN) }
    }
}

fn plain(src: Option<&DeviceTensor>, dst: u64, count: usize, dst_f16: bool) -> PrepSegment {
    PrepSegment {
        src: src.map_or(0, |t| t.ptr),
        dst,
        count: count as i64,
        kind: SEG_PLAIN,
        src_dtype: src.map_or(0, |t| t.dtype.code()),
        dst_f16: i32::from(dst_f16),
        scale: 1.0,
    }
}

/// The `prepare_weights` launch that fills `layout` at `base` from `w`.
fn params(w: &DeviceWeights, layout: &PreparedLayout, base: u64, grid: u32) -> Result<PrepareParams> {
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
            prep.fused_dtype[i] = l.weight.dtype.code();
            prep.fused_bias[i] = l.bias.map_or(0, |b| b.ptr);
            prep.fused_bias_dtype[i] = l.bias.map_or(0, |b| b.dtype.code());
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

impl CudaBackend {
    /// The storage layout of a layer of `config` prepared on the device.
    pub(super) fn prepared_layout(&self, config: &Config, input_bias: bool, out_bias: bool) -> PreparedLayout {
        PreparedLayout::new(config, self.fused_layout(config), input_bias, out_bias)
    }

    /// See [`Backend::prepare_device`](crate::Backend::prepare_device).
    ///
    /// # Safety
    /// As that method.
    pub(super) unsafe fn prepare_on_device(
        &self,
        w: &DeviceWeights,
        storage: DeviceSpan,
        stream: CUstream,
    ) -> Result<CudaPrepared> {
        w.validate()?;
        let cfg = w.config;
        let input_bias = w.input_linears().iter().any(|l| l.bias.is_some());
        let layout = self.prepared_layout(&cfg, input_bias, w.out_proj.bias.is_some());
        storage.check("the prepared-weight storage", layout.bytes)?;
        let inner = &self.inner;
        let grid = (layout.bytes / 2)
            .div_ceil(u64::from(PREP_THREADS))
            .clamp(1, 2 * u64::from(inner.info.compute_units)) as u32;
        let kp = params(w, &layout, storage.ptr, grid)?;
        inner.ctx.bind_to_thread().ctx("cuCtxSetCurrent")?;
        // SAFETY: every source in `kp` is a weight tensor of the length `validate` checked, live
        // until the stream runs the launch (this function's contract); every destination lies
        // inside `storage` (the layout's bytes, checked above); the kernel takes a
        // TmPrepareParams, which `PrepareParams` mirrors.
        unsafe { inner.kernels.prepare_weights.launch_with(grid, PREP_THREADS, 0, stream, &kp, false)? };
        fn view<T>(be: &CudaBackend, at: u64, len: usize) -> DeviceBuffer<T> {
            DeviceBuffer::borrowed(&be.inner.ctx, &be.inner.tracker, at, len)
        }
        let base = storage.ptr;
        let (c, h, p) = (cfg.c, cfg.h, cfg.fused_proj_width());
        Ok(CudaPrepared {
            config: cfg,
            id: super::super::next_weights_id(),
            fused: layout.fused.map(|f| FusedInput {
                layout: f,
                w: view(self, base + layout.fused_w, f.rows() * f.k_pad),
                bias: layout.fused_b.map(|off| view(self, base + off, f.rows())),
            }),
            w_in: view(self, base + layout.w_in, p * c),
            w_out: view(self, base + layout.w_out, c * h),
            proj_bias: layout.proj_bias.map(|off| view(self, base + off, p)),
            out_bias: layout.out_bias.map(|off| view(self, base + off, c)),
            norm_in_w: view(self, base + layout.norms[0], c),
            norm_in_b: view(self, base + layout.norms[1], c),
            norm_out_w: view(self, base + layout.norms[2], h),
            norm_out_b: view(self, base + layout.norms[3], h),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device_io::{DType, DeviceNorm};
    use crate::problem::Formulation;

    fn weights(cfg: Config, bias: bool) -> DeviceWeights {
        let mut next = 0x10_0000u64;
        let mut t = |len: usize| {
            next += 0x10_0000;
            DeviceTensor::new(next, DType::Bf16, len)
        };
        let (c, h, g) = (cfg.c, cfg.h, cfg.gate_width());
        let mut lin = |out: usize, inp: usize| DeviceLinear { weight: t(out * inp), bias: bias.then(|| t(out)) };
        let (lp, lg, rp, rg, og, op) = (lin(h, c), lin(h, c), lin(h, c), lin(h, c), lin(g, c), lin(c, h));
        let mut norm = |n: usize| DeviceNorm { weight: t(n), bias: t(n) };
        let (ni, no) = (norm(c), norm(h));
        DeviceWeights {
            config: cfg,
            norm_in: ni,
            left_proj: lp,
            left_gate: lg,
            right_proj: rp,
            right_gate: rg,
            out_gate: og,
            norm_out: no,
            out_proj: op,
        }
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
