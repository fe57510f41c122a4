//! cuBLASLt: one handle per backend and one cached plan per GEMM of a workspace.
//!
//! cudarc's safe `Matmul` recreates descriptors and re-runs the algorithm heuristic on every call
//! (~15 µs of host time); a plan here does that once per shape and each forward only launches.
//! The layout math comes from [`GemmSpec`](crate::backend::gemm::GemmSpec), shared with HIP.

use std::ffi::c_void;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys::{self, cublasComputeType_t, cublasLtEpilogue_t, cudaDataType};
use cudarc::driver::sys::{CUdeviceptr, CUstream};

use super::launch_graph::{self, GemmShape, Launch};
use crate::backend::gemm::GemmSpec;
use crate::error::{Error, Result};

fn blas_err(call: &str, e: lt::CublasError) -> Error {
    Error::Blas { library: "cuBLASLt", call: call.to_string(), status: format!("{:?}", e.0) }
}

/// How the attributes of one kind of cuBLASLt object are set: cudarc's setter and the name of
/// the call it makes (for errors).
struct Attributes<O, A> {
    set: unsafe fn(O, A, *const c_void, usize) -> std::result::Result<(), lt::CublasError>,
    call: &'static str,
}

impl<O, A> Attributes<O, A> {
    /// Sets attribute `attr` (`name` in an error) of `obj` to `value`.
    ///
    /// # Safety
    /// `obj` is a live object of this kind; `T` is the attribute's documented type.
    unsafe fn set<T>(&self, obj: O, attr: A, value: &T, name: &str) -> Result<()> {
        // SAFETY: this function's contract; `value` is a live `T`, which the call copies.
        unsafe { (self.set)(obj, attr, value as *const T as *const c_void, std::mem::size_of::<T>()) }
            .map_err(|e| blas_err(&format!("{}({name})", self.call), e))
    }
}

const LAYOUT: Attributes<sys::cublasLtMatrixLayout_t, sys::cublasLtMatrixLayoutAttribute_t> =
    Attributes { set: lt::set_matrix_layout_attribute, call: "cublasLtMatrixLayoutSetAttribute" };
const DESC: Attributes<sys::cublasLtMatmulDesc_t, sys::cublasLtMatmulDescAttributes_t> =
    Attributes { set: lt::set_matmul_desc_attribute, call: "cublasLtMatmulDescSetAttribute" };
const PREF: Attributes<sys::cublasLtMatmulPreference_t, sys::cublasLtMatmulPreferenceAttributes_t> =
    Attributes { set: lt::set_matmul_pref_attribute, call: "cublasLtMatmulPreferenceSetAttribute" };

/// The library handle.
pub(crate) struct BlasHandle(sys::cublasLtHandle_t);

// SAFETY: a cuBLASLt handle may be used from any thread as long as calls on it are not
// concurrent; the backend serialises calls by owning the handle behind `&self` on one stream,
// and cuBLASLt documents handle use as thread-safe for matmul with distinct descriptors.
unsafe impl Send for BlasHandle {}
// SAFETY: see above.
unsafe impl Sync for BlasHandle {}

impl BlasHandle {
    pub(crate) fn new() -> Result<Self> {
        lt::create_handle().map(BlasHandle).map_err(|e| blas_err("cublasLtCreate", e))
    }

    pub(crate) fn version() -> usize {
        // SAFETY: a plain query with no arguments; the library was probed before.
        unsafe { sys::cublasLtGetVersion() }
    }
}

impl Drop for BlasHandle {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { lt::destroy_handle(self.0) };
    }
}

/// Element types of a GEMM's operands.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Elem {
    F16,
    Bf16,
    F32,
}

impl Elem {
    fn cuda(self) -> cudaDataType {
        match self {
            Elem::F16 => cudaDataType::CUDA_R_16F,
            Elem::Bf16 => cudaDataType::CUDA_R_16BF,
            Elem::F32 => cudaDataType::CUDA_R_32F,
        }
    }
}

