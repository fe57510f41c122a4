//! `trimul._trimul`: the compiled half of the Python package. A thin layer over the `trimul`
//! crate's public API that takes tensors by address (PyTorch's `data_ptr()`, NumPy's
//! `ctypes.data`), so one abi3 module serves NumPy and PyTorch with no compile-time dependency
//! on either. Argument handling in cuEquivariance's signature, `torch.library` registration and
//! autograd live in the pure-Python package (`trimul/`).
//!
//! Two kinds of layer:
//! - [`HostLayer`]: weights and tensors in host memory (NumPy arrays, CPU tensors), run by a
//!   backend through its host-slice API (the CPU, or a GPU backend that stages the copies).
//! - `CudaLayer` and `HipLayer`: weights, tensors and workspace in device memory owned by the
//!   caller (PyTorch's caching allocator), every launch on the caller's stream, nothing allocated
//!   or synchronised here, except that `backward` waits for its work (it returns the weight
//!   gradients in host memory).
//!
//! - `CudaShardedRank`: one rank of forwards sharded by rows across GPUs (NCCL), joined from a
//!   unique id the Python side broadcasts through `torch.distributed`; its forwards take a
//!   `CudaLayer`'s prepared weights and the caller's tensors and stream, and allocate their
//!   workspace themselves (one per shape, kept until `release`).
//!
//! Weights arrive as 16 entries in the canonical order of [`WEIGHT_NAMES`], each `None` or
//! `(address, elements, dtype)` with dtype 0 = f32, 1 = bf16, 2 = f16.
//!
//! The `unsafe` here is the FFI boundary: addresses handed over by Python become slices or device
//! descriptors. The Python layer guarantees what each `// SAFETY:` comment relies on: every
//! address is the start of a contiguous tensor of at least the stated elements and dtype, kept
//! alive (and, for inputs, unchanged) until the call returns or, on the GPU, until the caller's
//! stream has run the work.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use pyo3::exceptions::{PyMemoryError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;

use trimul::backend::cuda::CudaBackend;
use trimul::backend::hip::HipBackend;
use trimul::collective::Communicator;
use trimul::sharded::ShardedRank;
use trimul::{
    BackendKind, BackwardDeviceIo, Config, DType, Device, DeviceIo, DeviceLinear, DeviceNorm, DeviceSpan, DeviceTensor,
    DeviceWeights, Direction, Error, Formulation, Layer, Linear, Norm, Options, Precision, Shape, TriMul, Weights,
    WEIGHT_NAMES,
};

/// One weight entry: address, element count, dtype code.
type Entry = Option<(u64, usize, i32)>;

/// The library's error as the Python exception of the right class, with its message.
fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::Shape(_) | Error::Weights(_) | Error::InvalidArgument(_) => PyValueError::new_err(msg),
        Error::Dtype(_) => PyTypeError::new_err(msg),
        Error::OutOfMemory { backend: BackendKind::Cpu, .. } => PyMemoryError::new_err(msg),
        _ => PyRuntimeError::new_err(msg),
    }
}

fn dtype(code: i32, what: &str) -> PyResult<DType> {
    match code {
        0 => Ok(DType::F32),
        1 => Ok(DType::Bf16),
        2 => Ok(DType::F16),
        other => Err(PyTypeError::new_err(format!("{what}: unknown dtype code {other} (0 f32, 1 bf16, 2 f16)"))),
    }
}

fn precision(code: i32) -> PyResult<Precision> {
    Ok(dtype(code, "x")?.precision())
}

fn config(formulation: &str, c: usize, h: usize) -> PyResult<Config> {
    let f: Formulation = formulation.parse().map_err(to_py)?;
    Config::new(f, c, h).map_err(to_py)
}

fn options(direction: &str, eps: f32) -> PyResult<Options> {
    let d: Direction = direction.parse().map_err(to_py)?;
    Ok(Options::new(d).with_eps(eps))
}

fn entries(weights: Vec<Entry>) -> PyResult<[Entry; 16]> {
    let n = weights.len();
    weights.try_into().map_err(|_| {
        PyValueError::new_err(format!("{n} weight entries given, expected 16 ({})", WEIGHT_NAMES.join(", ")))
    })
}

fn required(e: &[Entry; 16], i: usize) -> PyResult<(u64, usize, i32)> {
    e[i].ok_or_else(|| PyValueError::new_err(format!("{} is required", WEIGHT_NAMES[i])))
}

/// A host tensor's values as f32.
///
/// # Safety
/// `ptr` is the start of `len` contiguous elements of `code`'s type in host memory, alive and
/// unchanged for the call.
unsafe fn host_values(ptr: u64, len: usize, code: i32, what: &str) -> PyResult<Vec<f32>> {
    if len > 0 && ptr == 0 {
        return Err(PyValueError::new_err(format!("{what} is a null address")));
    }
    Ok(match dtype(code, what)? {
        // SAFETY: this function's contract.
        DType::F32 => unsafe { std::slice::from_raw_parts(ptr as *const f32, len) }.to_vec(),
        DType::Bf16 => {
            // SAFETY: as above.
            let s = unsafe { std::slice::from_raw_parts(ptr as *const u16, len) };
            s.iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect()
        }
        _ => {
            // SAFETY: as above.
            let s = unsafe { std::slice::from_raw_parts(ptr as *const u16, len) };
            s.iter().map(|&b| half::f16::from_bits(b).to_f32()).collect()
        }
    })
}

