"""The PyTorch path: `torch.ops.trimul.triangle_multiplicative_update`, a `torch.library` custom
op with a fake (meta) implementation and autograd, and the cuEquivariance-signature wrapper.

On the GPU (CUDA, or ROCm with a ROCm build of PyTorch) the op runs in-process on
`torch.cuda.current_stream()`: weights are prepared on the device by one kernel into a tensor
from PyTorch's caching allocator (cached, see `_PreparedCache`), the workspace and the output
come from the same allocator, and nothing waits on the host. On the CPU it runs through the
library's host-memory API.
"""

from __future__ import annotations

import inspect
import operator
import os
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import Optional

import torch

from . import _args, _trimul, reference

Tensor = torch.Tensor

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _code(t: Tensor, name: str) -> int:
    try:
        return _DTYPE_CODE[t.dtype]
    except KeyError:
        raise TypeError(f"{name} has dtype {t.dtype}; trimul takes float32, bfloat16 or float16") from None


def _whole(t: Optional[Tensor], name: str):
    return None if t is None else (t.data_ptr(), t.numel(), _code(t, name))


def _half(t: Optional[Tensor], i: int, name: str):
    """Rows [i*H, (i+1)*H) of a packed [2H, ...] tensor, by address."""
    if t is None:
        return None
    n = t.numel() // 2
    return (t.data_ptr() + i * n * t.element_size(), n, _code(t, name))


def _entries(w: list) -> list:
    """The 16 canonical entries (see `trimul._trimul`) from the twelve af3 weights, contiguous."""
    niw, nib, piw, pib, giw, gib, now, nob, pow_, pob, gow, gob = w
    return [
        _whole(niw, "norm_in_weight"),
        _whole(nib, "norm_in_bias"),
        _half(piw, 0, "p_in_weight"),
        _half(pib, 0, "p_in_bias"),
        _half(giw, 0, "g_in_weight"),
        _half(gib, 0, "g_in_bias"),
        _half(piw, 1, "p_in_weight"),
        _half(pib, 1, "p_in_bias"),
        _half(giw, 1, "g_in_weight"),
        _half(gib, 1, "g_in_bias"),
        _whole(gow, "g_out_weight"),
        _whole(gob, "g_out_bias"),
        _whole(now, "norm_out_weight"),
        _whole(nob, "norm_out_bias"),
        _whole(pow_, "p_out_weight"),
        _whole(pob, "p_out_bias"),
    ]


def _with_norm_defaults(w: list, c: int, h: int, device: torch.device) -> list:
    """LayerNorm defaults (weight 1, bias 0) where none is given. Made on the current stream for
    each preparation (never cached): a cached one would be read by other streams, or inside a
    graph capture would hold memory nothing ever filled."""
    w = list(w)
    for i, (n, v) in {0: (c, 1.0), 1: (c, 0.0), 6: (h, 1.0), 7: (h, 0.0)}.items():
        if w[i] is None:
            w[i] = torch.full((n,), v, dtype=torch.float32, device=device)
    return w


def _contiguous(t: Optional[Tensor]) -> Optional[Tensor]:
    """Contiguous and 16-byte aligned (the kernels load 16 bytes at a time)."""
    if t is None:
        return None
    if not t.is_contiguous() or t.data_ptr() % 16:
        t = t.contiguous() if not t.is_contiguous() else t.clone()
    return t


class _Entry:
    __slots__ = ("layer", "storage", "refs", "state", "ws_bytes", "keep", "c", "device")


class _PreparedCache:
    """Prepared layers keyed on the weight tensors themselves.

    An entry is found by the tensors' ids (and, on the GPU, the device and stream: an entry is
    used on the stream it was prepared on, so no other stream can read storage still being
    written, and its storage goes back to that stream's pool) and is used only while each tensor
    is the same object (an entry dies with its tensors, through weak references) with the same
    `_version` (in-place writes bump it: an optimizer step re-prepares), data pointer, dtype,
    shape and strides (`.data =` another tensor or a view of the same memory). The entry holds
    the weights' storages, so that while it lives no other tensor can be given their addresses.
    Writes that bump no version counter (through `.data`, DLPack, raw pointers, CUDA-graph
    replays of captured parameter updates, a storage resized and refilled in place) are not seen:
    call `trimul.clear_cache()` after them. Weights that require grad are not cached when the
    call records a gradient (see `_op`). At most `capacity` entries are kept.
    """

    def __init__(self, capacity: int = 256):
        self.capacity = capacity
        self.entries: dict = {}
        self.lock = threading.Lock()

    def get(self, key: tuple, tensors: Sequence) -> Optional[_Entry]:
        e = self.entries.get(key)
        if e is None or e.state != _state(tensors):
            return None
        return e

    def put(self, key: tuple, tensors: Sequence, entry: _Entry) -> None:
        cache = weakref.ref(self)

        def drop(_ref, key=key):
            # No lock: a dict pop is atomic under the GIL, and this may run (garbage collection)
            # on a thread that holds the lock already.
            c = cache()
            if c is not None:
                c.entries.pop(key, None)

        # The key holds the tensors' ids; the weak references' callbacks take the entry out when
        # one of them dies (CPython runs them before the object's memory can be reused, cyclic
        # garbage included), so while an entry is found its ids are still those tensors.
        entry.refs = [weakref.ref(t, drop) for t in tensors if t is not None]
        entry.keep = [t.untyped_storage() for t in tensors if t is not None]
        entry.state = _state(tensors)
        with self.lock:
            while len(self.entries) >= self.capacity:
                self.entries.pop(next(iter(self.entries)), None)
            self.entries[key] = entry

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()


