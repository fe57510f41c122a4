"""The GPU paths' Python glue, run on the CPU: the device-layer class is replaced by a stand-in
whose methods have the compiled class's exact signatures (read from `_trimul.CudaLayer`) and which
computes through the host API on the same addresses. A call the compiled module would refuse (a
missing or extra argument, an element count that disagrees with the shape) fails here too, so the
glue is checked in CI without a GPU; what runs on the GPU is checked on the GPU machine."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch
from conftest import af3_weights, compare, f64_reference, pair, random_mask

import trimul
from trimul import _torch, _trimul, gpumode, reference
from trimul._args import AF3_WEIGHTS


def _signature(method) -> inspect.Signature:
    text = method.__text_signature__.replace("$self", "self")
    return inspect.Signature([_parameter(p) for p in text.strip("()").split(",")])


def _parameter(text: str) -> inspect.Parameter:
    """One parameter of a text signature, `name` or `name=default`."""
    name, eq, default = text.strip().partition("=")
    extra = {"default": ast.literal_eval(default)} if eq else {}
    return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, **extra)


class FakeDeviceLayer:
    """`_trimul.CudaLayer`'s interface over host memory (CPU tensors stand in for device ones)."""

    calls: list = []

    def __init__(self, *args):
        _signature(_trimul.CudaLayer).bind(*args)
        device, formulation, c, h, direction, eps, weights, storage, storage_bytes, stream = args
        assert storage and storage_bytes > 0
        self.spec = (formulation, c, h, direction, eps)
        self.layer = _trimul.HostLayer(formulation, c, h, direction, eps, weights, "cpu")
        FakeDeviceLayer.calls.append("new")

    def reprepare(self, *args):
        _signature(_trimul.CudaLayer.reprepare).bind(self, *args)
        weights = args[0]
        self.layer = _trimul.HostLayer(*self.spec, weights, "cpu")

    def workspace_bytes(self, *args):
        _signature(_trimul.CudaLayer.workspace_bytes).bind(self, *args)
        return 4096

    def forward(self, *args):
        _signature(_trimul.CudaLayer.forward).bind(self, *args)
        x, x_len, mask, mask_len, y, y_len, b, n, io, ws, ws_bytes, stream, *fresh = args
        assert ws and ws_bytes == 4096
        if fresh:
            weights, storage, storage_bytes = fresh[0]
            assert storage and storage_bytes > 0
            self.reprepare(weights, storage, storage_bytes, stream)
            FakeDeviceLayer.calls.append("fresh")
        self.layer.forward(x, x_len, mask, mask_len, y, y_len, b, n, io)
        FakeDeviceLayer.calls.append("forward")


@pytest.fixture
def fake_device(monkeypatch):
    FakeDeviceLayer.calls = []
    for module in (_torch, gpumode):
        monkeypatch.setattr(module, "_DeviceLayer", FakeDeviceLayer)
        monkeypatch.setattr(module, "_device_prepared_bytes", lambda *a: 1000)
        monkeypatch.setattr(module, "_raw_stream", lambda index: 0)
    monkeypatch.setattr(_torch, "_capturing", lambda: False)
    gpumode._layers.clear()
    gpumode._sizes.clear()
    _torch.clear_cache()
    yield FakeDeviceLayer
    gpumode._layers.clear()
    gpumode._sizes.clear()
    _torch.clear_cache()


def test_af3_device_path_glue(fake_device):
    c, h, n = 32, 16, 12
    w = af3_weights(c, h, True, salt=90)
    x = pair((2, n, n, c), salt=91)
    mask = random_mask((2, n, n), salt=92)
    originals = [w.get(k) for k in AF3_WEIGHTS]
    for _ in range(2):  # prepared, then from the cache
        y = _torch._cuda_forward_on(x, mask, originals, "incoming", 1e-5)
        bad, rel = compare(y, f64_reference(x, "incoming", mask, **w))
        assert bad == 0 and rel < 1e-5
    assert fake_device.calls == ["new", "forward", "forward"]


