"""Can the memory-bound stages run under the contraction at N = 4096 if the GEMM leaves SMs free?

Issue 6's last bar (N = 4096 unchunked within 1.3x the floor) cannot be met by running the three
stages one after another (docs/perf/NOTES.md, long sequences). This probe measures the proposed
way out before anyone builds it, with PyTorch alone:
- the contraction: torch.bmm of 128 f16 matrices 4096 x 4096 x 4096 (trimul's contraction at
  N = 4096, C = H = 128), with cuBLASLt told to leave k SMs free
  (torch._C._set_sm_carveout_experimental, i.e. CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET = SMs - k);
- the memory-bound stages: an f32 -> f16 copy of 8.6 GB of x-sized data and an f16 -> f32 copy
  back (25.8 GB moved, two thirds of what trimul's input and output stages move);
- each alone, then both at once on two streams (GEMM first, so its persistent blocks hold their
  SMs and the copies get the k free ones).
Overlap pays if "both" is well under "GEMM alone + copies alone". Run on the GPU machine:
python3 scripts/probes/sm_partition.py
"""
import torch
from timing import median_ms

N, H = 4096, 128


def main():
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    print(f"{props.name}, {sms} SMs, torch {torch.__version__}")
    carve = getattr(torch._C, "_set_sm_carveout_experimental", None)
    print("sm carveout API:", "present" if carve else "absent (only k = 0 runs)")
    a = torch.randn(H, N, N, device="cuda", dtype=torch.float16)
    b = torch.randn(H, N, N, device="cuda", dtype=torch.float16)
    t = torch.empty(H, N, N, device="cuda", dtype=torch.float16)
    x = torch.randn(H, N, N, device="cuda", dtype=torch.float32)
    xh = torch.empty(H, N, N, device="cuda", dtype=torch.float16)
    y = torch.empty(H, N, N, device="cuda", dtype=torch.float32)
    gemm_stream, copy_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def gemm():
        torch.bmm(a, b.transpose(1, 2), out=t)

    def copies():
        xh.copy_(x)
        y.copy_(xh)

    flops = 2.0 * H * N**3
    t_copy = median_ms(copies, reps=5, warmup=1)
    print(f"copies alone: {t_copy:.2f} ms ({25.8e9 / t_copy / 1e9:.2f} TB/s)")
    for k in [0, 8, 16, 24, 32, 48]:
        if k and not carve:
            break
        if carve:
            carve(k if k else None)
        t_gemm = median_ms(gemm, reps=5, warmup=1)

        def both():
            start = torch.cuda.Event()
            start.record()
            gemm_stream.wait_event(start)
            copy_stream.wait_event(start)
            with torch.cuda.stream(gemm_stream):
                gemm()
            with torch.cuda.stream(copy_stream):
                copies()
            torch.cuda.current_stream().wait_stream(gemm_stream)
            torch.cuda.current_stream().wait_stream(copy_stream)

        t_both = median_ms(both, reps=5, warmup=1)
        print(
            f"k = {k:2d} SMs left free: GEMM alone {t_gemm:6.2f} ms ({flops / t_gemm / 1e9:5.0f} TFLOP/s), "
            f"serial {t_gemm + t_copy:6.2f} ms, both at once {t_both:6.2f} ms "
            f"({(t_both - t_gemm - t_copy) / (t_gemm + t_copy) * 100:+.1f}% vs serial)"
        )
    if carve:
        carve(None)


if __name__ == "__main__":
    main()
