"""Timing inside PyTorch: ``python -m trimul.bench``.

Times, in one process on one GPU, with CUDA events around each call (median of the timed calls
after warm-up):

- the op (``trimul.triangle_multiplicative_update``, weights cached) against PyTorch's own
  formula (``trimul.reference.af3`` in eager mode) and cuEquivariance's function where it is
  installed, af3 form, B = 1, C = H = 128, for each ``--sizes`` N: one call at a time on an idle
  GPU (what ``trimul bench`` times), back to back, and its device time alone (each call enqueued
  while a spin kernel keeps the stream busy, what ``trimul bench --device-time`` times);
- ``trimul.gpumode.custom_kernel`` on GPU MODE's 7 benchmark shapes with new weights handed over
  in every call, as its harness does (``--gpumode``);
- the host time per call at N = 256 against a no-op ``torch.library.custom_op`` taking the same
  arguments, bare and with the same registrations as the op (a fake and an autograd formula,
  whose layer PyTorch runs in every call) (``--host-time``).

Results print as a table and, with ``--json FILE``, are written as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from . import gpumode, reference
from . import triangle_multiplicative_update as tmu
from ._args import AF3_WEIGHTS

GPUMODE_SHAPES = [  # (N, B, C, masked, dist), SPEC.md's benchmark
    (256, 2, 128, False, "normal"),
    (768, 1, 128, False, "cauchy"),
    (256, 2, 384, True, "normal"),
    (512, 1, 128, False, "normal"),
    (1024, 1, 128, False, "cauchy"),
    (768, 1, 384, True, "normal"),
    (1024, 1, 384, False, "normal"),
]


def timed(fn, repeats: int, warmup: int) -> list:
    """Milliseconds of each timed call, CUDA events around each."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def timed_batch(fn, calls: int, rounds: int = 5, warmup: int = 3) -> list:
    """Milliseconds per call over `calls` back-to-back calls between two events (the GPU stays
    busy, so host time per call hides under device time when it is shorter), `rounds` times."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / calls)
    return out


def timed_held(fn, repeats: int, warmup: int, cycles: int = 2_000_000) -> list:
    """Milliseconds of each timed call's device work, the host's time to enqueue it hidden (as
    ``trimul bench --device-time`` holds its stream): a spin kernel (``torch.cuda._sleep``) keeps
    the stream busy while the call is enqueued, then CUDA events around the call see its work
    back to back. A sample whose start event had already passed when the call returned (the spin
    was shorter than the host's work) is taken again with a spin twice as long; after 8 such
    misses in a row the call is taken to wait for its own stream, which cannot be timed so."""
    for _ in range(warmup):
        fn()
    out = []
    misses = 0
    while len(out) < repeats:
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        a.record()
        fn()
        b.record()
        # Queried after b is enqueued: if the spin were still running at that point, everything
        # between the two events was enqueued before the GPU reached the first.
        hidden = not a.query()
        b.synchronize()
        if hidden:
            out.append(a.elapsed_time(b))
            misses = 0
        else:
            misses += 1
            if misses == 8:
                raise RuntimeError("the timed call waits for its own stream: its device time cannot be taken")
            cycles *= 2
    return out


def af3_weights(c: int, h: int, dtype, device, g) -> dict:
    def n(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    return {
        "norm_in_weight": n(c),
        "norm_in_bias": n(c),
        "p_in_weight": n(2 * h, c, scale=h**-0.5),
        "g_in_weight": n(2 * h, c, scale=h**-0.5),
        "norm_out_weight": n(h),
        "norm_out_bias": n(h),
        "p_out_weight": n(c, h, scale=c**-0.5),
        "g_out_weight": n(c, c, scale=h**-0.5),
    }


def bench_af3_one(n, dtype, masked, repeats, warmup, peers, cueq, g) -> dict:
    c = h = 128
    w = af3_weights(c, h, dtype, "cuda", g)
    x = torch.randn(1, n, n, c, generator=g).to(dtype).cuda()
    mask = torch.randint(0, 2, (1, n, n), generator=g).to(dtype).cuda() if masked else None
    row = {"n": n, "dtype": str(dtype).replace("torch.", ""), "masked": masked}
    # The device time first, right after the warm-up as `trimul bench` takes it: after the back-to-
    # back calls the chip runs warmer, and at N >= 1024 its clocks drop by a few percent.
    row["trimul_device_ms"] = statistics.median(timed_held(lambda: tmu(x, "outgoing", mask, **w), repeats, warmup))
    row["trimul_ms"] = statistics.median(timed(lambda: tmu(x, "outgoing", mask, **w), repeats, 1))
    row["trimul_back_to_back_ms"] = statistics.median(timed_batch(lambda: tmu(x, "outgoing", mask, **w), repeats))
    if "torch" in peers and n <= 2048:
        args = [w.get(k) for k in AF3_WEIGHTS]
        row["pytorch_ms"] = statistics.median(
            timed(lambda: reference.af3(x, mask, args, "outgoing", 1e-5), max(3, repeats // 3), 1)
        )
    if cueq is not None:
        try:

            def peer():
                return cueq(x, "outgoing", mask, **w)

            row["cueq_device_ms"] = statistics.median(timed_held(peer, repeats, warmup))
            row["cueq_ms"] = statistics.median(timed(peer, repeats, 1))
        except Exception as e:  # noqa: BLE001 - a peer failing is reported, not fatal
            row["cueq_error"] = str(e)[:200]
    return row


def bench_af3(sizes, dtype, masked, repeats, warmup, peers, g) -> list:
    rows = []
    cueq = None
    if "cueq" in peers:
        try:
            from cuequivariance_torch import triangle_multiplicative_update as cueq
        except ImportError as e:
            print(f"cuEquivariance not importable ({e}); timing trimul and PyTorch only")
        if cueq is not None and getattr(cueq, "__module__", "").startswith("trimul"):
            # trimul.patch_cuequivariance() ran in this process: the name is trimul's own.
            print("cuEquivariance's function is patched to trimul's here; timing trimul and PyTorch only")
            cueq = None
    for n in sizes:
        row = bench_af3_one(n, dtype, masked, repeats, warmup, peers, cueq, g)
        rows.append(row)
        print(
            f"N={n:5d} {row['dtype']}: trimul {row['trimul_ms']:.3f} ms"
            + f" ({row['trimul_back_to_back_ms']:.3f} back to back, {row['trimul_device_ms']:.3f} device time)"
            + (f", PyTorch {row['pytorch_ms']:.3f} ms" if "pytorch_ms" in row else "")
            + (f", cuEquivariance {row['cueq_ms']:.3f} ms" if "cueq_ms" in row else "")
            + (f" ({row['cueq_device_ms']:.3f} device time)" if "cueq_device_ms" in row else "")
        )
        torch.cuda.empty_cache()
    return rows


def gpumode_data(n, b, c, masked, dist, g):
    h = 128
    x = torch.empty(b, n, n, c).cauchy_(0, 2, generator=g) if dist == "cauchy" else torch.randn(b, n, n, c, generator=g)
    mask = torch.randint(0, 2, (b, n, n), generator=g).float() if masked else torch.ones(b, n, n)
    w = gpumode.random_weights(c, h, g)
    return x.cuda(), mask.cuda(), {k: v.cuda() for k, v in w.items()}, {"dim": c, "hidden_dim": h}


def bench_gpumode(repeats, warmup, g) -> dict:
    """custom_kernel on the 7 shapes; each call gets weights it has not seen (two sets alternate,
    so no call can reuse the previous one's preparation)."""
    rows = []
    for shape in GPUMODE_SHAPES:
        x, mask, w1, config = gpumode_data(*shape, g)
        w2 = {k: v.clone().mul_(1.0001) for k, v in w1.items()}
        sets = [w1, w2]
        i = [0]

        def call(x=x, mask=mask, config=config, sets=sets, i=i):
            i[0] += 1
            return gpumode.custom_kernel((x, mask, sets[i[0] % 2], config))

        ms = statistics.median(timed(call, repeats, warmup))
        rows.append({"shape": list(shape), "ms": ms})
        print(f"custom_kernel {shape}: {ms:.3f} ms")
        del x, mask, w1, w2, sets
    geomean = math.exp(sum(math.log(r["ms"]) for r in rows) / len(rows))
    print(f"custom_kernel geomean over the 7 GPU MODE shapes: {geomean:.3f} ms")
    return {"shapes": rows, "geomean_ms": geomean}


def _noop_impl(x, *rest):
    """A no-op taking trimul's op's arguments; registered twice below, bare and with the op's
    registrations."""
    return torch.empty_like(x)


# The op's own schema without its name: the no-ops take the same arguments by the same names.
_OP_SCHEMA = "(" + str(torch.ops.trimul.triangle_multiplicative_update.default._schema).partition("(")[2]
_noop = torch.library.custom_op("trimul_bench::noop", _noop_impl, mutates_args=(), schema=_OP_SCHEMA)
_noop_registered = torch.library.custom_op(
    "trimul_bench::noop_registered", _noop_impl, mutates_args=(), schema=_OP_SCHEMA
)


@_noop_registered.register_fake
def _(x, *rest):
    return torch.empty_like(x)


def _noop_backward(ctx, grad):
    return (grad,) + (None,) * 15


def _noop_setup_context(ctx, inputs, output):
    pass


# The registrations trimul's op has (register_fake and register_autograd): what PyTorch costs any
# op of this signature that supports autograd, so that the difference is the op's own.
_noop_registered.register_autograd(_noop_backward, setup_context=_noop_setup_context)


def bench_host_time(dtype, g, calls: int = 50, rounds: int = 200) -> dict:
    """Host microseconds per call at N = 256: bursts of `calls` calls after a synchronize (short
    enough that no launch queue fills). Each round times one burst of every variant in turn, so
    a drift of the host's speed (shared machines, clock changes) hits all of them alike; reported
    are each variant's median over the rounds and the median of its per-round difference from
    the no-op custom op."""
    n, c, h = 256, 128, 128
    w = af3_weights(c, h, dtype, "cuda", g)
    x = torch.randn(1, n, n, c, generator=g).to(dtype).cuda()
    args = [w.get(k) for k in AF3_WEIGHTS]

    op = torch.ops.trimul.triangle_multiplicative_update.default
    for _ in range(20):
        op(x, None, *args, "outgoing", 1e-5)
        _noop(x, None, *args, "outgoing", 1e-5)
        _noop_registered(x, None, *args, "outgoing", 1e-5)
        tmu(x, "outgoing", None, **w)
    # The library call alone, on buffers allocated once (what the op adds around it is PyTorch's).
    from . import _torch

    entry = next(iter(_torch._cache.entries.values()))
    nbytes = entry.layer.workspace_bytes(1, n, False, _torch._DTYPE_CODE[dtype])
    ws = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    stream = torch.cuda.current_stream().cuda_stream
    code = _torch._DTYPE_CODE[dtype]

    def raw():
        entry.layer.forward(
            x.data_ptr(), x.numel(), 0, 0, y.data_ptr(), y.numel(), 1, n, code, ws.data_ptr(), nbytes, stream
        )

    variants = {
        "noop_custom_op": lambda: _noop(x, None, *args, "outgoing", 1e-5),
        "noop_registered_op": lambda: _noop_registered(x, None, *args, "outgoing", 1e-5),
        "trimul_op": lambda: op(x, None, *args, "outgoing", 1e-5),
        "trimul_function": lambda: tmu(x, "outgoing", None, **w),
        # precision="default" is the same computation without the short path for prepared weights.
        "trimul_function_full_checks": lambda: tmu(x, "outgoing", None, **w, precision="default"),
        "library_call": raw,
        "two_empties": lambda: (torch.empty(nbytes, dtype=torch.uint8, device="cuda"), torch.empty_like(x)),
    }
    samples: dict = {k: [] for k in variants}
    for _ in range(rounds):
        for k, fn in variants.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[k].append((time.perf_counter() - t0) / calls * 1e6)
            torch.cuda.synchronize()
    out = {f"{k}_us": statistics.median(v) for k, v in samples.items()}
    base = samples["noop_custom_op"]
    for k in ("trimul_op", "trimul_function", "trimul_function_full_checks"):
        out[f"{k}_minus_noop_us"] = statistics.median(a - b for a, b in zip(samples[k], base))
    # The registered op against a no-op with the same registrations.
    out["trimul_op_minus_noop_registered_us"] = statistics.median(
        a - b for a, b in zip(samples["trimul_op"], samples["noop_registered_op"])
    )
    print("host time per call at N=256: " + ", ".join(f"{k[:-3]} {v:.1f} us" for k, v in out.items()))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m trimul.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="512,1024,2048", help="N values for the af3 timing (comma-separated)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"])
    p.add_argument("--mask", action="store_true", help="pass a random mask")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peers", default="torch,cueq", help="peers to time beside trimul: torch, cueq (or 'none')")
    p.add_argument("--gpumode", action="store_true", help="also time custom_kernel on GPU MODE's 7 shapes")
    p.add_argument("--host-time", action="store_true", help="also measure host time per call at N = 256")
    p.add_argument("--no-af3", action="store_true", help="skip the af3 timing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results to this file")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m trimul.bench: no CUDA device")
        return 2
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]
    g = torch.Generator().manual_seed(a.seed)
    import trimul

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "trimul": trimul.__version__}
    result["timing"] = (
        f"CUDA events around each call, median of {a.repeats} after {a.warmup} warm-up calls; back to back: "
        f"{a.repeats} calls between two events; device time: each call enqueued behind a spin kernel"
    )
    if not a.no_af3:
        sizes = [int(s) for s in a.sizes.split(",") if s]
        result["af3"] = bench_af3(sizes, dtype, a.mask, a.repeats, a.warmup, a.peers.split(","), g)
    if a.gpumode:
        result["gpumode"] = bench_gpumode(a.repeats, a.warmup, g)
    if a.host_time:
        result["host_time"] = bench_host_time(dtype, g)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
