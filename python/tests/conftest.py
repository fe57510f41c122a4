"""Shared helpers: devices to test on, fresh random inputs, the f64 reference."""

from __future__ import annotations

import os
import time

import pytest
import torch

import trimul
from trimul import reference
from trimul._args import AF3_WEIGHTS


def _seed() -> int:
    """A fresh seed per run, printed; TRIMUL_TEST_SEED replays one."""
    s = os.environ.get("TRIMUL_TEST_SEED")
    return int(s) if s else time.time_ns() % (1 << 31)


SEED = _seed()
print(f"trimul python tests: seed {SEED} (replay with TRIMUL_TEST_SEED={SEED})")


def pytest_terminal_summary(terminalreporter):
    """The seed again at the end, where `-q` and output capture keep it too (a failure on random
    inputs is replayed with it)."""
    terminalreporter.write_line(f"trimul python tests: seed {SEED} (replay with TRIMUL_TEST_SEED={SEED})")


def cuda_available() -> bool:
    return torch.cuda.is_available() and torch.version.hip is None


DEVICES = ["cpu"] + (["cuda"] if cuda_available() else [])
if not cuda_available():
    print("SKIPPED: no CUDA device: the CUDA cases of the Python suite do not run here")


@pytest.fixture(params=DEVICES)
def device(request):
    if request.param == "cuda":
        trimul._trimul.cuda_set_poison(0, True)
    return torch.device(request.param)


def generator(salt: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((SEED * 1000003 + salt) % (1 << 62))
    return g


def af3_weights(c: int, h: int, biases: bool, salt: int, dtype=torch.float32, device="cpu") -> dict:
    """SPEC.md's distributions: norms ~ N(0,1), projections ~ N(0,1)/sqrt(H), output ~ N(0,1)/sqrt(C)."""
    g = generator(salt)

    def n(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    sh, sc = h**-0.5, c**-0.5
    w = {
        "norm_in_weight": n(c),
        "norm_in_bias": n(c),
        "p_in_weight": n(2 * h, c, scale=sh),
        "g_in_weight": n(2 * h, c, scale=sh),
        "norm_out_weight": n(h),
        "norm_out_bias": n(h),
        "p_out_weight": n(c, h, scale=sc),
        "g_out_weight": n(c, c, scale=sh),
    }
    if biases:
        w.update(
            p_in_bias=n(2 * h, scale=sh),
            g_in_bias=n(2 * h, scale=sh),
            p_out_bias=n(c, scale=sh),
            g_out_bias=n(c, scale=sh),
        )
    return w


def pair(shape, salt: int, dist: str = "normal", dtype=torch.float32, device="cpu") -> torch.Tensor:
    g = generator(salt)
    if dist == "cauchy":
        x = torch.empty(*shape).cauchy_(0.0, 2.0, generator=g)
    else:
        x = torch.randn(*shape, generator=g)
    return x.to(dtype).to(device)


def random_mask(shape, salt: int, device="cpu") -> torch.Tensor:
    return torch.randint(0, 2, shape, generator=generator(salt)).to(torch.float32).to(device)


def f64_reference(x, direction="outgoing", mask=None, eps=1e-5, **w) -> torch.Tensor:
    """cuEquivariance's formula in float64 on the CPU, from the tensors as given (already rounded)."""
    d = lambda t: None if t is None else t.detach().to("cpu", torch.float64)  # noqa: E731
    return reference.af3(d(x), d(mask), [d(w.get(k)) for k in AF3_WEIGHTS], direction, eps)


def compare(got: torch.Tensor, want: torch.Tensor, tol: float = 2e-2):
    """GPU MODE's rule (every element within tol + tol*|ref|, no NaN where the reference has none)
    and the relative L2 error."""
    g = got.detach().to("cpu", torch.float64)
    w = want.detach().to("cpu", torch.float64)
    assert g.shape == w.shape, (g.shape, w.shape)
    bad = ~((g - w).abs() <= tol + tol * w.abs())
    bad |= torch.isnan(g) & ~torch.isnan(w)
    rel = ((g - w).norm() / w.norm()).item()
    return int(bad.sum()), rel


def sharded_gradients_report(direction: str, n: int, biases: bool, salt: int, device, dtype=torch.float32) -> dict:
    """One rank's part of the sharded call's gradient check, inside an initialised process group:
    every rank makes the same whole inputs, runs `trimul.distributed` on its rows with x and every
    weight requiring grad, backpropagates `g` (its rows of a fixed random cotangent), and sums the
    weights' gradients over the ranks. Returns the relative L2 error of y's rows, dx's rows and
    the worst weight gradient against f64 autograd of the formula on the whole tensor (of the
    inputs as rounded to `dtype`, which x, the weights and the cotangent are in)."""
    import torch.distributed as dist

    from trimul import distributed as tmd

    c, h = 24, 16
    x = pair((1, n, n, c), salt, dtype=dtype, device=device)
    mask = random_mask((1, n, n), salt + 1, device=device)
    w = af3_weights(c, h, biases, salt + 2, dtype=dtype, device=device)
    g = pair((1, n, n, c), salt + 3, dtype=dtype, device=device)
    r0, r1 = tmd.rows(n)
    xs = x[:, r0:r1].clone().requires_grad_()
    ws = {k: v.clone().requires_grad_() for k, v in w.items() if v is not None}
    y = tmd.triangle_multiplicative_update(xs, direction, mask=mask[:, r0:r1], **ws)
    # A graph of the gradients is refused (on every rank, before any exchange of its own).
    try:
        torch.autograd.grad(y, xs, g[:, r0:r1], create_graph=True, retain_graph=True)
        twice = "gave a graph of the gradients"
    except NotImplementedError as e:
        twice = str(e)
    y.backward(g[:, r0:r1])
    names = sorted(ws)
    summed = torch.cat([ws[k].grad.to(torch.float32).reshape(-1) for k in names])
    dist.all_reduce(summed)

    xd = x.detach().to("cpu", torch.float64).requires_grad_()
    wd = {k: v.detach().to("cpu", torch.float64).requires_grad_() for k, v in ws.items()}
    md = mask.to("cpu", torch.float64)
    want = reference.af3(xd, md, [wd.get(k) for k in AF3_WEIGHTS], direction, 1e-5)
    grads = torch.autograd.grad(want, [xd] + [wd[k] for k in names], g.to("cpu", torch.float64))
    rel = lambda got, ref: ((got.detach().cpu().double() - ref).norm() / ref.norm()).item()  # noqa: E731
    per_weight, at = {}, 0
    for k, gk in zip(names, grads[1:]):
        per_weight[k] = rel(summed[at : at + gk.numel()].reshape(gk.shape), gk)
        at += gk.numel()
    return {
        "rows": [r0, r1],
        "y": rel(y, want[:, r0:r1].detach()),
        "dx": rel(xs.grad, grads[0][:, r0:r1]),
        "weights": per_weight,
        "twice": twice,
    }
