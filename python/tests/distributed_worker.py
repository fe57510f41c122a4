"""One rank of test_distributed's two-GPU run, started by `torch.distributed.run`: each rank makes
the same whole inputs (the seed comes from TRIMUL_TEST_SEED), runs the sharded call on its rows,
and writes what it measured to OUTDIR/rank<r>.json for the test to judge:

- per case, the sharded rows against the f64 reference and against trimul's one-GPU call on the
  whole tensor (GPU MODE's element rule and the relative L2 error);
- that bad calls (wrong rows, f32 precision) raise on every rank before any exchange, and that
  the group's calls still work after them;
- gradients (x and every weight) against f64 autograd of the whole tensor;
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
from conftest import af3_weights, compare, f64_reference, pair, random_mask, sharded_gradients_report  # noqa: E402

import trimul  # noqa: E402
from trimul import _trimul  # noqa: E402
from trimul import distributed as tmd  # noqa: E402

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# (name, direction, leading dims, N, C, H, dtype, mask dtype or None, biases, inputs, precision)
CASES = [
    ("outgoing f32 masked", "outgoing", (1,), 64, 128, 128, F32, F32, False, "normal", None),
    ("incoming bf16 biases", "incoming", (2,), 48, 128, 64, BF16, None, True, "normal", None),
    ("outgoing f16 odd N bool mask", "outgoing", (), 37, 64, 32, F16, torch.bool, True, "normal", None),
    ("incoming bf16 cauchy masked", "incoming", (1, 2), 40, 128, 128, BF16, F32, False, "cauchy", None),
    ("incoming f32 as bfloat16", "incoming", (1,), 32, 64, 32, F32, F32, True, "normal", "bfloat16"),
]


def run_case(case, salt: int, device) -> dict:
    name, direction, lead, n, c, h, dtype, mask_dtype, biases, inputs, precision = case
    x = pair((*lead, n, n, c), salt, inputs, dtype=dtype, device=device)
    mask = None if mask_dtype is None else random_mask((*lead, n, n), salt + 1, device=device).to(mask_dtype)
    w = af3_weights(c, h, biases, salt + 2, dtype=dtype, device=device)
    r0, r1 = tmd.rows(n)
    rows = (..., slice(r0, r1), slice(None), slice(None))
    m_rows = None if mask is None else mask[rows[:-1]]
    # On PyTorch's default stream, or (odd salts' hundreds) a side stream: the call must run on
    # the current one. A first call (on other values) plans the workspace, whose host wait would
    # hide a wrong stream; then the rows are written on the stream after ~50 ms of sleep and y
    # is copied to the host there at once, so a forward on any other stream would read x before
    # it is written (the first call's values lie there) or hand back y before it is written.
    side = torch.cuda.Stream() if (salt // 100) % 2 else None
    with torch.no_grad(), torch.cuda.stream(side):
        tmd.triangle_multiplicative_update(-x[rows], direction, mask=m_rows, precision=precision, **w)
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)
        x_rows = x[rows] * 1
        got = tmd.triangle_multiplicative_update(x_rows, direction, mask=m_rows, precision=precision, **w).cpu()
        one = trimul.triangle_multiplicative_update(x, direction, mask=mask, precision=precision, **w)[rows]
    torch.cuda.synchronize()
    if precision == "bfloat16":
        x = x.to(torch.bfloat16)
        w = {k: v.to(torch.bfloat16) for k, v in w.items()}
    mask = None if mask is None else mask.float()
    return verdict(name, got, one, f64_reference(x, direction, mask, **w)[rows])


def verdict(name: str, got, one, want) -> dict:
    """The sharded rows `got` and the one-GPU call's `one` against the f64 reference `want`."""
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


def back_to_back(device) -> dict:
    """Outgoing then incoming (two workspaces, two layers) on the default stream with no wait
    between them or before the first reads their results."""
    n, c, h = 48, 128, 128
    x = pair((1, n, n, c), 31, dtype=torch.bfloat16, device=device)
    w_out = af3_weights(c, h, True, 32, dtype=torch.bfloat16, device=device)
    w_in = af3_weights(c, h, False, 33, dtype=torch.bfloat16, device=device)
    r0, r1 = tmd.rows(n)
    with torch.no_grad():
        torch.cuda._sleep(50_000_000)
        a = tmd.triangle_multiplicative_update(x[:, r0:r1] * 1, "outgoing", **w_out)
        b = tmd.triangle_multiplicative_update(a * 1, "incoming", **w_in)
        got = b.cpu()
        # The same two steps on one GPU, rank by rank: the incoming update of the outgoing one's
        # rows needs every row, so the whole first update is gathered.
        whole_a = tmd._gather_rows(dist, None, a, _trimul.row_split(n, dist.get_world_size()))
        one = trimul.triangle_multiplicative_update(whole_a, "incoming", **w_in)[:, r0:r1]
    torch.cuda.synchronize()
    want = f64_reference(whole_a, "incoming", None, **w_in)[:, r0:r1]
    return verdict("outgoing then incoming, no wait", got, one, want)


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
            ("precision", lambda: tmd.triangle_multiplicative_update(x[:, r0:r1], precision="ieee", **w)),
        ):
            try:
                call()
                report["errors"][what] = None
            except Exception as e:  # noqa: BLE001 - recorded for the test to judge
                report["errors"][what] = f"{type(e).__name__}: {e}"
        # Gradients: trimul's sharded forward, the backward recomputed through PyTorch with the
        # exchanges through the group (NCCL).
        report["gradients"] = {
            f"{direction} {str(dtype)[6:]}": sharded_gradients_report(direction, 33, True, 50 + k, device, dtype)
            for k, (direction, dtype) in enumerate(
                (("outgoing", torch.float32), ("incoming", torch.float32), ("incoming", torch.bfloat16))
            )
        }
        # The group still works, waits with a deadline, releases, and joins anew.
        report["cases"].append(run_case(CASES[0], 900, device))
        report["cases"].append(back_to_back(device))
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
