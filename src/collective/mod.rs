//! Communication between GPUs for the row-sharded forward (issue 29; the layout and its
//! arithmetic are in [`crate::plan::shard`]).
//!
//! One [`Communicator`] per rank, each bound to one GPU. It is NCCL's, loaded at run time by
//! cudarc like the other CUDA libraries (a build needs no NCCL; a machine without `libnccl.so.2`
//! gets [`crate::Error::LibraryNotFound`] when it asks for one). RCCL, AMD's library with the
//! same API, is not wired yet.
//!
//! The sharded forward issues two kinds of exchange on a row block of each `N × N` matrix of
//! the `[B, H, N, N]` intermediates, every block a contiguous run of `rows·N` halves:
//!
//! - **broadcast** from the rank that owns the rows to every other rank, in place (outgoing:
//!   every rank needs every rank's rows of right);
//! - **sum to the owner**, in place (incoming: each rank holds a partial t over its own rows of
//!   the contracted index, and the owner of a row block receives the sum of everyone's).
//!
//! A whole channel chunk's calls go in one NCCL group, enqueued on a stream of the caller's.

mod nccl;

pub use nccl::{nccl_version, Communicator};