def test_the_fast_path_for_prepared_weights(fake_device, monkeypatch):
    """`cached_call` (what the function and the op try first) on the CPU stand-in: it runs a
    call whose weights this stream prepared, on new x and masks, and hands anything it cannot
    vouch for back to the full path (None)."""
    monkeypatch.setattr(_torch, "_on_device", lambda t: True)
    monkeypatch.setattr(_torch, "_current_device", lambda: -1)  # CPU tensors' get_device()
    blocks: dict = {}  # the caching allocator's raw interface, over host tensors

    def raw_alloc(nbytes, stream):
        t = torch.empty(nbytes, dtype=torch.uint8)
        blocks[t.data_ptr()] = t
        return t.data_ptr()

    monkeypatch.setattr(_torch, "_raw_alloc", raw_alloc)
    monkeypatch.setattr(_torch, "_raw_delete", lambda ptr: blocks.pop(ptr))
    c, h, n = 32, 16, 12
    w = af3_weights(c, h, True, salt=93)
    x = pair((2, n, n, c), salt=94)
    mask = random_mask((2, n, n), salt=95)
    originals = [w.get(k) for k in AF3_WEIGHTS]
    assert _torch.cached_call(x, mask, originals, "incoming", 1e-5) is None  # nothing prepared yet
    _torch._cuda_forward_on(x, mask, originals, "incoming", 1e-5)
    x2 = pair((2, n, 2 * n, c), salt=96)[:, :, ::2]  # strided
    m2 = random_mask((2, n, n), salt=97).bool()
    y = _torch.cached_call(x2, m2, originals, "incoming", 1e-5)
    bad, rel = compare(y, f64_reference(x2, "incoming", m2.float(), **w))
    assert bad == 0 and rel < 1e-5
    assert fake_device.calls == ["new", "forward", "forward"] and not blocks, "the workspace block was not freed"
    for args in (
        (x2, m2, originals, "outgoing", 1e-5),  # another direction: not prepared
        (x2, m2, originals, ["incoming"], 1e-5),  # not a str
        (x2, m2, originals, "incoming", 1e-6),  # another eps
        (x2, m2, originals, "incoming", 1),  # not a float
        (x2[..., :-1], m2, originals, "incoming", 1e-5),  # another C
        (x2[:, :-1], m2, originals, "incoming", 1e-5),  # not square
        (x2.double(), m2, originals, "incoming", 1e-5),  # unsupported dtype
        (x2, m2[:, :-1], originals, "incoming", 1e-5),  # mask shape
        (x2, m2.numpy(), originals, "incoming", 1e-5),  # mask type
        (x2, None, originals, "incoming", 1e-5),  # unmasked: workspace not sized yet
        (x2[0], m2, originals, "incoming", 1e-5),  # x not 4-D
    ):
        assert _torch.cached_call(*args) is None, args
    w["g_out_weight"].data = w["g_out_weight"].data.t()  # a view: same pointer and version
    assert _torch.cached_call(x2, m2, originals, "incoming", 1e-5) is None
    assert fake_device.calls == ["new", "forward", "forward"]


def test_gpumode_device_path_glue(fake_device):
    c, h, n, b = 32, 16, 10, 2
    g = torch.Generator().manual_seed(5)
    weights = gpumode.random_weights(c, h, g)
    x = torch.randn(b, n, n, c, generator=g)
    mask = torch.randint(0, 2, (b, n, n), generator=g).float()
    keep: list = []
    entries = gpumode._weights(weights, x, c, h, keep)
    for _ in range(2):
        y = gpumode._on_device(x, mask, entries, c, h)
        want = reference.gpumode(x.double(), mask.double(), {k: v.double() for k, v in weights.items()})
        bad, rel = compare(y, want)
        assert bad == 0 and rel < 1e-5
    assert fake_device.calls.count("fresh") == 2


def test_workspace_limit_keeps_the_libraries_margin(monkeypatch):
    """The workspace a CUDA device call may plan in: the driver's free memory plus what PyTorch
    holds unused, less what the call allocates beside it and the Rust API's margin (2% of the
    device, at least 256 MiB, at most a quarter)."""
    gib = 1 << 30
    assert _trimul.memory_margin(80 * gib) == 80 * gib // 50
    assert _trimul.memory_margin(4 * gib) == 256 << 20
    assert _trimul.memory_margin(512 << 20) == 128 << 20
    monkeypatch.setattr(_torch, "_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 3 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: gib)
    got = _torch._memory_for_workspace(torch.device("cuda", 0), 100)
    assert got == 10 * gib + 2 * gib - 100 - 80 * gib // 50
    assert _torch._memory_for_workspace(torch.device("cpu"), 100) is None


def test_launch_graphs_switch_returns_what_it_replaced():
    """``trimul.set_launch_graphs`` (CUDA forwards as graph replays, on by default) takes effect
    for backends opened before and after it, and returns the setting it replaced."""
    was = trimul.set_launch_graphs(False)
    try:
        assert trimul.set_launch_graphs(True) is False
        assert trimul.set_launch_graphs(True) is True
    finally:
        trimul.set_launch_graphs(was)
