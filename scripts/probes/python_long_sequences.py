"""`python3 scripts/probes/python_long_sequences.py N [device]`: the function at sequence lengths
whose one-pass workspace does not fit beside x and y (issue 24's chunked caller workspaces;
issue 30's "runs where cuEquivariance cannot"): af3 bf16, B = 1, C = H = 128, masked, both
directions. Sampled f64 check: for each sampled (i, j), the rows (or
columns) of x that t[i, j] depends on, recomputed in float64 on the GPU."""

import sys

import torch
import torch.nn.functional as F
import trimul
from trimul import _torch
from trimul import triangle_multiplicative_update as tmu

n, c, h = int(sys.argv[1]), 128, 128
dev = sys.argv[2] if len(sys.argv) > 2 else "cuda"
g = torch.Generator().manual_seed(n)


def rn(*shape, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16).to(dev)


w = dict(
    norm_in_weight=rn(c),
    norm_in_bias=rn(c),
    p_in_weight=rn(2 * h, c, scale=c**-0.5),
    p_in_bias=rn(2 * h),
    g_in_weight=rn(2 * h, c, scale=c**-0.5),
    g_in_bias=rn(2 * h),
    norm_out_weight=rn(h),
    norm_out_bias=rn(h),
    p_out_weight=rn(c, h, scale=h**-0.5),
    p_out_bias=rn(c),
    g_out_weight=rn(c, c, scale=c**-0.5),
    g_out_bias=rn(c),
)
torch.manual_seed(n)
x = torch.randn(1, n, n, c, device=dev, dtype=torch.bfloat16)
mask = (torch.rand(1, n, n, device=dev) > 0.1).float()
d = {k: v.double() for k, v in w.items()}


def ab_of(xs, ms):
    """z and the gated a|b for a line of positions of x ([n, c]) and their mask ([n])."""
    z = F.layer_norm(xs.double(), (c,), d["norm_in_weight"], d["norm_in_bias"], 1e-5)
    ab = torch.sigmoid(F.linear(z, d["g_in_weight"], d["g_in_bias"])) * F.linear(z, d["p_in_weight"], d["p_in_bias"])
    return z, ab * ms.double()[:, None]


def want(i, j, direction):
    if direction == "outgoing":  # t_ij = sum_k a_ik b_jk
        zi, abi = ab_of(x[0, i], mask[0, i])
        _, abj = ab_of(x[0, j], mask[0, j])
        t, zij = (abi[:, :h] * abj[:, h:]).sum(0), zi[j]
    else:  # t_ij = sum_k a_ki b_kj
        _, abi = ab_of(x[0, :, i], mask[0, :, i])
        _, abj = ab_of(x[0, :, j], mask[0, :, j])
        zij, _ = ab_of(x[0, i, j : j + 1], mask[0, i, j : j + 1])
        t, zij = (abi[:, :h] * abj[:, h:]).sum(0), zij[0]
    u = F.layer_norm(t, (h,), d["norm_out_weight"], d["norm_out_bias"], 1e-5)
    return torch.sigmoid(F.linear(zij, d["g_out_weight"], d["g_out_bias"])) * F.linear(
        u, d["p_out_weight"], d["p_out_bias"]
    )


free, total = torch.cuda.mem_get_info() if dev == "cuda" else (0, 0)
print(
    f"N={n}: x and y {2 * x.numel() * 2 / 2**30:.1f} GiB, "
    f"free before the call {free / 2**30:.1f} of {total / 2**30:.1f} GiB"
)
for direction in ("outgoing", "incoming"):
    trimul.clear_cache()
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if dev == "cuda" else 0
    with torch.no_grad():
        y = tmu(x, direction, mask, **w)
        times = [] if dev == "cuda" else [0.0, 0.0, 0.0]
        for _ in range(3 if dev == "cuda" else 0):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            y2 = tmu(x, direction, mask, **w)
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
            del y2
    ws = max(next(iter(_torch._cache.entries.values())).ws_bytes.values()) if dev == "cuda" else 0
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if dev == "cuda" else 0
    gen = torch.Generator().manual_seed(n + 1)
    pts = [(0, 0), (n - 1, n - 1), (0, n - 1)] + [
        tuple(torch.randint(0, n, (2,), generator=gen).tolist()) for _ in range(13)
    ]
    worst, bad = 0.0, 0
    for i, j in pts:
        r = want(i, j, direction)
        got = y[0, i, j].double()
        err = (got - r).abs()
        bad += int((err > 2e-2 + 2e-2 * r.abs()).sum())
        worst = max(worst, (err.norm() / r.norm()).item())
    print(
        f"  {direction}: {sorted(times)[1]:.1f} ms (median of 3), workspace {ws / 2**30:.2f} GiB, "
        f"peak above x {peak:.1f} GiB, "
        f"{len(pts)} positions x {c} channels against f64: {bad} outside 2e-2 + 2e-2|ref|, worst rel. L2 {worst:.2e}"
    )
    del y
