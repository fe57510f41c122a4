//! The public layer API: weights prepared once on a device, forwards on host slices (staged to
//! the device once, above the backends: [`crate::staging`]), on backend buffers or on caller
//! device memory, workspaces reused across calls of the same shape. Every forward ends in the
//! backend's one entry, [`Backend::forward`], with a [`ForwardIo`] of the backend's memory.

use crate::backend::{cpu::CpuBackend, Backend};
use crate::device::{with_backend, Device};
use crate::device_io::{BackwardDeviceIo, BackwardIo, DeviceIo, DeviceSpan, DeviceWeights, ForwardIo};
use crate::error::{BackendKind, Error, Result};
use crate::gradients::Gradients;
use crate::plan::{self, ExecPlan, MemoryNeeds};
pub use crate::problem::Precision;
use crate::problem::{Config, Direction, Problem, Shape};
pub use crate::staging::IoElement;
use crate::staging::{check_host, Host, HostStaging, On};
use crate::weights::Weights;

/// Per-layer options. The precision of `x` and `y` is their element type (see [`IoElement`]).
///
/// ```
/// use trimul::{Direction, Options};
/// let opts = Options::new(Direction::Incoming).with_eps(1e-6);
/// assert_eq!((opts.direction, opts.eps), (Direction::Incoming, 1e-6));
/// ```
#[derive(Copy, Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Options {
    /// Which contraction the layer computes.
    pub direction: Direction,
    /// Epsilon of both LayerNorms ([`crate::problem::LN_EPS`] by default).
    pub eps: f32,
}

impl Default for Options {
    fn default() -> Self {
        Options { direction: Direction::default(), eps: crate::problem::LN_EPS }
    }
}

impl Options {
    /// Options for `direction` with the other fields at their defaults.
    pub fn new(direction: Direction) -> Self {
        Options { direction, ..Options::default() }
    }

    /// The same options with the contraction `direction`.
    pub fn with_direction(self, direction: Direction) -> Self {
        Options { direction, ..self }
    }

    /// The same options with LayerNorm epsilon `eps` (a finite value ≥ 0; checked when the
    /// layer is made).
    pub fn with_eps(self, eps: f32) -> Self {
        Options { eps, ..self }
    }
}

/// A layer on one statically known backend. Use this type to run on backend buffers
/// ([`Layer::forward_buffers`]); use [`TriMul`] when the backend is chosen at run time.
pub struct Layer<B: Backend> {
    backend: B,
    config: Config,
    options: Options,
    prepared: B::Prepared,
    workspace: Option<B::Workspace>,
    /// What the workspace's memory limit was computed for: the caller's tensors on the device
    /// (masked, in place, I/O precision) and whether the host-copy staging was counted. A call
    /// that changes any of them needs another limit, even where the workspace itself would fit.
    planned_for: Option<(bool, bool, Precision, bool)>,
    /// Bytes a forward may hold on the device (weights, x, mask, y, workspace); `None`: what
    /// the device has free, less [`plan::margin`].
    budget: Option<u64>,
    /// The workspace planned for caller memory ([`Layer::forward_device`] with a workspace
    /// span) and the bytes it needs; kept apart from `workspace` so that the two kinds of call
    /// do not replan each other's.
    caller_ws: Option<(B::Workspace, u64)>,
    /// Device copies of host x, mask and y for the host forwards, dropped with `workspace`.
    staging: HostStaging<B>,
}

impl<B: Backend> Layer<B> {
    /// Prepares (fuses, casts, uploads) the weights once.
    pub fn new(backend: &B, weights: &Weights, options: Options) -> Result<Self> {
        weights.validate()?;
        crate::problem::check_eps(options.eps)?;
        let prepared = backend.prepare(weights)?;
        Ok(Self::with_prepared(backend, weights.config(), options, prepared))
    }

    fn with_prepared(backend: &B, config: Config, options: Options, prepared: B::Prepared) -> Self {
        Layer {
            backend: backend.clone(),
            config,
            options,
            prepared,
            workspace: None,
            planned_for: None,
            budget: None,
            caller_ws: None,
            staging: HostStaging::new(),
        }
    }

    /// Device bytes [`Layer::from_device_weights`] needs as storage for a layer of `config`
    /// (`biases`: whether any linear layer has one).
    pub fn prepared_device_bytes(backend: &B, config: &Config, biases: bool) -> Result<u64> {
        backend.prepared_device_bytes(config, biases)
    }

