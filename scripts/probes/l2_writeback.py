"""Does a kernel pay for the dirty L2 lines the kernel before it left behind?

trimul's stage kernels each show a constant of ≈ 15 µs per launch in a linear fit of their time
against positions (docs/perf/NOTES.md). One explanation: a stage starts with up to the L2's worth
of the previous stage's writes still dirty, and their write-backs fall in its window. This probe
times one device copy of S bytes (CUDA events around it alone) in three conditions:
- after a copy that wrote 256 MiB (the L2 full of dirty lines),
- after the same copy followed by a 256 MiB read of other data (the dirty lines written back before the
  timed copy starts, the L2 holding clean lines),
- after that read alone (nothing dirty).
If "after writes" is slower than "after writes then reads" by about the L2's size at the copy
bandwidth, and this does not depend on S, the constant is inherited write-back.
Run on the GPU machine: python3 scripts/probes/l2_writeback.py
"""
import torch
from timing import median_ms


def main():
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, L2 {props.L2_cache_size / 2**20:.1f} MiB")
    big = 64 << 20  # floats: 256 MiB
    dirty_src, dirty_dst = torch.randn(big, device="cuda"), torch.empty(big, device="cuda")
    clean = torch.randn(big, device="cuda")
    sink = torch.empty((), device="cuda")
    for size_mib in [32, 64, 128, 256]:
        n = size_mib << 18
        src, dst = torch.randn(n, device="cuda"), torch.empty(n, device="cuda")
        results = {}
        for name in ["after writes", "after writes then reads", "after reads"]:

            def before(name=name):
                if name != "after reads":
                    dirty_dst.copy_(dirty_src)
                if name != "after writes":
                    torch.sum(clean, dim=0, out=sink)

            results[name] = 1000 * median_ms(lambda dst=dst, src=src: dst.copy_(src), reps=25, warmup=0, before=before)
        line = ", ".join(f"{k} {v:7.1f} µs" for k, v in results.items())
        extra = results["after writes"] - results["after writes then reads"]
        print(f"copy of {size_mib:3d} MiB (read + write {2 * size_mib} MiB): {line}; inherited {extra:+.1f} µs")


if __name__ == "__main__":
    main()