def _state(tensors: Sequence) -> list:
    """What must be unchanged for prepared weights to stay valid, per given tensor: its version
    (in-place writes bump it), data pointer (`.data = other`), dtype, shape and strides (`.data =`
    a view or a reinterpretation of the same memory keeps the other two)."""
    return [(t._version, t.data_ptr(), t.dtype, t.shape, t.stride()) for t in tensors if t is not None]


_cache = _PreparedCache()
_prepared_bytes: dict = {}


def clear_cache() -> None:
    """Forgets every prepared weight set and kept layer (they are made again on next use)."""
    _cache.clear()
    _fresh.clear()


def _cacheable(tensors: list) -> bool:
    # Inference tensors have no version counter: an in-place write to one would go unseen.
    return not any(t is not None and t.is_inference() for t in tensors)


# What torch.cuda.current_stream(i).cuda_stream and is_current_stream_capturing() return, without
# building Stream objects (the public calls cost microseconds per op call).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda i: torch.cuda.current_stream(i).cuda_stream
)
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


def _prepared_weights(originals: list, c: int, h: int, device: torch.device) -> list:
    """The weights as preparation reads them: LayerNorm defaults filled in, each contiguous."""
    w = originals
    if w[0] is None or w[1] is None or w[6] is None or w[7] is None:
        w = _with_norm_defaults(w, c, h, device)
    return [_contiguous(t) for t in w]


_HIP = torch.version.hip is not None


def _use_the_loaded_hip_runtime() -> None:
    """Points the library's HIP loaders at the runtime, rocBLAS and hipRTC this process already
    loaded (PyTorch's own copies), so that one HIP runtime serves both: a second copy of the
    runtime would see other streams and allocations. Variables the user set are kept."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if ".so" in line and line.rstrip().split()[-1].startswith("/")}
    except OSError:
        return
    for env, lib in (
        ("TRIMUL_HIP_LIBRARY", "libamdhip64.so"),
        ("TRIMUL_ROCBLAS_LIBRARY", "librocblas.so"),
        ("TRIMUL_HIPRTC_LIBRARY", "libhiprtc.so"),
    ):
        found = sorted(p for p in paths if os.path.basename(p).startswith(lib))
        if found and not os.environ.get(env):
            os.environ[env] = found[0]


_validated: set = set()

if _HIP:
    _use_the_loaded_hip_runtime()
    _DeviceLayer = _trimul.HipLayer
    _device_prepared_bytes = _trimul.hip_prepared_bytes
    _hip_validate = _trimul.hip_validate
else:
    _DeviceLayer = _trimul.CudaLayer
    _device_prepared_bytes = _trimul.cuda_prepared_bytes


def _cuda_prepare(x: Tensor, originals: list, direction: str, eps: float, index: int, stream: int) -> _Entry:
    """Prepares the weights on `stream` into storage from PyTorch's allocator."""
    c, h = x.shape[-1], originals[2].shape[0] // 2
    w = _prepared_weights(originals, c, h, x.device)
    biases = any(w[i] is not None for i in (3, 5, 9, 11))
    nb_key = (index, c, h, biases)
    nbytes = _prepared_bytes.get(nb_key)
    if nbytes is None:
        nbytes = _prepared_bytes[nb_key] = _device_prepared_bytes(index, "af3", c, h, biases)
    if _HIP and (index, c, h) not in _validated and not _capturing():
        # The MFMA kernels have not run on AMD hardware before: they are validated on this GPU
        # (once per C and H; the verdicts are kept on disk) before layers use them. Not during a
        # capture, where nothing may allocate or wait: such a layer uses the portable stages.
        _hip_validate(index, c, h)
        _validated.add((index, c, h))
    storage = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    entry = _Entry()
    entry.layer = _DeviceLayer(index, "af3", c, h, direction, eps, _entries(w), storage.data_ptr(), nbytes, stream)
    entry.storage = storage
    entry.ws_bytes = {}
    entry.c = c
    entry.device = x.device
    return entry


# Layers for weights being trained (or otherwise not cached), by thread, device, stream,
# direction, eps, C, H and which weights are given: each call prepares its weights again, into the
# entry's storage, keeping the layer and its plans (making a layer and planning its GEMMs cost
# about a millisecond of host time per call). One thread's calls on one stream run in order, so
# the layers of a model that share these share one entry; another thread, whose preparation could
# come between this thread's preparation and launch, has its own.
_fresh: dict = {}