    /// Prepares weights the caller holds on the device: one kernel enqueued on `stream` converts
    /// and reorders them into `storage` (at least [`Layer::prepared_device_bytes`]); nothing is
    /// copied from the host, allocated or waited for. See [`crate::device_io`].
    ///
    /// # Safety
    /// As [`Backend::prepare_device`]: the weight tensors stay unchanged until `stream` has run
    /// the preparation, `storage` stays alive and untouched by others while the layer is used, and
    /// forwards on other streams than `stream` (including the layer's own forwards without a
    /// caller workspace, on the backend's stream) are ordered after it by the caller.
    pub unsafe fn from_device_weights(
        backend: &B,
        weights: &DeviceWeights,
        options: Options,
        storage: DeviceSpan,
        stream: u64,
    ) -> Result<Self> {
        weights.validate()?;
        crate::problem::check_eps(options.eps)?;
        // SAFETY: forwarded from this function's contract.
        let prepared = unsafe { backend.prepare_device(weights, storage, stream)? };
        Ok(Self::with_prepared(backend, weights.config, options, prepared))
    }

    /// Replaces this layer's weights with `weights` prepared on the device into `storage` (as
    /// [`Layer::from_device_weights`]), keeping the workspaces' plans: a caller that receives new
    /// weights with every call (GPU MODE's harness does) pays one preparation kernel, not a new
    /// plan. The weights must have this layer's configuration.
    ///
    /// # Safety
    /// As [`Layer::from_device_weights`]; the storage of the weights replaced is no longer read.
    pub unsafe fn prepare_device_weights(
        &mut self,
        weights: &DeviceWeights,
        storage: DeviceSpan,
        stream: u64,
    ) -> Result<()> {
        weights.validate()?;
        if weights.config != self.config {
            return Err(Error::Weights(format!(
                "weights of {:?} given to a layer of {:?}",
                weights.config, self.config
            )));
        }
        // SAFETY: forwarded from this function's contract.
        self.prepared = unsafe { self.backend.prepare_device(weights, storage, stream)? };
        // A chunked workspace of the layer's own holds copies of the old weights.
        self.drop_workspace();
        Ok(())
    }

    /// Bytes of the workspace a [`Layer::forward_device`] of this shape needs when the caller
    /// provides it; plans that workspace (kept for the calls that follow) within the layer's
    /// memory budget, if it has one.
    pub fn device_workspace_bytes(&mut self, shape: Shape, masked: bool, io: Precision) -> Result<u64> {
        self.device_workspace_bytes_within(shape, masked, io, None)
    }

    /// [`Layer::device_workspace_bytes`] within `limit` bytes as well (the caller's free memory,
    /// say): the kept plan when it is this shape's and fits `limit`, else a new one. Where the
    /// one-pass workspace does not fit, the CUDA backend plans hidden passes and row chunks in
    /// the caller's memory, as [`Layer::forward_into`] does in its own (fused input kernel only;
    /// otherwise, and on HIP, the one-pass plan's out-of-memory error).
    pub fn device_workspace_bytes_within(
        &mut self,
        shape: Shape,
        masked: bool,
        io: Precision,
        limit: Option<u64>,
    ) -> Result<u64> {
        let problem = self.problem(shape, masked)?.with_io(io);
        Ok(self.caller_parts(&problem, limit, true)?.3)
    }

    /// The caller-memory workspace for `problem`: the kept one when it was planned for this
    /// problem (and, with `refit`, fits `limit`), else one planned now within `limit` and the
    /// layer's budget.
    fn caller_parts(
        &mut self,
        problem: &Problem,
        limit: Option<u64>,
        refit: bool,
    ) -> Result<(&B, &B::Prepared, &mut B::Workspace, u64)> {
        let fits = matches!(&self.caller_ws, Some((ws, bytes))
            if self.backend.workspace_fits(ws, problem) && !(refit && limit.is_some_and(|l| *bytes > l)));
        if !fits {
            self.caller_ws = None;
            let limit = self.budget.into_iter().chain(limit).min();
            self.caller_ws = Some(self.backend.caller_workspace(&self.prepared, problem, limit)?);
        }
        let Layer { backend, prepared, caller_ws, .. } = self;
        let (ws, bytes) = caller_ws.as_mut().ok_or_else(|| Error::Internal("caller workspace missing".into()))?;
        Ok((backend, prepared, ws, *bytes))
    }

