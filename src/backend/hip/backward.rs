//! The HIP backward pass: every gradient of `L` given `dy`, recomputing the forward's
//! intermediates from `x`. The steps are [`crate::backend::backward_steps`]'s, as on CUDA (its
//! module docs list them; `docs/backward.md` derives the math): the same ten kernels
//! (`common/backward.h`, compiled as HIP by `hip/backward.hip`) on the same buffers, and rocBLAS
//! `gemm_ex` / `gemm_strided_batched_ex` for the GEMMs between them, described by the same
//! [`GemmSpec`](crate::backend::gemm::GemmSpec)s.
//!
//! # Precision
//! The kernels compute in f32 and store as the step list says (f32 with f32 I/O; mostly f16 and
//! bf16 with 16-bit I/O, `crate::backend::backward_steps`); the bias and LayerNorm-weight column
//! sums are f64 in a fixed order, as on CUDA. With f32 I/O the GEMMs read and write f32 and are
//! asked for f32 compute (`rocblas_datatype_f32_r` everywhere, rocBLAS's default math mode): on
//! CUDA they run in TF32; with 16-bit I/O, the 16-bit ones are f16 or bf16 `gemm_ex` calls with
//! f32 compute.
//! What rocBLAS does with such a call on an MI300 is not known here: rocBLAS may pick an xf32
//! (reduced-mantissa) path only when a handle's math mode asks for it, which this backend never
//! sets, but nothing has run on AMD hardware, so neither the path rocBLAS picks nor its error
//! has been observed. On the fake ROCm (`tests/hip_emu/fake_rocm.cpp`) the GEMMs are plain f32
//! sums. The weights are the prepared f16 ones, converted to f32 by `backward_convert`.
//!
//! # Memory
//! Every intermediate is a whole tensor, as on CUDA (about `(C + F + 5H + max(C, H))·4` bytes
//! per position with f32 I/O, nothing chunked), carved from a caller's workspace span or from one block
//! the backend allocates and keeps for the next backward of the same sizes
//! ([`Backend::free_backward_buffers`](crate::Backend) drops it). With poisoning on (the tests),
//! every intermediate is filled with NaN first. rocBLAS manages its own GEMM workspace.
//!
//! # Kernels
//! The kernels' seventeen entry points are loaded on the first backward (a forward-only user
//! never loads them):
//! from the prebuilt `backward` code object for the device's processor, else compiled once with
//! hipRTC; one module per kernel, each from that one image.
//!
//! Nothing here has run on an AMD GPU; it runs on the fake ROCm, which executes the kernel
//! bodies through a CPU emulation of wave64 hardware and models rocBLAS's f32 GEMMs.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::blas::{DataType, RocblasGemm};
use super::context::{launch_by_value, poisoned, BackwardKernels, HipBackend, HipPrepared, POISON_BYTE};
use super::kernels::LDS_BYTES;
use super::result::{self, BlasHandle, DeviceMem};
use super::sys;
use crate::backend::backward_params::{
    acc_smem, backward_sizes, gradient_copies, in_kept_block, output_norm_grad_smem, Outputs, THREADS,
};
use crate::backend::backward_steps::{self, BackwardBuffers, BackwardStep, GemmElem, KernelArgs, Residency};
use crate::device_io::{BackwardDeviceIo, DeviceSpan};
use crate::error::{BackendKind, Error, Result};
use crate::gradients::Gradients;
use crate::problem::Problem;

impl HipBackend {
    /// The backward kernels, loaded on first use.
    fn backward_kernels(&self) -> Result<Arc<BackwardKernels>> {
        let mut slot = self.ctx.backward.lock().map_err(poisoned)?;
        if let Some(k) = slot.as_ref() {
            return Ok(k.clone());
        }
        let k = Arc::new(BackwardKernels::load(self.ctx.api, &self.ctx.target_id, self.ctx.force_rtc)?);
        *slot = Some(k.clone());
        Ok(k)
    }

    /// Refuses a backward whose LayerNorm kernels would need more LDS per block than the 64 KiB
    /// of gfx90a and gfx942 (a 32-position tile of t, and per-warp column sums): H ≤ 334 and
    /// C ≤ 1024.
    pub(super) fn check_backward_fits(&self, problem: &Problem) -> Result<()> {
        let (c, h) = (problem.config.c, problem.config.h);
        let need = [("H", h, output_norm_grad_smem(h)), ("C", c, acc_smem(c))];
        match need.into_iter().find(|&(_, _, bytes)| bytes > LDS_BYTES) {
            Some((name, v, bytes)) => Err(Error::Unsupported {
                backend: BackendKind::Hip,
                what: format!(
                    "the backward pass at {name} = {v} (its LayerNorm kernels need {bytes} bytes of LDS per \
                     block; the GPU has {LDS_BYTES})"
                ),
            }),
            None => Ok(()),
        }
    }