def _fresh_entry(x: Tensor, originals: list, direction: str, eps: float, index: int, stream: int) -> _Entry:
    """A layer with `originals` prepared into it on `stream` by this call (see `_fresh`)."""
    c, h = x.shape[-1], originals[2].shape[0] // 2
    key = (threading.get_ident(), index, stream, direction, eps, c, h, tuple(t is None for t in originals))
    e = _fresh.get(key)
    if e is None:
        e = _cuda_prepare(x, originals, direction, eps, index, stream)
        if not _in_cudagraph_tree(index):
            _fresh[key] = e
        return e
    w = _prepared_weights(originals, c, h, x.device)
    e.layer.reprepare(_entries(w), e.storage.data_ptr(), e.storage.numel(), stream)
    return e


def prepared_entry(x: Tensor, originals: list, direction: str, eps: float, index: int, stream: int) -> _Entry:
    """The layer of `originals` prepared on this device and stream: from the cache when these
    tensors were prepared before and have not changed, else prepared now (and cached where they
    are cacheable). x gives the device and C."""
    key = (index, stream, direction, eps, *map(id, originals))
    e = _cache.get(key, originals)
    if e is None:
        e = _cuda_prepare(x, originals, direction, eps, index, stream)
        if _cacheable(originals) and not _in_cudagraph_tree(index):
            _cache.put(key, originals, e)
    return e


def _in_cudagraph_tree(index: int) -> bool:
    """Whether torch.compile's CUDA-graph trees are warming up or recording on this device: their
    memory pool is then the allocator's, and a cached tensor allocated there would be overwritten
    by their replays (their pool only keeps the tensors they know of)."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None:
        return False
    try:
        manager = trees.get_manager(index, create_if_none_exists=False)
    except Exception:  # noqa: BLE001 - no manager state on this thread: no tree running here
        return False
    return manager is not None and (manager.in_warmup or manager.in_recording)


def _cuda_forward(
    x: Tensor, mask: Optional[Tensor], originals: list, direction: str, eps: float, cache: bool = True
) -> Tensor:
    if x.get_device() != torch.cuda.current_device():
        # The library makes the device's context current on this thread; PyTorch's current device
        # follows it, so a call on another device would leave PyTorch there.
        with torch.cuda.device(x.get_device()):
            return _cuda_forward_on(x, mask, originals, direction, eps, cache)
    return _cuda_forward_on(x, mask, originals, direction, eps, cache)


def _cuda_forward_on(
    x: Tensor, mask: Optional[Tensor], originals: list, direction: str, eps: float, cache: bool = True
) -> Tensor:
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = _contiguous(x)
    if mask is not None and (not mask.is_contiguous() or mask.data_ptr() % 16):
        mask = _contiguous(mask)
    index = x.get_device()
    stream = _raw_stream(index)
    # Inside a CUDA-graph capture the preparation is captured with the forward (every replay
    # prepares from the parameters' current values); nothing captured enters the cache. Nor do
    # weights being trained (see `_op`).
    if _capturing():
        e = _cuda_prepare(x, originals, direction, eps, index, stream)
    elif not cache:
        e = _fresh_entry(x, originals, direction, eps, index, stream)
    else:
        e = prepared_entry(x, originals, direction, eps, index, stream)
    b, n = x.shape[0], x.shape[1]
    io = _DTYPE_CODE[x.dtype]
    wkey = (b, n, mask is not None, io)
    nbytes = e.ws_bytes.get(wkey)
    if nbytes is None:
        try:
            limit = _memory_for_workspace(e.device, x.numel() * x.element_size())
            nbytes = e.ws_bytes[wkey] = e.layer.workspace_bytes(b, n, mask is not None, io, limit)
        except TypeError:
            if io == 0:
                raise
            # 16-bit x and y are read and written where they lie by the fused CUDA kernels (C a
            # multiple of 8 up to 512, H a multiple of 16 up to 128) and on HIP by the MFMA output
            # kernel (where this GPU validated it, or TRIMUL_HIP_MFMA=1); other layers run in f32
            # I/O, converted here on the device.
            nbytes = e.ws_bytes[wkey] = -1
    if nbytes < 0:
        return _cuda_forward_on(x.float(), mask, originals, direction, eps, cache).to(x.dtype)
    try:
        return _launch(e, x, mask, b, n, io, nbytes, stream)
    except torch.OutOfMemoryError:
        # The plan was made for memory the allocator could not give after all: plan again (within
        # what is left then) on the next call rather than fail with this size every time.
        e.ws_bytes.pop(wkey, None)
        raise


def _memory_for_workspace(device: torch.device, besides: int) -> Optional[int]:
    """The bytes a workspace may take on `device` when it is planned: the driver's free memory
    and what PyTorch's caching allocator holds unused, less `besides` (what the call allocates
    beside it). Where the one-pass workspace does not fit, the library plans hidden passes and
    row chunks in that much. None (no limit: the one-pass plan) during a CUDA-graph capture, where
    the query is not made, and for memory PyTorch does not count (the fake devices of the tests)."""
    if device.type != "cuda" or _capturing():
        return None
    free, total = torch.cuda.mem_get_info(device)
    unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    # The Rust API's margin: not every cached byte is usable for one block (partly used
    # segments, graph pools), nor is the last of the driver's free memory.
    return max(free + unused - besides - _trimul.memory_margin(total), 0)


def _launch(e: _Entry, x: Tensor, mask: Optional[Tensor], b: int, n: int, io: int, nbytes: int, stream: int) -> Tensor:
    """The workspace and y from PyTorch's allocator, then the one library call."""
    ws = torch.empty(nbytes, dtype=torch.uint8, device=e.device)
    return _enqueue(e, x, mask, b, n, io, ws.data_ptr(), nbytes, stream)