    /// Enqueues one forward on caller device memory ([`DeviceIo`]) on `io.stream`: x, the mask
    /// and y where the caller keeps them, in `io.io` precision, the intermediates in
    /// `io.workspace` (at least [`Layer::device_workspace_bytes`]) or, without one, in a
    /// workspace the layer allocates and keeps. Returns once the work is enqueued.
    ///
    /// # Safety
    /// As [`ForwardIo::device`]: the addresses are live device allocations of this layer's
    /// context with the element counts of `io.shape` (x and y in `io.io`, the mask f32), `y`
    /// aliasing neither, all alive until `io.stream` has run the work. A forward of this layer
    /// on another stream must not run concurrently when the layer's own workspace is used.
    pub unsafe fn forward_device(&mut self, io: &DeviceIo) -> Result<()> {
        let problem = self.problem(io.shape, io.mask.is_some())?.with_io(io.io);
        // SAFETY: this function's contract is the constructor's.
        let fio = unsafe { ForwardIo::device(io) };
        match io.workspace {
            Some(span) => {
                // A plan made again here (the kept one is another shape's) must fit the span the
                // caller sized from an earlier plan of this shape, which may have been chunked; a
                // span smaller than this shape's kept plan is refused below, not re-planned.
                let (backend, prepared, ws, bytes) = self.caller_parts(&problem, Some(span.bytes), false)?;
                span.check("the workspace", bytes)?;
                backend.forward(prepared, ws, &problem, fio)
            }
            None => {
                let (backend, prepared, ws, _) = self.parts(&problem)?;
                backend.forward(prepared, ws, &problem, fio)
            }
        }
    }

    /// Whether 16-bit x and y stay 16-bit on this layer's device ([`Backend::half_io_native`]);
    /// otherwise they are widened to f32 copies, and forwards on 16-bit device memory are refused.
    pub fn half_io_native(&self) -> bool {
        self.backend.half_io_native(&self.prepared)
    }

    /// One forward on caller-owned device memory and a caller-given stream, for integration
    /// into other GPU programs: `x`, `mask` and `y` are f32 tensors at device addresses,
    /// `stream` is the `CUstream` or `hipStream_t` as an integer (`stream as u64`; 0 is the
    /// legacy default stream), and the intermediates live in the layer's own workspace. Returns
    /// once the work is enqueued on `stream`. This is [`Layer::forward_device`] with f32 `x` and
    /// `y` and no caller workspace; that method also takes 16-bit `x` and `y` and a workspace in
    /// caller memory. A backend without device memory (the CPU) returns an error.
    ///
    /// # Safety
    /// `x` and `y` must be device allocations (of this layer's device and context) of `B·N·N·C`
    /// f32, `mask` of `B·N·N` f32, not aliasing each other, alive until `stream` has run the
    /// work; `stream` must be a live stream of the same context. The layer's workspace (left,
    /// right, t and the scratch) is one set of buffers: a forward of this layer on another
    /// stream, including the layer's own safe forwards on the backend's stream, must not start
    /// before this one has run (order the streams with an event, or use one layer per stream).
    pub unsafe fn forward_on_stream(
        &mut self,
        x: u64,
        mask: Option<u64>,
        y: u64,
        shape: Shape,
        stream: u64,
    ) -> Result<()> {
        let io = DeviceIo { x, mask, y, shape, io: Precision::F32Io, stream, workspace: None };
        // SAFETY: this function's contract is `forward_device`'s for f32 x and y and the
        // layer's own workspace, which is what `io` describes.
        unsafe { self.forward_device(&io) }
    }

    /// The prepared weights (the sharded forward runs any layer's).
    #[cfg(feature = "cuda")]
    pub(crate) fn prepared(&self) -> &B::Prepared {
        &self.prepared
    }

    /// The backend the layer runs on.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Formulation, C and H of the layer's weights.
    pub fn config(&self) -> Config {
        self.config
    }

    /// The options the layer was made with.
    pub fn options(&self) -> Options {
        self.options
    }

    /// The validated problem for one call of this layer.
    pub fn problem(&self, shape: Shape, masked: bool) -> Result<Problem> {
        Ok(Problem::new(self.config, shape, self.options.direction, masked)?.with_eps(self.options.eps))
    }