/// A GEMM with its descriptors and algorithm chosen once.
pub(crate) struct MatmulPlan {
    spec: GemmSpec,
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
    workspace_bytes: usize,
    bias: bool,
    /// Unique among the process's plans: a captured launch graph names its GEMM by it
    /// ([`launch_graph::GemmShape`]), so a plan made later at the same address is another GEMM.
    id: u64,
}

static NEXT_PLAN_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

// SAFETY: the descriptors are immutable after construction except the bias pointer, which is
// set right before each launch under `&mut self`.
unsafe impl Send for MatmulPlan {}
// SAFETY: through `&self` the plan only hands out its spec; every call that passes the
// descriptors to cuBLASLt (`run`) takes `&mut self`, so shared references never race.
unsafe impl Sync for MatmulPlan {}

fn layout(
    ty: Elem,
    rows: usize,
    cols: usize,
    ld: usize,
    batch: usize,
    stride: usize,
) -> Result<sys::cublasLtMatrixLayout_t> {
    // cuBLASLt counts batches in 32 bits; a wrapped count would multiply only some matrices.
    let count = i32::try_from(batch).map_err(|_| {
        Error::Shape(format!(
            "{batch} matrices in one batched GEMM (B·H for the contraction); cuBLASLt takes at most {}",
            i32::MAX
        ))
    })?;
    let l = lt::create_matrix_layout(ty.cuda(), rows as u64, cols as u64, ld as i64)
        .map_err(|e| blas_err("cublasLtMatrixLayoutCreate", e))?;
    if batch > 1 {
        let stride = stride as i64;
        // SAFETY: `l` is a live layout; the attribute values are plain integers of the sizes
        // the attributes are documented with (int32 batch count, int64 stride).
        unsafe {
            use sys::cublasLtMatrixLayoutAttribute_t as L;
            LAYOUT.set(l, L::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, "BATCH_COUNT")?;
            LAYOUT.set(l, L::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, "STRIDED_BATCH_OFFSET")?;
        }
    }
    Ok(l)
}

/// Up to `count` algorithms the heuristic offers for these descriptors, best first (at least one,
/// or an error).
///
/// # Safety
/// Every descriptor must be live.
unsafe fn heuristic_candidates(
    handle: sys::cublasLtHandle_t,
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    pref: sys::cublasLtMatmulPreference_t,
    count: usize,
) -> std::result::Result<Vec<sys::cublasLtMatmulHeuristicResult_t>, lt::CublasError> {
    let count = count.clamp(1, 16);
    // SAFETY: the heuristic result is plain data (an algorithm blob, sizes and a status);
    // all-zero is a valid value that the call overwrites.
    let mut results: Vec<sys::cublasLtMatmulHeuristicResult_t> = vec![std::mem::zeroed(); count];
    let mut returned = 0i32;
    sys::cublasLtMatmulAlgoGetHeuristic(
        handle,
        desc,
        a,
        b,
        d,
        d,
        pref,
        count as i32,
        results.as_mut_ptr(),
        &mut returned,
    )
    .result()?;
    if returned <= 0 {
        return Err(lt::CublasError(sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED));
    }
    results.truncate(returned as usize);
    Ok(results)
}

impl MatmulPlan {
    /// Creates descriptors for `spec` with f16 A/B, `d_type` output, f32 accumulation, an
    /// optional per-row (of D, i.e. per output feature) bias epilogue, and picks the fastest
    /// algorithm the heuristic offers within `max_workspace` bytes.
    pub(crate) fn new(
        handle: &BlasHandle,
        spec: GemmSpec,
        d_type: Elem,
        bias: bool,
        max_workspace: usize,
    ) -> Result<Self> {
        Self::new_ranked(handle, spec, d_type, bias, max_workspace, 0)
    }