/// Host weights from the 16 entries.
///
/// # Safety
/// Every entry is a host tensor as [`host_values`] requires.
unsafe fn host_weights(cfg: Config, e: &[Entry; 16]) -> PyResult<Weights> {
    let get = |i: usize| -> PyResult<Option<Vec<f32>>> {
        // SAFETY: this function's contract.
        e[i].map(|(p, n, d)| unsafe { host_values(p, n, d, WEIGHT_NAMES[i]) }).transpose()
    };
    let need = |i: usize| -> PyResult<Vec<f32>> { get(i)?.ok_or_else(|| required(e, i).unwrap_err()) };
    let (c, h, g) = (cfg.c, cfg.h, cfg.gate_width());
    let lin =
        |i: usize, out: usize, inp: usize| -> PyResult<Linear> { Ok(Linear::new(need(i)?, get(i + 1)?, out, inp)) };
    let norm = |i: usize| -> PyResult<Norm> { Ok(Norm { weight: need(i)?, bias: need(i + 1)? }) };
    Weights::new(
        cfg,
        norm(0)?,
        lin(2, h, c)?,
        lin(4, h, c)?,
        lin(6, h, c)?,
        lin(8, h, c)?,
        lin(10, g, c)?,
        norm(12)?,
        lin(14, c, h)?,
    )
    .map_err(to_py)
}

/// Device weight descriptors from the 16 entries (nothing is read).
fn device_weights(cfg: Config, e: &[Entry; 16]) -> PyResult<DeviceWeights> {
    let t = |i: usize| -> PyResult<Option<DeviceTensor>> {
        e[i].map(|(p, n, d)| Ok(DeviceTensor::new(p, dtype(d, WEIGHT_NAMES[i])?, n))).transpose()
    };
    let need = |i: usize| -> PyResult<DeviceTensor> { t(i)?.ok_or_else(|| required(e, i).unwrap_err()) };
    let lin = |i: usize| -> PyResult<DeviceLinear> { Ok(DeviceLinear { weight: need(i)?, bias: t(i + 1)? }) };
    let norm = |i: usize| -> PyResult<DeviceNorm> { Ok(DeviceNorm { weight: need(i)?, bias: need(i + 1)? }) };
    let w = DeviceWeights {
        config: cfg,
        norm_in: norm(0)?,
        left_proj: lin(2)?,
        left_gate: lin(4)?,
        right_proj: lin(6)?,
        right_gate: lin(8)?,
        out_gate: lin(10)?,
        norm_out: norm(12)?,
        out_proj: lin(14)?,
    };
    w.validate().map_err(to_py)?;
    Ok(w)
}

/// A layer on host memory: NumPy arrays or CPU tensors.
#[pyclass(module = "trimul._trimul")]
struct HostLayer {
    layer: Mutex<TriMul>,
    c: usize,
}

#[pymethods]
impl HostLayer {
    /// Prepares the weights (host addresses) on `backend` ("cpu", "cuda", "hip"; `None`: the
    /// `TRIMUL_BACKEND` environment variable if set, else the CPU).
    #[new]
    #[pyo3(signature = (formulation, c, h, direction, eps, weights, backend=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        formulation: &str,
        c: usize,
        h: usize,
        direction: &str,
        eps: f32,
        weights: Vec<Entry>,
        backend: Option<&str>,
    ) -> PyResult<Self> {
        let cfg = config(formulation, c, h)?;
        let opts = options(direction, eps)?;
        let e = entries(weights)?;
        // SAFETY: the Python layer passes host tensors as the module docs state.
        let w = unsafe { host_weights(cfg, &e)? };
        let backend = backend.map(str::to_owned);
        let layer = py.detach(move || TriMul::new(&host_device(backend.as_deref())?, &w, opts));
        Ok(HostLayer { layer: Mutex::new(layer.map_err(to_py)?), c })
    }

    /// The backend the layer runs on ("cpu", "cuda" or "hip").
    #[getter]
    fn backend(&self) -> PyResult<String> {
        Ok(self.lock()?.kind().to_string())
    }

    /// y = TriMul(x) for host tensors: x and y `[b, n, n, C]` in `io` (0 f32, 1 bf16, 2 f16),
    /// the mask `[b, n, n]` f32 (address 0: none). Returns when y holds the result.
    /// `x_len`, `mask_len` and `y_len` are the tensors' element counts, checked against the shape
    /// before anything is read.
    #[pyo3(signature = (x, x_len, mask, mask_len, y, y_len, b, n, io))]
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        x: u64,
        x_len: usize,
        mask: u64,
        mask_len: usize,
        y: u64,
        y_len: usize,
        b: usize,
        n: usize,
        io: i32,
    ) -> PyResult<()> {
        let p = precision(io)?;
        let (len, xlen) = check_io(self.c, b, n, (x, x_len), (mask, mask_len), (y, y_len))?;
        // Host slices need their type's alignment (a NumPy view can start anywhere).
        let align = if p == Precision::F32Io { 4 } else { 2 };
        if !x.is_multiple_of(align) || !y.is_multiple_of(align) || !mask.is_multiple_of(4) {
            return Err(PyValueError::new_err("x, y and the mask must be aligned to their element size"));
        }
        let shape = Shape::new(b, n);
        let (xb, mb) = (xlen as u64 * p.io_bytes() as u64, len as u64 * 4);
        let overlap = |a: u64, an: u64, b: u64, bn: u64| a < b + bn && b < a + an;
        if overlap(x, xb, y, xb) || (mask != 0 && overlap(mask, mb, y, xb)) {
            return Err(PyValueError::new_err("y must not overlap x or the mask"));
        }
        py.detach(|| -> PyResult<()> {
            let mut layer = self.lock()?;
            // SAFETY: the mask is a host tensor of B·N·N f32 (module docs), alive for this call.
            let mask = (mask != 0).then(|| unsafe { std::slice::from_raw_parts(mask as *const f32, len) });
            // SAFETY (all three): x and y are host tensors of B·N·N·C elements of `io`'s type,
            // alive for this call (module docs), and do not overlap (checked above).
            match p {
                Precision::F32Io => unsafe { host_forward::<f32>(&mut layer, x, mask, y, xlen, shape) },
                Precision::Bf16Io => unsafe { host_forward::<half::bf16>(&mut layer, x, mask, y, xlen, shape) },
                _ => unsafe { host_forward::<half::f16>(&mut layer, x, mask, y, xlen, shape) },
            }
            .map_err(to_py)
        })
    }

    /// The gradients of a loss given dy = ∂L/∂y, for host f32 tensors: x and dy `[b, n, n, C]`,
    /// the mask `[b, n, n]` f32 (address 0: none). `outs` has 17 entries, `(address, elements,
    /// dtype)` or `None`: the gradient of x, then those of the 16 weights in the canonical order.
    /// Each given entry must be f32 with exactly its tensor's element count (a bias entry only
    /// where the layer has that bias) and receives the gradient; `None` entries are skipped.
    /// Nothing is written before every entry has been checked.
    #[pyo3(signature = (x, x_len, mask, mask_len, dy, dy_len, b, n, outs))]
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        py: Python<'_>,
        x: u64,
        x_len: usize,
        mask: u64,
        mask_len: usize,
        dy: u64,
        dy_len: usize,
        b: usize,
        n: usize,
        outs: Vec<Entry>,
    ) -> PyResult<()> {
        let (len, xlen) = check_pair_io(self.c, b, n, (x, x_len), (mask, mask_len), ("dy", (dy, dy_len)))?;
        if !x.is_multiple_of(4) || !dy.is_multiple_of(4) || !mask.is_multiple_of(4) {
            return Err(PyValueError::new_err("x, dy and the mask must be aligned to 4 bytes"));
        }
        let outs = gradient_entries::<17>(outs, 0)?;
        py.detach(|| -> PyResult<()> {
            let mut layer = self.lock()?;
            // SAFETY: x, dy (B·N·N·C f32 each) and the mask (B·N·N f32) are host tensors alive for
            // this call (module docs); they are only read.
            let (xs, dys, mask) = unsafe {
                (
                    std::slice::from_raw_parts(x as *const f32, xlen),
                    std::slice::from_raw_parts(dy as *const f32, xlen),
                    (mask != 0).then(|| std::slice::from_raw_parts(mask as *const f32, len)),
                )
            };
            let g = layer.backward(xs, mask, dys, Shape::new(b, n)).map_err(to_py)?;
            // SAFETY: the entries are host f32 tensors alive for this call (module docs).
            unsafe { write_gradients(&outs, &gradient_slots(&g), 0) }
        })
    }
}