    /// Bytes of device workspace a call of this shape needs.
    pub fn workspace_bytes(&self, shape: Shape, masked: bool) -> Result<u64> {
        let p = self.problem(shape, masked)?;
        Ok(self.backend.workspace_bytes(&self.prepared, &p))
    }

    /// Caps the device memory a forward of this layer may hold: the prepared weights, `x`, the
    /// mask, `y` and the workspace together (`None`: the memory the device reports free, less a
    /// margin). Shapes whose one-pass workspace does not fit run in chunks (see
    /// [`crate::plan`]); when nothing fits, forwards fail with [`Error::OutOfMemory`] before
    /// allocating anything.
    pub fn set_memory_budget(&mut self, bytes: Option<u64>) {
        if self.budget != bytes {
            self.budget = bytes;
            self.drop_workspace();
            self.caller_ws = None;
        }
    }

    /// The memory budget set by [`Layer::set_memory_budget`], if any.
    pub fn memory_budget(&self) -> Option<u64> {
        self.budget
    }

    /// What a forward of this shape holds on the device: weights, x/mask/y and the workspace of
    /// the fastest and of the narrowest plan.
    pub fn memory_needs(&self, shape: Shape, masked: bool, in_place: bool) -> Result<MemoryNeeds> {
        self.memory_needs_io(shape, masked, in_place, Precision::F32Io)
    }

    /// [`Layer::memory_needs`] for `x` and `y` held in precision `io`.
    pub fn memory_needs_io(&self, shape: Shape, masked: bool, in_place: bool, io: Precision) -> Result<MemoryNeeds> {
        let p = self.problem(shape, masked)?.in_place(in_place).with_io(io);
        Ok(MemoryNeeds {
            weights: self.backend.prepared_bytes(&self.prepared),
            io: self.io_bytes(&p),
            one_pass_workspace: self.backend.workspace_bytes(&self.prepared, &p),
            min_workspace: self.backend.min_workspace_bytes(&self.prepared, &p),
        })
    }

    /// The plan of the current workspace (after a forward), e.g. to report chunking.
    pub fn exec_plan(&self) -> Option<ExecPlan> {
        self.workspace.as_ref().map(B::exec_plan)
    }

    /// Bytes of the caller's tensors in the backend's memory: 16-bit x and y count as f32 where
    /// the backend widens them ([`Backend::half_io_native`]).
    fn io_bytes(&self, problem: &Problem) -> u64 {
        if problem.io != Precision::F32Io && !self.backend.half_io_native(&self.prepared) {
            problem.with_io(Precision::F32Io).io_device_bytes()
        } else {
            problem.io_device_bytes()
        }
    }

    /// Bytes the workspace of `problem` may take under the budget and the device's free memory,
    /// or the error naming what does not fit. `host_io` says the forward is on host slices, so
    /// a GPU backend will stage x, mask and y on the device (counted in the budget anyway).
    fn workspace_limit(&self, problem: &Problem, host_io: bool) -> Result<Option<u64>> {
        let backend = &self.backend;
        let io = self.io_bytes(problem);
        let fixed = io + backend.prepared_bytes(&self.prepared);
        let min_ws = backend.min_workspace_bytes(&self.prepared, problem);
        let what = |available: &str| {
            format!(
                "B={} N={} C={} H={}{}: weights, x, mask and y take {}, the smallest workspace {}; {available}",
                problem.shape.batch,
                problem.shape.n,
                problem.config.c,
                problem.config.h,
                if problem.in_place { " in place" } else { "" },
                crate::units::fmt_bytes(fixed),
                crate::units::fmt_bytes(min_ws),
            )
        };
        // Device buffers of the caller already count as used; a host forward's staging not yet.
        let staged = if host_io && backend.host_io_staged() { io } else { 0 };
        let device = backend.memory_info()?.map(|m| (m.free, m.total));
        plan::budget::workspace_limit(self.budget, fixed, min_ws, device, staged).map_err(|short| Error::OutOfMemory {
            backend: backend.kind(),
            what: what(short.reason),
            needed: short.needed,
            available: short.available,
        })
    }

