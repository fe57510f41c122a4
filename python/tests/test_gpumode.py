"""`trimul.gpumode.custom_kernel` on GPU MODE's data: the 18 test cases (on CUDA; the small ones
on the CPU) against the f64 reference of GPU MODE's module, weights prepared inside every call."""

from __future__ import annotations

import pytest
import torch
from conftest import compare, generator

from trimul import gpumode, reference

# (N, B, C, masked, dist): SPEC.md's GPU MODE test suite; hidden H = 128.
CASES = [
    (32, 1, 128, False, "normal"),
    (32, 1, 128, True, "normal"),
    (64, 2, 256, False, "normal"),
    (64, 2, 256, True, "normal"),
    (128, 1, 768, False, "normal"),
    (256, 1, 128, False, "normal"),
    (256, 1, 128, True, "normal"),
    (768, 2, 128, False, "normal"),
    (1024, 1, 384, True, "normal"),
    (1024, 1, 768, False, "normal"),
    (1024, 1, 768, True, "normal"),
    (32, 1, 128, False, "cauchy"),
    (64, 2, 256, False, "cauchy"),
    (128, 1, 768, False, "cauchy"),
    (256, 1, 128, False, "cauchy"),
    (768, 2, 128, False, "cauchy"),
    (1024, 1, 384, True, "cauchy"),
    (1024, 1, 768, True, "cauchy"),
]


def data(n, b, c, masked, dist, device, salt):
    """GPU MODE's generator: input, a mask (ones when unmasked, as its harness passes), weights."""
    g = generator(salt)
    h = 128
    x = torch.empty(b, n, n, c).cauchy_(0, 2, generator=g) if dist == "cauchy" else torch.randn(b, n, n, c, generator=g)
    mask = torch.randint(0, 2, (b, n, n), generator=g).float() if masked else torch.ones(b, n, n)
    w = gpumode.random_weights(c, h, g)
    to = lambda t: t.to(device)  # noqa: E731
    return to(x), to(mask), {k: to(v) for k, v in w.items()}, {"dim": c, "hidden_dim": h}


def small(case):
    n, b, c, *_ = case
    return b * n * n * c <= 2 * 64 * 64 * 256


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"N{c[0]}-B{c[1]}-C{c[2]}-{'mask' if c[3] else 'nomask'}-{c[4]}")
def test_gpumode_cases(device, case):
    if device.type == "cpu" and not small(case):
        pytest.skip("large GPU MODE case: run on CUDA (the CPU backend's own tests cover these shapes in Rust)")
    x, mask, w, config = data(*case, device, salt=CASES.index(case))
    y = gpumode.custom_kernel((x, mask, w, config))
    assert y.shape == x.shape and y.dtype == torch.float32
    if x.numel() > 64 * 1024 * 1024:
        # The f64 reference of the largest cases: on the GPU, then compared there.
        want = reference.gpumode(x.double(), mask.double(), {k: v.double() for k, v in w.items()})
    else:
        want = reference.gpumode(x.cpu().double(), mask.cpu().double(), {k: v.cpu().double() for k, v in w.items()})
    bad, rel = compare(y, want.cpu())
    print(f"{case} on {device}: rel L2 {rel:.2e}, {bad} outside")
    assert bad == 0, f"{case}: {bad} elements outside GPU MODE's tolerance (rel L2 {rel:.2e})"
    assert rel <= (1e-5 if device.type == "cpu" else 5e-3)


def test_new_weights_every_call_are_used(device):
    x, mask, w1, config = data(32, 1, 128, True, "normal", device, salt=1)
    _, _, w2, _ = data(32, 1, 128, True, "normal", device, salt=2)
    y1 = gpumode.custom_kernel((x, mask, w1, config))
    y2 = gpumode.custom_kernel((x, mask, w2, config))
    for y, w in ((y1, w1), (y2, w2)):
        want = reference.gpumode(x.cpu().double(), mask.cpu().double(), {k: v.cpu().double() for k, v in w.items()})
        assert compare(y, want)[0] == 0


def test_gpumode_bad_data(device):
    x, mask, w, config = data(16, 1, 128, False, "normal", device, salt=3)
    with pytest.raises(ValueError, match="to_out.weight"):
        gpumode.custom_kernel((x, mask, {k: v for k, v in w.items() if k != "to_out.weight"}, config))
    with pytest.raises(ValueError, match="left_gate.weight.*shape"):
        gpumode.custom_kernel((x, mask, {**w, "left_gate.weight": w["left_gate.weight"][:, :5]}, config))
    with pytest.raises(ValueError, match="mask"):
        gpumode.custom_kernel((x, mask[:, :3], w, config))
    with pytest.raises(ValueError, match="config"):
        gpumode.custom_kernel((x, mask, w, {"dim": 64, "hidden_dim": 128}))
