"""Does configuring an L2 set-aside for persisting accesses slow unrelated kernels on this GPU?

Times, with CUDA events, a batched f16 GEMM shaped like trimul's contraction at 256,2,128
(256 matrices of 256 x 256 x 256) and a 128 MiB device-to-device copy, first with no set-aside, then after
cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, S) for a few sizes S, with no access policy
window and no cache hints anywhere: any change is the set-aside's alone. Run on the GPU machine,
which has PyTorch: python3 scripts/probes/l2_setaside.py
"""
import ctypes

import torch
from timing import median_ms

CUDA_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06


def cudart():
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    import glob
    import os

    for path in glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "*", "lib", "libcudart.so*")):
        return ctypes.CDLL(path)
    raise OSError("no libcudart found")


def main():
    rt = cudart()
    torch.cuda.init()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, L2 {props.L2_cache_size / 2**20:.1f} MiB")
    left = [torch.randn(256, 256, 256, device="cuda", dtype=torch.float16) for _ in range(4)]
    right = [torch.randn(256, 256, 256, device="cuda", dtype=torch.float16) for _ in range(4)]
    out = torch.empty(256, 256, 256, device="cuda", dtype=torch.float16)
    src = torch.randn(32 << 20, device="cuda")
    dst = torch.empty_like(src)
    k = [0]

    def gemm():
        k[0] = (k[0] + 1) % 4
        torch.bmm(left[k[0]], right[k[0]].transpose(1, 2), out=out)

    def copy():
        dst.copy_(src)

    for mib in (0, 4, 16, 31):
        got = rt.cudaDeviceSetLimit(CUDA_LIMIT_PERSISTING_L2_CACHE_SIZE, ctypes.c_size_t(mib << 20))
        value = ctypes.c_size_t(0)
        rt.cudaDeviceGetLimit(ctypes.byref(value), CUDA_LIMIT_PERSISTING_L2_CACHE_SIZE)
        g, c = median_ms(gemm), median_ms(copy)
        print(
            f"set-aside {mib:3d} MiB (rc {got}, now {value.value / 2**20:.1f} MiB): "
            f"contraction-shaped bmm {g * 1e3:7.1f} us, 128 MiB copy {c * 1e3:7.1f} us "
            f"({2 * src.numel() * 4 / (c * 1e-3) / 1e9:.0f} GB/s read + write)"
        )
    rt.cudaDeviceSetLimit(CUDA_LIMIT_PERSISTING_L2_CACHE_SIZE, ctypes.c_size_t(0))
    print(f"set-aside back to 0: bmm {median_ms(gemm) * 1e3:7.1f} us, copy {median_ms(copy) * 1e3:7.1f} us")


if __name__ == "__main__":
    main()