    /// The backend, the prepared weights, a workspace that fits `problem` (made anew only when
    /// the shape changed) and the host staging.
    fn parts(&mut self, problem: &Problem) -> Result<Parts<'_, B>> {
        self.parts_for(problem, false)
    }

    fn parts_for(&mut self, problem: &Problem, host_io: bool) -> Result<Parts<'_, B>> {
        let planned_for = Some((problem.masked, problem.in_place, problem.io, host_io));
        let fits = self.planned_for == planned_for
            && matches!(&self.workspace, Some(ws) if self.backend.workspace_fits(ws, problem));
        if !fits {
            // Free the old workspace (and the staging beside it) before planning and allocating
            // the new one.
            self.drop_workspace();
            let limit = self.workspace_limit(problem, host_io)?;
            self.workspace = Some(self.backend.workspace(&self.prepared, problem, limit)?);
            self.planned_for = planned_for;
        }
        let Layer { backend, prepared, workspace, staging, .. } = self;
        let ws = workspace.as_mut().ok_or_else(|| Error::InvalidArgument("workspace missing".into()))?;
        Ok((backend, prepared, ws, staging))
    }

    /// Frees the workspace and the host staging made for it.
    fn drop_workspace(&mut self) {
        self.workspace = None;
        self.planned_for = None;
        self.staging.clear();
    }

    /// One forward on host slices (`x`: `[B,N,N,C]`, `mask`: `[B,N,N]`, `y`: `[B,N,N,C]`), with
    /// `x` and `y` in f32, bf16 or f16 (see [`IoElement`]). Returns when `y` holds the result.
    /// `x` and `mask` are not modified.
    pub fn forward_into<T: IoElement>(
        &mut self,
        x: &[T],
        mask: Option<&[f32]>,
        y: &mut [T],
        shape: Shape,
    ) -> Result<()> {
        let problem = self.problem(shape, mask.is_some())?.with_io(T::PRECISION);
        check_host(&problem, T::PRECISION, Some(x.len()), mask, y.len())?;
        let (backend, prepared, workspace, staging) = self.parts_for(&problem, true)?;
        let on = On { backend, prepared, workspace, problem: &problem };
        staging.run(on, Host { x: Some(T::words(x)), mask, y: T::words_mut(y) })
    }

    /// One forward whose output overwrites its input: on return `xy` holds `y`. The largest
    /// tensor exists once instead of twice, which is what lets the longest sequences fit. Errors
    /// found before any work (shapes, dtypes, weights, memory budget) leave `xy` untouched; after
    /// a failure during the work, treat `xy` as undefined (it may hold `x`, or part of `y`).
    pub fn forward_in_place<T: IoElement>(&mut self, xy: &mut [T], mask: Option<&[f32]>, shape: Shape) -> Result<()> {
        let problem = self.problem(shape, mask.is_some())?.in_place(true).with_io(T::PRECISION);
        check_host(&problem, T::PRECISION, None, mask, xy.len())?;
        let (backend, prepared, workspace, staging) = self.parts_for(&problem, true)?;
        let on = On { backend, prepared, workspace, problem: &problem };
        staging.run(on, Host { x: None, mask, y: T::words_mut(xy) })
    }

    /// [`Layer::forward_in_place`] on a backend buffer: enqueues the work, `xy` holds `y` after
    /// a synchronize.
    pub fn forward_buffers_in_place(
        &mut self,
        xy: &mut B::Buffer,
        mask: Option<&B::Buffer>,
        shape: Shape,
    ) -> Result<()> {
        let problem = self.problem(shape, mask.is_some())?.in_place(true);
        self.forward_io(&problem, B::buffer_io(None, mask, xy))
    }

    /// Enqueues one forward on backend buffers; call [`Backend::synchronize`] (or download)
    /// before reading `y`.
    pub fn forward_buffers(
        &mut self,
        x: &B::Buffer,
        mask: Option<&B::Buffer>,
        y: &mut B::Buffer,
        shape: Shape,
    ) -> Result<()> {
        let problem = self.problem(shape, mask.is_some())?;
        self.forward_io(&problem, B::buffer_io(Some(x), mask, y))
    }

    /// The gradients of a scalar loss `L` with respect to `x` and every weight and bias, given
    /// `dy = ∂L/∂y`, on host slices in f32 (`x`, `dy`: `[B,N,N,C]`; `mask`: `[B,N,N]`, the one
    /// the forward used). The forward's intermediates are recomputed from `x`; nothing the
    /// caller passes is modified. The mask is data and gets no gradient. Every backend has a
    /// backward (HIP's has run only on the fake ROCm, `docs/amd.md`).
    pub fn backward(&mut self, x: &[f32], mask: Option<&[f32]>, dy: &[f32], shape: Shape) -> Result<Gradients> {
        let problem = self.problem(shape, mask.is_some())?;
        self.backend.backward(&self.prepared, &problem, BackwardIo { x, mask, dy })
    }

    /// [`Layer::backward`] on the backend's f32 buffers: `∂L/∂x` into `dx`, the weight and bias
    /// gradients returned with an empty `x` ([`Backend::backward_buffers`]). Waits for the work.
    pub fn backward_buffers(
        &mut self,
        x: &B::Buffer,
        mask: Option<&B::Buffer>,
        dy: &B::Buffer,
        dx: &mut B::Buffer,
        shape: Shape,
    ) -> Result<Gradients> {
        let problem = self.problem(shape, mask.is_some())?;
        self.backend.backward_buffers(&self.prepared, &problem, x, mask, dy, dx)
    }

    /// [`Layer::backward_buffers`] on caller device memory, stream and workspace
    /// ([`Backend::backward_device`]): for bindings whose tensors the backend did not allocate.
    /// `io` is `(x, mask, dy, dx)`, the mask 0 when there is none; x, dy and dx are in
    /// `precision` (with 16-bit I/O the backward keeps most intermediates in f16 or bf16:
    /// `docs/backward.md`), the mask f32.
    ///
    /// # Safety
    /// As [`Backend::backward_device`], with x, dy and dx of `precision`'s element size.
    pub unsafe fn backward_device(
        &mut self,
        io: (u64, u64, u64, u64),
        shape: Shape,
        precision: Precision,
        stream: u64,
        workspace: Option<DeviceSpan>,
    ) -> Result<Gradients> {
        let problem = self.problem(shape, io.1 != 0)?.with_io(precision);
        // SAFETY: forwarded from this method's contract.
        unsafe { self.backend.backward_device(&self.prepared, &problem, io, stream, workspace) }
    }

    /// [`Layer::backward_device`] with the weight gradients kept on the device
    /// ([`Backend::backward_device_async`]): each is copied (f32) to its destination in
    /// `io.grads` once the stream has run the backward, x, dy and dx being in `precision`.
    /// Returns once the work is enqueued, waiting for nothing.
    ///
    /// # Safety
    /// As [`Backend::backward_device_async`].
    pub unsafe fn backward_device_async(
        &mut self,
        io: BackwardDeviceIo,
        shape: Shape,
        precision: Precision,
    ) -> Result<()> {
        let problem = self.problem(shape, io.tensors.1 != 0)?.with_io(precision);
        // SAFETY: forwarded from this method's contract.
        unsafe { self.backend.backward_device_async(&self.prepared, &problem, io) }
    }

    /// The element count of each weight's gradient, in the order of [`Gradients::tensors`] after
    /// x with every bias in its place (whether or not the layer has it): the destinations of
    /// [`Layer::backward_device_async`].
    pub fn gradient_sizes(&self) -> [usize; 16] {
        let (c, h) = (self.config.c, self.config.h);
        let g = self.config.fused_proj_width() - 4 * h;
        [c, c, h * c, h, h * c, h, h * c, h, h * c, h, g * c, g, h, h, c * h, c]
    }

    /// Bytes of the workspace a [`Layer::backward_device`] of this shape and precision needs.
    pub fn backward_workspace_bytes(&self, shape: Shape, masked: bool, precision: Precision) -> Result<u64> {
        let problem = self.problem(shape, masked)?.with_io(precision);
        self.backend.backward_workspace_bytes(&self.prepared, &problem)
    }

    /// A forward on the backend's memory with the layer's own workspace. The I/O is checked
    /// before the workspace is planned, so that a bad call allocates nothing.
    fn forward_io(&mut self, problem: &Problem, io: ForwardIo<'_>) -> Result<()> {
        io.check(problem)?;
        let (backend, prepared, ws, _) = self.parts(problem)?;
        backend.forward(prepared, ws, problem, io)
    }
}

