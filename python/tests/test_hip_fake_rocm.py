"""The Python entry points driven through the HIP backend on the fake ROCm
(tests/hip_emu/fake_rocm.cpp: the HIP runtime and rocBLAS on the host, running the real kernel
bodies), with NumPy arrays and CPU tensors and `TRIMUL_BACKEND=hip`. This exercises the path
from Python to the HIP backend's host-staged forward; it is not AMD hardware."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fake_rocm(tmp_path_factory):
    cxx = os.environ.get("TRIMUL_HOST_CXX", "clang++-19")
    if shutil.which(cxx) is None:
        if os.environ.get("TRIMUL_REQUIRE_HIP_CLANG"):
            pytest.fail(f"TRIMUL_REQUIRE_HIP_CLANG is set but {cxx} is missing")
        pytest.skip(f"no {cxx} to build the fake ROCm")
    lib = tmp_path_factory.mktemp("fake-rocm") / "libtrimul_fake_rocm.so"
    cmd = [cxx, "-std=c++20", "-O2", "-pthread", "-fPIC", "-shared", "-Wno-psabi", "-I", str(ROOT)]
    subprocess.run(cmd + [str(ROOT / "tests/hip_emu/fake_rocm.cpp"), "-o", str(lib)], check=True)
    return lib


SCRIPT = textwrap.dedent(
    """
    import numpy as np, torch
    import trimul
    from trimul import _trimul, gpumode, reference
    from trimul._args import AF3_WEIGHTS
    assert _trimul.host_backend() == "hip", _trimul.host_backend()
    rng = np.random.default_rng(SEED)
    c, h, n = 32, 32, 16
    w = {
        "norm_in_weight": rng.standard_normal(c), "norm_in_bias": rng.standard_normal(c),
        "p_in_weight": rng.standard_normal((2 * h, c)) / h**0.5, "p_in_bias": rng.standard_normal(2 * h) / h**0.5,
        "g_in_weight": rng.standard_normal((2 * h, c)) / h**0.5, "g_in_bias": rng.standard_normal(2 * h) / h**0.5,
        "norm_out_weight": rng.standard_normal(h), "norm_out_bias": rng.standard_normal(h),
        "p_out_weight": rng.standard_normal((c, h)) / c**0.5, "p_out_bias": rng.standard_normal(c) / h**0.5,
        "g_out_weight": rng.standard_normal((c, c)) / h**0.5, "g_out_bias": rng.standard_normal(c) / h**0.5,
    }
    w = {k: v.astype(np.float32) for k, v in w.items()}
    for direction in ("outgoing", "incoming"):
        x = rng.standard_normal((2, n, n, c)).astype(np.float32)
        mask = rng.integers(0, 2, (2, n, n)).astype(np.float32)
        y = trimul.triangle_multiplicative_update(x, direction, mask, **w)
        t = lambda a: torch.from_numpy(np.asarray(a, np.float64))
        want = reference.af3(t(x), t(mask), [t(w[k]) for k in AF3_WEIGHTS], direction, 1e-5).numpy()
        rel = np.linalg.norm(y - want) / np.linalg.norm(want)
        bad = int((np.abs(y - want) > 2e-2 + 2e-2 * np.abs(want)).sum())
        print(f"hip {direction}: rel L2 {rel:.2e}, {bad} outside")
        assert bad == 0 and rel < 5e-3, (rel, bad)
    # GPU MODE's entry point with CPU tensors goes through the same backend.
    g = torch.Generator().manual_seed(SEED)
    square = ("left_proj", "right_proj", "left_gate", "right_gate", "out_gate", "to_out")
    gw = {f"{k}.weight": torch.randn(128, 128, generator=g) / 128**0.5 for k in square}
    for k in ("norm.weight", "norm.bias", "to_out_norm.weight", "to_out_norm.bias"):
        gw[k] = torch.randn(128, generator=g)
    x = torch.randn(1, 16, 16, 128, generator=g)
    mask = torch.ones(1, 16, 16)
    y = gpumode.custom_kernel((x, mask, gw, {"dim": 128, "hidden_dim": 128}))
    want = reference.gpumode(x.double(), mask.double(), {k: v.double() for k, v in gw.items()})
    rel = ((y.double() - want).norm() / want.norm()).item()
    print(f"hip gpumode: rel L2 {rel:.2e}")
    assert rel < 5e-3, rel

    # The device path the ROCm build of PyTorch takes (HipLayer: weights prepared on the device
    # into caller storage, the workspace in caller memory, the caller's stream), driven here with
    # "device" memory from the fake runtime itself.
    import ctypes, os
    hip = ctypes.CDLL(os.environ["TRIMUL_HIP_LIBRARY"])
    held = []

    def dev(a):
        a = np.ascontiguousarray(a)
        p = ctypes.c_void_p()
        assert hip.hipMalloc(ctypes.byref(p), ctypes.c_size_t(max(a.nbytes, 1))) == 0
        assert hip.hipMemcpyHtoDAsync(p, ctypes.c_void_p(a.ctypes.data), ctypes.c_size_t(a.nbytes), None) == 0
        held.append(p)
        return p.value

    def empty(nbytes):
        return dev(np.zeros(nbytes, np.uint8))

    def host(ptr, like):
        out = np.empty_like(like)
        dst, src = ctypes.c_void_p(out.ctypes.data), ctypes.c_void_p(ptr)
        assert hip.hipMemcpyDtoHAsync(dst, src, ctypes.c_size_t(out.nbytes), None) == 0
        return out

    x = rng.standard_normal((1, n, n, c)).astype(np.float32)
    mask = rng.integers(0, 2, (1, n, n)).astype(np.float32)
    wd = {k: (dev(v), v.size) for k, v in w.items()}
    def half(k, i):
        p, size = wd[k]
        return (p + i * (size // 2) * 4, size // 2, 0)
    whole = lambda k: (wd[k][0], wd[k][1], 0)
    # The layer's 16 weight entries in their canonical order, by AF3 name and half (None: whole).
    order = [("norm_in_weight", None), ("norm_in_bias", None), ("p_in_weight", 0), ("p_in_bias", 0),
             ("g_in_weight", 0), ("g_in_bias", 0), ("p_in_weight", 1), ("p_in_bias", 1),
             ("g_in_weight", 1), ("g_in_bias", 1), ("g_out_weight", None), ("g_out_bias", None),
             ("norm_out_weight", None), ("norm_out_bias", None), ("p_out_weight", None), ("p_out_bias", None)]
    entries = [whole(k) if i is None else half(k, i) for k, i in order]
    nbytes = _trimul.hip_prepared_bytes(0, "af3", c, h, True)
    storage = empty(nbytes)
    layer = _trimul.HipLayer(0, "af3", c, h, "incoming", 1e-5, entries, storage, nbytes, 0)
    try:
        layer.workspace_bytes(1, n, True, 1)
        raise AssertionError("bf16 I/O on HIP should be refused (converted by the caller)")
    except TypeError as e:
        assert "f32" in str(e), e
    wbytes = layer.workspace_bytes(1, n, True, 0)
    y = empty(x.nbytes)
    xd, md = dev(x), dev(mask)
    layer.forward(xd, x.size, md, mask.size, y, x.size, 1, n, 0, empty(wbytes + 256), wbytes, 0)
    got = host(y, x)
    # The workspace planned once, bound to another span in the next call: the same bits.
    y2 = empty(x.nbytes)
    layer.forward(xd, x.size, md, mask.size, y2, x.size, 1, n, 0, empty(wbytes + 4096), wbytes, 0)
    assert np.array_equal(host(y2, x), got), "rebinding the workspace changed y"
    # Element counts that disagree with the shape are refused before anything is read.
    try:
        layer.forward(xd, x.size - 1, md, mask.size, y2, x.size, 1, n, 0, empty(wbytes), wbytes, 0)
        raise AssertionError("a short x was accepted")
    except ValueError as e:
        assert "x has" in str(e), e
    t = lambda a: torch.from_numpy(np.asarray(a, np.float64))
    want = reference.af3(t(x), t(mask), [t(w[k]) for k in AF3_WEIGHTS], "incoming", 1e-5).numpy()
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    print(f"hip device path: rel L2 {rel:.2e}")
    assert rel < 5e-3, rel
    # The same through the host path of the same weights: the same bits.
    host_y = trimul.triangle_multiplicative_update(x, "incoming", mask, **w)
    assert np.array_equal(host_y, got), "HipLayer and the host path differ"
    # The backward the ROCm build of PyTorch calls (HipLayer.backward on device tensors, the
    # workspace in caller memory): the weight gradients written to host entries (waiting), then
    # copied to device entries on the stream (waiting for nothing), against f64 autograd.
    dy = rng.standard_normal(x.shape).astype(np.float32)
    xr = torch.from_numpy(x.astype(np.float64)).requires_grad_()
    wr = [torch.from_numpy(w[k].astype(np.float64)).requires_grad_() for k in AF3_WEIGHTS]
    yr = reference.af3(xr, torch.from_numpy(mask.astype(np.float64)), wr, "incoming", 1e-5)
    want_grads = torch.autograd.grad(yr, [xr] + wr, torch.from_numpy(dy.astype(np.float64)))
    def assembled(parts):
        # The 16 entries' gradients put back into the twelve AF3 tensors.
        out = {}
        for (k, half_index), g in zip(order, parts):
            out.setdefault(k, [None, None])[0 if half_index is None else half_index] = g
        return [np.concatenate([p for p in out[k] if p is not None]).reshape(w[k].shape) for k in AF3_WEIGHTS]
    def sizes():
        return [w[k].size // (1 if half_index is None else 2) for k, half_index in order]
    bws = layer.backward_workspace_bytes(1, n, True, 0)
    dyd, dxd = dev(dy), empty(x.nbytes)
    host_grads = [np.zeros(size, np.float32) for size in sizes()]
    outs = [(g.ctypes.data, g.size, 0) for g in host_grads]
    layer.backward((xd, x.size), (md, mask.size), (dyd, dy.size), (dxd, x.size), 1, n, outs, (empty(bws), bws), 0)
    dev_grads = [empty(size * 4) for size in sizes()]
    dxd2 = empty(x.nbytes)
    outs = [(p, size, 0) for p, size in zip(dev_grads, sizes())]
    layer.backward((xd, x.size), (md, mask.size), (dyd, dy.size), (dxd2, x.size), 1, n, outs, (empty(bws), bws), 0,
                   0, True)
    assert np.array_equal(host(dxd2, x), host(dxd, x)), "the waiting and the device-entry backward differ (dx)"
    from_device = [host(p, np.zeros(size, np.float32)) for p, size in zip(dev_grads, sizes())]
    assert all(np.array_equal(a, b) for a, b in zip(from_device, host_grads)), "device gradients differ"
    rel = lambda got, ref: float(np.linalg.norm(got - ref.numpy()) / np.linalg.norm(ref.numpy()))
    worst = max([rel(host(dxd, x), want_grads[0])] + [rel(g, r) for g, r in zip(assembled(host_grads), want_grads[1:])])
    print(f"hip device backward: worst gradient rel L2 {worst:.2e}")
    assert worst < 2e-3, worst
    # The MFMA kernels were validated on first use (the host path's layer) and lost.
    v = _trimul.hip_validate(0, c, h)
    assert len(v) == 2 and all("not used" in line and "not faster" in line for line in v), v
    print("FAKE ROCM OK")
    """
)


def test_the_loaded_hip_runtime_is_the_one_used(fake_rocm, tmp_path):
    """On ROCm PyTorch the library opens the HIP runtime, rocBLAS and hipRTC the process already
    loaded (found in /proc/self/maps) instead of a second copy; a variable the user set wins."""
    lib = tmp_path / "libamdhip64.so.6"
    shutil.copy(fake_rocm, lib)
    script = textwrap.dedent(
        f"""
        import ctypes, os
        ctypes.CDLL({str(lib)!r})
        from trimul import _torch
        os.environ.pop("TRIMUL_HIP_LIBRARY", None)
        os.environ["TRIMUL_ROCBLAS_LIBRARY"] = "/user/choice.so"
        _torch._use_the_loaded_hip_runtime()
        assert os.environ["TRIMUL_HIP_LIBRARY"] == {str(lib)!r}, os.environ.get("TRIMUL_HIP_LIBRARY")
        assert os.environ["TRIMUL_ROCBLAS_LIBRARY"] == "/user/choice.so"
        print("OK")
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


def test_python_entry_points_through_the_hip_backend(fake_rocm):
    from conftest import SEED

    env = dict(os.environ)
    env.update(
        TRIMUL_BACKEND="hip",
        TRIMUL_HIP_LIBRARY=str(fake_rocm),
        TRIMUL_ROCBLAS_LIBRARY=str(fake_rocm),
        TRIMUL_HIPRTC_LIBRARY=str(fake_rocm.parent / "no-hiprtc-here.so"),
        TRIMUL_FAKE_ROCM_ARCH="gfx942:sramecc+:xnack-",
        # The MFMA kernel is validated on first use: verdicts in the test's directory, a small
        # timed shape (the emulation runs on the host's CPU).
        TRIMUL_CACHE_DIR=str(fake_rocm.parent / "verdicts"),
        TRIMUL_VALIDATION_N="16",
        # ... which the MFMA kernels lose here (the fake makes them slow), so this test knows its
        # path: the portable stages, where 16-bit device I/O is refused.
        TRIMUL_FAKE_ROCM_SLOW="output_projection:10000,input_projection:10000",
    )
    env.pop("TRIMUL_HIP_MFMA", None)
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT.replace("SEED", str(SEED))],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(r.stdout, r.stderr)
    assert r.returncode == 0 and "FAKE ROCM OK" in r.stdout