def _enqueue(
    e: _Entry, x: Tensor, mask: Optional[Tensor], b: int, n: int, io: int, ws: int, nbytes: int, stream: int
) -> Tensor:
    """y from PyTorch's allocator and the one library call, with the workspace at `ws`."""
    y = torch.empty_like(x)
    # `_io_args`'s six values written out in the call: every fast-path call comes here, and
    # building their tuple and unpacking it into the call is a measurable part of its host time.
    e.layer.forward(
        x.data_ptr(),
        x.numel(),
        0 if mask is None else mask.data_ptr(),
        0 if mask is None else mask.numel(),
        y.data_ptr(),
        y.numel(),
        b,
        n,
        io,
        ws,
        nbytes,
        stream,
    )
    return y


def _io_args(x: Tensor, mask: Optional[Tensor], y: Tensor) -> tuple[int, int, int, int, int, int]:
    """x, the mask and y as the layers' forwards take them: each one's address and element count
    (0 and 0 for no mask). `_enqueue` writes the same six out in its call."""
    m = (0, 0) if mask is None else (mask.data_ptr(), mask.numel())
    return (x.data_ptr(), x.numel(), *m, y.data_ptr(), y.numel())


_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
# Whether a tensor is on a CUDA (or ROCm) device: the tests' CPU stand-in for a device swaps it.
_on_device = operator.attrgetter("is_cuda")


def cached_call(x: Tensor, mask: Optional[Tensor], w: Sequence, direction, eps) -> Optional[Tensor]:
    """The common call, fast: x a CUDA tensor on the current device, outside any capture, with
    weights this stream has prepared before and unchanged since (so they are the tensors that
    passed every check then). Checks x and the mask against the entry and runs; returns None
    wherever anything differs, and the full path takes over (and raises, for bad input). `w` is
    the twelve weights in signature order."""
    if not _on_device(x) or x.dim() != 4 or eps.__class__ is not float or direction.__class__ is not str:
        return None
    index = x.get_device()
    if index != _current_device() or _capturing():
        return None
    stream = _raw_stream(index)
    e = _cache.get((index, stream, direction, eps, *map(id, w)), w)
    if e is None:
        return None
    b, n, n2, c = x.shape
    io = _DTYPE_CODE.get(x.dtype)
    if n != n2 or c != e.c or b == 0 or n == 0 or io is None:
        return None
    if mask is not None:
        if (
            mask.__class__ is not torch.Tensor
            or not _on_device(mask)
            or mask.get_device() != index
            or mask.shape != x.shape[:3]
        ):
            return None
        if mask.dtype != torch.float32:
            mask = mask.to(torch.float32)
        if not mask.is_contiguous() or mask.data_ptr() % 16:
            mask = _contiguous(mask)
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = _contiguous(x)
    nbytes = e.ws_bytes.get((b, n, mask is not None, io))
    if nbytes is None or nbytes < 0:
        return None
    if _raw_alloc is None or nbytes == 0:
        return _launch(e, x, mask, b, n, io, nbytes, stream)
    # The workspace as a raw block of the caching allocator (no tensor built: about 2 µs a call),
    # freed right after the enqueue as a temporary tensor would be, so the allocator hands it out
    # again only to later work on this stream. x is on the current device (checked above).
    ws = _raw_alloc(nbytes, stream)
    try:
        return _enqueue(e, x, mask, b, n, io, ws, nbytes, stream)
    finally:
        _raw_delete(ws)


_raw_alloc = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_alloc", None)
_raw_delete = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_delete", None)


_host_cache = _PreparedCache()


def _host_forward(
    x: Tensor, mask: Optional[Tensor], originals: list, direction: str, eps: float, backend, cache: bool = True
):
    """Through the library's host API: CPU tensors."""
    c, h = x.shape[-1], originals[2].shape[0] // 2
    key = (backend, direction, eps) + tuple(id(t) for t in originals)
    e = _host_cache.get(key, originals) if cache else None
    if e is None:
        w = _prepared_weights(originals, c, h, x.device)
        host_w = [None if t is None else t.detach().cpu().contiguous() for t in w]
        e = _Entry()
        e.layer = _trimul.HostLayer("af3", c, h, direction, eps, _entries(host_w), backend)
        if cache and _cacheable(originals):
            _host_cache.put(key, originals, e)
    xh = x.detach().cpu().contiguous()
    mh = None if mask is None else mask.detach().cpu().contiguous()
    y = torch.empty_like(xh)
    e.layer.forward(*_io_args(xh, mh, y), x.shape[0], x.shape[1], _DTYPE_CODE[x.dtype])
    return y.to(x.device)


