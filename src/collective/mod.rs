//! Communication between GPUs for the row-sharded forward (issue 29; the layout and its
//! arithmetic are in [`crate::plan::shard`]).
//!
//! One [`Communicator`] per rank, each bound to one GPU. It is NCCL's, loaded at run time by
//! cudarc like the other CUDA libraries (a build needs no NCCL; a machine without `libnccl.so.2`
//! gets [`crate::Error::LibraryNotFound`] when it asks for one). RCCL, AMD's library with the
//! same API, is not wired yet.
//!
//! The sharded forward issues two kinds of exchange, each a contiguous run of f16 elements per
//! rank and chunk of matrices (a rank keeps its rows of every matrix of a pass one after another,
//! so one call moves a whole chunk):
//!
//! - **broadcast** from the rank that owns the rows to every other rank (outgoing: every rank
//!   needs every rank's rows of right);
//! - **sum to the owner** (incoming: each rank computes a partial t over its own rows of the
//!   contracted index, and the owner of a row block receives the sum of everyone's).
//!
//! A chunk's calls go in one NCCL group, enqueued on a stream of the caller's.

mod nccl;

pub(crate) use nccl::Transfer;
pub use nccl::{nccl_version, Communicator};