    /// As [`MatmulPlan::new`], with the heuristic's candidate of rank `rank` (0: its first
    /// choice; past the last candidate, the last). The tuning table (`super::tuning`) names
    /// ranks that measured faster than the first choice.
    pub(crate) fn new_ranked(
        handle: &BlasHandle,
        spec: GemmSpec,
        d_type: Elem,
        bias: bool,
        max_workspace: usize,
        rank: usize,
    ) -> Result<Self> {
        Self::build(handle, spec, Elem::F16, d_type, bias, max_workspace, rank, None)
    }

    /// As [`MatmulPlan::new`] (no bias) for operands whose addresses are multiples of
    /// `alignment` bytes only, not of the 256 the heuristic otherwise assumes: the sharded
    /// forward's GEMMs on blocks inside its buffers (a row offset of `r0·N` halves).
    pub(crate) fn new_aligned(
        handle: &BlasHandle,
        spec: GemmSpec,
        d_type: Elem,
        max_workspace: usize,
        alignment: u32,
    ) -> Result<Self> {
        Self::build(handle, spec, Elem::F16, d_type, false, max_workspace, 0, Some(alignment))
    }

    /// A GEMM of the backward, A and B in `inputs` and D in `output`, with f32 accumulation:
    /// f32 operands run on the tensor cores in TF32 (rounded to a 10-bit mantissa, as f16's, with
    /// f32's range, which gradients need), bf16 ones as they are. Every operand's address is a
    /// multiple of `alignment` bytes (a power of two; the weight gradients' tail GEMMs start
    /// inside their buffers).
    pub(crate) fn backward(
        handle: &BlasHandle,
        spec: GemmSpec,
        (inputs, output): (Elem, Elem),
        max_workspace: usize,
        alignment: u32,
    ) -> Result<Self> {
        Self::build(handle, spec, inputs, output, false, max_workspace, 0, Some(alignment))
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        handle: &BlasHandle,
        spec: GemmSpec,
        ab_type: Elem,
        d_type: Elem,
        bias: bool,
        max_workspace: usize,
        rank: usize,
        alignment: Option<u32>,
    ) -> Result<Self> {
        let compute = match ab_type {
            Elem::F16 | Elem::Bf16 => cublasComputeType_t::CUBLAS_COMPUTE_32F,
            Elem::F32 => cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        };
        let desc = lt::create_matmul_desc(compute, cudaDataType::CUDA_R_32F)
            .map_err(|e| blas_err("cublasLtMatmulDescCreate", e))?;
        // cublasOperation_t as a 32-bit int: CUBLAS_OP_N = 0, CUBLAS_OP_T = 1.
        let (ta, tb) = (i32::from(spec.trans_a), i32::from(spec.trans_b));
        // SAFETY: `desc` is live; each attribute gets a value of its documented type and size.
        unsafe {
            use sys::cublasLtMatmulDescAttributes_t as D;
            DESC.set(desc, D::CUBLASLT_MATMUL_DESC_TRANSA, &ta, "TRANSA")?;
            DESC.set(desc, D::CUBLASLT_MATMUL_DESC_TRANSB, &tb, "TRANSB")?;
            if bias {
                let epi = cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS;
                DESC.set(desc, D::CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, "EPILOGUE")?;
            }
        }
        let (ar, ac) = spec.a_dims();
        let (br, bc) = spec.b_dims();
        let a = layout(ab_type, ar, ac, spec.lda, spec.batch, spec.stride_a)?;
        let b = layout(ab_type, br, bc, spec.ldb, spec.batch, spec.stride_b)?;
        let d = layout(d_type, spec.m, spec.n, spec.ldd, spec.batch, spec.stride_d)?;

        let pref = lt::create_matmul_pref().map_err(|e| blas_err("cublasLtMatmulPreferenceCreate", e))?;
        let ws = max_workspace as u64;
        // SAFETY: `pref` is live; each attribute gets a value of its documented type (a u64 workspace
        // byte count, u32 alignments).
        let heuristic = unsafe {
            use sys::cublasLtMatmulPreferenceAttributes_t as P;
            PREF.set(pref, P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, "MAX_WORKSPACE_BYTES")?;
            if let Some(align) = alignment {
                for attr in [
                    P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                    P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                    P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                ] {
                    // The attribute is a uint32 byte count.
                    PREF.set(pref, attr, &align, "MIN_ALIGNMENT")?;
                }
            }
            let h = heuristic_candidates(handle.0, desc, a, b, d, pref, rank + 1);
            let _ = lt::destroy_matmul_pref(pref);
            let all = h.map_err(|e| blas_err(&format!("cublasLtMatmulAlgoGetHeuristic for {spec:?}"), e))?;
            all[rank.min(all.len() - 1)]
        };
        let id = NEXT_PLAN_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(MatmulPlan { spec, desc, a, b, d, algo: heuristic.algo, workspace_bytes: heuristic.workspaceSize, bias, id })
    }