@torch.library.custom_op("trimul::triangle_multiplicative_update", mutates_args=())
def _op(
    x: Tensor,
    mask: Optional[Tensor],
    norm_in_weight: Optional[Tensor],
    norm_in_bias: Optional[Tensor],
    p_in_weight: Tensor,
    p_in_bias: Optional[Tensor],
    g_in_weight: Tensor,
    g_in_bias: Optional[Tensor],
    norm_out_weight: Optional[Tensor],
    norm_out_bias: Optional[Tensor],
    p_out_weight: Tensor,
    p_out_bias: Optional[Tensor],
    g_out_weight: Tensor,
    g_out_bias: Optional[Tensor],
    direction: str,
    eps: float,
) -> Tensor:
    """y = TriMul(x) in the af3 form. x `[B, N, N, C]`, mask `[B, N, N]` float32 or None; the
    weights as cuEquivariance names them; y in x's dtype. A public entry point: it checks what it
    is given as `triangle_multiplicative_update` does."""
    originals = [norm_in_weight, norm_in_bias, p_in_weight, p_in_bias, g_in_weight, g_in_bias]
    originals += [norm_out_weight, norm_out_bias, p_out_weight, p_out_bias, g_out_weight, g_out_bias]
    # Weights that require grad are being trained: their values can change without a version
    # bump (FSDP2 refills unsharded parameters in place under a preserved version counter), and
    # preparing them costs little beside a training step, so they are prepared on every call.
    cache = not any(t is not None and t.requires_grad for t in originals)
    if cache:
        # Weights this stream prepared before were checked then; x and the mask are checked here.
        y = cached_call(x, mask, originals, direction, eps)
        if y is not None:
            return y
    if direction != "outgoing" and direction != "incoming":
        _args.check_direction(direction)
    eps = _args.check_eps(eps)
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"x must be a [B, N, N, C] tensor here, got {getattr(x, 'shape', type(x).__name__)}")
    mask = _check_tensors(x, mask, dict(zip(_args.AF3_WEIGHTS, originals)))
    return _forward(x, mask, originals, direction, eps, cache)


def _forward(
    x: Tensor, mask: Optional[Tensor], originals: list, direction: str, eps: float, cache: bool = True
) -> Tensor:
    """The op's implementation on real tensors (the checks are the wrapper's)."""
    if x.is_cuda:  # CUDA, or ROCm on a ROCm build of PyTorch
        return _cuda_forward(x, mask, originals, direction, eps, cache)
    x = _contiguous(x)
    mask = _contiguous(mask)
    if x.device.type == "cpu":
        return _host_forward(x, mask, originals, direction, eps, None, cache)
    raise ValueError(f"x is on {x.device}; trimul runs on CUDA, ROCm and CPU tensors")


@_op.register_fake
def _(x, mask, *rest):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


_WEIGHT_SLOTS = range(2, 14)


def _setup_context(ctx, inputs, output):
    x, mask, *w = inputs[:14]
    ctx.direction, ctx.eps = inputs[14], inputs[15]
    ctx.save_for_backward(x, mask, *w)


# ROCm's native backward (the HIP backend's) has run on the fake ROCm only: opt-in until it has
# run on an AMD GPU, as the MFMA output path's 16-bit I/O is (TRIMUL_HIP_MFMA=1).
_HIP_NATIVE_BACKWARD = os.environ.get("TRIMUL_HIP_BACKWARD", "") == "native"


def _native_backward(x: Tensor) -> bool:
    """Whether the library's backward op takes x's device: the CPU, CUDA, and ROCm where
    `TRIMUL_HIP_BACKWARD=native`, outside a graph capture (the native backward has not run inside
    one; the op checks again when it runs, for graphs captured after tracing)."""
    if x.device.type == "cpu":
        return True
    return x.is_cuda and (not _HIP or _HIP_NATIVE_BACKWARD) and not _capturing()


def _backward(ctx, grad):
    """The library's native backward where it runs (`_native_backward`); elsewhere the forward
    recomputed with PyTorch operations in float32 and differentiated."""
    x, mask, *w = ctx.saved_tensors
    need = ctx.needs_input_grad
    slots = [(0, x)] + list(zip(_WEIGHT_SLOTS, w))
    if not any(t is not None and need[i] for i, t in slots):
        return (None,) * 16
    if _native_backward(x):
        if not torch.is_grad_enabled() and _eager(grad, ()) and x.__class__ is torch.Tensor:
            # Nothing traces or records this call (no `create_graph`, whose gradients must carry
            # the op's node, so that differentiating them raises rather than gives zeros): the
            # implementation without the dispatcher.
            given = _backward_impl(grad, x, mask, list(w), ctx.direction, ctx.eps)
        else:
            # An op of its own, so that tracing (torch.compile, opcheck) sees one opaque call.
            given = _backward_op(grad, x, mask, list(w), ctx.direction, ctx.eps)
        grads = dict(zip([i for i, t in slots if t is not None], given))
    else:
        grads = _recomputed_backward(x, mask, w, ctx.direction, ctx.eps, grad, need)
    out = [None] * 16
    for i, t in slots:
        if t is not None and need[i]:
            out[i] = grads[i].to(t.dtype)
    return tuple(out)