/// The gradient entries of a backward (`N` of them from slot `first` of [`grad_name`]'s order),
/// each `None` or a non-null, aligned f32 tensor.
fn gradient_entries<const N: usize>(outs: Vec<Entry>, first: usize) -> PyResult<[Entry; N]> {
    let outs: [Entry; N] = outs
        .try_into()
        .map_err(|v: Vec<Entry>| PyValueError::new_err(format!("{} gradient entries given, expected {N}", v.len())))?;
    for (i, (ptr, _, code)) in outs.iter().enumerate().filter_map(|(i, e)| e.map(|e| (i, e))) {
        if code != 0 || ptr == 0 || !ptr.is_multiple_of(4) {
            return Err(PyValueError::new_err(format!(
                "the gradient entry of {} must be a non-null, aligned f32 tensor",
                grad_name(first + i)
            )));
        }
    }
    Ok(outs)
}

/// Copies each gradient into its caller entry (slots from `first`), after checking every entry
/// against its gradient's length, so that nothing is written when one does not match.
///
/// # Safety
/// Each entry is a host f32 tensor of its stated element count, alive for the call and written by
/// no one else meanwhile.
unsafe fn write_gradients(outs: &[Entry], tensors: &[Option<&[f32]>], first: usize) -> PyResult<()> {
    let tensors = &tensors[first..];
    for (i, (entry, t)) in outs.iter().zip(tensors).enumerate() {
        match (entry, t) {
            (Some((_, elems, _)), Some(t)) if *elems == t.len() => {}
            (Some((_, elems, _)), Some(t)) => {
                return Err(PyValueError::new_err(format!(
                    "the gradient entry of {} has {elems} elements, expected {}",
                    grad_name(first + i),
                    t.len()
                )))
            }
            (Some(_), None) => {
                return Err(PyValueError::new_err(format!(
                    "a gradient entry for {} was given, but the layer has no such bias",
                    grad_name(first + i)
                )))
            }
            (None, _) => {}
        }
    }
    for (entry, t) in outs.iter().zip(tensors) {
        if let (Some((ptr, elems, _)), Some(t)) = (entry, t) {
            // SAFETY: the caller's entry is a host f32 tensor of `elems` elements (checked equal
            // to the gradient's length), alive and unshared (this function's contract).
            unsafe { std::slice::from_raw_parts_mut(*ptr as *mut f32, *elems) }.copy_from_slice(t);
        }
    }
    Ok(())
}

/// The name of gradient slot `i` of [`HostLayer::backward`]: `x`, then [`WEIGHT_NAMES`].
fn grad_name(i: usize) -> &'static str {
    if i == 0 {
        "x"
    } else {
        WEIGHT_NAMES[i - 1]
    }
}

