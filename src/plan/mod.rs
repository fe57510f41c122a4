//! Plans: how one forward is split and laid out to fit its memory, independent of any backend.
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
//! # What lives here
//! - [`budget`]: every piece of budget arithmetic (the margin kept free, the limit a workspace
//!   may take, the search for the widest plan that fits) and the reports on a plan
//!   ([`ExecPlan`], [`MemoryNeeds`]).
//! - [`layout`]: the one plan type, [`Plan`]: hidden passes, row chunks, where the gate comes
//!   from, and where every intermediate lives (its own buffer, inside `t`, inside the caller's
//!   `y`, or in a scratch buffer shared by the two phases), for each way a backend runs its
//!   input stage ([`InputStage`]).
//!
//! - [`shard`]: the rows each rank holds when the pair tensor is split by rows across GPUs
//!   (issue 29), and one rank's plan: its buffers, hidden passes and exchange steps, the widest
//!   that fits its memory.
//!
//! Backends declare what they can do and execute a plan; they do no budget arithmetic of their
//! own.

pub mod budget;
pub mod layout;
pub mod shard;

pub use budget::{margin, parse_bytes, widest_fit, widest_hidden_chunk, ExecPlan, MemoryNeeds};
pub use layout::{Blas, Buffer, Capabilities, InputStage, Plan, Region};
