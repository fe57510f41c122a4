//! Element-wise kernels of the CPU backend, shared by its forward and backward: plain loops
//! over slices, written so LLVM vectorises them (run them inside [`simd`]).

/// `eˣ` in f32 without branches, so loops that call it vectorise (`libm`'s `expf` is a scalar
/// call). Range reduction `x = n·ln2 + r` with `|r| ≤ ln2/2` (ln2 split in two so `n·LN2_HI` is
/// exact), a degree-7 Taylor polynomial for `eʳ` (truncation below 6e-9 relative) in Horner form
/// with fused multiply-adds, and `2ⁿ` built from its exponent bits. Relative error about 2 ulp.
/// NaN stays NaN: `clamp` keeps NaN and every later step propagates it. Inputs are clamped to
/// [-87, 88] so `2ⁿ` stays a normal number: the result saturates at e⁸⁸ ≈ 1.7e38 and
/// e⁻⁸⁷ ≈ 1.6e-38, which moves σ by < 1e-37.
///
/// `mul_add` becomes one FMA instruction inside [`simd`] on AVX2 and Arm CPUs (a third fewer
/// operations than separate multiply and add); only on x86 CPUs without FMA does it fall back to
/// the slower but exact `fmaf` library call.
#[inline(always)]
pub(super) fn exp_f32(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    // 355/512: 9 significant bits, so n·LN2_HI is exact for |n| < 2¹⁵.
    const LN2_HI: f32 = 0.693_359_4;
    // ln 2 − LN2_HI.
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5·2²³: adding it rounds to an integer and leaves that integer in the low mantissa bits.
    const SHIFTER: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let shifted = x.mul_add(LOG2_E, SHIFTER);
    let n = shifted - SHIFTER;
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    let mut p = 1.0 / 5040.0f32;
    for coef in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = p.mul_add(r, coef);
    }
    let n_int = shifted.to_bits() as i32 - SHIFTER.to_bits() as i32;
    p * f32::from_bits(((n_int + 127) << 23) as u32)
}

#[inline(always)]
pub(super) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp_f32(-x))
}

/// Runs `f` inside a function compiled for the best x86 (AVX2+FMA) or Arm SIMD level this CPU
/// has, chosen at run time by `pulp`, so the element-wise loops inlined into `f` vectorise to
/// full-width registers instead of the SSE2 baseline of a portable build (2× on the gates).
/// Everything called inside must be `#[inline(always)]` to be compiled for that level.
#[inline(always)]
pub(super) fn simd<R>(f: impl FnOnce() -> R) -> R {
    pulp::Arch::new().dispatch(f)
}

/// `dst = σ(gate + bg) ⊙ (val + bv) ⊙ mask`.
#[inline(always)]
pub(super) fn gated(dst: &mut [f32], val: &[f32], gate: &[f32], bv: f32, bg: f32, mask: Option<&[f32]>) {
    match mask {
        Some(mask) => {
            for (((d, &v), &g), &m) in dst.iter_mut().zip(val).zip(gate).zip(mask) {
                *d = sigmoid(g + bg) * (v + bv) * m;
            }
        }
        None => {
            for ((d, &v), &g) in dst.iter_mut().zip(val).zip(gate) {
                *d = sigmoid(g + bg) * (v + bv);
            }
        }
    }
}

/// Sum of a slice in f64, with eight independent accumulators so the loop vectorises.
#[inline(always)]
pub(super) fn sum_f64(v: &[f32]) -> f64 {
    let mut acc = [0.0f64; 8];
    let chunks = v.chunks_exact(8);
    let tail: f64 = chunks.remainder().iter().map(|&a| a as f64).sum();
    for ch in chunks {
        for (a, &b) in acc.iter_mut().zip(ch) {
            *a += b as f64;
        }
    }
    acc.iter().sum::<f64>() + tail
}

/// `Σ (v − mean)²` in f64 (the second pass of a two-pass variance: no cancellation).
#[inline(always)]
pub(super) fn sum_sq_dev_f64(v: &[f32], mean: f64) -> f64 {
    let mut acc = [0.0f64; 8];
    let chunks = v.chunks_exact(8);
    let tail: f64 = chunks.remainder().iter().map(|&a| (a as f64 - mean) * (a as f64 - mean)).sum();
    for ch in chunks {
        for (a, &b) in acc.iter_mut().zip(ch) {
            let d = b as f64 - mean;
            *a += d * d;
        }
    }
    acc.iter().sum::<f64>() + tail
}

/// LayerNorm of each row of `x` (rows of `w.len()` values) into `out`. Mean and variance are
/// two-pass in f64: Cauchy inputs put values of 1e4 next to values of 1e-2 in one row, where a
/// one-pass f32 `E[x²] − E[x]²` loses every digit.
#[inline(always)]
pub(super) fn layer_norm_rows(x: &[f32], out: &mut [f32], w: &[f32], b: &[f32], eps: f64) {
    let width = w.len();
    for (xr, zr) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
        let mean = sum_f64(xr) / width as f64;
        let var = sum_sq_dev_f64(xr, mean) / width as f64;
        let rstd = 1.0 / (var + eps).sqrt();
        for (((z, &v), &wi), &bi) in zr.iter_mut().zip(xr).zip(w).zip(b) {
            *z = ((v as f64 - mean) * rstd) as f32 * wi + bi;
        }
    }
}
