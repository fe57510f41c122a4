//! Memory budgets: what a forward may hold on the device, and the widest plan within it.
//!
//! A budget counts everything a forward holds on the device: the prepared weights, the caller's
//! `x`, mask and `y` (one tensor for both in in-place mode) and the workspace. Without one the
//! limit is the memory the device reports free, less [`margin`]. Plans are chosen before any
//! allocation; when even the narrowest plan does not fit, the error names the bytes needed and
//! available ([`crate::Error::OutOfMemory`]).

// Defined with `fmt_bytes` in the foundation module of byte counts; offered here beside the
// budgets it parses (the CLI's `--max-memory`).
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

/// The widest plan that fits `limit` bytes, searched in the order every backend uses: first
/// the widest hidden chunk ([`widest_hidden_chunk`], channels in multiples of `channel_step`)
/// whose plan fits with the narrowest row chunk, then the largest row chunk with that hidden
/// chunk, halving from `max_rows` (at most `rows`) in multiples of `row_step` down to
/// `min(rows, row_step)`. `bytes(hc, rows)` is what the plan of `hc` channels per pass and
/// row chunks of `rows` positions holds. Returns `(hc, rows)`, or `None` when even the narrowest
/// plan does not fit.
pub fn widest_fit(
    h: usize,
    channel_step: usize,
    rows: usize,
    row_step: usize,
    max_rows: usize,
    limit: u64,
    bytes: impl Fn(usize, usize) -> u64,
) -> Option<(usize, usize)> {
    let row_step = row_step.max(1);
    let min_rows = rows.min(row_step);
    let hc = widest_hidden_chunk(h, channel_step, limit, |hc| bytes(hc, min_rows))?;
    let mut chunk = rows.min(max_rows);
    loop {
        if bytes(hc, chunk) <= limit {
            return Some((hc, chunk));
        }
        if chunk <= min_rows {
            return None;
        }
        chunk = (chunk / 2 / row_step * row_step).max(min_rows);
    }
}

/// Why no workspace fits: what is short, the bytes needed and those available.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Shortfall {
    /// `"the memory budget is too small"` or `"the device has too little free"`.
    pub reason: &'static str,
    /// Bytes the narrowest plan needs in that place.
    pub needed: u64,
    /// Bytes there are.
    pub available: u64,
}

/// Bytes the workspace of one forward may take (`None`: no limit known), or what is short.
///
/// - `budget`: the caller's cap on everything the forward holds, if any;
/// - `fixed`: what the forward holds besides its workspace (prepared weights, x, mask, y);
/// - `min_workspace`: the narrowest plan's workspace;
/// - `device`: the device's free and total bytes, where the backend can tell ([`margin`] of the
///   total is kept free);
/// - `staged`: bytes of x, mask and y a host forward will still copy onto the device (device
///   buffers of the caller already count as used in `free`).
pub fn workspace_limit(
    budget: Option<u64>,
    fixed: u64,
    min_workspace: u64,
    device: Option<(u64, u64)>,
    staged: u64,
) -> Result<Option<u64>, Shortfall> {
    let mut limit = None;
    if let Some(budget) = budget {
        let needed = fixed.saturating_add(min_workspace);
        if needed > budget {
            return Err(Shortfall { reason: "the memory budget is too small", needed, available: budget });
        }
        limit = Some(budget - fixed);
    }
    if let Some((free, total)) = device {
        let free = free.saturating_sub(margin(total));
        let needed = staged.saturating_add(min_workspace);
        if needed > free {
            return Err(Shortfall { reason: "the device has too little free", needed, available: free });
        }
        limit = Some(limit.map_or(free - staged, |l: u64| l.min(free - staged)));
    }
    Ok(limit)
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

    #[test]
    fn widest_fit_takes_the_widest_pass_then_the_longest_chunk() {
        // 1000 bytes fixed, 10 per channel, 1 per row of the chunk.
        let bytes = |hc: usize, rows: usize| 1000 + 10 * hc as u64 + rows as u64;
        assert_eq!(widest_fit(128, 32, 4096, 128, 1 << 20, u64::MAX, bytes), Some((128, 4096)));
        // The widest pass with the narrowest chunk, then chunks halving in multiples of 128.
        assert_eq!(widest_fit(128, 32, 4096, 128, 1 << 20, 1000 + 1280 + 2048, bytes), Some((128, 2048)));
        assert_eq!(widest_fit(128, 32, 4096, 128, 1 << 20, 1000 + 1280 + 2047, bytes), Some((128, 1024)));
        assert_eq!(widest_fit(128, 32, 4096, 128, 1 << 20, 1000 + 640 + 128, bytes), Some((64, 128)));
        assert_eq!(widest_fit(128, 32, 4096, 128, 1 << 20, 1000 + 320 + 127, bytes), None);
        // max_rows caps the first chunk; fewer rows than a step make one chunk.
        assert_eq!(widest_fit(8, 8, 4096, 64, 1000, u64::MAX, bytes), Some((8, 1000)));
        assert_eq!(widest_fit(8, 8, 50, 64, 1 << 20, 1000 + 80 + 50, bytes), Some((8, 50)));
    }

    #[test]
    fn workspace_limits_keep_the_budget_and_the_device_margin() {
        // No budget, no device information: no limit.
        assert_eq!(workspace_limit(None, 10, 5, None, 0), Ok(None));
        // A budget leaves what the fixed tensors do not take.
        assert_eq!(workspace_limit(Some(100), 40, 5, None, 0), Ok(Some(60)));
        let short = workspace_limit(Some(44), 40, 5, None, 0).unwrap_err();
        assert_eq!((short.needed, short.available), (45, 44));
        // The device keeps its margin free, and host staging comes out of the rest.
        let total = 100u64 << 30;
        let free = 50u64 << 30;
        let room = free - margin(total);
        assert_eq!(workspace_limit(None, 0, 1, Some((free, total)), 1 << 30), Ok(Some(room - (1 << 30))));
        assert_eq!(workspace_limit(Some(1 << 30), 0, 1, Some((free, total)), 0), Ok(Some(1 << 30)));
        let short = workspace_limit(None, 0, room, Some((free, total)), 1).unwrap_err();
        assert_eq!((short.reason, short.needed, short.available), ("the device has too little free", room + 1, room));
    }
}