/// What a forward needs of a layer: the backend, the prepared weights, the workspace and the host
/// staging, borrowed together.
type Parts<'a, B> = (&'a B, &'a <B as Backend>::Prepared, &'a mut <B as Backend>::Workspace, &'a mut HostStaging<B>);

/// Forwards on the CUDA backend's 16-bit device buffers. They are defined here, with the layer,
/// rather than in `backend::cuda`: the layer sits above the backends, and a backend that extended
/// [`Layer`] would import the layer above it (a cycle, `layer` → `backend::cuda` → `layer`).
#[cfg(feature = "cuda")]
impl Layer<crate::backend::cuda::CudaBackend> {
    /// Enqueues one forward on device buffers holding `x` and `y` in 16-bit precision `io`
    /// (bf16 or f16 bit patterns, e.g. filled with
    /// [`CudaBackend::upload_bits`](crate::backend::cuda::CudaBackend::upload_bits)); the mask
    /// stays f32. The fused kernels read x and write y in that precision, so x and y take half
    /// the bytes of the f32 path. Synchronize (or download) before reading `y`.
    pub fn forward_buffers_half(
        &mut self,
        x: &crate::backend::cuda::DeviceBuffer<u16>,
        mask: Option<&crate::backend::cuda::DeviceBuffer<f32>>,
        y: &mut crate::backend::cuda::DeviceBuffer<u16>,
        shape: Shape,
        io: Precision,
    ) -> Result<()> {
        let problem = self.problem(shape, mask.is_some())?.with_io(io);
        self.forward_io(&problem, Self::half_io(Some(x), mask, y, io)?)
    }

