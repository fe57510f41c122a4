//! The CUDA backward pass: every gradient of `L` given `dy`, recomputing the forward's
//! intermediates from `x`. The steps are [`crate::backend::backward_steps`]'s (its module docs
//! list them, `docs/backward.md` derives the math): the kernels of `common/backward.h` compiled
//! by `cuda/backward.cu`, cuBLASLt for the GEMMs between them, and for af3 with 16-bit
//! I/O the output side as one kernel (`cuda/backward_output.cu`).
//!
//! # Precision and memory
//! With f32 I/O the GEMMs read f32 and run on the tensor cores in TF32 (10-bit mantissa, as the
//! forward's f16 operands, but f32's range, which gradients need) with f32 accumulation,
//! including the weight gradients' sums over all `M` positions; with 16-bit I/O those of the
//! input side and the contraction read f16 or bf16 (the step list's module docs say which).
//! The weights are the prepared f16 ones, converted where a GEMM needs another type. The buffers, cuBLASLt's workspace last, come from a caller's workspace span, or else
//! from the backend, which keeps them for the next backward of the same sizes
//! (`Backend::free_backward_buffers`).

use std::collections::hash_map::Entry;

use cudarc::driver::result as cu;
use cudarc::driver::sys::{CUdeviceptr, CUstream};

use super::blas::{Elem, MatmulPlan};
use super::context::{CudaBackend, BACKWARD_PLANS, MAX_GEMM_WORKSPACE, POISON_BYTE};
use super::driver::{DeviceBuffer, DriverResult};
use super::workspace::CudaPrepared;
use crate::backend::backward_params::{
    acc_smem, backward_sizes, gradient_copies, in_kept_block, output_norm_grad_smem, Outputs, OUTPUT_SIDE_SMEM, THREADS,
};
use crate::backend::backward_steps::{self, BackwardBuffers, BackwardStep, GemmElem, KernelArgs, Residency};
use crate::device_io::{BackwardDeviceIo, DeviceSpan};
use crate::error::{Error, Result};
use crate::gradients::Gradients;
use crate::problem::Problem;

impl CudaBackend {
    /// Refuses a backward whose LayerNorm kernels would need more shared memory per block than
    /// the GPU has (they hold a 32-position tile of t, and per-warp column sums): H ≤ 1185 and
    /// C ≤ 3632 on an H100, before anything is enqueued.
    pub(super) fn check_backward_fits(&self, problem: &Problem) -> Result<()> {
        let (c, h) = (problem.config.c, problem.config.h);
        let max = self.inner.kernels.max_smem;
        let need = [("H", h, output_norm_grad_smem(h)), ("C", c, acc_smem(c))];
        match need.into_iter().find(|&(_, _, bytes)| bytes > max) {
            Some((name, v, bytes)) => Err(Error::Unsupported {
                backend: crate::error::BackendKind::Cuda,
                what: format!(
                    "the backward pass at {name} = {v} (its LayerNorm kernels need {bytes} bytes of shared memory \
                     per block; this GPU has {max})"
                ),
            }),
            None => Ok(()),
        }
    }

    /// Bytes of the workspace span a backward of `problem` carves its buffers from
    /// ([`Backend::backward_device`](crate::Backend) with a workspace).
    pub(super) fn backward_span_bytes(&self, problem: &Problem) -> Result<u64> {
        Ok(BackwardBuffers::new(problem, MAX_GEMM_WORKSPACE as u64, 0).bytes)
    }

    /// Drops the block the last backward kept: the next backward allocates one again.
    pub(super) fn drop_backward_buffers(&self) {
        if let Ok(mut kept) = self.inner.backward_block.lock() {
            *kept = None;
        }
    }