/// The gradients in [`HostLayer::backward`]'s 17 slots (`None`: a bias the layer lacks).
fn gradient_slots(g: &trimul::Gradients) -> [Option<&[f32]>; 17] {
    fn norm(n: &Norm) -> [Option<&[f32]>; 2] {
        [Some(&n.weight[..]), Some(&n.bias[..])]
    }
    fn lin(l: &Linear) -> [Option<&[f32]>; 2] {
        [Some(&l.weight[..]), l.bias.as_deref()]
    }
    let [niw, nib] = norm(&g.norm_in);
    let [now, nob] = norm(&g.norm_out);
    let [lpw, lpb] = lin(&g.left_proj);
    let [lgw, lgb] = lin(&g.left_gate);
    let [rpw, rpb] = lin(&g.right_proj);
    let [rgw, rgb] = lin(&g.right_gate);
    let [ogw, ogb] = lin(&g.out_gate);
    let [opw, opb] = lin(&g.out_proj);
    [Some(&g.x[..]), niw, nib, lpw, lpb, lgw, lgb, rpw, rpb, rgw, rgb, ogw, ogb, now, nob, opw, opb]
}

/// Checks the element counts the caller gives for x `[b, n, n, c]`, the mask `[b, n, n]` (address
/// 0: none) and y against the shape, and that the addresses are non-null: `(B·N·N, B·N·N·C)`.
fn check_io(
    c: usize,
    b: usize,
    n: usize,
    x: (u64, usize),
    mask: (u64, usize),
    y: (u64, usize),
) -> PyResult<(usize, usize)> {
    check_pair_io(c, b, n, x, mask, ("y", y))
}

/// [`check_io`] with the second `[b, n, n, c]` tensor's name (`y`, or the backward's `dy`).
fn check_pair_io(
    c: usize,
    b: usize,
    n: usize,
    x: (u64, usize),
    mask: (u64, usize),
    (y_name, y): (&str, (u64, usize)),
) -> PyResult<(usize, usize)> {
    let len =
        b.checked_mul(n).and_then(|v| v.checked_mul(n)).ok_or_else(|| PyValueError::new_err("B·N·N overflows"))?;
    let xlen = len.checked_mul(c).ok_or_else(|| PyValueError::new_err("B·N·N·C overflows"))?;
    if x.0 == 0 || y.0 == 0 {
        return Err(PyValueError::new_err(format!("x and {y_name} must be non-null addresses")));
    }
    for (name, got, want) in [("x", x.1, xlen), (y_name, y.1, xlen)] {
        if got != want {
            return Err(PyValueError::new_err(format!(
                "{name} has {got} elements, expected B·N·N·C = {b}·{n}·{n}·{c} = {want}"
            )));
        }
    }
    if mask.0 != 0 && mask.1 != len {
        return Err(PyValueError::new_err(format!("the mask has {} elements, expected B·N·N = {len}", mask.1)));
    }
    Ok((len, xlen))
}

/// The device I/O of one forward on caller memory, its element counts checked first
/// ([`check_io`]): x and y in precision `io`, the mask (address 0: none), the workspace, the
/// stream.
#[allow(clippy::too_many_arguments)]
fn device_io(
    c: usize,
    b: usize,
    n: usize,
    x: (u64, usize),
    mask: (u64, usize),
    y: (u64, usize),
    io: i32,
    workspace: DeviceSpan,
    stream: u64,
) -> PyResult<DeviceIo> {
    check_io(c, b, n, x, mask, y)?;
    Ok(DeviceIo {
        x: x.0,
        mask: (mask.0 != 0).then_some(mask.0),
        y: y.0,
        shape: Shape::new(b, n),
        io: precision(io)?,
        stream,
        workspace: Some(workspace),
    })
}

/// One host forward on tensors by address.
///
/// # Safety
/// `x` and `y` are the starts of `len` elements of `T` each in host memory, alive for the call,
/// not overlapping; nothing else reads or writes `y` meanwhile.
unsafe fn host_forward<T: trimul::IoElement>(
    layer: &mut TriMul,
    x: u64,
    mask: Option<&[f32]>,
    y: u64,
    len: usize,
    shape: Shape,
) -> trimul::Result<()> {
    // SAFETY: this function's contract.
    let (xs, ys) =
        unsafe { (std::slice::from_raw_parts(x as *const T, len), std::slice::from_raw_parts_mut(y as *mut T, len)) };
    layer.forward_into(xs, mask, ys, shape)
}

impl HostLayer {
    fn lock(&self) -> PyResult<std::sync::MutexGuard<'_, TriMul>> {
        self.layer.lock().map_err(|_| PyRuntimeError::new_err("a previous call on this layer panicked"))
    }
}

/// One backend per device ordinal, opened on first use: CUDA in the device's primary context (the
/// one PyTorch uses), HIP on the runtime the process already loaded (see `trimul._torch`).
fn backend_for<B: Clone + Send + 'static>(
    table: &'static OnceLock<Mutex<HashMap<usize, B>>>,
    device: usize,
    open: impl FnOnce(usize) -> trimul::Result<B>,
) -> PyResult<B> {
    let map = table.get_or_init(|| Mutex::new(HashMap::new()));
    let mut map = map.lock().map_err(|_| PyRuntimeError::new_err("backend table poisoned"))?;
    if let Some(b) = map.get(&device) {
        return Ok(b.clone());
    }
    let b = open(device).map_err(to_py)?;
    map.insert(device, b.clone());
    Ok(b)
}

/// The CUDA backends opened so far, by device.
static CUDA_BACKENDS: OnceLock<Mutex<HashMap<usize, CudaBackend>>> = OnceLock::new();

