"""Session 34: where does one call's latency go (issue 24's 3% bar, one call at a time)?
af3 bf16, B = 1, C = H = 128, unmasked, cached weights. Each variant timed one call at a time
(events around the call, GPU idle before it, as `trimul.bench.timed` and `trimul bench` do) and
back to back (10 calls between two events); rounds interleaved, medians. The difference between
the two is the time the GPU waits for the call's host work before its first kernel.
Usage: python latency_probe.py N [rounds]"""
import json, os, statistics, sys, time
import torch
import trimul
from trimul import _torch
from trimul.bench import af3_weights, timed_batch
from trimul._args import AF3_WEIGHTS

n = int(sys.argv[1]) if len(sys.argv) > 1 else 512
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 30
dt = torch.bfloat16
g = torch.Generator().manual_seed(1)
c = h = 128
w = af3_weights(c, h, dt, "cuda", g)
x = torch.randn(1, n, n, c, generator=g).to(dt).cuda()
f = lambda: trimul.triangle_multiplicative_update(x, "outgoing", None, **w)
for _ in range(5):
    f()
entry = next(iter(_torch._cache.entries.values()))
code = _torch._DTYPE_CODE[dt]
nbytes = entry.layer.workspace_bytes(1, n, False, code)
ws = torch.empty(max(nbytes, 1), dtype=torch.uint8, device="cuda")
y = torch.empty_like(x)
cur = torch.cuda.current_stream().cuda_stream
lib = lambda: entry.layer.forward(x.data_ptr(), x.numel(), 0, 0, y.data_ptr(), y.numel(), 1, n, code, ws.data_ptr(), nbytes, cur)
tiny = torch.zeros(1, device="cuda")
variants = {"function": f, "library_call": lib, "tiny_add": lambda: tiny.add_(1.0), "nothing": lambda: None}


def one(fn):
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3, (t1 - t0) * 1e6


def batch(fn, calls=10):
    # One round of trimul.bench's back-to-back timing (the run in docs/perf/s34 had the same loop
    # written out here), in µs.
    return timed_batch(fn, calls, rounds=1, warmup=0)[0] * 1e3


res = {}
for graphs in (True, False):
    trimul.set_launch_graphs(graphs)
    for fn in variants.values():
        for _ in range(3):
            fn()
    s = {k: {"one_us": [], "host_us": [], "b2b_us": []} for k in variants}
    for _ in range(rounds):
        for k, fn in variants.items():
            o, hst = one(fn)
            s[k]["one_us"].append(o)
            s[k]["host_us"].append(hst)
            s[k]["b2b_us"].append(batch(fn))
    for k in variants:
        r = {m: statistics.median(v) for m, v in s[k].items()}
        r["wait_us"] = r["one_us"] - r["b2b_us"]
        res[f"{k}_graphs_{'on' if graphs else 'off'}"] = r
        print(f"N={n} graphs={'on ' if graphs else 'off'} {k:14s} one {r['one_us']:8.1f} us  b2b {r['b2b_us']:8.1f}  wait {r['wait_us']:6.1f}  host {r['host_us']:6.1f}")
trimul.set_launch_graphs(True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), f"latency_probe_{n}.json"), "w"), indent=1)
