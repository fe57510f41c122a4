//! Memory budgets and the chunked execution plan that keeps long sequences within them.
//!
//! # Why chunking is exact
//! For one batch `b` and hidden channel `h`, the contraction `t[b,·,·,h]` reads only
//! `left[b,·,·,h]` and `right[b,·,·,h]`, and those come from the `h`-th rows of the four input
//! projections. So the projections and the contraction can run over *hidden chunks* of `hc`
//! channels, one after another, each pass writing its channels of `t`; `left` and `right` only
//! ever exist for one chunk. The output stage needs every channel of `t` at a position (LN_H),
//! but nothing from other positions, so it runs over *row chunks*. Every value is computed by
//! the same arithmetic as in the unchunked plan, so results agree to rounding (and exactly on the
//! CPU, where the per-element operations do not depend on the chunk).
//!
//! # The output gate
//! The unchunked plan stores the output gate (`[M, G]`) during the input pass. A chunked plan
//! does not keep it: each row chunk of the output stage recomputes `σ(LN_C(x)·Wogᵀ)` for its
//! positions (one more read of those rows of `x` and a GEMM of `2·C·G` FLOPs per position, a
//! few percent of the whole). That drops an `[M, G]` tensor from the peak and is what makes
//! in-place mode possible: a row chunk reads its rows of `x` for the gate before it writes
//! the same rows of `y`, and every hidden pass, the only other reader of `x`, is done by then.
//!
//! # Budgets
//! A budget counts everything a forward holds on the device: the prepared weights, the caller's
//! `x`, mask and `y` (one tensor for both in in-place mode) and the workspace. Without one the
//! limit is the memory the device reports free, less [`margin`]. Plans are chosen before any
//! allocation; when even the narrowest plan does not fit, the error names the bytes needed and
//! available ([`crate::Error::OutOfMemory`]).

// Defined with `fmt_bytes` in the foundation module of byte counts; kept here, where the CLI,
// the Python bindings and the fuzz tests have always found it.
pub use crate::units::parse_bytes;

/// How one forward is split to fit its memory limit.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ExecPlan {
    /// Hidden channels per projection + contraction pass.
    pub hidden_chunk: usize,
    /// Number of those passes (`⌈H / hidden_chunk⌉`).
    pub hidden_passes: usize,
    /// Positions per output-stage chunk.
    pub output_rows: usize,
    /// Whether the output gate is recomputed per row chunk instead of stored by the input pass.
    pub gate_recomputed: bool,
    /// Bytes of workspace this plan allocates.
    pub workspace_bytes: u64,
}

impl ExecPlan {
    /// Whether the projections and the contraction run in more than one hidden pass.
    pub fn is_chunked(&self) -> bool {
        self.hidden_passes > 1
    }

    /// `one pass`, or `4 hidden passes of 32 channels; gate recomputed per 65536 positions`.
    pub fn describe(&self) -> String {
        let passes = if self.hidden_passes == 1 {
            "one hidden pass".to_string()
        } else {
            format!("{} hidden passes of {} channels", self.hidden_passes, self.hidden_chunk)
        };
        if self.gate_recomputed {
            format!("{passes}; output stage per {} positions, gate recomputed from x", self.output_rows)
        } else {
            format!("{passes}; gate stored")
        }
    }
}

/// What one forward of a shape holds on the device, for choosing a budget.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MemoryNeeds {
    /// The prepared weights.
    pub weights: u64,
    /// `x`, the mask and `y` (`x` alone holds `y` in place).
    pub io: u64,
    /// Workspace of the one-pass (fastest) plan.
    pub one_pass_workspace: u64,
    /// Workspace of the narrowest plan.
    pub min_workspace: u64,
}

impl MemoryNeeds {
    /// Total with the one-pass plan.
    pub fn one_pass_total(&self) -> u64 {
        self.weights.saturating_add(self.io).saturating_add(self.one_pass_workspace)
    }

    /// The smallest budget this forward can run in.
    pub fn min_total(&self) -> u64 {
        self.weights.saturating_add(self.io).saturating_add(self.min_workspace)
    }
}