/// Whether CUDA forwards are enqueued as launch-graph replays ([`set_launch_graphs`]); the first
/// value from `TRIMUL_CUDA_GRAPHS` (on unless it is `0`).
fn launch_graphs() -> &'static std::sync::atomic::AtomicBool {
    static ON: OnceLock<std::sync::atomic::AtomicBool> = OnceLock::new();
    ON.get_or_init(|| {
        std::sync::atomic::AtomicBool::new(std::env::var("TRIMUL_CUDA_GRAPHS").map_or(true, |v| v.trim() != "0"))
    })
}

fn cuda_backend(device: usize) -> PyResult<CudaBackend> {
    backend_for(&CUDA_BACKENDS, device, |d| {
        let b = CudaBackend::new(d)?;
        // One graph replay per forward instead of its launches: a fraction of the host time.
        b.set_launch_graphs(launch_graphs().load(std::sync::atomic::Ordering::Relaxed));
        Ok(b)
    })
}

fn hip_backend(device: usize) -> PyResult<HipBackend> {
    static TABLE: OnceLock<Mutex<HashMap<usize, HipBackend>>> = OnceLock::new();
    backend_for(&TABLE, device, HipBackend::new)
}

/// A layer whose weights, tensors and workspace live in caller-owned device memory, every launch
/// on the caller's stream: `CudaLayer` on NVIDIA GPUs, `HipLayer` on AMD GPUs (same methods).
macro_rules! device_layer {
    ($name:ident, $backend:ty, $open:ident, $what:literal) => {
        #[doc = concat!("A layer on caller-owned ", $what, " memory (see the module docs).")]
        #[pyclass(module = "trimul._trimul")]
        struct $name {
            layer: Mutex<Layer<$backend>>,
        }

        impl $name {
            fn lock(&self) -> PyResult<std::sync::MutexGuard<'_, Layer<$backend>>> {
                self.layer.lock().map_err(|_| PyRuntimeError::new_err("a previous call on this layer panicked"))
            }
        }

        #[pymethods]
        impl $name {
            /// Prepares device weights (16 entries of device addresses) into `storage` (at least
            /// `prepared_bytes` bytes) with one kernel on `stream`.
            #[new]
            #[allow(clippy::too_many_arguments)]
            fn new(
                device: usize,
                formulation: &str,
                c: usize,
                h: usize,
                direction: &str,
                eps: f32,
                weights: Vec<Entry>,
                storage: u64,
                storage_bytes: u64,
                stream: u64,
            ) -> PyResult<Self> {
                let b = $open(device)?;
                let cfg = config(formulation, c, h)?;
                let w = device_weights(cfg, &entries(weights)?)?;
                let span = DeviceSpan { ptr: storage, bytes: storage_bytes };
                // SAFETY: the weights are live device tensors of the stated lengths on this
                // device, and `storage` a live allocation of `storage_bytes` that the Python
                // object keeps alive beside this layer (module docs); the stream is the caller's
                // on this device.
                let layer = unsafe { Layer::from_device_weights(&b, &w, options(direction, eps)?, span, stream) };
                Ok($name { layer: Mutex::new(layer.map_err(to_py)?) })
            }

            /// Replaces the weights with new device weights prepared into new storage, keeping
            /// the plans.
            fn reprepare(&self, weights: Vec<Entry>, storage: u64, storage_bytes: u64, stream: u64) -> PyResult<()> {
                let mut layer = self.lock()?;
                let w = device_weights(layer.config(), &entries(weights)?)?;
                let span = DeviceSpan { ptr: storage, bytes: storage_bytes };
                // SAFETY: as in `new`.
                unsafe { layer.prepare_device_weights(&w, span, stream) }.map_err(to_py)
            }

            /// Bytes of workspace a forward of this shape needs (plans it on first use, within
            /// `limit` bytes when given: a chunked plan where one pass does not fit). A
            /// `TypeError` says the I/O precision is not read and written on this device (the
            /// caller converts x to f32 then).
            #[pyo3(signature = (b, n, masked, io, limit=None))]
            fn workspace_bytes(&self, b: usize, n: usize, masked: bool, io: i32, limit: Option<u64>) -> PyResult<u64> {
                let p = precision(io)?;
                let layer = &mut *self.lock()?;
                if p != Precision::F32Io && !layer.half_io_native() {
                    return Err(PyTypeError::new_err(format!(
                        "{p} x and y are converted to f32 for this layer on {} (its kernels read and write f32)",
                        trimul::Backend::kind(layer.backend())
                    )));
                }
                layer.device_workspace_bytes_within(Shape::new(b, n), masked, p, limit).map_err(to_py)
            }

            /// Bytes of the workspace a `backward` of this shape needs.
            #[pyo3(signature = (b, n, masked, io=0))]
            fn backward_workspace_bytes(&self, b: usize, n: usize, masked: bool, io: i32) -> PyResult<u64> {
                let p = precision(io)?;
                self.lock()?.backward_workspace_bytes(Shape::new(b, n), masked, p).map_err(to_py)
            }

            /// The native backward on `stream`: x, dy and dx `[b, n, n, C]` device tensors in
            /// `io` (0 f32, 1 bf16, 2 f16), the mask `[b, n, n]` f32 (0: none), the workspace
            /// at `ws` (`ws_bytes` ≥ `backward_workspace_bytes` of the same `io`); the 16
            /// weight-gradient entries (f32 tensors in the canonical order, `None`: not wanted)
            /// receive the weights' gradients. Host entries: waits for the work. Device entries
            /// (`on_device`): the gradients are copied there on `stream`, and nothing waits.
            #[pyo3(signature = (x, mask, dy, dx, b, n, outs, ws, stream, io=0, on_device=false))]
            #[allow(clippy::too_many_arguments)]
            fn backward(
                &self,
                py: Python<'_>,
                x: (u64, usize),
                mask: (u64, usize),
                dy: (u64, usize),
                dx: (u64, usize),
                b: usize,
                n: usize,
                outs: Vec<Entry>,
                ws: (u64, u64),
                stream: u64,
                io: i32,
                on_device: bool,
            ) -> PyResult<()> {
                let p = precision(io)?;
                let c = self.lock()?.config().c;
                check_pair_io(c, b, n, x, mask, ("dy", dy))?;
                check_pair_io(c, b, n, x, mask, ("dx", dx))?;
                let outs = gradient_entries::<16>(outs, 1)?;
                let workspace = DeviceSpan { ptr: ws.0, bytes: ws.1 };
                let io4 = (x.0, mask.0, dy.0, dx.0);
                if on_device {
                    let mut layer = self.lock()?;
                    let mut grads = [0u64; 16];
                    for (i, (e, want)) in outs.iter().zip(layer.gradient_sizes()).enumerate() {
                        if let Some((ptr, len, _)) = *e {
                            if len != want {
                                return Err(PyValueError::new_err(format!(
                                    "the gradient entry of {} has {len} elements, expected {want}",
                                    grad_name(1 + i)
                                )));
                            }
                            grads[i] = ptr;
                        }
                    }
                    // SAFETY: as below; the entries are device f32 tensors of the lengths just
                    // checked, alive until the stream has run the work (module docs).
                    let io = BackwardDeviceIo { tensors: io4, stream, workspace, grads };
                    return unsafe { layer.backward_device_async(io, Shape::new(b, n), p) }.map_err(to_py);
                }
                py.detach(|| {
                    let mut layer = self.lock()?;
                    // SAFETY: x, mask, dy, dx and the workspace are live device tensors of this
                    // device with the element counts checked above, dx and the workspace fresh
                    // allocations (the caller's), all alive until this returns (module docs).
                    let g = unsafe { layer.backward_device(io4, Shape::new(b, n), p, stream, Some(workspace)) }
                        .map_err(to_py)?;
                    // SAFETY: the entries are host f32 tensors alive for this call (module docs).
                    unsafe { write_gradients(&outs, &gradient_slots(&g), 1) }
                })
            }

            /// Enqueues y = TriMul(x) on `stream`: x and y `[b, n, n, C]` in `io`, the mask
            /// `[b, n, n]` f32 (0: none), the workspace at `ws` (`ws_bytes` ≥ `workspace_bytes`).
            /// With `fresh` (16 weight entries, storage address and bytes), first prepares those
            /// weights into that storage on `stream` (as `reprepare`): GPU MODE's protocol, new
            /// weights in every call, in one call.
            #[pyo3(signature = (x, x_len, mask, mask_len, y, y_len, b, n, io, ws, ws_bytes, stream, fresh=None))]
            #[allow(clippy::too_many_arguments)]
            fn forward(
                &self,
                py: Python<'_>,
                x: u64,
                x_len: usize,
                mask: u64,
                mask_len: usize,
                y: u64,
                y_len: usize,
                b: usize,
                n: usize,
                io: i32,
                ws: u64,
                ws_bytes: u64,
                stream: u64,
                fresh: Option<(Vec<Entry>, u64, u64)>,
            ) -> PyResult<()> {
                let c = self.lock()?.config().c;
                let workspace = DeviceSpan { ptr: ws, bytes: ws_bytes };
                let io = device_io(c, b, n, (x, x_len), (mask, mask_len), (y, y_len), io, workspace, stream)?;
                let fresh =
                    fresh.map(|(w, ptr, bytes)| entries(w).map(|e| (e, DeviceSpan { ptr, bytes }))).transpose()?;
                py.detach(|| {
                    let mut layer = self.lock()?;
                    if let Some((e, span)) = &fresh {
                        let w = device_weights(layer.config(), e)?;
                        // SAFETY: the weights are live device tensors of this device with the
                        // stated sizes and the storage a live allocation of its bytes, kept
                        // alive by the caller's stream-ordered allocator until the stream has
                        // run the work (module docs).
                        unsafe { layer.prepare_device_weights(&w, *span, stream) }.map_err(to_py)?;
                    }
                    // SAFETY: x, mask, y and the workspace are live device tensors of this device
                    // with the element counts of the shape, kept alive by the caller's
                    // stream-ordered allocator until the stream has run the work (module docs).
                    unsafe { layer.forward_device(&io) }.map_err(to_py)
                })
            }
        }
    };
}