    /// [`forward_buffers_half`](Self::forward_buffers_half) with `y` written over `x` (same
    /// buffer, same 16-bit precision `io`): the buffer holds `y` after a synchronize. The plan
    /// keeps every read of x ahead of the writes of y over it, as the f32 in-place path does, so
    /// N = 8192 in bf16 needs one 16 GiB tensor on the device instead of two.
    pub fn forward_buffers_half_in_place(
        &mut self,
        xy: &mut crate::backend::cuda::DeviceBuffer<u16>,
        mask: Option<&crate::backend::cuda::DeviceBuffer<f32>>,
        shape: Shape,
        io: Precision,
    ) -> Result<()> {
        let problem = self.problem(shape, mask.is_some())?.in_place(true).with_io(io);
        self.forward_io(&problem, Self::half_io(None, mask, xy, io)?)
    }

    /// [`Layer::backward_buffers`] on 16-bit device buffers: x, dy and dx in precision `io`
    /// (bf16 or f16 bit patterns), the mask f32; `∂L/∂x` into `dx` and the weight and bias
    /// gradients returned (f32, with an empty `x`). Waits for the work.
    pub fn backward_buffers_half(
        &mut self,
        (x, mask, dy): (
            &crate::backend::cuda::DeviceBuffer<u16>,
            Option<&crate::backend::cuda::DeviceBuffer<f32>>,
            &crate::backend::cuda::DeviceBuffer<u16>,
        ),
        dx: &mut crate::backend::cuda::DeviceBuffer<u16>,
        shape: Shape,
        io: Precision,
    ) -> Result<Gradients> {
        let problem = self.problem(shape, mask.is_some())?.with_io(io);
        self.backend.backward_buffers_half(&self.prepared, &problem, (x, mask, dy), dx)
    }

    /// The I/O of 16-bit buffers, refused for `io` f32 (the buffers hold 16-bit words).
    fn half_io<'a>(
        x: Option<&'a crate::backend::cuda::DeviceBuffer<u16>>,
        mask: Option<&'a crate::backend::cuda::DeviceBuffer<f32>>,
        y: &'a mut crate::backend::cuda::DeviceBuffer<u16>,
        io: Precision,
    ) -> Result<ForwardIo<'a>> {
        if io == Precision::F32Io {
            return Err(Error::Dtype("16-bit device buffers were given with the precision f32-io".into()));
        }
        Ok(crate::backend::cuda::CudaBackend::half_buffer_io(x, mask, y, io))
    }
}

/// A layer on a backend chosen at run time: the type most callers want.
// A layer is created once and held; variant sizes do not matter, boxing would only add a hop.
#[allow(clippy::large_enum_variant)]
#[non_exhaustive]
pub enum TriMul {
    /// On the CPU.
    Cpu(Layer<CpuBackend>),
    /// On an NVIDIA GPU.
    #[cfg(feature = "cuda")]
    Cuda(Layer<crate::backend::cuda::CudaBackend>),
    /// On an AMD GPU.
    #[cfg(feature = "rocm")]
    Hip(Layer<crate::backend::hip::HipBackend>),
}

