"""trimul.distributed inside PyTorch on two GPUs against trimul's one-GPU call on the whole tensor
(rank 0 alone, the other rank waiting): af3 bf16, B = 1, C = H = 128, half the positions masked; device events on
the current stream around each call, median of 10 after 3 warm-ups; the two-GPU time is the
longer rank's. Run with two processes:

    python -m torch.distributed.run --standalone --nproc-per-node=2 scripts/probes/python_distributed_bench.py

With ``--grad``, each call is a forward and a backward of ``sum(y * g)`` with x and every weight
requiring grad (the sharded call's backward is the PyTorch recompute; the one-GPU call's the
native backward), at N = 512, 1024 and 2048. Its numbers: `docs/perf/NOTES.md`, thirty-second
session.
"""

import functools
import os
import statistics
import sys

import torch
import torch.distributed as dist
import trimul
from trimul import distributed as tmd
from trimul.bench import af3_weights

C = H = 128


def timed(call, reps: int = 10, warmup: int = 3) -> float:
    with torch.no_grad():
        for _ in range(warmup):
            call()
        ms = []
        for _ in range(reps):
            start, stop = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            start.record()
            call()
            stop.record()
            stop.synchronize()
            ms.append(start.elapsed_time(stop))
    return statistics.median(ms)


def pair(rows: int, n: int, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, rows, n, C, generator=g).to(device, torch.bfloat16)
    # Half the positions masked, as `trimul bench` masks (its mask's zeros change the GEMMs' power
    # draw, and so the clocks under the power cap).
    mask = (torch.rand(1, rows, n, generator=g) > 0.5).float().to(device)
    return x, mask


def with_grad(call, x, w: dict):
    """`call` as one forward and backward of sum(y * g), x and every weight requiring grad."""
    xs = x.detach().clone().requires_grad_()
    ws = {k: v.detach().clone().requires_grad_() for k, v in w.items()}
    g = torch.ones_like(x)

    def step():
        with torch.enable_grad():
            y = call(xs, **ws)
            torch.autograd.grad(y, [xs, *ws.values()], g)

    return step


def main() -> None:
    grad = "--grad" in sys.argv[1:]
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    me = dist.get_rank()
    w = af3_weights(C, H, torch.bfloat16, device, torch.Generator().manual_seed(5))
    for direction in ("outgoing", "incoming"):
        for n in (512, 1024, 2048) if grad else (1024, 2048, 4096):
            r0, r1 = tmd.rows(n)
            x, mask = pair(r1 - r0, n, device, n + me)
            if grad:
                sharded = functools.partial(
                    tmd.triangle_multiplicative_update, direction=direction, mask=mask
                )
                two = timed(with_grad(sharded, x, w))
            else:
                two = timed(
                    functools.partial(
                        tmd.triangle_multiplicative_update, x, direction, mask, **w
                    )
                )
            per_rank = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, two)
            if me == 0:
                xf, mf = pair(n, n, device, n)
                whole = functools.partial(
                    trimul.triangle_multiplicative_update, direction=direction, mask=mf
                )
                one = timed(
                    with_grad(whole, xf, w)
                    if grad
                    else functools.partial(whole, xf, **w)
                )
                del xf, mf
                ranks = "/".join(f"{t:.3f}" for t in per_rank)
                print(
                    f"{direction} N={n}: 2 GPUs {max(per_rank):.3f} ms (ranks {ranks}), 1 GPU {one:.3f} ms, "
                    f"ratio {max(per_rank) / one:.3f}",
                    flush=True,
                )
            dist.barrier()
            tmd.release()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