device_layer!(CudaLayer, CudaBackend, cuda_backend, "CUDA");
device_layer!(HipLayer, HipBackend, hip_backend, "HIP");

/// One rank of forwards sharded by rows across GPUs: the NCCL communicator it joined and a
/// workspace per shape, shared by every `CudaLayer` on its device.
#[pyclass(module = "trimul._trimul")]
struct CudaShardedRank {
    rank: Mutex<ShardedRank>,
}

impl CudaShardedRank {
    fn lock(&self) -> PyResult<std::sync::MutexGuard<'_, ShardedRank>> {
        self.rank.lock().map_err(|_| PyRuntimeError::new_err("a previous call on this rank panicked"))
    }
}

#[pymethods]
impl CudaShardedRank {
    /// Joins rank `rank` of `ranks` on CUDA device `device` to the communicator named by
    /// `unique_id` (`nccl_unique_id` on one rank, the same bytes on every rank): returns once
    /// every rank has joined. With `timeout_s`, the communicator is NCCL's non-blocking kind:
    /// the join raises after `timeout_s` seconds without the other ranks (and so does an
    /// exchange that cannot reach a peer in that time later), and every exchange costs more
    /// (`Communicator::join_within`); without it, NCCL waits for them as long as it takes.
    #[new]
    #[pyo3(signature = (unique_id, ranks, rank, device, timeout_s=None))]
    fn new(
        py: Python<'_>,
        unique_id: Vec<u8>,
        ranks: usize,
        rank: usize,
        device: usize,
        timeout_s: Option<f64>,
    ) -> PyResult<Self> {
        if let Some(t) = timeout_s.filter(|t| !(t.is_finite() && *t > 0.0)) {
            return Err(PyValueError::new_err(format!(
                "timeout_s={t}: give the join's deadline as a positive, finite number of seconds (or None: no deadline)"
            )));
        }
        let timeout = timeout_s.map(timeout).transpose()?;
        let joined = py.detach(|| {
            match timeout {
                Some(timeout) => Communicator::join_within(&unique_id, ranks, rank, device, timeout),
                None => Communicator::join(&unique_id, ranks, rank, device),
            }
            .and_then(ShardedRank::new)
        });
        Ok(CudaShardedRank { rank: Mutex::new(joined.map_err(to_py)?) })
    }

