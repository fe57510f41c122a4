//! Non-finite outputs, counted on request.
//!
//! NaN and ±infinity in `x` are accepted, as PyTorch accepts them, and propagate into `y` (a NaN
//! at one position reaches whole rows and columns of `y` through the contraction). Finite `x`
//! and finite weights give finite math, so a non-finite `y` from finite inputs means an
//! intermediate overflowed the precision it is held in: f16 (largest value 65504) on the GPU
//! backends, which weights a hundred times larger than trained ones reach; f32 (3.4e38) on the
//! CPU, which only absurd weights or inputs reach.
//!
//! A forward never inspects its own output: on a GPU that would mean waiting for the stream
//! behind the caller's back (and a pass over `y`). The check is a separate call, made once `y`
//! is on the host: [`NonFinite::count`] counts, [`check_output`] also turns an overflow into an
//! error. `trimul run` makes both, reports propagated NaN on stderr and refuses (exit 1) an
//! output that overflowed.

use rayon::prelude::*;

use crate::error::{BackendKind, Error, Result};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// The element types a forward reads and writes (f32, bf16, f16), as seen by [`NonFinite`].
pub trait Value: sealed::Sealed + Copy + Send + Sync {
    /// Whether the value is NaN.
    fn is_nan(self) -> bool;
    /// Whether the value is neither NaN nor infinite.
    fn is_finite(self) -> bool;
}

impl Value for f32 {
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
    fn is_finite(self) -> bool {
        f32::is_finite(self)
    }
}

impl Value for half::bf16 {
    fn is_nan(self) -> bool {
        half::bf16::is_nan(self)
    }
    fn is_finite(self) -> bool {
        half::bf16::is_finite(self)
    }
}

impl Value for half::f16 {
    fn is_nan(self) -> bool {
        half::f16::is_nan(self)
    }
    fn is_finite(self) -> bool {
        half::f16::is_finite(self)
    }
}

/// How many values of a tensor are NaN or infinite.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct NonFinite {
    /// NaN elements.
    pub nan: usize,
    /// Infinite elements.
    pub infinite: usize,
    /// Values counted.
    pub len: usize,
}

impl NonFinite {
    /// Counts the NaN and infinite values of `values` (in parallel: outputs reach gigabytes).
    pub fn count<T: Value>(values: &[T]) -> NonFinite {
        let (nan, infinite) = values
            .par_chunks(1 << 16)
            .map(|chunk| {
                chunk.iter().fold((0usize, 0usize), |(n, i), &v| match (v.is_finite(), v.is_nan()) {
                    (true, _) => (n, i),
                    (false, true) => (n + 1, i),
                    (false, false) => (n, i + 1),
                })
            })
            .reduce(|| (0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        NonFinite { nan, infinite, len: values.len() }
    }

    /// NaN and infinite values together.
    pub fn total(&self) -> usize {
        self.nan + self.infinite
    }

    /// Whether every value was finite.
    pub fn all_finite(&self) -> bool {
        self.total() == 0
    }
}

impl std::fmt::Display for NonFinite {
    /// `3 of 1024 values are not finite (2 NaN, 1 infinite)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} of {} values are not finite ({} NaN, {} infinite)",
            self.total(),
            self.len,
            self.nan,
            self.infinite
        )
    }
}

/// The check after a forward on `backend`: counts `y`'s non-finite values and returns them, or
/// [`Error::NonFinite`] when `y` has some although `x` had none (`x_non_finite` is
/// [`NonFinite::count`] of `x`, taken before the forward; an in-place forward overwrites `x`):
/// an intermediate overflowed, and `y` is not the layer's output.
pub fn check_output<T: Value>(x_non_finite: &NonFinite, y: &[T], backend: BackendKind) -> Result<NonFinite> {
    let y_count = NonFinite::count(y);
    if x_non_finite.all_finite() && !y_count.all_finite() {
        let reason = match backend {
            BackendKind::Cpu => {
                "the CPU backend's f32 intermediates (largest value 3.4e38) overflowed; weights or inputs this \
                 large are far outside any trained model's range"
            }
            BackendKind::Cuda | BackendKind::Hip => {
                "the GPU backend's f16 intermediates (largest value 65504) overflowed, which weights about a \
                 hundred times larger than trained ones cause; the CPU backend computes in f32 (--backend cpu)"
            }
        };
        return Err(Error::NonFinite { count: y_count.total(), len: y_count.len, reason: reason.to_string() });
    }
    Ok(y_count)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_each_kind_in_each_type() {
        let v = [1.0f32, f32::NAN, f32::INFINITY, -f32::INFINITY, 0.0];
        assert_eq!(NonFinite::count(&v), NonFinite { nan: 1, infinite: 2, len: 5 });
        let b: Vec<half::bf16> = v.iter().map(|&x| half::bf16::from_f32(x)).collect();
        assert_eq!(NonFinite::count(&b).total(), 3);
        let h: Vec<half::f16> = [7e4f32, 1.0].iter().map(|&x| half::f16::from_f32(x)).collect();
        assert_eq!(NonFinite::count(&h), NonFinite { nan: 0, infinite: 1, len: 2 }, "7e4 is beyond f16");
        let big = vec![f32::NAN; 300_000];
        assert_eq!(NonFinite::count(&big).nan, 300_000);
        assert_eq!(NonFinite::count(&v).to_string(), "3 of 5 values are not finite (1 NaN, 2 infinite)");
    }

    #[test]
    fn only_an_overflow_is_an_error() {
        let finite = NonFinite { nan: 0, infinite: 0, len: 4 };
        let nan_x = NonFinite { nan: 1, infinite: 0, len: 4 };
        assert!(check_output(&finite, &[1.0f32; 4], BackendKind::Cpu).unwrap().all_finite());
        assert_eq!(check_output(&nan_x, &[f32::NAN; 4], BackendKind::Cpu).unwrap().nan, 4);
        let e = check_output(&finite, &[f32::NAN, 1.0], BackendKind::Cuda).unwrap_err().to_string();
        assert!(e.contains("1 of 2") && e.contains("f16") && e.contains("--backend cpu"), "{e}");
    }
}
