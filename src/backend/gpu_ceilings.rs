//! How the GPU backends measure their [`Ceilings`], the same way on CUDA and HIP: an f16 GEMM
//! (f32 accumulation) of [`GEMM_N`]³ on non-zero data, and a device-to-device copy of
//! [`COPY_BYTES`], each run once and then timed over [`REPS`] runs with
//! [`Backend::elapsed_ms`]. The backends allocate, launch and name their GEMM.

use super::{Backend, Ceilings};
use crate::error::Result;

/// The GEMM's M = N = K.
pub(crate) const GEMM_N: usize = 8192;
/// The copy's size (512 MiB); its bandwidth counts bytes read plus bytes written.
pub(crate) const COPY_BYTES: usize = 512 << 20;
/// Timed runs of each.
pub(crate) const REPS: usize = 10;

/// A GEMM operand: `GEMM_N`² f16 bits, uniform in [-0.5, 0.5) (zeros run faster).
pub(crate) fn gemm_operand() -> Vec<u16> {
    let mut rng = crate::rand::Rng::new(0xCE11);
    (0..GEMM_N * GEMM_N).map(|_| half::f16::from_f32(rng.uniform() as f32 - 0.5).to_bits()).collect()
}

/// Milliseconds per run of `work` on `backend`'s stream: one run, then the mean of [`REPS`].
pub(crate) fn mean_ms<B: Backend>(backend: &B, mut work: impl FnMut() -> Result<()>) -> Result<f64> {
    work()?;
    Ok(backend.elapsed_ms(&mut || (0..REPS).try_for_each(|_| work()))? / REPS as f64)
}

/// The ceilings of a GEMM that took `gemm_ms` (`library` names what ran it) and a copy that took
/// `copy_ms`.
pub(crate) fn ceilings(library: &str, gemm_ms: f64, copy_ms: f64) -> Ceilings {
    Ceilings {
        gemm_tflops: 2.0 * (GEMM_N as f64).powi(3) / (gemm_ms * 1e-3) / 1e12,
        gemm_desc: format!("{library} f16·f16 (f32 accumulate) {GEMM_N}³"),
        copy_gbs: 2.0 * COPY_BYTES as f64 / (copy_ms * 1e-3) / 1e9,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn rates_count_two_flops_per_multiply_add_and_bytes_both_ways() {
        let c = super::ceilings("rocBLAS gemm_ex", 1.0, 1.0);
        assert!((c.gemm_tflops - 2.0 * 8192f64.powi(3) / 1e9).abs() < 1e-9);
        assert!((c.copy_gbs - 2.0 * (512u64 << 20) as f64 / 1e6).abs() < 1e-9);
        assert_eq!(c.gemm_desc, "rocBLAS gemm_ex f16·f16 (f32 accumulate) 8192³");
        assert_eq!(super::gemm_operand().len(), 8192 * 8192);
    }
}
