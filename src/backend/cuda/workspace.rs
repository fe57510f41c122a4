//! Prepared weights and workspaces: what the plans allocate and fill and the launches read (the
//! fused kernels' builds and shared-memory sizes, the one-pass scratch, the chunked and staged
//! layouts).

use cudarc::driver::sys::CUstream;

use super::blas::{Elem, MatmulPlan};
use super::context::{ceil_div, OutputGate};
use super::driver::DeviceBuffer;
use super::kernels;
use super::launch_graph::{self, GraphCache};
use super::tuning::Tuning;
use crate::backend::caller_workspace::Rebase;
use crate::backend::gemm::GemmSpec;
use crate::backend::params::{self, geometry, FusedInputLayout, InputParams, STAGE_THREADS};
use crate::backend::prepared::{DeviceBytes, PreparedTensors};
use crate::error::{Error, Result};
use crate::plan::Plan;
use crate::problem::{Config, Problem};

// Block sizes and shared memory of the fused kernels: `common/smem.h`, which the kernels assert
// their layouts against ([`params::geometry`]).

/// Positions per block of the fused output kernels (`cuda/output_projection.cu`).
pub(super) const OUTPUT_PROJECTION_ROWS: usize = geometry::TM_OP_ROWS;
/// Dynamic shared memory of the fused output kernel: the a tile, one 128-column Wout chunk, the
/// statistics and LN_H's parameters, and for af3 or 16-bit y the staging tile of the gate and y.
pub(super) const fn output_projection_smem(af3: bool, io_dtype: i32) -> u32 {
    let staging = if af3 || io_dtype != params::IO_F32 { geometry::TM_OP_SMEM_STAGING } else { 0 };
    (geometry::TM_OP_SMEM + staging) as u32
}
/// Shared memory of `output_projection_sm90_xgate` (`OpxSmem` in `cuda/output_projection.cu`).
pub(super) const OUTPUT_XGATE_SMEM: u32 = geometry::TM_OP_XGATE_SMEM as u32;
/// Shared memory of the resident output kernel: [`output_projection_smem`]'s for f32 y, plus the
/// next tile's t.
pub(super) const OUTPUT_RESIDENT_SMEM: u32 = geometry::TM_OP_RESIDENT_SMEM as u32;

/// Weights fused, cast to f16 and uploaded once.
pub struct CudaPrepared {
    /// The layer these weights belong to; a forward of another layer's problem is refused.
    pub(super) config: Config,
    /// Which prepared weights these are ([`super::next_weights_id`]).
    pub(super) id: u64,
    /// Weights in the fused input kernel's order, when that kernel takes this shape.
    pub(super) fused: Option<FusedInput>,
    /// The f16 projections, f32 biases and LayerNorm parameters.
    pub(super) tensors: PreparedTensors<DeviceBuffer<u16>, DeviceBuffer<f32>>,
}

// The prepared weights' buffers (`backend/prepared.rs`).
impl<T> DeviceBytes for DeviceBuffer<T> {
    fn address(&self) -> u64 {
        self.ptr()
    }

    fn byte_len(&self) -> u64 {
        self.bytes()
    }
}

/// One build of the fused input kernel: its entry point, dynamic shared memory and positions
/// per block.
#[derive(Copy, Clone)]
pub(super) struct InputBuild<'a> {
    pub(super) stage: &'a kernels::Stage,
    pub(super) smem: u32,
    pub(super) rows: usize,
}

/// The fused input kernel a forward launches.
#[derive(Copy, Clone)]
pub(super) struct FusedKernel<'a> {
    pub(super) build: InputBuild<'a>,
    /// The warpgroup-MMA (sm_90a) builds.
    pub(super) wgmma: bool,
    /// Another build for launches whose x is f32 (see [`FusedKernel::launch`]).
    pub(super) f32_x: Option<InputBuild<'a>>,
    /// The warp-specialised persistent build, for the launches it takes ([`WsBuild::takes`]).
    pub(super) ws: Option<WsBuild<'a>>,
    /// Launched as a programmatic dependent of the kernel before it (sm_90+, see
    /// `kernels::Stage::launch_dependent`): its weight set-up runs under that kernel's tail.
    pub(super) pdl: bool,
}

