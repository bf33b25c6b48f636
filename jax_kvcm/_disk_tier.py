"""The disk tier: one preallocated, slot-addressed file per cold pool group, checksummed per page.

:class:`DiskPool` creates ``<directory>/<name>.kvcm`` (exclusively, mode 0600, preallocated to
``num_slots * slot_bytes`` so a full disk shows up at construction) through the native
``_kvcm_cpu.DiskFile``, and keeps the slot free list (:class:`~jax_kvcm._slots.SlotAllocator`).
The name is unlinked right after the create: the open descriptor keeps the file, so it vanishes
with the process however that ends (a killed server leaves no preallocated file behind), and
closing never removes a file some other process created under that name later.

I/O moves whole cold pages between disk slots and host memory: page ``i`` of a call lives at
``address + pages[i] * slot_bytes`` in host memory (``pages`` defaults to ``0, 1, ...``: a
contiguous staging region) and in slot ``slots[i]`` on disk. Pages adjacent both on disk and in
host memory are coalesced into pieces of at most 4 MiB, one pread/pwrite each; the native code
runs with the GIL released, a call's pieces spread over up to ``io_threads`` native threads
(default ``min(8, hardware threads)``), each doing the checksums and the syscall of its pieces. A
CRC32C per page is recorded when its write succeeds and verified on every read.

Errors:

- A page whose checksum does not match, or that was never written (or was invalidated / freed), is
  a *miss*: ``read`` returns ``False`` for it and never raises for that. Its bytes must not be used.
- I/O failures raise :class:`DiskIOError` (an ``OSError``, errno preserved; short reads and writes
  are ``EIO``); a full disk raises :class:`DiskFullError` (``ENOSPC``).
- Misuse (slots out of range or not allocated, bad dtype/shape, a closed pool) raises
  ``ValueError`` before any I/O.

NOTE: a failed ``write`` may have written the pieces before the failing one (their checksums are
recorded); the failing piece's slots read as missing; later pieces are untouched, except, with more
than one I/O thread and a real (not injected) I/O error, those another thread had already started
(they hold the new data with valid checksums, or read as missing). Which error is raised does not
depend on the threads: the first failing piece's. Callers treat a failed write as failed whole:
they free the slots (which drops every checksum) and keep the source.
"""

from __future__ import annotations

import errno as _errno
import os

import numpy as np

from jax_kvcm._slots import SlotAllocator, SlotPool, as_slot_array
from jax_kvcm._types import check_count

__all__ = ["DISK_FILE_SUFFIX", "CorruptPageError", "DiskFullError", "DiskIOError", "DiskPool",
           "UnreadablePageError"]

DISK_FILE_SUFFIX = ".kvcm"


class DiskIOError(OSError):
    """A disk-tier I/O operation failed (errno and filename preserved)."""


class DiskFullError(DiskIOError):
    """The disk tier's file system is full (``ENOSPC``)."""


def _disk_error(e: OSError) -> DiskIOError:
    cls = DiskFullError if e.errno == _errno.ENOSPC else DiskIOError
    if e.errno is None:
        return cls(str(e))
    return cls(e.errno, e.strerror, e.filename)


def _check_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if (not name or name in (".", "..") or "/" in name or os.sep in name
            or (os.altsep and os.altsep in name) or "\0" in name):
        raise ValueError(f"name must be a plain file name (no path separators), got {name!r}")
    return name


def _host_pages(pages, n: int, name: str) -> np.ndarray | None:
    if pages is None:
        return None
    arr = as_slot_array(pages, name)
    if arr.size != n:
        raise ValueError(f"{name} has {arr.size} entries for {n} slots")
    return arr


