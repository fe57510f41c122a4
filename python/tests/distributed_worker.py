"""One rank of test_distributed's two-GPU run, started by `torch.distributed.run`: each rank makes
the same whole inputs (the seed comes from TRIMUL_TEST_SEED), runs the sharded call on its rows,
and writes what it measured to OUTDIR/rank<r>.json for the test to judge:

- per case, the sharded rows against the f64 reference and against trimul's one-GPU call on the
  whole tensor (GPU MODE's element rule and the relative L2 error);
- that bad calls (wrong rows, gradients) raise on every rank before any exchange, and that the
  group's calls still work after them;
- that `wait`, `release` and a call after the release (a new communicator) work.

Usage: python -m torch.distributed.run --standalone --nproc-per-node=2 distributed_worker.py OUTDIR
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import af3_weights, compare, f64_reference, pair, random_mask  # noqa: E402

import trimul  # noqa: E402
from trimul import distributed as tmd  # noqa: E402

# (name, direction, leading dims, N, C, H, dtype, masked, biases, inputs)
CASES = [
    ("outgoing f32 masked", "outgoing", (1,), 64, 128, 128, torch.float32, True, False, "normal"),
    ("incoming bf16 biases", "incoming", (2,), 48, 128, 64, torch.bfloat16, False, True, "normal"),
    ("outgoing f16 odd N", "outgoing", (), 37, 64, 32, torch.float16, True, True, "normal"),
    ("incoming bf16 cauchy masked", "incoming", (1, 2), 40, 128, 128, torch.bfloat16, True, False, "cauchy"),
]


def run_case(case, salt: int, device) -> dict:
    name, direction, lead, n, c, h, dtype, masked, biases, inputs = case
    x = pair((*lead, n, n, c), salt, inputs, dtype=dtype, device=device)
    mask = random_mask((*lead, n, n), salt + 1, device=device) if masked else None
    w = af3_weights(c, h, biases, salt + 2, dtype=dtype, device=device)
    r0, r1 = tmd.rows(n)
    rows = (..., slice(r0, r1), slice(None), slice(None))
    torch.cuda.synchronize()
    # On PyTorch's default stream, or (odd salts' hundreds) a side stream: the call must run on
    # the current one. The rows are written there after ~50 ms of sleep and y is copied to the
    # host there at once, so a forward on any other stream would read x before it exists or
    # hand back y before it is written.
    side = torch.cuda.Stream() if (salt // 100) % 2 else None
    with torch.no_grad(), torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        x_rows = x[rows] * 1
        got = tmd.triangle_multiplicative_update(
            x_rows, direction, mask=None if mask is None else mask[rows[:-1]], **w
        ).cpu()
        one = trimul.triangle_multiplicative_update(x, direction, mask=mask, **w)[rows]
    torch.cuda.synchronize()
    want = f64_reference(x, direction, mask, **w)[rows]
    bad, rel = compare(got, want)
    bad_one, rel_one = compare(one, want)
    return {
        "name": name,
        "shape": list(got.shape),
        "dtype": str(got.dtype),
        "bad": bad,
        "rel": rel,
        "bad_one_gpu": bad_one,
        "rel_one_gpu": rel_one,
    }


def main() -> None:
    out = sys.argv[1]
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    me = dist.get_rank()
    tmd._poison = True
    report: dict = {"rank": me, "rows_64": list(tmd.rows(64)), "cases": [], "errors": {}, "failures": []}
    try:
        for i, case in enumerate(CASES):
            report["cases"].append(run_case(case, 100 * i, device))
        # Bad calls raise on every rank alike, before any exchange.
        n, c, h = 32, 64, 32
        x = pair((1, n, n, c), 7, device=device)
        w = af3_weights(c, h, False, 8, device=device)
        r0, r1 = tmd.rows(n)
        for what, call in (
            ("wrong rows", lambda: tmd.triangle_multiplicative_update(x[:, : r1 - r0 + 1], **w)),
            ("gradients", lambda: tmd.triangle_multiplicative_update(x[:, r0:r1].clone().requires_grad_(), **w)),
            ("precision", lambda: tmd.triangle_multiplicative_update(x[:, r0:r1], precision="ieee", **w)),
        ):
            try:
                call()
                report["errors"][what] = None
            except Exception as e:  # noqa: BLE001 - recorded for the test to judge
                report["errors"][what] = f"{type(e).__name__}: {e}"
        # The group still works, waits with a deadline, releases, and joins anew.
        report["cases"].append(run_case(CASES[0], 900, device))
        tmd.wait(60.0)
        tmd.release()
        report["cases"].append(run_case(CASES[1], 901, device))
        tmd.release()
    except Exception:  # noqa: BLE001 - the test prints it
        report["failures"].append(traceback.format_exc())
    with open(os.path.join(out, f"rank{me}.json"), "w") as f:
        json.dump(report, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
