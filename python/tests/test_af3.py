"""`trimul.triangle_multiplicative_update` against the f64 reference: both directions, masks,
biases, dtypes, Cauchy inputs, leading dims, on the CPU and (where present) CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import af3_weights, compare, f64_reference, pair, random_mask

from trimul import triangle_multiplicative_update as tmu

# Relative L2 bounds: f32 on the CPU is f32 throughout; the GPU keeps f16 intermediates (SPEC.md:
# near 5e-4); 16-bit outputs add their own rounding.
REL = {("cpu", torch.float32): 1e-5, ("cuda", torch.float32): 5e-3}
REL_16 = 1e-2


def bound(device, dtype):
    return REL.get((device.type, dtype), REL_16)


def check(y, want, device, dtype, what):
    bad, rel = compare(y, want)
    print(f"{what}: rel L2 {rel:.2e}, {bad} elements outside 2e-2")
    assert bad <= y.numel() // 100_000, f"{what}: {bad} elements outside tolerance (rel L2 {rel:.2e})"
    assert rel <= bound(device, dtype), f"{what}: rel L2 {rel:.2e} > {bound(device, dtype)}"


@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
@pytest.mark.parametrize("biases", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_af3_matches_f64_reference(device, direction, biases, masked):
    b, n, c, h = 2, 24, 32, 16
    w = af3_weights(c, h, biases, salt=1, device=device)
    x = pair((b, n, n, c), salt=2, device=device)
    mask = random_mask((b, n, n), salt=3, device=device) if masked else None
    y = tmu(x, direction, mask, **w)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    check(
        y,
        f64_reference(x, direction, mask, **w),
        device,
        torch.float32,
        f"{device} {direction} biases={biases} mask={masked}",
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
def test_dtypes_in_and_out(device, dtype, direction):
    """x in f32/bf16/f16 (weights in the same dtype) returns that dtype; f16 on normal inputs."""
    b, n, c, h = 1, 64, 128, 128
    w = af3_weights(c, h, True, salt=4, dtype=dtype, device=device)
    x = pair((b, n, n, c), salt=5, dtype=dtype, device=device)
    mask = random_mask((b, n, n), salt=6, device=device)
    y = tmu(x, direction, mask, **w)
    assert y.dtype == dtype
    check(y, f64_reference(x, direction, mask, **w), device, dtype, f"{device} {dtype} {direction}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cauchy_inputs(device, dtype):
    b, n, c, h = 2, 32, 64, 32
    w = af3_weights(c, h, True, salt=7, device=device)
    x = pair((b, n, n, c), salt=8, dist="cauchy", dtype=dtype, device=device)
    y = tmu(x, "outgoing", None, **w)
    check(y, f64_reference(x, "outgoing", None, **w), device, dtype, f"{device} cauchy {dtype}")


def test_mixed_weight_dtypes_and_bool_mask(device):
    """f32 x with bf16 weights, and a bool mask, as models hold them under autocast."""
    b, n, c, h = 1, 20, 32, 32
    w = af3_weights(c, h, True, salt=9, dtype=torch.bfloat16, device=device)
    w["norm_in_weight"] = w["norm_in_weight"].float()
    x = pair((b, n, n, c), salt=10, device=device)
    mask = random_mask((b, n, n), salt=11, device=device).bool()
    y = tmu(x, "incoming", mask, **w)
    check(y, f64_reference(x, "incoming", mask.float(), **w), device, torch.float32, f"{device} mixed")


@pytest.mark.parametrize("lead", [(), (3,), (2, 2)])
def test_leading_dims(device, lead):
    """x [..., N, N, C] with no batch dim, one, or two (folded into one, as cuEquivariance does)."""
    n, c, h = 12, 16, 16
    w = af3_weights(c, h, False, salt=12, device=device)
    x = pair(lead + (n, n, c), salt=13, device=device)
    mask = random_mask(lead + (n, n), salt=14, device=device)
    y = tmu(x, "outgoing", mask, **w)
    assert y.shape == x.shape
    x4 = x.reshape((-1, n, n, c))
    want = f64_reference(x4, "outgoing", mask.reshape((-1, n, n)), **w).reshape(x.shape)
    check(y, want, device, torch.float32, f"{device} lead {lead}")


def test_missing_norm_parameters_default_to_identity(device):
    c, h, n = 32, 16, 10
    w = af3_weights(c, h, False, salt=15, device=device)
    for k in ("norm_in_weight", "norm_in_bias", "norm_out_weight", "norm_out_bias"):
        w.pop(k)
    x = pair((1, n, n, c), salt=16, device=device)
    check(tmu(x, **w), f64_reference(x, **w), device, torch.float32, f"{device} default norms")


def test_eps_is_used(device):
    """eps reaches both LayerNorms: with x of variance ~1e-4, eps = 1e-2 changes y."""
    c, h, n = 32, 32, 16
    w = af3_weights(c, h, False, salt=17, device=device)
    x = pair((1, n, n, c), salt=18, device=device) * 1e-2
    y = tmu(x, eps=1e-2, **w)
    check(y, f64_reference(x, eps=1e-2, **w), device, torch.float32, f"{device} eps 1e-2")
    _, rel = compare(y, f64_reference(x, eps=1e-5, **w))
    assert rel > 1e-2


def test_non_contiguous_inputs_are_handled(device):
    c, h, n = 32, 16, 16
    w = af3_weights(c, h, True, salt=19, device=device)
    x = pair((1, n, n, c), salt=20, device=device).transpose(1, 2)  # a strided view
    w["p_in_weight"] = w["p_in_weight"].t().contiguous().t()  # a transposed-storage weight
    mask = random_mask((1, n, n), salt=21, device=device).transpose(1, 2)
    assert not x.is_contiguous() and not w["p_in_weight"].is_contiguous()
    y = tmu(x, "outgoing", mask, **w)
    check(y, f64_reference(x.contiguous(), "outgoing", mask.contiguous(), **w), device, torch.float32, "strided")


def test_inputs_are_not_modified(device):
    c, h, n = 16, 16, 8
    w = af3_weights(c, h, True, salt=22, device=device)
    x = pair((1, n, n, c), salt=23, device=device)
    mask = random_mask((1, n, n), salt=24, device=device)
    before = [t.clone() for t in [x, mask, *w.values()]]
    tmu(x, "outgoing", mask, **w)
    for a, b in zip(before, [x, mask, *w.values()]):
        assert torch.equal(a, b)


def test_precision_bfloat16_rounds_inputs_and_returns_bf16(device):
    c, h, n = 32, 32, 16
    w = af3_weights(c, h, True, salt=25, device=device)
    x = pair((1, n, n, c), salt=26, device=device)
    y = tmu(x, precision="bfloat16", **w)
    assert y.dtype == torch.bfloat16
    rounded = {k: v.to(torch.bfloat16) for k, v in w.items()}
    check(y, f64_reference(x.to(torch.bfloat16), **rounded), device, torch.bfloat16, "precision=bfloat16")


def test_precision_values(device):
    c, h, n = 16, 16, 6
    w = af3_weights(c, h, False, salt=27, device=device)
    x = pair((1, n, n, c), salt=28, device=device)
    for p in (None, "none", "DEFAULT", -1, 0):
        tmu(x, precision=p, **w)
    for p in (1, "ieee", 2, 3):
        if device.type == "cpu":
            check(tmu(x, precision=p, **w), f64_reference(x, **w), device, torch.float32, f"precision {p}")
        else:
            with pytest.raises(ValueError, match="CPU only"):
                tmu(x, precision=p, **w)
    with pytest.raises(ValueError, match="mxfp8"):
        tmu(x, precision="mxfp8", **w)
    with pytest.raises(ValueError, match="invalid precision"):
        tmu(x, precision="fp4", **w)
    with pytest.raises(ValueError):
        tmu(x, precision=7, **w)


def test_numpy_arrays_run_on_the_cpu():
    c, h, n = 24, 16, 10
    w = af3_weights(c, h, True, salt=29)
    x = pair((2, n, n, c), salt=30)
    mask = random_mask((2, n, n), salt=31)
    y = tmu(x.numpy(), "incoming", mask.numpy(), **{k: v.numpy() for k, v in w.items()})
    assert isinstance(y, np.ndarray) and y.dtype == np.float32 and y.shape == tuple(x.shape)
    check(
        torch.from_numpy(y),
        f64_reference(x, "incoming", mask, **w),
        torch.device("cpu"),
        torch.float32,
        "numpy",
    )
    y16 = tmu(x.numpy().astype(np.float16), "outgoing", None, **{k: v.numpy() for k, v in w.items()})
    assert y16.dtype == np.float16
    want = f64_reference(x.half(), "outgoing", None, **w)
    check(torch.from_numpy(y16), want, torch.device("cpu"), torch.float16, "numpy f16")


def test_16_bit_io_at_widths_the_fused_kernels_do_not_take(device):
    """bf16 x with H = 24 (not a multiple of 16): the GPU runs it in f32 I/O, converted around the
    call; the result is still bf16 and right."""
    b, n, c, h = 1, 16, 40, 24
    w = af3_weights(c, h, True, salt=32, dtype=torch.bfloat16, device=device)
    x = pair((b, n, n, c), salt=33, dtype=torch.bfloat16, device=device)
    y = tmu(x, "outgoing", None, **w)
    assert y.dtype == torch.bfloat16
    check(y, f64_reference(x, "outgoing", None, **w), device, torch.bfloat16, f"{device} bf16 H=24")