# The native CUDA backward no longer waits for its work (its weight gradients stay on the
# device), but it has not been run inside a CUDA graph: its layer is prepared again and its GEMMs
# planned on every call. Tagged so, torch.compile's CUDA-graph trees leave the op out of their
# graphs (PyTorch >= 2.7 has the tag); inside a capture it recomputes instead.
_UNSAFE_IN_GRAPHS = (
    {"tags": (torch.Tag.cudagraph_unsafe,)}
    if hasattr(torch.Tag, "cudagraph_unsafe") and "tags" in inspect.signature(torch.library.custom_op).parameters
    else {}
)


@torch.library.custom_op("trimul::triangle_multiplicative_update_backward", mutates_args=(), **_UNSAFE_IN_GRAPHS)
def _backward_op(
    grad: Tensor, x: Tensor, mask: Optional[Tensor], w: list[Optional[Tensor]], direction: str, eps: float
) -> list[Tensor]:
    """The library's native backward on CPU or CUDA tensors (ROCm ones with
    `TRIMUL_HIP_BACKWARD=native`), given grad = dL/dy and the forward's
    twelve weights in signature order (`AF3_WEIGHTS`): the gradients of x (in x's dtype where it
    is float32, bfloat16 or float16, else float32) and of each weight that is not None (float32),
    in that order, on x's device. Autograd calls it with what the forward
    checked; called directly (it is public, as
    torch.ops.trimul.triangle_multiplicative_update_backward) it checks its arguments first."""
    _check_backward_args(grad, x, mask, w)
    return _backward_impl(grad, x, mask, w, direction, eps)


def _backward_impl(
    grad: Tensor, x: Tensor, mask: Optional[Tensor], w: list[Optional[Tensor]], direction: str, eps: float
) -> list[Tensor]:
    """The backward op's implementation, on arguments it has checked (or autograd has)."""
    if x.is_cuda:
        if _capturing():
            given = [i for i, t in zip(_WEIGHT_SLOTS, w) if t is not None]
            grads = _recomputed_backward(x, mask, w, direction, eps, grad, [True] * 16)
            return [grads[0].to(_dx_dtype(x))] + [grads[i] for i in given]
        with torch.cuda.device(x.get_device()):
            return _cuda_backward(grad, x, mask, w, direction, eps)
    c, h = x.shape[-1], w[2].shape[0] // 2
    host_w = [None if t is None else t.detach().contiguous() for t in _prepared_weights(w, c, h, x.device)]
    layer = _trimul.HostLayer("af3", c, h, direction, eps, _entries(host_w), "cpu")
    x32 = x.detach().to(torch.float32).contiguous()
    dy = grad.detach().to(torch.float32).contiguous()
    m = None if mask is None else mask.detach().to(torch.float32).contiguous()
    dx = torch.empty(x.shape, dtype=torch.float32)
    gw = [None if t is None else torch.empty(t.shape, dtype=torch.float32) for t in w]
    entries = [_whole(dx, "x gradient")] + _entries(gw)
    m_ptr, m_len = (0, 0) if m is None else (m.data_ptr(), m.numel())
    layer.backward(
        x32.data_ptr(), x32.numel(), m_ptr, m_len, dy.data_ptr(), dy.numel(), x.shape[0], x.shape[1], entries
    )
    return [dx.to(_dx_dtype(x))] + [g for g in gw if g is not None]


def _dx_dtype(x: Tensor) -> torch.dtype:
    """The dtype of the backward op's x gradient: x's where the library takes it as I/O."""
    return x.dtype if x.dtype in _DTYPE_CODE else torch.float32


def _cuda_backward(grad: Tensor, x: Tensor, mask: Optional[Tensor], w: list, direction: str, eps: float) -> list:
    """The native backward on CUDA (or ROCm: the HIP backend's) tensors, on the current stream:
    x and grad in x's precision
    (float32, or bfloat16 and float16 as they are: the library then keeps most intermediates in
    16 bits), dx in it too, the mask as float32; dx, the workspace and the weight gradients
    (float32, written on the device at the end of the stream's work) from PyTorch's allocator.
    Nothing waits for the GPU."""
    index = x.get_device()
    stream = _raw_stream(index)
    e = _fresh_entry(x, list(w), direction, eps, index, stream)
    dtype = _dx_dtype(x)
    io = _DTYPE_CODE[dtype]
    # Contiguous and 16-byte aligned, as the forward's inputs (a view at an odd offset is copied).
    xs = _contiguous(x.detach().to(dtype))
    dy = _contiguous(grad.detach().to(dtype))
    m = None if mask is None else _contiguous(mask.detach().to(torch.float32))
    b, n = x.shape[0], x.shape[1]
    dx = torch.empty(x.shape, dtype=dtype, device=x.device)
    nbytes = e.layer.backward_workspace_bytes(b, n, m is not None, io)
    ws = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    gw = [None if t is None else torch.empty(t.shape, dtype=torch.float32, device=x.device) for t in w]
    e.layer.backward(
        (xs.data_ptr(), xs.numel()),
        (0, 0) if m is None else (m.data_ptr(), m.numel()),
        (dy.data_ptr(), dy.numel()),
        (dx.data_ptr(), dx.numel()),
        b,
        n,
        _entries(gw),
        (ws.data_ptr(), nbytes),
        stream,
        io,
        True,
    )
    return [dx] + [g for g in gw if g is not None]