    /// Enqueues the backward on device memory: `x`, `dy` and `dx` are `[M, C]` in `problem.io`,
    /// `mask` `[M]` f32 or 0; the weight gradients land in `b.sums` at [`Outputs`]' offsets once the stream
    /// has run. With poisoning on (the tests), every buffer a step writes is filled with NaN
    /// first, so that an element a step fails to write shows in the gradients.
    ///
    /// # Safety
    /// `x`, `dy`, `mask` (when non-zero) and `dx` are live device allocations of those sizes
    /// until the stream has run the work, `dx` aliasing none of the others; `b` was laid out for
    /// this problem in live device memory that nothing else uses meanwhile.
    unsafe fn enqueue_backward(
        &self,
        prep: &CudaPrepared,
        problem: &Problem,
        io: (CUdeviceptr, CUdeviceptr, CUdeviceptr, CUdeviceptr),
        b: &BackwardBuffers,
        stream: CUstream,
    ) -> Result<()> {
        if self.inner.poison.load(std::sync::atomic::Ordering::Relaxed) {
            for &(at, bytes) in &b.written {
                DeviceBuffer::<u8>::borrowed(&self.inner.ctx, &self.inner.tracker, at, bytes as usize)
                    .memset_async(POISON_BYTE, stream)?;
            }
        }
        let w = prep.tensors.backward_weights();
        let device = Residency {
            shared: self.inner.smem_per_sm,
            units: self.inner.info.compute_units as usize,
            output_side: OUTPUT_SIDE_SMEM <= self.inner.kernels.max_smem,
            vector_gating: self.inner.vector_gating,
        };
        let k = &self.inner.kernels.backward;
        let blas = &self.inner.blas;
        // A backward that panicked while holding the plans left no half-made entry (an insert is
        // the last thing done to the map): the cache is still sound, so its lock is taken back.
        let mut plans = self.inner.backward_gemms.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for step in backward_steps::steps(problem, &w, io, b, device) {
            match step {
                BackwardStep::Launch { kernel, sixteen, grid, smem, args } => {
                    let (stage, grid, smem) = (k.stage(kernel, sixteen), u32::try_from(grid), smem as u32);
                    let grid = grid.map_err(|_| Error::Internal(format!("{kernel:?}: grid too large")))?;
                    // SAFETY: every address in `args` lies in a buffer of the size the kernel's
                    // argument struct's comments give for this problem (the caller's by this
                    // function's contract, the rest in `b`; `backward_steps`' tests check the
                    // list's addresses); the Rust struct mirrors the one the kernel takes.
                    unsafe {
                        match &args {
                            KernelArgs::Backward(p) => stage.launch_with(grid, THREADS, smem, stream, p, false),
                            KernelArgs::ColumnSums(p) => stage.launch_with(grid, THREADS, smem, stream, p, false),
                            KernelArgs::Convert(p) => stage.launch_with(grid, THREADS, smem, stream, p, false),
                        }?
                    }
                }
                BackwardStep::Gemm { spec, u, v, d, inputs, output } => {
                    let elem = |e| match e {
                        GemmElem::F32 => Elem::F32,
                        GemmElem::F16 => Elem::F16,
                        GemmElem::Bf16 => Elem::Bf16,
                    };
                    // The largest power of two (up to 256) that divides every operand's address.
                    let alignment = 1u32 << (u | v | d | 256).trailing_zeros();
                    let types = (elem(inputs), elem(output));
                    let key = (spec, types.0, types.1, alignment);
                    if plans.len() >= BACKWARD_PLANS && !plans.contains_key(&key) {
                        plans.clear();
                    }
                    let plan = match plans.entry(key) {
                        Entry::Occupied(kept) => kept.into_mut(),
                        Entry::Vacant(new) => {
                            new.insert(MatmulPlan::backward(blas, spec, types, MAX_GEMM_WORKSPACE, alignment)?)
                        }
                    };
                    // SAFETY: `u`, `v` and `d` hold the matrices `spec` describes (as above);
                    // the workspace holds MAX_GEMM_WORKSPACE bytes; all live until the stream has
                    // run the call. Row-major D = op(U)·op(V) is column-major A = V, B = U.
                    unsafe { plan.run(blas, v, u, d, 0, b.gemm_ws, MAX_GEMM_WORKSPACE, stream)? }
                }
                BackwardStep::Mark(label) => self.mark(label, stream)?,
            }
        }
        Ok(())
    }

