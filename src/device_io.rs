//! Forwards on device memory the caller owns: descriptors of tensors, weights, workspace and
//! stream by address, for programs that allocate and schedule device work themselves (PyTorch,
//! JAX, a cudarc program).
//!
//! With these a forward runs entirely in the caller's world: weights prepared by a kernel from
//! the caller's own weight tensors into storage the caller allocated
//! ([`Layer::from_device_weights`](crate::Layer::from_device_weights)), the intermediates in a
//! workspace the caller allocated ([`Layer::device_workspace_bytes`](crate::Layer::device_workspace_bytes)
//! says how large), every launch on the caller's stream, nothing allocated by the library and
//! nothing waiting on the host ([`Layer::forward_device`](crate::Layer::forward_device)).
//!
//! Addresses are plain integers (`CUdeviceptr` on CUDA, a device pointer on HIP); tensors are
//! contiguous and row-major. A caller holding cudarc memory passes `CudaSlice`'s device pointer.

use crate::error::{Error, Result};
use crate::problem::{Config, Formulation, Precision, Problem, Shape};
use crate::weights::{Linear, Norm, Weights};

/// Element type of a tensor the caller holds.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// IEEE single precision.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half precision.
    F16,
}

impl DType {
    /// Bytes of one element.
    pub fn bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 | DType::F16 => 2,
        }
    }

    /// The I/O precision of `x` and `y` held in this type.
    pub fn precision(self) -> Precision {
        match self {
            DType::F32 => Precision::F32Io,
            DType::Bf16 => Precision::Bf16Io,
            DType::F16 => Precision::F16Io,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
        })
    }
}

/// A contiguous row-major tensor on the device: its address, element type and element count.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct DeviceTensor {
    /// Device address of the first element.
    pub ptr: u64,
    /// Element type.
    pub dtype: DType,
    /// Number of elements.
    pub len: usize,
}

impl DeviceTensor {
    /// A tensor of `len` elements of `dtype` at `ptr`.
    pub fn new(ptr: u64, dtype: DType, len: usize) -> Self {
        DeviceTensor { ptr, dtype, len }
    }

    fn check(&self, name: &str, len: usize) -> Result<()> {
        if self.ptr == 0 {
            return Err(Error::Weights(format!("{name} is a null device address")));
        }
        if self.len != len {
            return Err(Error::Weights(format!("{name} has {} elements, expected {len}", self.len)));
        }
        if self.ptr % self.dtype.bytes() as u64 != 0 {
            return Err(Error::Weights(format!(
                "{name} at {:#x} is not aligned to its {} elements",
                self.ptr, self.dtype
            )));
        }
        Ok(())
    }
}

/// A linear layer's weight `[out, in]` and optional bias `[out]` on the device.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct DeviceLinear {
    /// `[out, in]`, row-major.
    pub weight: DeviceTensor,
    /// `[out]`, or none.
    pub bias: Option<DeviceTensor>,
}

/// LayerNorm affine parameters on the device.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct DeviceNorm {
    /// `[width]`.
    pub weight: DeviceTensor,
    /// `[width]`.
    pub bias: DeviceTensor,
}

/// A layer's weights on the device, named as in [`Weights`] (af3's packed
/// `p_in`/`g_in` are two tensors each: the `a` rows are `left_*`, the `b` rows `right_*`; a
/// caller passes addresses inside the packed tensor).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct DeviceWeights {
    /// Formulation, C and H.
    pub config: Config,
    /// LN_C, `[C]`.
    pub norm_in: DeviceNorm,
    /// `[H, C]`.
    pub left_proj: DeviceLinear,
    /// `[H, C]`.
    pub left_gate: DeviceLinear,
    /// `[H, C]`.
    pub right_proj: DeviceLinear,
    /// `[H, C]`.
    pub right_gate: DeviceLinear,
    /// gpumode `[H, C]`, af3 `[C, C]`.
    pub out_gate: DeviceLinear,
    /// LN_H, `[H]`.
    pub norm_out: DeviceNorm,
    /// `[C, H]`.
    pub out_proj: DeviceLinear,
}