def _check_backward_args(grad: Tensor, x: Tensor, mask: Optional[Tensor], w: list) -> None:
    """What the backward op needs of its arguments when called directly: tensors on x's device,
    the CPU or a GPU (CUDA; ROCm with `TRIMUL_HIP_BACKWARD=native`), x `[B, N, N, C]`, grad of
    x's shape, the mask `[B, N, N]`, twelve weights with the forward's shapes."""
    if len(w) != 12:
        raise ValueError(f"{len(w)} weights given, expected 12 ({', '.join(_args.AF3_WEIGHTS)})")
    if not isinstance(x, torch.Tensor) or not (x.device.type == "cpu" or x.is_cuda):
        where = getattr(x, "device", type(x).__name__)
        raise ValueError(f"the native backward takes CPU or GPU tensors; x is on {where}")
    if _HIP and not _HIP_NATIVE_BACKWARD and x.is_cuda:
        raise ValueError(
            "the native backward on ROCm tensors has not run on an AMD GPU: it is opt-in "
            "(TRIMUL_HIP_BACKWARD=native before importing trimul)"
        )
    named = [("grad", grad), ("mask", mask)] + list(zip(_args.AF3_WEIGHTS, w))
    for name, t in named:
        if t is not None and (not isinstance(t, torch.Tensor) or t.device != x.device):
            where = getattr(t, "device", type(t).__name__)
            raise ValueError(f"{name} is on {where}, x on {x.device}: the backward takes tensors on one device")
    if grad.shape != x.shape:
        raise ValueError(f"grad has shape {tuple(grad.shape)}, expected x's {tuple(x.shape)}")
    _args.check_af3_shapes(x.shape, None if mask is None else mask.shape, dict(zip(_args.AF3_WEIGHTS, w)))


@_backward_op.register_fake
def _(grad, x, mask, w, direction, eps):
    given = [t for t in w if t is not None]
    return [torch.empty(x.shape, dtype=_dx_dtype(x), device=x.device)] + [
        torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in given
    ]


def _recomputed_backward(x, mask, w, direction, eps, grad, need, contraction=reference.contract) -> dict:
    """Every needed gradient by PyTorch autograd of the formula in float32, by slot (`need` and
    the result indexed as the op's arguments: x 0, the weights `_WEIGHT_SLOTS`); `contraction`
    as `reference.af3` takes it."""
    with torch.enable_grad():

        def leaf(t, slot):
            if t is None:
                return None
            return t.detach().to(torch.float32).requires_grad_(bool(need[slot]))

        xs = leaf(x, 0)
        ws = [leaf(t, i) for t, i in zip(w, _WEIGHT_SLOTS)]
        m = None if mask is None else mask.detach().to(torch.float32)
        y = reference.af3(xs, m, ws, direction, eps, contraction)
        slots = [(0, x, xs)] + [(i, t, s) for i, t, s in zip(_WEIGHT_SLOTS, w, ws)]
        wanted = [(i, s) for i, t, s in slots if t is not None and need[i]]
        grads = torch.autograd.grad(y, [s for _, s in wanted], grad.to(torch.float32)) if wanted else ()
    return {i: g for (i, _), g in zip(wanted, grads)}


_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerAutograd(torch.autograd.Function):
    """The op's forward and backward for eager calls that record gradients (`_eager`): the same
    implementation, context and backward as the registered op's, without the dispatcher's
    custom-op layers, whose Python costs a few hundred microseconds of host time per training
    step (more than the GPU work of a forward and backward at N = 256). Its backward runs once:
    the gradients it returns are not themselves differentiable, as the op's are not."""

    @staticmethod
    def forward(x, mask, *rest):
        # `update` checked the arguments and made the mask float32.
        w, direction, eps = list(rest[:12]), rest[12], rest[13]
        return _forward(x, mask, w, direction, eps, not _any_requires_grad(*w))

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, inputs, output)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        return _backward(ctx, grad)


def _check_tensors(x: Tensor, mask: Optional[Tensor], weights: dict) -> Optional[Tensor]:
    """Types, dtypes, devices and shapes of x `[B, N, N, C]`, the mask and the weights (by
    cuEquivariance's names); returns the mask as f32."""
    if x.dtype not in _DTYPE_CODE:
        raise TypeError(f"x has dtype {x.dtype}; trimul takes float32, bfloat16 or float16")
    device = x.device
    # The common case in one cheap pass: every given tensor a torch.Tensor on x's device with a
    # supported dtype; anything else gets the check that names it.
    for name, t in weights.items():
        if t is not None and (t.__class__ is not torch.Tensor and not isinstance(t, torch.Tensor)):
            _check_tensor(name, t, x)
        if t is not None and (t.device != device or t.dtype not in _DTYPE_CODE):
            _check_tensor(name, t, x)
    if mask is not None:
        _check_tensor("mask", mask, x)
        if mask.dtype != torch.float32:
            mask = mask.to(torch.float32)
    _args.check_af3_shapes(x.shape, None if mask is None else mask.shape, weights)
    return mask


