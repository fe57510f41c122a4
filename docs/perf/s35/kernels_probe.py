"""Session 35: which kernels make up trimul's and cuEquivariance's device time (af3 bf16, B = 1,
C = H = 128, unmasked), from PyTorch's profiler: per kernel, calls and mean device time over 5
calls after 3 warm-ups. Run with the trimul wheel and cuEquivariance 0.13 on PYTHONPATH."""

import sys

import torch
import trimul
from cuequivariance_torch import triangle_multiplicative_update as cueq
from torch.profiler import ProfilerActivity, profile
from trimul.bench import af3_weights

g = torch.Generator().manual_seed(0)
for n in [int(s) for s in sys.argv[1].split(",")]:
    w = af3_weights(128, 128, torch.bfloat16, "cuda", g)
    x = torch.randn(1, n, n, 128, generator=g).to(torch.bfloat16).cuda()
    for name, op in [("trimul", trimul.triangle_multiplicative_update), ("cueq", cueq)]:

        def fn(op=op, x=x, w=w):
            return op(x, "outgoing", None, **w)

        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        rows = [e for e in prof.key_averages() if e.device_time_total > 0]
        rows.sort(key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in rows) / 5 / 1000
        print(f"== N = {n} {name}: {total:.3f} ms of kernels per call")
        for e in rows[:12]:
            print(
                f"  {e.count // 5:>3} × {e.device_time_total / e.count / 1000:8.3f} ms  {e.key[:110]}"
            )