    pub(crate) fn spec(&self) -> &GemmSpec {
        &self.spec
    }

    /// Enqueues `D = op(A)·op(B) (+ bias)` on `stream`.
    ///
    /// # Safety
    /// `a`, `b`, `d` (and `bias` when the plan has one) must be device allocations of the sizes
    /// the spec implies and `workspace` must hold `workspace_len ≥ self.workspace_bytes` bytes, all
    /// alive until the stream has executed the call.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn run(
        &mut self,
        handle: &BlasHandle,
        a: CUdeviceptr,
        b: CUdeviceptr,
        d: CUdeviceptr,
        bias: CUdeviceptr,
        workspace: CUdeviceptr,
        workspace_len: usize,
        stream: CUstream,
    ) -> Result<()> {
        if workspace_len < self.workspace_bytes {
            return Err(Error::InvalidArgument(format!(
                "cuBLASLt plan needs {} workspace bytes, {} given",
                self.workspace_bytes, workspace_len
            )));
        }
        // A workspace planned for weights with an output bias, used with weights without one (or
        // the reverse; device-prepared weights can change between calls), would read address 0
        // or drop the bias: refused instead.
        if self.bias != (bias != 0) {
            return Err(Error::InvalidArgument(format!(
                "a workspace planned for weights {} an output bias was given weights {} one",
                if self.bias { "with" } else { "without" },
                if self.bias { "without" } else { "with" }
            )));
        }
        // A graph captured from this call bakes in every address; the workspace's only where the
        // algorithm uses one.
        let recorded = || {
            let (ws, ws_len) = if self.workspace_bytes > 0 { (workspace, self.workspace_bytes) } else { (0, 0) };
            let (plan, bias_at) = (self.id, if self.bias { bias } else { 0 });
            Launch::Gemm(GemmShape { plan, a, b, d, bias: bias_at, workspace: ws, workspace_len: ws_len })
        };
        if !launch_graph::note(recorded) {
            return Ok(());
        }
        if self.bias {
            let p = bias as *const c_void;
            lt::set_matmul_desc_attribute(
                self.desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                &p as *const *const c_void as *const c_void,
                std::mem::size_of::<*const c_void>(),
            )
            .map_err(|e| blas_err("cublasLtMatmulDescSetAttribute(BIAS_POINTER)", e))?;
        }
        let alpha = 1.0f32;
        let beta = 0.0f32;
        lt::matmul(
            handle.0,
            self.desc,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            a as *const c_void,
            self.a,
            b as *const c_void,
            self.b,
            d as *const c_void,
            self.d,
            d as *mut c_void,
            self.d,
            &self.algo,
            workspace as *mut c_void,
            self.workspace_bytes,
            stream as sys::cudaStream_t,
        )
        .map_err(|e| blas_err("cublasLtMatmul", e))
    }
}

impl Drop for MatmulPlan {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created in `new` and is destroyed once.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.a);
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.d);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}