def _check_tensor(name: str, t, x: Tensor) -> None:
    """Type, dtype and device of one argument beside x (the shapes are checked by _args)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor like x, got {type(t).__name__}")
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but x is on {x.device}; every tensor must be on x's device")
    if name != "mask" and t.dtype not in _DTYPE_CODE:
        raise TypeError(f"{name} has dtype {t.dtype}; trimul takes float32, bfloat16 or float16 weights")


def update(x, direction, mask, weights: dict, eps, precision) -> Tensor:
    """cuEquivariance's `triangle_multiplicative_update` for torch tensors (see `trimul`)."""
    if direction != "outgoing" and direction != "incoming":
        _args.check_direction(direction)
    if eps.__class__ is not float or not 0.0 <= eps < float("inf"):
        eps = _args.check_eps(eps)
    mode = _args.DEFAULT if precision is None else _args.parse_precision(precision)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor or a numpy.ndarray, got {type(x).__name__}")
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor like x, got {type(mask).__name__}")
    # The mode first: the default one (nearly every call) never reads x's device here.
    if mode != _args.DEFAULT and x.device.type != "cpu":
        _args.refuse_f32_on_gpu(mode, precision)
    if _forward_ad._current_level >= 0 and _has_tangent([x, mask, *weights.values()]):
        raise NotImplementedError(
            "trimul's op has no forward-mode derivative (jvp); use reverse-mode autograd, which it supports"
        )
    original_shape = x.shape
    x4 = x if x.dim() == 4 else x.reshape(_args.fold_leading(tuple(x.shape), 4))
    m3 = None
    if mask is not None:
        m3 = mask if mask.dim() == 3 else mask.reshape(_args.fold_leading(tuple(mask.shape), 3))
    m3 = _check_tensors(x4, m3, weights)
    w = [weights[n] for n in _args.AF3_WEIGHTS]
    if mode == _args.BFLOAT16:
        x4 = x4.to(torch.bfloat16)
        if m3 is not None:
            m3 = m3.to(torch.bfloat16).to(torch.float32)
        w = [None if t is None else t.to(torch.bfloat16) for t in w]
    if _eager(x4, w):
        if torch.is_grad_enabled() and (x4.requires_grad or _any_requires_grad(*w)):
            y = _EagerAutograd.apply(x4, m3, *w, direction, eps)
        else:
            y = _forward(x4, m3, w, direction, eps)
    else:
        y = torch.ops.trimul.triangle_multiplicative_update(x4, m3, *w, direction, eps)
    return y if y.shape == original_shape else y.view(original_shape)


def _has_tangent(tensors: list) -> bool:
    """Whether any tensor carries a forward-mode AD tangent (PyTorch drops it silently at a custom
    op without a jvp, which would hand back a result whose derivative is missing)."""
    return any(isinstance(t, torch.Tensor) and _forward_ad.unpack_dual(t).tangent is not None for t in tensors)


_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._len_torch_function_stack
_tracing = torch._C._get_tracing_state  # torch.jit.trace records only dispatched ops
_functorch_active = torch._C._functorch.peek_interpreter_stack  # vmap, grad, jvp transforms
_forward_ad = torch.autograd.forward_ad
# The autograd profiler (torch.profiler) records dispatched ops only: under it, calls go through the
# op so that they show in its trace.
_profiling = getattr(torch._C._autograd, "_profiler_enabled", lambda: False)


def _eager(x: Tensor, w: Sequence) -> bool:
    """Whether a call may run the op's implementation without PyTorch's dispatcher: plain
    tensors, no compiler or `torch.jit.trace` tracing, no forward-mode AD, no functorch transform,
    and no dispatch or function mode active (fake tensors, functionalization, profilers' modes).
    Then the dispatcher would only forward the call (and, for a call that records gradients, wrap
    it in its autograd layer: `_EagerAutograd` is that layer without the rest); going around it
    saves its cost on every call. Everything else goes through the registered op. (Written for
    speed: it runs on every call.)"""
    if x.__class__ is not torch.Tensor or _is_compiling():
        return False
    if _dispatch_modes() or _function_modes() or _tracing() or _functorch_active() or _profiling():
        return False
    if _forward_ad._current_level >= 0:  # forward-mode AD: the op has no forward derivative
        return False
    return _PLAIN.issuperset(map(type, w))


def _direct(x: Tensor, w: Sequence) -> bool:
    """Whether an eager call (`_eager`) records no gradient: the op's implementation then runs as
    it is, with nothing around it."""
    return _eager(x, w) and not (torch.is_grad_enabled() and (x.requires_grad or _any_requires_grad(*w)))


# Tensor classes that add no behaviour of their own (nn.Parameter only marks a module's weight),
# and None for an absent weight.
_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter, type(None)))
_is_compiling = torch.compiler.is_compiling
# Whether any of the tensors given requires grad, None skipped: one C call in place of a Python
# loop over the twelve weights, where this PyTorch has it (older releases lack it).
_any_requires_grad = getattr(torch._C, "_any_requires_grad", None) or (
    lambda *tensors: any(t is not None and t.requires_grad for t in tensors)
)
