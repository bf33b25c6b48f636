from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

def registrations() -> dict[str, Any]:
    """FFI handler capsules by target name, for platform "CUDA"."""

# Tickets of the concat codec's side-stream mover (encode with the side_stream option): the host
# creates one per encode call, registers it with the call's host index pairs, and learns through it
# when the copies, which run after the call on a side stream, are done.

def ticket_create() -> int:
    """A new ticket (an id > 0)."""

def ticket_query(ticket: int) -> int:
    """-1 unknown, 0 created (no call submitted it yet), 1 copies in flight, 2 done; RuntimeError
    when the copies failed."""

def ticket_wait(ticket: int) -> bool:
    """Blocks (GIL released) until the ticket's copies are done: True; False when no call
    submitted it yet (wait for that call's token first). RuntimeError when they failed,
    ValueError for an unknown ticket."""

def ticket_release(ticket: int) -> None:
    """Forgets the ticket (no-op when unknown); a pending completion event is released by the
    driver once the side stream passed it."""

def num_tickets() -> int:
    """Live tickets (leak checks in tests)."""

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

def reservation_granularity(device: int = -1) -> int:
    """The driver's minimum VMM granularity on ``device`` (-1: the current one); RuntimeError
    without VMM support."""

class Reservation:
    """_kvcm_cpu.Reservation on CUDA VMM (backend "vmm"): cuMemAddressReserve, super-pages backed
    by cuMemCreate handles (cuMemMap + cuMemSetAccess). The driver entry points are looked up at
    run time: RuntimeError when the driver or device has no VMM support. Same methods, errors and
    counters; read/write are synchronous cudaMemcpy; dlpack arrays are kDLCUDA."""

    dtypes: tuple[str, ...]

    def __init__(self, nbytes: int, super_page_bytes: int, device: int = -1) -> None: ...
    def create_physical(self) -> int: ...
    def create_physical_many(self, n: int) -> list[int]: ...
    def release_physical(self, handle: int) -> None: ...
    def release_physical_many(self, handles: Sequence[int]) -> None: ...
    def map(self, offset: int, handle: int) -> None: ...
    def map_many(self, offsets: Sequence[int], handles: Sequence[int]) -> None: ...
    def unmap(self, offset: int) -> None:
        """cuMemUnmap; the caller has waited for every step that may read the super-page."""
    def unmap_many(self, offsets: Sequence[int]) -> None: ...
    def is_mapped(self, offset: int) -> bool: ...
    def handle_at(self, offset: int) -> int: ...
    def read(self, offset: int, dst_address: int, nbytes: int) -> None: ...
    def write(self, offset: int, src_address: int, nbytes: int) -> None: ...
    def dlpack(self, offset: int, shape: Sequence[int], dtype: str) -> Any: ...
    def view(self) -> npt.NDArray[np.uint8]:
        """ValueError: the memory is on the device (use dlpack)."""
    def close(self) -> None: ...
    def _inject_fault(self, kind: str, after: int = 0) -> None: ...
    @property
    def backend(self) -> str:
        """"vmm"."""
    @property
    def device(self) -> int: ...
    @property
    def base(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def super_page_bytes(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    @property
    def num_map_calls(self) -> int: ...
    @property
    def num_unmap_calls(self) -> int: ...
    @property
    def num_create_calls(self) -> int: ...
    @property
    def num_release_calls(self) -> int: ...
    @property
    def num_physical(self) -> int: ...
    @property
    def mapped_bytes(self) -> int: ...
    @property
    def physical_bytes(self) -> int: ...