    /// The rows `(r0, r1)` of the first pair index this rank holds of a pair tensor of `n` rows.
    fn rows(&self, py: Python<'_>, n: usize) -> PyResult<(usize, usize)> {
        // Every method takes the rank's lock without the GIL: another thread may hold it while
        // it waits for a forward.
        let rows = py.detach(|| self.lock()?.rows(n).map_err(to_py))?;
        Ok((rows.start, rows.end))
    }

    /// Device bytes of the workspaces kept.
    fn workspace_bytes(&self, py: Python<'_>) -> PyResult<u64> {
        py.detach(|| Ok(self.lock()?.workspace_bytes()))
    }

    /// Waits for the last forward (at most `timeout_s` seconds; then, or on an NCCL error,
    /// aborts the communicator and raises), then frees the workspaces.
    fn release(&self, py: Python<'_>, timeout_s: f64) -> PyResult<()> {
        let timeout = timeout(timeout_s)?;
        py.detach(|| self.lock()?.release_workspaces(timeout).map_err(to_py))
    }

    /// Fills y and every intermediate with NaN before each forward, so an element nobody writes
    /// fails a check (the tests' switch).
    fn set_poison(&self, py: Python<'_>, on: bool) -> PyResult<()> {
        py.detach(|| {
            self.lock()?.backend().set_poison(on);
            Ok(())
        })
    }

    /// Waits for the last forward, at most `timeout_s` seconds (see `release`).
    fn wait(&self, py: Python<'_>, timeout_s: f64) -> PyResult<()> {
        let timeout = timeout(timeout_s)?;
        py.detach(|| self.lock()?.wait(timeout).map_err(to_py))
    }

    /// Enqueues this rank's part of y = TriMul(x) with `layer`'s weights on `stream`: x and y
    /// the rank's rows `[b, r1 − r0, n, C]` in `io`, the mask its rows `[b, r1 − r0, n]` f32
    /// (0: none). Every rank must make the same calls in the same order.
    #[pyo3(signature = (layer, x, x_len, mask, mask_len, y, y_len, b, n, io, stream))]
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        layer: PyRef<'_, CudaLayer>,
        x: u64,
        x_len: usize,
        mask: u64,
        mask_len: usize,
        y: u64,
        y_len: usize,
        b: usize,
        n: usize,
        io: i32,
        stream: u64,
    ) -> PyResult<()> {
        let p = precision(io)?;
        let layer: &CudaLayer = &layer;
        py.detach(|| {
            let mut rank = self.lock()?;
            let layer = layer.lock()?;
            let rows = rank.rows(n).map_err(to_py)?;
            let c = layer.config().c;
            let positions = b * rows.len() * n;
            for (what, len, want) in [("x", x_len, positions * c), ("y", y_len, positions * c)] {
                if len != want {
                    return Err(PyValueError::new_err(format!(
                        "{what} has {len} elements; rank {} holds rows {}..{} of N = {n}: B·{}·N·C = {want}",
                        rank.rank(),
                        rows.start,
                        rows.end,
                        rows.len()
                    )));
                }
            }
            if mask != 0 && mask_len != positions {
                return Err(PyValueError::new_err(format!("the mask has {mask_len} elements, expected {positions}")));
            }
            let problem = layer.problem(Shape::new(b, n), mask != 0).map_err(to_py)?.with_io(p).in_place(x == y);
            // SAFETY: x, the mask and y are live device tensors on the rank's device with the
            // element counts checked above, kept alive by the caller's stream-ordered allocator
            // until the stream has run the work (module docs).
            unsafe { rank.forward_layer(&layer, &problem, x, mask, y, stream) }.map_err(to_py)
        })
    }
}

fn timeout(seconds: f64) -> PyResult<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(seconds).map_err(|_| {
        PyValueError::new_err(format!(
            "timeout of {seconds} s: give a finite, non-negative number of seconds below 1.8e19"
        ))
    })
}

/// The rows `(r0, r1)` of a pair tensor of `n` rows each of `ranks` ranks holds (as even as
/// possible, the first ranks one more).
#[pyfunction]
fn row_split(n: usize, ranks: usize) -> PyResult<Vec<(usize, usize)>> {
    Ok(trimul::plan::shard::row_split(n, ranks).map_err(to_py)?.into_iter().map(|r| (r.start, r.end)).collect())
}