impl DeviceWeights {
    /// The descriptor of `w`'s tensors where `put` places each one (an upload, say), called for
    /// every tensor `w` has (biases only where it has them), the error of the first that fails.
    pub fn place(w: &Weights, mut put: impl FnMut(&[f32]) -> Result<DeviceTensor>) -> Result<DeviceWeights> {
        let mut lin = |l: &Linear| -> Result<DeviceLinear> {
            Ok(DeviceLinear { weight: put(&l.weight)?, bias: l.bias.as_deref().map(&mut put).transpose()? })
        };
        let (left_proj, left_gate) = (lin(&w.left_proj)?, lin(&w.left_gate)?);
        let (right_proj, right_gate) = (lin(&w.right_proj)?, lin(&w.right_gate)?);
        let (out_gate, out_proj) = (lin(&w.out_gate)?, lin(&w.out_proj)?);
        let mut norm =
            |n: &Norm| -> Result<DeviceNorm> { Ok(DeviceNorm { weight: put(&n.weight)?, bias: put(&n.bias)? }) };
        let (norm_in, norm_out) = (norm(&w.norm_in)?, norm(&w.norm_out)?);
        let config = w.config();
        Ok(DeviceWeights {
            config,
            norm_in,
            left_proj,
            left_gate,
            right_proj,
            right_gate,
            out_gate,
            norm_out,
            out_proj,
        })
    }

    /// The five linear layers applied to `z`, in the order of the fused input projection.
    pub fn input_linears(&self) -> [&DeviceLinear; 5] {
        [&self.left_proj, &self.left_gate, &self.right_proj, &self.right_gate, &self.out_gate]
    }

    /// Whether any linear layer has a bias.
    pub fn has_biases(&self) -> bool {
        self.input_linears().iter().any(|l| l.bias.is_some()) || self.out_proj.bias.is_some()
    }

    /// Checks every tensor against the config: non-null, aligned to its element type, the
    /// element count its shape implies, and no linear biases in the gpumode formulation. The
    /// message names the tensor. (Values are on the device and are not read here.)
    pub fn validate(&self) -> Result<()> {
        let Config { c, h, formulation } = self.config;
        self.config.validate()?;
        let g = self.config.gate_width();
        let linears = [
            ("left_proj", &self.left_proj, h, c),
            ("left_gate", &self.left_gate, h, c),
            ("right_proj", &self.right_proj, h, c),
            ("right_gate", &self.right_gate, h, c),
            ("out_gate", &self.out_gate, g, c),
            ("out_proj", &self.out_proj, c, h),
        ];
        for (name, l, out, inp) in linears {
            l.weight.check(&format!("{name}.weight"), out * inp)?;
            if let Some(b) = &l.bias {
                if formulation == Formulation::GpuMode {
                    return Err(Error::Weights(format!(
                        "{name} has a bias, but the gpumode formulation has no linear biases"
                    )));
                }
                b.check(&format!("{name}.bias"), out)?;
            }
        }
        for (name, n, width) in [("norm_in", &self.norm_in, c), ("norm_out", &self.norm_out, h)] {
            n.weight.check(&format!("{name}.weight"), width)?;
            n.bias.check(&format!("{name}.bias"), width)?;
        }
        Ok(())
    }
}

/// A backward on caller device memory that leaves the weight gradients on the device
/// ([`crate::Backend::backward_device_async`]).
#[derive(Copy, Clone, Debug)]
pub struct BackwardDeviceIo {
    /// x, the mask (0: none), dy and dx: `[B, N, N, C]` in the problem's precision, the mask
    /// `[B, N, N]` f32; dx aliases none of the others.
    pub tensors: (u64, u64, u64, u64),
    /// The stream every launch and copy is enqueued on (0: the legacy default stream).
    pub stream: u64,
    /// The intermediates' workspace, at least `backward_workspace_bytes`; the weight gradients
    /// are summed there before they are copied out.
    pub workspace: DeviceSpan,
    /// Where each weight's gradient goes (f32, of the weight's element count), in the order of
    /// [`crate::WEIGHT_NAMES`]; 0: not wanted (and for a bias the layer does not have).
    pub grads: [u64; 16],
}

/// A range of device memory the caller owns: a workspace, or storage for prepared weights.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct DeviceSpan {
    /// Device address of the first byte (256-byte aligned: every allocator's blocks are).
    pub ptr: u64,
    /// Size in bytes.
    pub bytes: u64,
}

/// Alignment [`DeviceSpan`]s must have: the sub-buffers carved from them keep 256-byte
/// alignment, which the GEMM libraries and the stage kernels' vector accesses want.
pub const SPAN_ALIGN: u64 = 256;