    /// Bytes of the workspace span a backward of `problem` carves its buffers from.
    pub(super) fn backward_span_bytes(&self, problem: &Problem) -> Result<u64> {
        Ok(BackwardBuffers::new(problem, 0, 0).bytes)
    }

    /// Drops the block the last backward kept.
    pub(super) fn drop_backward_buffers(&self) {
        if let Ok(mut kept) = self.ctx.backward_block.lock() {
            *kept = None;
        }
    }

    /// Enqueues the backward on `stream`, `blas` bound to it: `x`, `dy` and `dx` are `[M, C]`
    /// f32, `mask` `[M]` f32 or 0; the weight gradients land in `b.sums` at [`Outputs`]' offsets
    /// once the stream has run the work.
    ///
    /// # Safety
    /// `x`, `dy`, `mask` (when non-zero) and `dx` are live device allocations of those sizes
    /// until the stream has run the work, `dx` aliasing none of the others; `b` was laid out for
    /// this problem in live device memory that nothing else uses meanwhile.
    #[allow(clippy::too_many_arguments)]
    unsafe fn enqueue_backward(
        &self,
        k: &BackwardKernels,
        blas: &BlasHandle,
        prep: &HipPrepared,
        problem: &Problem,
        io: (u64, u64, u64, u64),
        b: &BackwardBuffers,
        stream: sys::hipStream_t,
    ) -> Result<()> {
        let w = prep.tensors.backward_weights();
        // 64 KiB of LDS per CU.
        // The output side as separate steps: its fused kernel is CUDA's (mma.sync).
        let device = Residency {
            shared: LDS_BYTES,
            units: self.ctx.info.compute_units as usize,
            output_side: false,
            vector_gating: false,
        };
        for step in backward_steps::steps(problem, &w, io, b, device) {
            match step {
                BackwardStep::Launch { kernel, sixteen, grid, smem, args } => {
                    let kernel = k.kernel(kernel, sixteen);
                    // SAFETY: every address in `args` lies in a buffer of the size the kernel's
                    // argument struct's comments give for this problem (the caller's by this
                    // function's contract, the rest in `b`; `backward_steps`' tests check the
                    // list's addresses); the Rust struct mirrors the one the kernel takes.
                    unsafe {
                        match &args {
                            KernelArgs::Backward(p) => launch_by_value(kernel, stream, grid, THREADS, smem, p),
                            KernelArgs::ColumnSums(p) => launch_by_value(kernel, stream, grid, THREADS, smem, p),
                            KernelArgs::Convert(p) => launch_by_value(kernel, stream, grid, THREADS, smem, p),
                        }?
                    }
                }
                BackwardStep::Gemm { spec, u, v, d, inputs, output } => {
                    let ty = |e| match e {
                        GemmElem::F32 => DataType::F32,
                        GemmElem::F16 => DataType::F16,
                        GemmElem::Bf16 => DataType::Bf16,
                    };
                    let g = RocblasGemm::from_spec(&spec, ty(inputs), ty(output))?;
                    // SAFETY: `u`, `v` and `d` hold the matrices `spec` describes (as above),
                    // live until the stream has run the call; `blas` is bound to `stream`.
                    // Row-major D = op(U)·op(V) is column-major A = V, B = U.
                    unsafe { blas.gemm(&g, 1.0, v, u, 0.0, d)? }
                }
                BackwardStep::Mark(_) => {}
            }
        }
        Ok(())
    }

