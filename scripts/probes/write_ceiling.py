"""How fast can the H100 move data when most of it is written?

trimul's input stage reads x once and writes left, right and the gate: 1.5 bytes written per
byte read with f32 x, 3 with 16-bit x (docs/perf/NOTES.md, twelfth session). Its
floor so far is "bytes at the copy ceiling", measured with a device copy (half reads, half
writes). This probe measures the DRAM rate for other mixes, with PyTorch's own kernels only:
- read only: a sum over S bytes;
- write only: a fill of S bytes;
- half and half: a copy of S bytes into S bytes;
- three writes per read: a copy of S bytes and, on a second stream at the same time, a fill of
  2S bytes (the two kernels share the SMs and the DRAM; the time is from before both to after both).
Rates are bytes moved (read + written) per second, median of 20 after 5 warm-ups.
Run on the GPU machine: python3 scripts/probes/write_ceiling.py
"""
import torch
from timing import median_ms


def main():
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, L2 {props.L2_cache_size / 2**20:.1f} MiB")
    n = 256 << 20  # f32 elements: 1 GiB per buffer, 20x the L2
    gb = n * 4 / 1e9
    src = torch.randn(n, device="cuda")
    dst = torch.empty(n, device="cuda")
    big = torch.empty(2 * n, device="cuda")
    side = torch.cuda.Stream()

    def mixed():
        main_stream = torch.cuda.current_stream()
        side.wait_stream(main_stream)
        dst.copy_(src)
        with torch.cuda.stream(side):
            big.fill_(1.0)
        main_stream.wait_stream(side)

    cases = [
        ("read only (sum)", lambda: src.sum(), gb),
        ("write only (fill)", lambda: dst.fill_(2.0), gb),
        ("1 write per read (copy)", lambda: dst.copy_(src), 2 * gb),
        ("3 writes per read (copy + fill 2x)", mixed, 4 * gb),
    ]
    for name, fn, moved in cases:
        ms = median_ms(fn, reps=20, warmup=5)
        print(f"{name:36s} {ms:8.3f} ms  {moved / ms:6.3f} TB/s")


if __name__ == "__main__":
    main()