impl DeviceSpan {
    /// Checks that the span is aligned and holds at least `needed` bytes; `what` names it.
    pub fn check(&self, what: &str, needed: u64) -> Result<()> {
        if self.ptr == 0 || self.ptr % SPAN_ALIGN != 0 {
            return Err(Error::InvalidArgument(format!(
                "{what} at {:#x} must be a non-null address aligned to {SPAN_ALIGN} bytes",
                self.ptr
            )));
        }
        if self.bytes < needed {
            return Err(Error::InvalidArgument(format!("{what} holds {} bytes, {needed} needed", self.bytes)));
        }
        Ok(())
    }
}

/// One forward on caller-owned device memory ([`Layer::forward_device`](crate::Layer::forward_device)).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct DeviceIo {
    /// `x`, `[B, N, N, C]` in the element type `io` says.
    pub x: u64,
    /// The mask, `[B, N, N]` f32 of 0/1 values, or none.
    pub mask: Option<u64>,
    /// `y`, `[B, N, N, C]` in the element type of `x`; must not alias `x`.
    pub y: u64,
    /// B and N.
    pub shape: Shape,
    /// Element type of `x` and `y`.
    pub io: Precision,
    /// The stream every launch is enqueued on (`CUstream` / `hipStream_t` as an integer; 0 is
    /// the legacy default stream).
    pub stream: u64,
    /// Workspace for the intermediates, at least
    /// [`Layer::device_workspace_bytes`](crate::Layer::device_workspace_bytes) bytes; `None`:
    /// the layer allocates and keeps its own.
    pub workspace: Option<DeviceSpan>,
}

/// Host memory that host staging copies to and from a backend's buffers: f32, or 16-bit words
/// (bf16 or f16 bit patterns, as the problem's precision says).
#[derive(Copy, Clone, Debug)]
pub enum HostWords<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// 16-bit words.
    Half(&'a [u16]),
}

/// [`HostWords`] to copy into.
#[derive(Debug)]
pub enum HostWordsMut<'a> {
    /// f32 values.
    F32(&'a mut [f32]),
    /// 16-bit words.
    Half(&'a mut [u16]),
}

/// Where one forward's x, mask and y lie, in the memory of the backend that runs it (see
/// [`ForwardIo`]).
#[derive(Debug)]
pub enum Operands<'a> {
    /// Host slices: the memory of a backend that computes on the host (the CPU). `x: None` runs
    /// in place: `y` holds x on entry.
    Host {
        /// `x`, or `None` in place.
        x: Option<&'a [f32]>,
        /// The mask, or none.
        mask: Option<&'a [f32]>,
        /// `y` (in place: x, overwritten).
        y: &'a mut [f32],
    },
    /// Device addresses of a GPU backend's context.
    Device(DeviceOperands),
}

/// x, mask and y at device addresses ([`Operands::Device`]); `y == x` in place. Made only by
/// the constructors of [`ForwardIo`], so that a descriptor's addresses always carry the promise
/// of one of them.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct DeviceOperands {
    x: u64,
    mask: Option<u64>,
    y: u64,
    /// What the memory is known to hold: element counts of x, the mask and y for buffers (which
    /// know their lengths), or the B and N the caller described ([`DeviceIo::shape`]).
    extent: Extent,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Extent {
    Lens { x: usize, mask: Option<usize>, y: usize },
    Shape(Shape),
}

impl DeviceOperands {
    /// Address of x.
    pub fn x(&self) -> u64 {
        self.x
    }

    /// Address of the mask, 0 for none (the kernels' convention).
    pub fn mask(&self) -> u64 {
        self.mask.unwrap_or(0)
    }

    /// Address of y (x's in place).
    pub fn y(&self) -> u64 {
        self.y
    }
}

/// One backward's inputs on the host, as [`Backend::backward`](crate::Backend::backward) takes
/// them: `x` and `dy` `[B,N,N,C]` and the forward's `mask` `[B,N,N]`, all f32.
#[derive(Copy, Clone, Debug)]
pub struct BackwardIo<'a> {
    /// The forward's input.
    pub x: &'a [f32],
    /// The forward's mask, if it had one.
    pub mask: Option<&'a [f32]>,
    /// `∂L/∂y`.
    pub dy: &'a [f32],
}