    /// Lays `problem`'s backward out in `span` and enqueues it on `stream` with `blas` bound
    /// there (every buffer a step writes filled with NaN first when poisoning is on), then the
    /// weight-gradient `copies` ([`gradient_copies`]) after it; returns the layout. On a failure,
    /// what came before it may still be running: the caller waits.
    ///
    /// # Safety
    /// As [`HipBackend::enqueue_backward`] for `io`, until the stream has run the work; `stream`
    /// is a live stream of this device (or 0); `span` and each copy's destination are device
    /// memory of their sizes that nothing else uses meanwhile.
    #[allow(clippy::too_many_arguments)]
    unsafe fn enqueue_in(
        &self,
        kernels: &BackwardKernels,
        prep: &HipPrepared,
        problem: &Problem,
        io: (u64, u64, u64, u64),
        span: DeviceSpan,
        stream: sys::hipStream_t,
        copies: &[(u64, usize, usize)],
    ) -> Result<BackwardBuffers> {
        let api = self.ctx.api;
        let bufs = BackwardBuffers::new(problem, 0, span.ptr);
        span.check("the backward's workspace", bufs.bytes)?;
        let poison = self.ctx.poison.load(Ordering::Relaxed);
        let enqueue = |blas: &BlasHandle| -> Result<()> {
            if poison {
                for &(at, bytes) in &bufs.written {
                    // SAFETY: a buffer laid out for this problem in `span` (checked above).
                    unsafe { result::memset_async(api, at, POISON_BYTE, bytes as usize, stream)? };
                }
            }
            // SAFETY: forwarded from this function's contract; `bufs` lies in `span`.
            unsafe { self.enqueue_backward(kernels, blas, prep, problem, io, &bufs, stream)? };
            for &(dst, at, n) in copies {
                // SAFETY: the sums lie in `bufs`, the destination holds `n` floats (the contract).
                unsafe { result::copy_dtod_async(api, dst, bufs.sums + (at * 4) as u64, n * 4, stream)? };
            }
            Ok(())
        };
        // SAFETY: the caller's stream is live for the work (this function's contract).
        unsafe { self.with_blas_on(stream, enqueue) }?;
        Ok(bufs)
    }

    /// The backward on device memory, on `io.stream`, its buffers carved from `io.workspace`,
    /// the weight gradients copied on the device to `io.grads` at the end; returns once
    /// enqueued.
    ///
    /// # Safety
    /// As [`HipBackend::enqueue_in`].
    pub(super) unsafe fn backward_on_device_async(
        &self,
        prep: &HipPrepared,
        problem: &Problem,
        io: BackwardDeviceIo,
    ) -> Result<()> {
        let stream = io.stream as sys::hipStream_t;
        let copies = gradient_copies(problem, prep.tensors.biases, io.grads)?;
        let kernels = self.backward_kernels()?;
        // SAFETY: forwarded from this function's contract.
        let enqueued = unsafe { self.enqueue_in(&kernels, prep, problem, io.tensors, io.workspace, stream, &copies) };
        if enqueued.is_err() {
            // What was enqueued before the failure still writes dx and the buffers: wait for it.
            // SAFETY: a live stream of this device.
            let _ = unsafe { result::stream_synchronize(self.ctx.api, stream) };
        }
        enqueued.map(drop)
    }

    /// The backward on device memory, on `stream`, its buffers carved from `workspace` or else
    /// from the block the backend keeps: runs it, waits, and returns the weight gradients. With
    /// poisoning on (the tests), every buffer a step writes is filled with NaN first.
    ///
    /// # Safety
    /// As [`HipBackend::enqueue_backward`] for `io`; `stream` is a live stream of this device
    /// (or 0, the null stream); the workspace span, when given, is device memory of its bytes
    /// that nothing else uses until this returns.
    pub(super) unsafe fn backward_on_device(
        &self,
        prep: &HipPrepared,
        problem: &Problem,
        io: (u64, u64, u64, u64),
        stream: sys::hipStream_t,
        workspace: Option<DeviceSpan>,
    ) -> Result<Gradients> {
        let cfg = problem.config;
        let (c, h, f) = (cfg.c, cfg.h, cfg.fused_proj_width());
        let out = Outputs::new(c, h, f);
        let kernels = self.backward_kernels()?;
        let api = self.ctx.api;
        let run = |span: DeviceSpan| -> Result<Vec<f32>> {
            // SAFETY: forwarded from this function's contract.
            let enqueued = unsafe { self.enqueue_in(&kernels, prep, problem, io, span, stream, &[]) };
            // Whatever was enqueued (all of it, or what came before a failure) still writes dx
            // and the buffers: wait for it, so that the caller's memory is free when this returns.
            // SAFETY: a live stream of this device (the caller's, by contract, or ours).
            let waited = unsafe { result::stream_synchronize(api, stream) };
            let bufs = enqueued?;
            waited?;
            let mut sums = vec![0f32; out.len];
            let view = DeviceMem::borrowed(api, &self.ctx.tracker, bufs.sums, out.len * 4);
            view.download(&self.ctx.stream, 0, &mut sums)?;
            Ok(sums)
        };
        let sums = match workspace {
            Some(span) => run(span)?,
            None => {
                let bytes = self.backward_span_bytes(problem)?;
                let mut kept = self.ctx.backward_block.lock().map_err(poisoned)?;
                let alloc = || self.alloc_mem(bytes as usize);
                in_kept_block(&mut kept, backward_sizes(problem), alloc, |block| {
                    run(DeviceSpan { ptr: block.addr(), bytes })
                })?
            }
        };
        Ok(out.gradients(&sums, prep.tensors.biases, c, h))
    }
}