impl FusedKernel<'_> {
    /// Launches the kernel over `rows` positions (`kp` says which and the I/O precision). On an
    /// H100 at padded C ≤ 128, f32 x takes 64-position blocks three per SM and 16-bit x
    /// 128-position blocks two per SM: the third block hides more of the DRAM latency of f32 x,
    /// while with 16-bit x the weight slices each block re-reads from L2 (twice as many per
    /// position in 64-position blocks) cost more than it hides (input stage, H100, 1024,1,128:
    /// f32 0.70 → 0.66 ms, bf16 0.60 → 0.64 ms with the 64-position build). Launches the
    /// warp-specialised build instead where it takes them ([`WsBuild::takes`]).
    ///
    /// # Safety
    /// As [`kernels::Stage::launch`].
    pub(super) unsafe fn launch(&self, rows: usize, stream: CUstream, kp: &InputParams) -> Result<()> {
        if let Some(ws) = self.ws.filter(|ws| ws.takes(rows, kp)) {
            let grid = (rows / WS_ROWS).min(ws.sms as usize) as u32;
            launch_graph::count(ws.launches);
            // The register-operand form takes the 16-bit launches without the gate chunk.
            if let Some((rs, launches)) = ws.rs.filter(|_| kp.common.io_dtype() != params::IO_F32 && kp.chunk_end == 4)
            {
                launch_graph::count(launches);
                return rs.launch_dependent(grid, RS_THREADS, WS_SMEM_BYTES, stream, kp, self.pdl);
            }
            return ws.stage.launch_dependent(grid, WS_THREADS, WS_SMEM_BYTES, stream, kp, self.pdl);
        }
        let b = match self.f32_x {
            Some(b) if kp.common.io_dtype() == params::IO_F32 => b,
            _ => self.build,
        };
        b.stage.launch_dependent(ceil_div(rows, b.rows), STAGE_THREADS, b.smem, stream, kp, self.pdl)
    }
}

/// The warp-specialised persistent input build (`input_projection_sm90_ws` in
/// `cuda/input_projection.cu`): one block of [`WS_THREADS`] per SM, all weights resident, tiles of
/// [`WS_ROWS`] positions; its shared-memory layout is the kernel's `WS_SMEM_BYTES`.
#[derive(Copy, Clone)]
pub(super) struct WsBuild<'a> {
    pub(super) stage: &'a kernels::Stage,
    /// Its register-operand form (`input_projection_sm90_rs`), which takes the launches with
    /// 16-bit x and the four gating chunks alone, and that build's launch counter.
    pub(super) rs: Option<(&'a kernels::Stage, &'a std::sync::atomic::AtomicU64)>,
    pub(super) sms: u32,
    pub(super) launches: &'a std::sync::atomic::AtomicU64,
}

pub(super) const WS_THREADS: u32 = geometry::TM_WS_THREADS as u32;
pub(super) const WS_ROWS: usize = geometry::TM_WS_ROWS;
/// All weights, z, staging, masks and LN_C's parameters: 226.5 KB of the SM's 227.
pub(super) const WS_SMEM_BYTES: u32 = geometry::TM_WS_SMEM as u32;
/// The register-operand build's block: a producer and two consumer warpgroups. Its shared
/// memory is the same 226.5 KB (`TM_RS_SMEM`, checked equal below).
pub(super) const RS_THREADS: u32 = geometry::TM_RS_THREADS as u32;
const _: () = assert!(geometry::TM_RS_SMEM == geometry::TM_WS_SMEM);

impl WsBuild<'_> {
    /// Whether the build takes this launch: C = H = G = 128 (checked with the layout), every
    /// channel, every column chunk or all but the gate's, and full tiles inside one batch (the
    /// first position, rows and N² multiples of 64): the one-pass plan, and a rank's positions
    /// in the sharded forward. Where it applies it is the fastest build
    /// at every size measured, in every I/O precision (H100, 16 producer warps, against the two-
    /// and three-blocks-per-SM builds: gpumode f32 256,2,128 0.194 → 0.183 ms, 1024,1,128 1.428 →
    /// 1.378 ms, N = 4096 42.9 → 41.6 ms; af3 bf16 1024,1,128 1.342 → 1.240 ms).
    pub(super) fn takes(&self, rows: usize, kp: &InputParams) -> bool {
        let p = &kp.common;
        let nn = p.n() * p.n();
        p.c() == 128
            && p.h() == 128
            && p.g() == 128
            && p.row0() % WS_ROWS == 0
            && p.rows() == rows
            && kp.chunk_begin == 0
            // Every column chunk, or the four gating ones (the output stage makes the gate).
            && matches!(kp.chunk_end, 0 | 4 | 5)
            && kp.lr_h0 == 0
            && (kp.lr_h == 0 || kp.lr_h == 128)
            && rows > 0
            && rows % WS_ROWS == 0
            && nn % WS_ROWS == 0
    }
}

pub(super) struct FusedInput {
    pub(super) layout: FusedInputLayout,
    pub(super) w: DeviceBuffer<u16>,
    pub(super) bias: Option<DeviceBuffer<f32>>,
}

impl FusedInput {
    /// Dynamic shared memory of one block of the mma.sync build (see the layout comment in
    /// `cuda/input_projection.cu`).
    pub(super) fn smem_bytes(&self) -> usize {
        Self::smem_bytes_of(&self.layout)
    }

    pub(super) fn smem_bytes_of(layout: &FusedInputLayout) -> usize {
        geometry::TM_IP_SMEM(layout.k_pad)
    }

    /// The same for the wgmma builds with `rows` positions per block: unpadded swizzled tiles,
    /// plus 1024 bytes to align them.
    pub(super) fn smem_bytes_sm90_rows(&self, rows: usize) -> usize {
        geometry::TM_IP_SM90_SMEM(rows, self.layout.k_pad)
    }
}

