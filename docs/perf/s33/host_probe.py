"""Session 33: is a CUDA graph worth it for the library call's host time? Host µs per call at
N = 256 (af3 bf16, C = H = 128, cached weights): the library call (three launches, one cuBLASLt)
against a replay of the same work captured in a CUDA graph, and the pieces around them. Bursts of
50 after a synchronize, 200 rounds interleaved, medians."""
import statistics, time, json, sys, os
import torch
import trimul
from trimul import _torch
from trimul.bench import af3_weights, _noop
from trimul._args import AF3_WEIGHTS

dt = torch.bfloat16
g = torch.Generator().manual_seed(1)
n, c, h = 256, 128, 128
w = af3_weights(c, h, dt, "cuda", g)
x = torch.randn(1, n, n, c, generator=g).to(dt).cuda()
args = [w.get(k) for k in AF3_WEIGHTS]
for _ in range(5):
    trimul.triangle_multiplicative_update(x, "outgoing", None, **w)
entry = next(iter(_torch._cache.entries.values()))
code = _torch._DTYPE_CODE[dt]
nbytes = entry.layer.workspace_bytes(1, n, False, code)
ws = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
y = torch.empty_like(x)
s = torch.cuda.Stream()
def raw_on(stream):
    entry.layer.forward(x.data_ptr(), x.numel(), 0, 0, y.data_ptr(), y.numel(), 1, n, code, ws.data_ptr(), nbytes, stream)
cur = torch.cuda.current_stream().cuda_stream
raw = lambda: raw_on(cur)
raw(); torch.cuda.synchronize()
ref = y.clone()
gr = torch.cuda.CUDAGraph()
with torch.cuda.graph(gr, stream=s):
    raw_on(s.cuda_stream)
y.zero_(); gr.replay(); torch.cuda.synchronize()
print("graph replay equals the eager call:", torch.equal(y, ref))
tiny = torch.zeros(1, device="cuda")
variants = {
    "noop_custom_op": lambda: _noop(x, None, *args, "outgoing", 1e-5),
    "function": lambda: trimul.triangle_multiplicative_update(x, "outgoing", None, **w),
    "library_call": raw,
    "graph_replay": gr.replay,
    "torch_tiny_add": lambda: tiny.add_(1.0),
}
samples = {k: [] for k in variants}
for _ in range(200):
    for k, fn in variants.items():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            fn()
        samples[k].append((time.perf_counter() - t0) / 50 * 1e6)
        torch.cuda.synchronize()
out = {k: statistics.median(v) for k, v in samples.items()}
out["function_minus_noop"] = statistics.median(a - b for a, b in zip(samples["function"], samples["noop_custom_op"]))
for k, v in out.items():
    print(f"{k:24s} {v:7.2f} us")
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "host_probe.json"), "w"), indent=1)
