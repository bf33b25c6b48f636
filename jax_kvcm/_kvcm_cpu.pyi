from typing import Any

import numpy as np
import numpy.typing as npt

def registrations() -> dict[str, Any]:
    """FFI handler capsules by target name (kvcm_write_kv, kvcm_paged_attention, ...)."""

class HostBuffer:
    """Zero-initialized, aligned host memory owned by the extension (host tier on CPU builds)."""

    def __init__(self, nbytes: int, alignment: int = 4096) -> None: ...
    @property
    def address(self) -> int: ...
    @property
    def device_address(self) -> int:
        """Equals ``address`` on CPU."""
    @property
    def nbytes(self) -> int: ...
    @property
    def pinned(self) -> bool:
        """Always False."""
    def view(self) -> npt.NDArray[np.uint8]:
        """uint8 [nbytes] over the buffer, no copy; keeps the buffer alive."""

class DiskFile:
    """A preallocated, slot-addressed file with a CRC32C per page; its name is unlinked right
    after the exclusive create (the descriptor keeps the file until close)."""

    def __init__(self, path: str, num_slots: int, slot_bytes: int, io_threads: int = 0) -> None: ...
    @property
    def path(self) -> str: ...
    @property
    def num_slots(self) -> int: ...
    @property
    def slot_bytes(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    @property
    def fileno(self) -> int:
        """The file descriptor (-1 once closed)."""
    @property
    def linked(self) -> bool:
        """Whether the name is still in the directory (the early unlink failed)."""
    @property
    def num_io_calls(self) -> int:
        """pread/pwrite syscalls issued so far (one per piece of adjacent pages, normally)."""
    @property
    def io_threads(self) -> int:
        """The most threads one write/read call uses (set 0 for min(8, hardware threads))."""
    @io_threads.setter
    def io_threads(self, n: int) -> None: ...
    _io_piece_bytes: int
    _min_thread_bytes: int
    @property
    def _last_workers(self) -> int: ...
    def write(self, slots: npt.NDArray[np.int32], src_address: int,
              src_pages: npt.NDArray[np.int32] | None = None) -> None: ...
    def read(self, slots: npt.NDArray[np.int32], dst_address: int,
             dst_pages: npt.NDArray[np.int32] | None = None) -> npt.NDArray[np.bool_]: ...
    def invalidate(self, slots: npt.NDArray[np.int32]) -> None: ...
    def close(self) -> None: ...
    def _inject_fault(self, kind: str, after_ios: int = 0) -> None: ...
    def _clear_faults(self) -> None: ...

def _crc32c(data: bytes, software: bool = False) -> int:
    """Test hook: the disk tier's CRC32C of ``data``."""

_CRC32C_IMPL: str
"""Which CRC32C path the disk tier uses: "sse4.2", "armv8-crc" or "software"."""

def arena_granularity() -> int:
    """The smallest super-page the CPU arena accepts (the system page size)."""

class ArenaReservation:
    """A PROT_NONE reservation of ``nbytes`` whose super-pages are backed on demand by memfd pages
    (MAP_FIXED | MAP_SHARED); the contiguous arena's memory on CPU builds. One handle may be mapped
    at several offsets (aliasing). ValueError for a super-page that is not a multiple of
    ``arena_granularity()``; MemoryError when the address space cannot hold the reservation."""

    def __init__(self, nbytes: int, super_page_bytes: int) -> None: ...
    def create_physical(self) -> int:
        """A zero-filled super-page of physical memory, by handle."""
    def release_physical(self, handle: int) -> None:
        """Returns it; ValueError while it is still mapped somewhere."""
    def map(self, offset: int, handle: int) -> None: ...
    def unmap(self, offset: int) -> None: ...
    def is_mapped(self, offset: int) -> bool: ...
    def handle_at(self, offset: int) -> int:
        """The handle mapped at ``offset``, -1 when unmapped."""
    def read(self, offset: int, dst_address: int, nbytes: int) -> None: ...
    def write(self, offset: int, src_address: int, nbytes: int) -> None: ...
    def dlpack(self, offset: int, shape: list[int], dtype: str) -> Any:
        """A DLPack-exportable (kDLCPU) array at ``offset``, no copy; keeps the object alive."""
    def view(self) -> npt.NDArray[np.uint8]:
        """uint8 [nbytes] over the reservation; only mapped super-pages may be touched."""
    def close(self) -> None:
        """Unmaps everything, releases every handle, frees the reservation (idempotent)."""
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
