"""Session 34: why is the function's device time at N = 1024 (and 2048) above `trimul bench
--device-time`'s? af3 bf16, B = 1, C = H = 128, unmasked, outgoing. Device time of each call
(behind a spin kernel, `trimul.bench.timed_held`) with launch graphs on and off, and the kernels
the function runs with their durations (torch.profiler). Usage: python gap_probe.py N..."""
import statistics, sys
import torch
import trimul
from trimul.bench import af3_weights, timed_held

for n in [int(a) for a in sys.argv[1:]] or [1024]:
    g = torch.Generator().manual_seed(1)
    w = af3_weights(128, 128, torch.bfloat16, "cuda", g)
    x = torch.randn(1, n, n, 128, generator=g).to(torch.bfloat16).cuda()
    f = lambda: trimul.triangle_multiplicative_update(x, "outgoing", None, **w)
    res = {}
    for r in range(2):
        for on in (True, False):
            trimul.set_launch_graphs(on)
            res.setdefault(on, []).append(statistics.median(timed_held(f, 15, 3)))
    trimul.set_launch_graphs(True)
    print(f"N={n} device time, graphs on {res[True]} off {res[False]}")
    for on in (True, False):
        trimul.set_launch_graphs(on)
        for _ in range(3):
            f()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                f()
            torch.cuda.synchronize()
        print(f"N={n} graphs {'on' if on else 'off'}: kernels (5 calls)")
        for e in prof.key_averages():
            if e.device_type == torch.autograd.DeviceType.CUDA or getattr(e, "device_time_total", 0) > 0:
                print(f"   {e.key[:110]:110s} count {e.count:3d} avg {e.device_time_total / max(e.count, 1):9.1f} us")
    trimul.set_launch_graphs(True)
