"""Type stubs of the compiled module (python/src/lib.rs). Addresses are ints (`data_ptr()`,
`ctypes.data`); dtype codes 0 = float32, 1 = bfloat16, 2 = float16; weights are 16 entries in
the order of WEIGHT_NAMES, each None or (address, elements, dtype code). Every tensor is passed
as its address and its element count, which the library checks against the shape."""

from typing import Optional

__version__: str
WEIGHT_NAMES: list[str]

Entry = Optional[tuple[int, int, int]]

class HostLayer:
    def __init__(
        self,
        formulation: str,
        c: int,
        h: int,
        direction: str,
        eps: float,
        weights: list[Entry],
        backend: Optional[str] = None,
    ) -> None: ...
    @property
    def backend(self) -> str: ...
    def forward(
        self, x: int, x_len: int, mask: int, mask_len: int, y: int, y_len: int, b: int, n: int, io: int
    ) -> None: ...
    def backward(
        self,
        x: int,
        x_len: int,
        mask: int,
        mask_len: int,
        dy: int,
        dy_len: int,
        b: int,
        n: int,
        outs: list[Entry],
    ) -> None:
        """float32 gradients into `outs`: 17 entries, x's then the 16 weights' (None: skipped)."""

class _DeviceLayer:
    """CudaLayer and HipLayer: caller memory on the device, launches on the caller's stream."""

    def __init__(
        self,
        device: int,
        formulation: str,
        c: int,
        h: int,
        direction: str,
        eps: float,
        weights: list[Entry],
        storage: int,
        storage_bytes: int,
        stream: int,
    ) -> None: ...
    def reprepare(self, weights: list[Entry], storage: int, storage_bytes: int, stream: int) -> None: ...
    def workspace_bytes(self, b: int, n: int, masked: bool, io: int, limit: Optional[int] = None) -> int: ...
    def backward_workspace_bytes(self, b: int, n: int, masked: bool, io: int = 0) -> int: ...
    def backward(
        self,
        x: tuple[int, int],
        mask: tuple[int, int],
        dy: tuple[int, int],
        dx: tuple[int, int],
        b: int,
        n: int,
        outs: list[Entry],
        ws: tuple[int, int],
        stream: int,
        io: int = 0,
        on_device: bool = False,
    ) -> None:
        """The native backward on `stream` (HIP's has run on the fake ROCm only, and the torch op
        does not call it): (address,
        elements) of x, mask, dy and dx (device tensors in `io`: 0 float32, 1 bfloat16, 2 float16;
        the mask float32), 16 float32 entries for the weights' gradients, the workspace (address,
        bytes) of at least `backward_workspace_bytes` of the same `io`. Host entries: waits for
        the work; device entries (`on_device`): written on `stream`, nothing waits."""
    def forward(
        self,
        x: int,
        x_len: int,
        mask: int,
        mask_len: int,
        y: int,
        y_len: int,
        b: int,
        n: int,
        io: int,
        ws: int,
        ws_bytes: int,
        stream: int,
        fresh: Optional[tuple[list[Entry], int, int]] = None,
    ) -> None:
        """Enqueues the forward on `stream`; with `fresh` (weights, storage, storage_bytes),
        first prepares those weights into that storage (GPU MODE's protocol in one call)."""

class CudaLayer(_DeviceLayer): ...
class HipLayer(_DeviceLayer): ...

class CudaShardedRank:
    def __init__(
        self, unique_id: bytes, ranks: int, rank: int, device: int, timeout_s: Optional[float] = None
    ) -> None: ...
    def rows(self, n: int) -> tuple[int, int]: ...
    def workspace_bytes(self) -> int: ...
    def set_poison(self, on: bool) -> None: ...
    def release(self, timeout_s: float) -> None: ...
    def wait(self, timeout_s: float) -> None: ...
    def forward(
        self,
        layer: CudaLayer,
        x: int,
        x_len: int,
        mask: int,
        mask_len: int,
        y: int,
        y_len: int,
        b: int,
        n: int,
        io: int,
        stream: int,
    ) -> None: ...

def nccl_unique_id() -> list[int]: ...
def nccl_version() -> str: ...
def row_split(n: int, ranks: int) -> list[tuple[int, int]]: ...
def memory_margin(total: int) -> int: ...
def cuda_prepared_bytes(device: int, formulation: str, c: int, h: int, biases: bool) -> int: ...
def hip_prepared_bytes(device: int, formulation: str, c: int, h: int, biases: bool) -> int: ...
def hip_validate(device: int, c: int, h: int) -> list[str]: ...
def cuda_set_poison(device: int, on: bool) -> None: ...
def set_launch_graphs(on: bool) -> None: ...
def launch_graphs_on() -> bool: ...
def cuda_info(device: int) -> str: ...
def compiled_backends() -> list[str]: ...
def host_backend(backend: Optional[str] = None) -> str: ...