impl TriMul {
    /// Prepares `weights` on `device` once; later forwards reuse them.
    pub fn new(device: &Device, weights: &Weights, options: Options) -> Result<Self> {
        Ok(match device {
            Device::Cpu(b) => TriMul::Cpu(Layer::new(b, weights, options)?),
            #[cfg(feature = "cuda")]
            Device::Cuda(b) => TriMul::Cuda(Layer::new(b, weights, options)?),
            #[cfg(feature = "rocm")]
            Device::Hip(b) => TriMul::Hip(Layer::new(b, weights, options)?),
        })
    }

    /// Which backend the layer runs on.
    pub fn kind(&self) -> BackendKind {
        with_backend!(TriMul, self, l => l.backend().kind())
    }

    /// The device the layer runs on.
    pub fn device(&self) -> Device {
        match self {
            TriMul::Cpu(l) => Device::Cpu(l.backend().clone()),
            #[cfg(feature = "cuda")]
            TriMul::Cuda(l) => Device::Cuda(l.backend().clone()),
            #[cfg(feature = "rocm")]
            TriMul::Hip(l) => Device::Hip(l.backend().clone()),
        }
    }

    /// Formulation, C and H of the layer's weights.
    pub fn config(&self) -> Config {
        with_backend!(TriMul, self, l => l.config())
    }

    /// The options the layer was made with.
    pub fn options(&self) -> Options {
        with_backend!(TriMul, self, l => l.options())
    }

    /// Bytes of device workspace a call of this shape needs.
    pub fn workspace_bytes(&self, shape: Shape, masked: bool) -> Result<u64> {
        with_backend!(TriMul, self, l => l.workspace_bytes(shape, masked))
    }

    /// One forward on host slices into `y`. See [`Layer::forward_into`].
    pub fn forward_into<T: IoElement>(
        &mut self,
        x: &[T],
        mask: Option<&[f32]>,
        y: &mut [T],
        shape: Shape,
    ) -> Result<()> {
        with_backend!(TriMul, self, l => l.forward_into(x, mask, y, shape))
    }

    /// See [`Layer::forward_in_place`].
    pub fn forward_in_place<T: IoElement>(&mut self, xy: &mut [T], mask: Option<&[f32]>, shape: Shape) -> Result<()> {
        with_backend!(TriMul, self, l => l.forward_in_place(xy, mask, shape))
    }

    /// See [`Layer::backward`].
    pub fn backward(&mut self, x: &[f32], mask: Option<&[f32]>, dy: &[f32], shape: Shape) -> Result<Gradients> {
        with_backend!(TriMul, self, l => l.backward(x, mask, dy, shape))
    }

    /// See [`Layer::set_memory_budget`].
    pub fn set_memory_budget(&mut self, bytes: Option<u64>) {
        with_backend!(TriMul, self, l => l.set_memory_budget(bytes))
    }

    /// See [`Layer::memory_budget`].
    pub fn memory_budget(&self) -> Option<u64> {
        with_backend!(TriMul, self, l => l.memory_budget())
    }

    /// See [`Layer::memory_needs`].
    pub fn memory_needs(&self, shape: Shape, masked: bool, in_place: bool) -> Result<MemoryNeeds> {
        with_backend!(TriMul, self, l => l.memory_needs(shape, masked, in_place))
    }

    /// See [`Layer::memory_needs_io`].
    pub fn memory_needs_io(&self, shape: Shape, masked: bool, in_place: bool, io: Precision) -> Result<MemoryNeeds> {
        with_backend!(TriMul, self, l => l.memory_needs_io(shape, masked, in_place, io))
    }

    /// See [`Layer::exec_plan`].
    pub fn exec_plan(&self) -> Option<ExecPlan> {
        with_backend!(TriMul, self, l => l.exec_plan())
    }

    /// One forward on host slices, returning a new `y` of the shape and element type of `x`.
    pub fn forward<T: IoElement>(&mut self, x: &[T], mask: Option<&[f32]>, shape: Shape) -> Result<Vec<T>> {
        let mut y = crate::hostmem::try_vec(x.len(), T::default(), "y")?;
        self.forward_into(x, mask, &mut y, shape)?;
        Ok(y)
    }
}

impl std::fmt::Debug for TriMul {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = self.config();
        write!(f, "TriMul({}, {}, C={}, H={}, {})", self.kind(), c.formulation, c.c, c.h, self.options().direction)
    }
}