/// A fresh NCCL unique id (128 bytes) for `CudaShardedRank`.
#[pyfunction]
fn nccl_unique_id() -> PyResult<Vec<u8>> {
    Communicator::unique_id().map_err(to_py)
}

/// NCCL's version, or why it cannot be loaded.
#[pyfunction]
fn nccl_version() -> PyResult<String> {
    trimul::collective::nccl_version().map_err(to_py)
}

/// Bytes of device storage a `CudaLayer` of this configuration prepares its weights into.
#[pyfunction]
fn cuda_prepared_bytes(device: usize, formulation: &str, c: usize, h: usize, biases: bool) -> PyResult<u64> {
    let b = cuda_backend(device)?;
    Layer::prepared_device_bytes(&b, &config(formulation, c, h)?, biases).map_err(to_py)
}

/// Bytes of device storage a `HipLayer` of this configuration prepares its weights into.
#[pyfunction]
fn hip_prepared_bytes(device: usize, formulation: &str, c: usize, h: usize, biases: bool) -> PyResult<u64> {
    let b = hip_backend(device)?;
    Layer::prepared_device_bytes(&b, &config(formulation, c, h)?, biases).map_err(to_py)
}

/// Makes sure HIP layers of C and H on `device` follow verdicts on the MFMA kernels (validating
/// them now where none exists; never call this during a graph capture). Returns the verdicts in
/// words (none where settings or the hardware settle every path).
#[pyfunction]
fn hip_validate(py: Python<'_>, device: usize, c: usize, h: usize) -> PyResult<Vec<String>> {
    let b = hip_backend(device)?;
    py.detach(|| b.ensure_verdicts(c, h)).map(|v| v.iter().map(|v| v.describe()).collect()).map_err(to_py)
}

/// Fill outputs and intermediates with NaN before each forward on this CUDA device (tests).
#[pyfunction]
fn cuda_set_poison(device: usize, on: bool) -> PyResult<()> {
    cuda_backend(device)?.set_poison(on);
    Ok(())
}

/// Whether CUDA forwards from now on, on every device, are enqueued as one CUDA-graph replay
/// each (on by default, or as `TRIMUL_CUDA_GRAPHS` says) or as their launches.
#[pyfunction]
fn set_launch_graphs(on: bool) -> PyResult<()> {
    launch_graphs().store(on, std::sync::atomic::Ordering::Relaxed);
    if let Some(map) = CUDA_BACKENDS.get() {
        let map = map.lock().map_err(|_| PyRuntimeError::new_err("backend table poisoned"))?;
        map.values().for_each(|b| b.set_launch_graphs(on));
    }
    Ok(())
}

/// Whether CUDA forwards are enqueued as CUDA-graph replays ([`set_launch_graphs`]).
#[pyfunction]
fn launch_graphs_on() -> bool {
    launch_graphs().load(std::sync::atomic::Ordering::Relaxed)
}

/// What the CUDA backend found on device `device`: its description, or the error saying why not.
#[pyfunction]
fn cuda_info(device: usize) -> PyResult<String> {
    let b = cuda_backend(device)?;
    let i = trimul::Backend::info(&b);
    let versions: Vec<String> = i.versions.iter().map(|(k, v)| format!("{k} {v}")).collect();
    Ok(format!("{} ({}, {} SMs): {}", i.name, i.arch, i.compute_units, versions.join(", ")))
}

/// The backend a `HostLayer` made with `backend` (None: the environment, else the CPU) runs on,
/// or the error saying why it cannot open.
#[pyfunction]
#[pyo3(signature = (backend=None))]
fn host_backend(py: Python<'_>, backend: Option<&str>) -> PyResult<String> {
    let backend = backend.map(str::to_owned);
    py.detach(move || host_device(backend.as_deref())).map(|d| d.kind().to_string()).map_err(to_py)
}

fn host_device(backend: Option<&str>) -> trimul::Result<Device> {
    match backend {
        Some(k) => Device::of_kind(k.parse()?),
        None if std::env::var_os(trimul::backend::BACKEND_ENV).is_some() => Device::detect(),
        None => Ok(Device::cpu()),
    }
}

/// The bytes of a device's memory (`total`) a workspace plan leaves free
/// (`trimul::plan::margin`): not every cached or free byte is usable for one block.
#[pyfunction]
fn memory_margin(total: u64) -> u64 {
    trimul::plan::margin(total)
}

/// The backends compiled into this module.
#[pyfunction]
fn compiled_backends() -> Vec<String> {
    Device::compiled().iter().map(|k| k.to_string()).collect()
}

#[pymodule]
fn _trimul(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("WEIGHT_NAMES", WEIGHT_NAMES.to_vec())?;
    m.add_class::<HostLayer>()?;
    m.add_class::<CudaLayer>()?;
    m.add_class::<HipLayer>()?;
    m.add_class::<CudaShardedRank>()?;
    m.add_function(wrap_pyfunction!(nccl_unique_id, m)?)?;
    m.add_function(wrap_pyfunction!(nccl_version, m)?)?;
    m.add_function(wrap_pyfunction!(row_split, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_prepared_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(hip_prepared_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(hip_validate, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_set_poison, m)?)?;
    m.add_function(wrap_pyfunction!(set_launch_graphs, m)?)?;
    m.add_function(wrap_pyfunction!(launch_graphs_on, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_info, m)?)?;
    m.add_function(wrap_pyfunction!(compiled_backends, m)?)?;
    m.add_function(wrap_pyfunction!(memory_margin, m)?)?;
    m.add_function(wrap_pyfunction!(host_backend, m)?)?;
    Ok(())
}