/// One forward's I/O, as [`Backend::forward`](crate::Backend::forward) takes it: x, the mask and
/// y (or x overwritten in place) in the backend's memory, their element type, the stream the work
/// is enqueued on and the workspace in caller memory, if any.
///
/// Host slices ([`ForwardIo::host`]) are the CPU backend's memory; GPU backends get device
/// addresses: their own buffers (`Backend::buffer_io`), the layer's host staging (slices copied
/// to the device above the backends, `src/staging.rs`), or the caller's memory
/// ([`ForwardIo::device`], unsafe: addresses carry no lifetime). [`ForwardIo::check`] holds
/// every check of the I/O against the problem, once for all of them.
#[derive(Debug)]
pub struct ForwardIo<'a> {
    operands: Operands<'a>,
    io: Precision,
    stream: Option<u64>,
    workspace: Option<DeviceSpan>,
}

impl<'a> ForwardIo<'a> {
    /// f32 host slices, y apart from x.
    pub fn host(x: &'a [f32], mask: Option<&'a [f32]>, y: &'a mut [f32]) -> Self {
        ForwardIo::of(Operands::Host { x: Some(x), mask, y }, Precision::F32Io)
    }

    /// An f32 host slice holding x, overwritten by y.
    pub fn host_in_place(xy: &'a mut [f32], mask: Option<&'a [f32]>) -> Self {
        ForwardIo::of(Operands::Host { x: None, mask, y: xy }, Precision::F32Io)
    }

    /// Caller device memory as `io` describes it: its stream, and its workspace span if any.
    ///
    /// # Safety
    /// `io.x`, `io.y` (and the mask) are live device allocations of the backend's context that
    /// runs the descriptor, holding the element counts of `io.shape` in `io.io` (the mask f32),
    /// `y` aliasing neither unless it is `x` in place; the workspace span, if any, is a live
    /// allocation of its size used by nothing else; all stay alive until `io.stream` has run the
    /// work, and `io.stream` belongs to that context.
    pub unsafe fn device(io: &DeviceIo) -> ForwardIo<'static> {
        ForwardIo {
            operands: Operands::Device(DeviceOperands {
                x: io.x,
                mask: io.mask,
                y: io.y,
                extent: Extent::Shape(io.shape),
            }),
            io: io.io,
            stream: Some(io.stream),
            workspace: io.workspace,
        }
    }

    /// Device buffers of `(address, element count)`, x `None` in place (y holds x), x and y in
    /// `io`, on the backend's own stream. For the backends' `buffer_io` and the host staging.
    ///
    /// # Safety
    /// The addresses are allocations of the backend that runs the descriptor, of at least the
    /// given element counts, borrowed for `'a`, and not freed before the work enqueued on them
    /// has run (the backends' buffers are freed through calls that wait for it).
    pub(crate) unsafe fn device_buffers(
        x: Option<(u64, usize)>,
        mask: Option<(u64, usize)>,
        y: (u64, usize),
        io: Precision,
    ) -> Self {
        let x = x.unwrap_or(y);
        let extent = Extent::Lens { x: x.1, mask: mask.map(|m| m.1), y: y.1 };
        let operands = DeviceOperands { x: x.0, mask: mask.map(|m| m.0), y: y.0, extent };
        ForwardIo::of(Operands::Device(operands), io)
    }

    fn of(operands: Operands<'a>, io: Precision) -> Self {
        ForwardIo { operands, io, stream: None, workspace: None }
    }

    /// Where x, the mask and y are.
    pub fn operands(&self) -> &Operands<'a> {
        &self.operands
    }

    /// The operands, by value (host slices come back with their borrows).
    pub fn into_operands(self) -> Operands<'a> {
        self.operands
    }

    /// Element type of x and y.
    pub fn io(&self) -> Precision {
        self.io
    }

    /// The stream to enqueue on (`None`: the backend's own).
    pub fn stream(&self) -> Option<u64> {
        self.stream
    }

    /// The workspace span in caller memory (`None`: the workspace's own buffers).
    pub fn workspace(&self) -> Option<DeviceSpan> {
        self.workspace
    }

    /// Whether y is x.
    pub fn in_place(&self) -> bool {
        match &self.operands {
            Operands::Host { x, .. } => x.is_none(),
            Operands::Device(d) => d.x == d.y,
        }
    }

    /// Checks the I/O against `problem`: element counts (where the memory knows them; caller
    /// memory's B and N), the mask's presence, in place or not, and the element type. The one
    /// place these are checked, whichever memory the forward runs on.
    pub fn check(&self, problem: &Problem) -> Result<()> {
        match &self.operands {
            Operands::Host { x, mask, y } => {
                problem.check_lengths(x.map_or(y.len(), <[f32]>::len), mask.map(<[f32]>::len), y.len())?
            }
            Operands::Device(d) => match d.extent {
                Extent::Lens { x, mask, y } => problem.check_lengths(x, mask, y)?,
                Extent::Shape(shape) => {
                    problem.validate()?;
                    if shape != problem.shape || d.mask.is_some() != problem.masked {
                        return Err(Error::InvalidArgument(format!(
                            "device I/O of B={} N={} ({}) does not describe the problem's B={} N={} ({})",
                            shape.batch,
                            shape.n,
                            if d.mask.is_some() { "masked" } else { "no mask" },
                            problem.shape.batch,
                            problem.shape.n,
                            if problem.masked { "masked" } else { "no mask" },
                        )));
                    }
                }
            },
        }
        check_in_place(self.in_place(), problem)?;
        check_io_precision(self.io, problem.io)
    }
}

