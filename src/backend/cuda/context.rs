//! The device state every part of the CUDA backend reads: [`CudaBackend`] (a cheap handle on
//! the context, stream, cuBLASLt handle, loaded kernels and switches), the output-gate choice, and
//! two small integer helpers. The backend's root (`mod.rs`) implements `Backend` over it; the
//! plans and launches (`forward.rs`, `chunked.rs`, `prepare.rs`) add methods to it.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};

use super::blas::{BlasHandle, Elem, MatmulPlan};
use super::driver::{AllocTracker, DeviceBuffer, Timeline};
use super::kernels::Kernels;
use super::tuning::{Tuning, TuningTable};
use crate::backend::backward_params::BackwardSizes;
use crate::backend::gemm::GemmSpec;
use crate::backend::DeviceInfo;

/// Largest cuBLASLt workspace a GEMM may borrow.
pub(super) use crate::plan::layout::MAX_GEMM_WORKSPACE;
/// Byte bit pattern that makes every f16/f32 element a NaN: poisons buffers in checks.
pub(super) const POISON_BYTE: u8 = 0xFF;

/// Where a one-pass forward gets af3's output gate σ(z·Wgᵀ + bg) when x is 16-bit (C = H = 128,
/// out of place, on an H100; elsewhere the gate is always stored).
///
/// - `Stored`: the input stage writes it (`M × C` halves of workspace) and the output stage reads
///   it back.
/// - `FromX`: the output stage makes it from x (`output_projection_sm90_xgate`): no gate buffer,
///   a quarter fewer bytes written by the input stage, the same bytes read by the output stage.
///   On the H100 it measured 2% slower on the GPU MODE shapes (N ≤ 1024) and as fast at N = 2048
///   to 4096 (`docs/perf/NOTES.md`, v33), with 4 GiB less workspace at N = 4096.
/// - `Auto` (the default): `Stored`, unless the one-pass plan fits the memory limit only without
///   the gate buffer; then `FromX` rather than a chunked plan.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[repr(u8)]
#[non_exhaustive]
pub enum OutputGate {
    /// Stored unless the one-pass plan fits only without the gate buffer.
    Auto = 0,
    /// Always stored by the input stage.
    Stored = 1,
    /// Always made from x by the output stage (where the kernel applies).
    FromX = 2,
}

impl OutputGate {
    pub(super) fn from_u8(v: u8) -> Self {
        match v {
            1 => OutputGate::Stored,
            2 => OutputGate::FromX,
            _ => OutputGate::Auto,
        }
    }

    /// `TRIMUL_CUDA_OUTPUT_GATE` = `auto`, `stored` or `from-x` (anything else: auto).
    pub(super) fn from_env() -> Self {
        match std::env::var("TRIMUL_CUDA_OUTPUT_GATE").as_deref().map(str::trim) {
            Ok("stored") => OutputGate::Stored,
            Ok("from-x") => OutputGate::FromX,
            _ => OutputGate::Auto,
        }
    }
}

pub(super) struct Inner {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) stream: Arc<CudaStream>,
    pub(super) blas: BlasHandle,
    pub(super) kernels: Kernels,
    pub(super) info: DeviceInfo,
    pub(super) tracker: Arc<AllocTracker>,
    pub(super) poison: AtomicBool,
    pub(super) fused_input: AtomicBool,
    /// Whether the warp-specialised input build runs where it applies (`set_warp_specialised`).
    pub(super) warp_specialised: AtomicBool,
    /// Whether that build's 16-bit launches without the gate chunk take the register-operand
    /// build instead (`set_register_operand_input`).
    pub(super) register_operand_input: AtomicBool,
    pub(super) fused_output: AtomicBool,
    pub(super) warpgroup_mma: AtomicBool,
    /// Measured per-shape choices (`trimul tune`) for this GPU's architecture.
    pub(super) tuning: TuningTable,
    /// Choices that replace the table's for every shape (the sweep sets these).
    pub(super) tuning_override: std::sync::Mutex<Option<Tuning>>,
    /// Shared memory per SM (bytes), to decide how many blocks of a kernel fit.
    pub(super) smem_per_sm: usize,
    /// When set, the next forward records an event after each stage (see `stage_times`).
    pub(super) timeline: std::sync::Mutex<Option<Timeline>>,
    /// Whether the resident output kernel runs where it applies (`TRIMUL_CUDA_RESIDENT_OUTPUT=0`
    /// turns it off, to compare).
    pub(super) resident_output: AtomicBool,
    /// Launches of the resident output kernel so far (tests check that a path they mean to
    /// exercise ran).
    pub(super) resident_launches: std::sync::atomic::AtomicU64,
    /// Launches of the warp-specialised input build so far (as `resident_launches`).
    pub(super) ws_launches: std::sync::atomic::AtomicU64,
    /// Launches of the register-operand input build so far (as `resident_launches`).
    pub(super) rs_launches: std::sync::atomic::AtomicU64,
    /// Where one-pass forwards get af3's output gate ([`OutputGate`] as a u8; the environment's
    /// `TRIMUL_CUDA_OUTPUT_GATE` sets the first value).
    pub(super) output_gate: std::sync::atomic::AtomicU8,
    /// Launches of that output kernel so far (as `resident_launches`).
    pub(super) xgate_launches: std::sync::atomic::AtomicU64,
    /// The block the last backward carved its intermediates from, with the sizes it was made
    /// for (batch, N, C, H, F), kept for the next backward of the same sizes
    /// (`Backend::free_backward_buffers` drops it).
    pub(super) backward_block: std::sync::Mutex<Option<(BackwardSizes, DeviceBuffer<u8>)>>,
    /// The backward's cuBLASLt plans by GEMM, operand and result types and operand alignment,
    /// made on first use: choosing an algorithm (`cublasLtMatmulAlgoGetHeuristic`) costs tens of
    /// microseconds of host time per GEMM, several hundred per backward otherwise. Emptied when
    /// it passes [`BACKWARD_PLANS`] entries.
    pub(super) backward_gemms: std::sync::Mutex<BackwardPlans>,
    /// Whether the backward's gating steps use the 16-byte-vector kernels where they apply
    /// (`TRIMUL_CUDA_VECTOR_GATING=0` turns them off, to compare).
    pub(super) vector_gating: bool,
    /// Whether one-pass forwards replay launch graphs ([`CudaBackend::set_launch_graphs`]).
    pub(super) launch_graphs: AtomicBool,
    /// Forwards enqueued as a launch of a graph so far, those that captured it included (as
    /// `resident_launches`).
    pub(super) graph_launches: std::sync::atomic::AtomicU64,
}

/// The backward's cached cuBLASLt plans ([`Inner::backward_gemms`]).
pub(super) type BackwardPlans = std::collections::HashMap<(GemmSpec, Elem, Elem, u32), MatmulPlan>;

/// How many backward GEMM plans the backend keeps (a backward has nine or ten; a training run
/// sees a few shapes).
pub(super) const BACKWARD_PLANS: usize = 64;

/// An NVIDIA GPU with its stream, cuBLASLt handle and loaded kernels. Cheap to clone.
///
/// Every call that touches the device makes the device's primary context current on the calling
/// thread (`cuCtxSetCurrent`) and leaves it so; a program that keeps another device current
/// (the CUDA runtime's current device follows the context) restores it after the call.
#[derive(Clone)]
pub struct CudaBackend {
    pub(super) inner: Arc<Inner>,
}

pub(super) fn ceil_div(a: usize, b: usize) -> u32 {
    u32::try_from(a.div_ceil(b)).unwrap_or(u32::MAX)
}