/// Intermediates and GEMM plans for one problem shape.
pub struct CudaWorkspace {
    /// The one-pass forward's launch graph ([`CudaBackend::set_launch_graphs`]). First, so that
    /// it is destroyed before the buffers below, which keep the device's context alive.
    pub(super) graphs: GraphCache,
    pub(super) problem: Problem,
    /// How the forward is split and where its intermediates live.
    pub(super) plan: Plan,
    pub(super) layout: Layout,
    /// `[B, H, N, N]` f16, the contraction (plus, in the one-pass cuBLASLt input path, that
    /// path's scratch before the contraction runs).
    pub(super) t: DeviceBuffer<u16>,
    /// One-pass: all `B·H` matrices. Chunked: the `hc` matrices of one batch and pass.
    pub(super) contraction: MatmulPlan,
    /// Chunked: the last pass when `hc` does not divide H.
    pub(super) contraction_tail: Option<MatmulPlan>,
    /// One-pass: all M rows. Chunked: one row chunk.
    pub(super) output: MatmulPlan,
    /// Chunked: the last row chunk when it is shorter.
    pub(super) output_tail: Option<MatmulPlan>,
    /// The choices this workspace was planned and is run with.
    pub(super) tuning: Tuning,
    /// [`CudaBackend::set_output_gate`] when it was planned (a one-pass workspace has a gate
    /// buffer or not by it).
    pub(super) output_gate: OutputGate,
    /// The prepared weights a chunked workspace holds copies of (`None` for one pass, which
    /// reads the prepared weights themselves).
    pub(super) weights_of: Option<u64>,
    /// The kernel switches when it was planned ([`CudaBackend::switches`]): which input build
    /// runs decides whether the plan holds the cuBLASLt projection's scratch.
    pub(super) switches: u8,
    /// For a workspace in caller memory ([`CudaBackend::plan_caller_workspace`]), the address
    /// its buffers are laid out from now (0 until the first bind) and the bytes they span;
    /// `None`: the backend owns it.
    pub(super) caller_base: Option<(u64, u64)>,
}

/// Where the intermediates live. One per workspace, so the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub(super) enum Layout {
    /// Everything at once: left, right and the gate for every position.
    OnePass {
        left: DeviceBuffer<u16>,
        right: DeviceBuffer<u16>,
        /// None when the output stage makes the gate from x ([`CudaBackend::gate_from_x_for`]).
        gate: Option<DeviceBuffer<u16>>,
        /// The cuBLASLt stage-1 path's scratch plan and projection GEMMs (None with the fused kernel).
        blas_input: Option<BlasInput>,
    },
    /// Hidden passes and row chunks within a memory limit (see [`crate::plan`]).
    Chunked { scratch: DeviceBuffer<u8> },
    /// The same for layers the fused input kernel does not take: the stage kernels around
    /// cuBLASLt ([`Staged`]).
    Staged(Staged),
}

/// A chunked plan of the staged pipeline (shared with the HIP backend, [`crate::backend::staged_steps`]):
/// per hidden pass `input_norm`, a cuBLASLt projection with the pass's rows of the gated
/// projections (packed per pass into `pass_w`) and `input_gating` with H = the pass width, then
/// the pass's contraction; per row chunk the gate from x and the output stage. t lives in the
/// workspace's `t`.
pub(super) struct Staged {
    pub(super) scratch: DeviceBuffer<u8>,
    pub(super) pass_w: DeviceBuffer<u8>,
    pub(super) gemm_ws: DeviceBuffer<u8>,
    /// One cuBLASLt plan per distinct GEMM of the forward (full and last pass, full and last row
    /// chunk), made with the workspace.
    pub(super) gemms: std::collections::HashMap<(GemmSpec, Elem, bool), MatmulPlan>,
}

impl Staged {
    pub(super) fn gemm(&mut self, spec: GemmSpec, d: Elem, bias: bool) -> Result<&mut MatmulPlan> {
        self.gemms
            .get_mut(&(spec, d, bias))
            .ok_or_else(|| Error::InvalidArgument(format!("no cuBLASLt plan for {spec:?}")))
    }
}

impl<T> Rebase for DeviceBuffer<T> {
    fn rebase(&mut self, from: u64, to: u64) -> Result<()> {
        DeviceBuffer::rebase(self, from, to)
    }
}

/// The GEMM plan for one piece of a chunked stage: `full`'s for a piece of the chunk size,
/// `tail`'s for the last, shorter piece when there is one.
pub(super) fn full_or_tail<'a>(
    full: &'a mut MatmulPlan,
    tail: &'a mut Option<MatmulPlan>,
    is_full: bool,
) -> &'a mut MatmulPlan {
    match tail {
        Some(t) if !is_full => t,
        _ => full,
    }
}

/// The cuBLASLt projection GEMMs of a one-pass plan without the fused input kernel: a full
/// input chunk and the last, shorter one.
pub(super) struct BlasInput {
    pub(super) proj_full: MatmulPlan,
    pub(super) proj_tail: Option<MatmulPlan>,
}