/// The error for I/O in place (one tensor for x and y) or not, given a problem that is the other.
pub(crate) fn check_in_place(in_place: bool, problem: &Problem) -> Result<()> {
    match (in_place, problem.in_place) {
        (true, false) => Err(Error::InvalidArgument(
            "y is x (an in-place forward), but the problem was not made with in_place(true); out of place, y must \
             not alias x"
                .into(),
        )),
        (false, true) => Err(Error::InvalidArgument(
            "the problem is in place (in_place(true)): an in-place forward needs y = x, one tensor".into(),
        )),
        _ => Ok(()),
    }
}

/// The error for x and y in `given` precision given a problem in another.
pub(crate) fn check_io_precision(given: Precision, problem: Precision) -> Result<()> {
    if given == problem {
        return Ok(());
    }
    let what = match given {
        Precision::F32Io => "an f32".to_string(),
        other => format!("a 16-bit ({other})"),
    };
    Err(Error::Dtype(format!("{what} forward was given a problem in {problem}")))
}

/// Element types cudarc holds that [`DType`] names: `f32`, `half::bf16`, `half::f16`.
#[cfg(feature = "cuda")]
pub trait CudarcElement: cudarc::driver::DeviceRepr {
    /// The matching element type.
    const DTYPE: DType;
}

#[cfg(feature = "cuda")]
impl CudarcElement for f32 {
    const DTYPE: DType = DType::F32;
}

#[cfg(feature = "cuda")]
impl CudarcElement for half::bf16 {
    const DTYPE: DType = DType::Bf16;
}

#[cfg(feature = "cuda")]
impl CudarcElement for half::f16 {
    const DTYPE: DType = DType::F16;
}

#[cfg(feature = "cuda")]
impl DeviceTensor {
    /// The tensor of cudarc memory (a `CudaSlice` or `CudaView`) that a call enqueued on `stream`
    /// reads, with cudarc's synchronisation: `stream` is made to wait for the memory's earlier
    /// writes, and the returned guard, dropped once the call is enqueued, records the read.
    ///
    /// ```no_run
    /// # fn demo(x: &cudarc::driver::CudaSlice<half::bf16>, stream: &cudarc::driver::CudaStream) {
    /// let (xt, _read) = trimul::DeviceTensor::from_cudarc(x, stream);
    /// // ... DeviceIo { x: xt.ptr, stream: stream.cu_stream() as u64, .. } and the forward,
    /// // then `_read` is dropped at the end of the scope.
    /// # }
    /// ```
    pub fn from_cudarc<'a, T: CudarcElement, S: cudarc::driver::DevicePtr<T>>(
        slice: &'a S,
        stream: &'a cudarc::driver::CudaStream,
    ) -> (DeviceTensor, cudarc::driver::SyncOnDrop<'a>) {
        let (ptr, guard) = slice.device_ptr(stream);
        (DeviceTensor::new(ptr, T::DTYPE, slice.len()), guard)
    }

    /// [`DeviceTensor::from_cudarc`] for memory the call writes (y): `stream` waits for the
    /// memory's earlier reads and writes, and the guard records the write.
    pub fn from_cudarc_mut<'a, T: CudarcElement, S: cudarc::driver::DevicePtrMut<T>>(
        slice: &'a mut S,
        stream: &'a cudarc::driver::CudaStream,
    ) -> (DeviceTensor, cudarc::driver::SyncOnDrop<'a>) {
        let len = slice.len();
        let (ptr, guard) = slice.device_ptr_mut(stream);
        (DeviceTensor::new(ptr, T::DTYPE, len), guard)
    }
}
