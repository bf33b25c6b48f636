from collections.abc import Sequence
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

def reservation_granularity() -> int:
    """The smallest super-page a ``Reservation`` accepts here (the system page size)."""

class Reservation:
    """A virtual reservation of ``nbytes`` whose super-pages are backed on demand by physical
    super-pages; the contiguous arena's memory. Backend "memfd" here: a PROT_NONE range, pieces of
    one memfd mapped with MAP_FIXED | MAP_SHARED (_kvcm_cuda.Reservation: CUDA VMM, same API).

    One handle may be mapped at several offsets (prefix aliasing). Errors name the argument:
    ValueError for bad offsets, handles and sizes (nothing changed), MemoryError when memory or
    address space runs out, RuntimeError for a driver failure."""

    dtypes: tuple[str, ...]
    """The ``dtype`` names ``dlpack`` accepts (float32, float16, bfloat16, float8_e4m3fn, ...)."""

    def __init__(self, nbytes: int, super_page_bytes: int) -> None:
        """``super_page_bytes``: a multiple of ``reservation_granularity()``; ``nbytes``: a
        multiple of ``super_page_bytes``."""
    def create_physical(self) -> int:
        """A zero-filled physical super-page, by handle (freed handles are reused)."""
    def create_physical_many(self, n: int) -> list[int]:
        """``n`` handles, all or none: on a failure the ones created are released, it raises and
        the counters are as before."""
    def release_physical(self, handle: int) -> None:
        """Returns it; ValueError while it is still mapped somewhere."""
    def release_physical_many(self, handles: Sequence[int]) -> None:
        """Every handle is checked first (live, unmapped, no repeats): a bad one releases none."""
    def map(self, offset: int, handle: int) -> None:
        """Backs the super-page at byte ``offset`` with ``handle``."""
    def map_many(self, offsets: Sequence[int], handles: Sequence[int]) -> None:
        """``map`` for each pair, all or none: every pair is checked first, and on a failure part
        way the pairs mapped are unmapped; then it raises and the counters are as before."""
    def unmap(self, offset: int) -> None:
        """The caller has waited for every step that may read the super-page."""
    def unmap_many(self, offsets: Sequence[int]) -> None:
        """Every offset is checked first (mapped, no repeats): a bad one unmaps none."""
    def is_mapped(self, offset: int) -> bool:
        """False once closed."""
    def handle_at(self, offset: int) -> int:
        """The handle mapped at ``offset``, -1 when unmapped."""
    def read(self, offset: int, dst_address: int, nbytes: int) -> None:
        """Copies ``nbytes`` at ``offset`` to host memory; every touched super-page is mapped."""
    def write(self, offset: int, src_address: int, nbytes: int) -> None:
        """Copies ``nbytes`` of host memory to ``offset``; every touched super-page is mapped."""
    def dlpack(self, offset: int, shape: Sequence[int], dtype: str) -> Any:
        """A DLPack-exportable array of ``shape``/``dtype`` at byte ``offset``, no copy (kDLCPU
        here); it keeps the reservation alive. Touching an unmapped super-page through it faults."""
    def view(self) -> npt.NDArray[np.uint8]:
        """uint8 [nbytes] over the reservation, no copy (host memory only: ValueError on vmm);
        only mapped super-pages may be touched."""
    def close(self) -> None:
        """Unmaps everything, releases every handle, frees the reservation (idempotent)."""
    def _inject_fault(self, kind: str, after: int = 0) -> None:
        """Test hook: the (after + 1)-th following physical create ("create") or map ("map")
        fails with MemoryError, once."""
    @property
    def backend(self) -> str:
        """"memfd" here."""
    @property
    def device(self) -> int:
        """-1: host memory."""
    @property
    def base(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def super_page_bytes(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    @property
    def num_map_calls(self) -> int:
        """Super-pages mapped so far (one per map; map_many counts each)."""
    @property
    def num_unmap_calls(self) -> int: ...
    @property
    def num_create_calls(self) -> int: ...
    @property
    def num_release_calls(self) -> int: ...
    @property
    def num_physical(self) -> int:
        """Live physical super-pages."""
    @property
    def mapped_bytes(self) -> int: ...
    @property
    def physical_bytes(self) -> int: ...
