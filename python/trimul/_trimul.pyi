"""Type stubs of the compiled module (python/src/lib.rs). Addresses are ints (`data_ptr()`,
`ctypes.data`); dtype codes 0 = float32, 1 = bfloat16, 2 = float16; weights are 16 entries in
the order of WEIGHT_NAMES, each None or (address, elements, dtype code)."""

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
    def forward(self, x: int, mask: int, y: int, b: int, n: int, io: int) -> None: ...

class CudaLayer:
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
    def workspace_bytes(self, b: int, n: int, masked: bool, io: int) -> int: ...
    def forward(
        self, x: int, mask: int, y: int, b: int, n: int, io: int, ws: int, ws_bytes: int, stream: int
    ) -> None: ...

def cuda_prepared_bytes(device: int, formulation: str, c: int, h: int, biases: bool) -> int: ...
def cuda_set_poison(device: int, on: bool) -> None: ...
def cuda_info(device: int) -> str: ...
def compiled_backends() -> list[str]: ...
def host_backend(backend: Optional[str] = None) -> str: ...
