"""Is the contraction at N = 4096 faster with bf16 operands than with f16 ones?

The H100's GEMM rate at N = 4096 is power-bound (trimul's contraction takes 22.5 ms on a cold GPU
and 24-25 ms a few forwards later, same kernel), and a tensor core's power depends on its
operands' bits. bf16 has 7 mantissa bits where f16 has 10, so the same GEMM may run at a higher
clock in bf16. This probe times torch.bmm of 128 matrices 4096 x 4096 x 4096 (trimul's
contraction at N = 4096, C = H = 128: t = L . R^T per channel, f32 accumulation) with f16 and
with bf16 operands holding the same gated-projection-like values (sigmoid(a) * b, a and b
standard normal), alternating the two over rounds so that the GPU's temperature drifts alike.
Run on the GPU machine: python3 scripts/probes/contraction_dtype.py
"""
import torch
from timing import median_ms

N, H = 4096, 128


def main():
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, torch {torch.__version__}")
    g = torch.Generator(device="cuda").manual_seed(1)
    data = {}
    for name in ("left", "right"):
        a = torch.randn(H, N, N, device="cuda", generator=g, dtype=torch.float16)
        b = torch.randn(H, N, N, device="cuda", generator=g, dtype=torch.float16)
        data[name] = torch.sigmoid(a) * b
        del a, b
    flop = 2.0 * H * N**3
    ops = {}
    for dt in (torch.float16, torch.bfloat16):
        l, r = data["left"].to(dt), data["right"].to(dt)
        t = torch.empty(H, N, N, device="cuda", dtype=dt)
        ops[str(dt).split(".")[1]] = (lambda l=l, r=r, t=t: torch.bmm(l, r.transpose(1, 2), out=t))
    del data
    for rnd in range(3):
        for name, fn in ops.items():
            ms = median_ms(fn, reps=10, warmup=2)
            print(f"round {rnd} {name:9s} {ms:7.3f} ms  {flop / ms / 1e9:6.1f} TFLOP/s")


if __name__ == "__main__":
    main()