/// Device memory kept free when no budget is given: 2% of the device, at least 256 MiB (the
/// libraries' handles and allocator slack live there), but at most a quarter of it: a CPU
/// process under a small memory limit (a 250 MB container) would otherwise have no room at all.
pub fn margin(total: u64) -> u64 {
    (total / 50).max(256 << 20).min(total / 4)
}

/// The widest hidden chunk whose plan fits `limit` bytes: `need(hc)` is the workspace a chunk
/// of `hc` channels takes. Candidates are `H` and then, for 2, 3, … passes, `⌈H / passes⌉`
/// rounded up to a multiple of `step` (the granularity a kernel writes channels in), so passes
/// stay balanced. `None` when even the narrowest candidate does not fit.
pub fn widest_hidden_chunk(h: usize, step: usize, limit: u64, need: impl Fn(usize) -> u64) -> Option<usize> {
    let step = step.max(1);
    let mut last = 0;
    for passes in 1..=h.max(1) {
        let hc = h.div_ceil(passes).div_ceil(step).saturating_mul(step).min(h).max(1);
        if hc == last {
            continue;
        }
        last = hc;
        if need(hc) <= limit {
            return Some(hc);
        }
        if hc <= step {
            break;
        }
    }
    None
}

/// Bytes currently and at most allocated on one GPU backend's device (weights, workspaces and
/// buffers), for [`Backend::peak_memory`](crate::backend::Backend::peak_memory). Shared by the
/// CUDA and HIP allocation wrappers, which are FFI layers (`cuda/driver.rs`, `hip/result.rs`):
/// defined here, in a foundation module, so that they need not import the backend layer above
/// them.
#[cfg(any(feature = "cuda", feature = "rocm"))]
#[derive(Debug, Default)]
pub(crate) struct AllocTracker {
    current: std::sync::atomic::AtomicU64,
    peak: std::sync::atomic::AtomicU64,
}

#[cfg(any(feature = "cuda", feature = "rocm"))]
impl AllocTracker {
    pub(crate) fn add(&self, bytes: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        let now = self.current.fetch_add(bytes, Relaxed) + bytes;
        self.peak.fetch_max(now, Relaxed);
    }

    pub(crate) fn sub(&self, bytes: u64) {
        self.current.fetch_sub(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn peak(&self) -> u64 {
        self.peak.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Starts a new high-water mark at what is allocated now.
    pub(crate) fn reset_peak(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        self.peak.store(self.current.load(Relaxed), Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widest_chunk_prefers_one_pass_and_balances_passes() {
        let need = |hc: usize| 1000 + 10 * hc as u64;
        assert_eq!(widest_hidden_chunk(128, 32, u64::MAX, need), Some(128));
        assert_eq!(widest_hidden_chunk(128, 32, 1000 + 10 * 64, need), Some(64));
        assert_eq!(widest_hidden_chunk(128, 32, 1000 + 10 * 63, need), Some(32));
        assert_eq!(widest_hidden_chunk(128, 32, 1000 + 10 * 31, need), None);
        // step 1: 128 → 64 → 43 → 32 → 26 …
        assert_eq!(widest_hidden_chunk(128, 1, 1000 + 10 * 50, need), Some(43));
        assert_eq!(widest_hidden_chunk(128, 1, 1010, need), Some(1));
        assert_eq!(widest_hidden_chunk(40, 32, 1000 + 10 * 39, need), Some(32));
        assert_eq!(widest_hidden_chunk(1, 32, 1010, need), Some(1));
    }

    #[test]
    fn plans_describe_themselves() {
        let p = ExecPlan {
            hidden_chunk: 32,
            hidden_passes: 4,
            output_rows: 65536,
            gate_recomputed: true,
            workspace_bytes: 1,
        };
        assert!(p.is_chunked());
        assert_eq!(
            p.describe(),
            "4 hidden passes of 32 channels; output stage per 65536 positions, gate recomputed from x"
        );
        let one = ExecPlan { hidden_passes: 1, hidden_chunk: 128, gate_recomputed: false, ..p };
        assert!(!one.is_chunked());
        assert_eq!(one.describe(), "one hidden pass; gate stored");
    }
}