class DiskPool(SlotPool):
    """``num_slots`` cold-page slots of ``slot_bytes`` each in ``<directory>/<name>.kvcm``."""

    __slots__ = ("_file", "_allocator", "_directory", "_name", "_num_slots", "_slot_bytes")

    def __init__(self, directory: str | os.PathLike[str], name: str, num_slots: int,
                 slot_bytes: int, *, io_threads: int | None = None) -> None:
        self._file = None
        try:
            directory = os.fspath(directory)
        except TypeError:
            raise ValueError(f"directory must be a path, got {type(directory).__name__}") from None
        if isinstance(directory, bytes):
            directory = os.fsdecode(directory)
        if not os.path.isdir(directory):
            what = "is not a directory" if os.path.exists(directory) else "does not exist"
            raise ValueError(f"directory {directory!r} {what}")
        self._directory = directory
        self._name = _check_name(name)
        self._num_slots = check_count(num_slots, "num_slots", minimum=1)
        self._slot_bytes = check_count(slot_bytes, "slot_bytes", minimum=1)
        threads = 0 if io_threads is None else check_count(io_threads, "io_threads", minimum=1)
        self._allocator = SlotAllocator(self._num_slots)
        from jax_kvcm import _kvcm_cpu

        path = os.path.join(directory, name + DISK_FILE_SUFFIX)
        try:
            self._file = _kvcm_cpu.DiskFile(path, self._num_slots, self._slot_bytes, threads)
        except OSError as e:
            raise _disk_error(e) from e

    # -- geometry ------------------------------------------------------------------------------

    @property
    def path(self) -> str:
        return os.path.join(self._directory, self._name + DISK_FILE_SUFFIX)

    @property
    def directory(self) -> str:
        return self._directory

    @property
    def name(self) -> str:
        return self._name

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    @property
    def closed(self) -> bool:
        return self._file is None or self._file.closed

    @property
    def fileno(self) -> int:
        """The open file's descriptor (its name is gone from the directory); -1 once closed."""
        return -1 if self._file is None else self._file.fileno

    @property
    def num_io_calls(self) -> int:
        """pread/pwrite syscalls issued so far (one per piece of adjacent pages, normally)."""
        return 0 if self._file is None else self._file.num_io_calls

    @property
    def io_threads(self) -> int:
        """The most native threads one read/write call uses."""
        return self._check_open().io_threads

    # -- slots ---------------------------------------------------------------------------------

    def free(self, slots) -> None:
        """Returns ``slots`` and drops their checksums (a freed slot never reads as valid)."""
        file = self._check_open()
        arr = as_slot_array(slots)
        self._allocator.free(arr)  # NOTE: validates everything before changing anything
        file.invalidate(arr)

    # -- I/O -----------------------------------------------------------------------------------

    def write(self, slots, src_address: int, src_pages=None) -> None:
        """Writes page ``i`` from ``src_address + src_pages[i] * slot_bytes`` (``src_pages``
        default: ``i``) to slot ``slots[i]``.

        DiskFullError / DiskIOError on failure (see the module notes for partial effects).
        """
        file = self._check_open()
        arr = self._check_io_slots(slots)
        pages = _host_pages(src_pages, arr.size, "src_pages")
        try:
            file.write(arr, int(src_address), pages)
        except OSError as e:
            raise _disk_error(e) from e

    def read(self, slots, dst_address: int, dst_pages=None) -> np.ndarray:
        """Reads slot ``slots[i]`` into ``dst_address + dst_pages[i] * slot_bytes`` (``dst_pages``
        default: ``i``); returns a bool mask, False for pages that fail their checksum or hold
        nothing (misses: do not use them).

        DiskIOError on I/O errors and short reads.
        """
        file = self._check_open()
        arr = self._check_io_slots(slots)
        pages = _host_pages(dst_pages, arr.size, "dst_pages")
        try:
            return file.read(arr, int(dst_address), pages)
        except OSError as e:
            raise _disk_error(e) from e

    def invalidate(self, slots) -> None:
        """Drops the checksums of ``slots``: they read as missing until rewritten."""
        file = self._check_open()
        file.invalidate(as_slot_array(slots))

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Closes the file, which frees its space (idempotent). DiskIOError only when the name,
        still linked because the unlink at creation failed, cannot be removed now either: the
        pool is closed all the same."""
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except OSError as e:
                raise _disk_error(e) from e

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"num_free={self.num_free}"
        return (f"DiskPool(path={self.path!r}, num_slots={self._num_slots}, "
                f"slot_bytes={self._slot_bytes}, {state})")

    # -- test hooks ----------------------------------------------------------------------------

    def _inject_fault(self, kind: str, after_ios: int = 0) -> None:
        """One-shot fault on the (after_ios + 1)-th following I/O syscall of the matching kind:
        ``enospc`` / ``short_write`` (writes), ``short_read`` / ``eio_read`` (reads)."""
        self._check_open()._inject_fault(kind, after_ios)

    def _clear_faults(self) -> None:
        self._check_open()._clear_faults()

    def _set_io_tuning(self, *, piece_bytes: int | None = None,
                       min_thread_bytes: int | None = None) -> None:
        """Test hook: the most bytes per piece (one syscall) and the bytes per extra thread, so
        that small test pages can exercise the multi-threaded path."""
        file = self._check_open()
        if piece_bytes is not None:
            file._io_piece_bytes = piece_bytes
        if min_thread_bytes is not None:
            file._min_thread_bytes = min_thread_bytes

    # -- helpers -------------------------------------------------------------------------------

    def _check_open(self):
        if self._file is None or self._file.closed:
            raise ValueError("DiskPool is closed")
        return self._file

    def _check_io_slots(self, slots) -> np.ndarray:
        arr = as_slot_array(slots)
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= self._num_slots:
                raise ValueError(f"slots: values [{lo}, {hi}] out of range [0, {self._num_slots})")
            if not self._allocator.all_allocated(arr):
                bad = int(arr[~np.array([self._allocator.is_allocated(int(s)) for s in arr])][0])
                raise ValueError(f"slots: slot {bad} is not allocated in this pool")
        return arr


class CorruptPageError(Exception):
    """Cold pages that cannot be served: disk pages that failed their checksum, or (``level``
    ``"HOST"``) host pages whose writing copy failed on the device. They are missing, never
    served. Nothing was changed; ``slots`` are the bad source slots of ``level`` (the caller
    drops or invalidates them)."""

    def __init__(self, layer_group: int, slots: np.ndarray, level: str = "DISK") -> None:
        why = ("failed their checksum" if level == "DISK" else
               "were never written: the device copy that wrote them failed")
        super().__init__(f"layer group {layer_group}: {level.lower()} pages {slots.tolist()} "
                         f"{why}")
        self.layer_group = layer_group
        self.slots = slots
        self.level = level


class UnreadablePageError(CorruptPageError, DiskIOError):
    """A disk read failed (EIO, a short read): its pages count as corrupt (a miss; ``slots``
    are every source slot of the failed read) and it is also the :class:`DiskIOError` (errno
    preserved). Nothing was changed."""

    def __init__(self, layer_group: int, slots: np.ndarray, cause: OSError) -> None:
        super().__init__(layer_group, slots)
        self.errno = cause.errno
        self.filename = cause.filename
        self.strerror = (f"layer group {layer_group}: disk pages {slots.tolist()} unreadable "
                         f"({cause.strerror or cause})")