    /// Lays `problem`'s backward out in `span` and enqueues it on `stream`, then the
    /// weight-gradient `copies` ([`gradient_copies`]) after it; returns the layout. On a failure,
    /// waits for what was enqueued before it (it still writes dx and the buffers), so that the
    /// caller's memory is free when this returns, as promised.
    ///
    /// # Safety
    /// As [`CudaBackend::enqueue_backward`] for `io`, until the stream has run the work; `span`
    /// and each copy's destination are device memory of their sizes that nothing else uses
    /// meanwhile.
    #[allow(clippy::too_many_arguments)]
    unsafe fn enqueue_in(
        &self,
        prep: &CudaPrepared,
        problem: &Problem,
        io: (CUdeviceptr, CUdeviceptr, CUdeviceptr, CUdeviceptr),
        span: DeviceSpan,
        stream: CUstream,
        copies: &[(u64, usize, usize)],
    ) -> Result<BackwardBuffers> {
        let b = BackwardBuffers::new(problem, MAX_GEMM_WORKSPACE as u64, span.ptr);
        span.check("the backward's workspace", b.bytes)?;
        let enqueue = || -> Result<()> {
            // SAFETY: forwarded from this function's contract; `b` lies in `span`, checked.
            unsafe { self.enqueue_backward(prep, problem, io, &b, stream)? };
            for &(dst, at, n) in copies {
                // SAFETY: the sums lie in `b`, the destination holds `n` floats (the contract).
                unsafe { cu::memcpy_dtod_async(dst, b.sums + (at * 4) as u64, n * 4, stream) }
                    .ctx("cuMemcpyDtoDAsync(weight gradients)")?;
            }
            Ok(())
        };
        if let Err(e) = enqueue() {
            // SAFETY: a live stream of this context (the caller's or the backend's).
            let _ = unsafe { cudarc::driver::result::stream::synchronize(stream) };
            return Err(e);
        }
        Ok(b)
    }

    /// The backward on device memory, on `io.stream`, its buffers carved from `io.workspace`,
    /// the weight gradients copied on the device to `io.grads` at the end; returns once
    /// enqueued.
    ///
    /// # Safety
    /// As [`CudaBackend::enqueue_in`].
    pub(super) unsafe fn backward_on_device_async(
        &self,
        prep: &CudaPrepared,
        problem: &Problem,
        io: BackwardDeviceIo,
    ) -> Result<()> {
        let copies = gradient_copies(problem, prep.tensors.biases, io.grads)?;
        // SAFETY: forwarded from this function's contract.
        unsafe { self.enqueue_in(prep, problem, io.tensors, io.workspace, io.stream as CUstream, &copies) }.map(drop)
    }

    /// The backward on device memory, on `stream` (see
    /// [`Backend::backward_buffers`](crate::Backend)), its buffers carved from `workspace` or
    /// else the backend's own (kept for the next backward of the same sizes): runs it, waits,
    /// and returns the weight gradients.
    ///
    /// # Safety
    /// As [`CudaBackend::enqueue_backward`] for `io`; the workspace span, when given, is device
    /// memory of its bytes that nothing else uses until this returns.
    pub(super) unsafe fn backward_on_device(
        &self,
        prep: &CudaPrepared,
        problem: &Problem,
        io: (CUdeviceptr, CUdeviceptr, CUdeviceptr, CUdeviceptr),
        stream: CUstream,
        workspace: Option<DeviceSpan>,
    ) -> Result<Gradients> {
        let cfg = problem.config;
        let (c, h, f) = (cfg.c, cfg.h, cfg.fused_proj_width());
        let out = Outputs::new(c, h, f);
        let run = |span: DeviceSpan| -> Result<Vec<f32>> {
            // SAFETY: forwarded from this function's contract.
            let b = unsafe { self.enqueue_in(prep, problem, io, span, stream, &[]) }?;
            let mut sums = vec![0f32; out.len];
            let view = DeviceBuffer::<f32>::borrowed(&self.inner.ctx, &self.inner.tracker, b.sums, out.len);
            // Waits for the backward: the buffers are free for the next call once this returns.
            view.download(&mut sums, stream)?;
            Ok(sums)
        };
        let sums = match workspace {
            Some(span) => run(span)?,
            None => {
                let bytes = self.backward_span_bytes(problem)?;
                let mut kept =
                    self.inner.backward_block.lock().map_err(|_| {
                        Error::Internal("a backward panicked while holding the backward buffers".into())
                    })?;
                let alloc = || self.alloc_buffer::<u8>(bytes as usize);
                in_kept_block(&mut kept, backward_sizes(problem), alloc, |block| {
                    run(DeviceSpan { ptr: block.ptr(), bytes })
                })?
            }
        };
        Ok(out.gradients(&sums, prep.tensors.biases, c, h))
    }
}
