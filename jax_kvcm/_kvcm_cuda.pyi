from typing import Any

import numpy as np
import numpy.typing as npt

def registrations() -> dict[str, Any]:
    """FFI handler capsules by target name, for platform "CUDA"."""

class PinnedHostBuffer:
    """Zeroed, pinned, device-mapped host memory (host tier on CUDA builds).

    cudaHostAlloc (mapped, portable), else cudaHostRegister in regions of at most 2 GiB;
    MemoryError with the CUDA error strings when neither works.
    """

    def __init__(self, nbytes: int) -> None: ...
    @property
    def address(self) -> int: ...
    @property
    def device_address(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def pinned(self) -> bool:
        """Always True."""
    @property
    def registered(self) -> bool:
        """True when the memory came from the cudaHostRegister fallback: then it is registered as
        adjacent regions starting at ``address + k * 2**31`` (a copy descriptor crossing such a
        boundary must be split)."""
    def view(self) -> npt.NDArray[np.uint8]:
        """uint8 [nbytes] over the buffer, no copy; keeps the buffer alive."""
