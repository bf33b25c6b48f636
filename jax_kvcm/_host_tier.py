"""The host tier: host memory owned by the native extension, cut into fixed-size cold-page slots.

One :class:`HostPool` per cold pool group. Its memory is

- on CUDA builds with a GPU: pinned, device-mapped memory (``_kvcm_cuda.PinnedHostBuffer``:
  ``cudaHostAlloc`` mapped, else ``cudaHostRegister`` in adjacent regions of at most 2 GiB), whose
  ``device_address`` the custom calls use as the cold tier's base address;
- otherwise: zeroed, page-aligned host memory (``_kvcm_cpu.HostBuffer``; ``device_address ==
  base_address``).

The address never moves while the pool is open. Slot ``s`` is the bytes
``[base_address + s * slot_bytes, base_address + (s + 1) * slot_bytes)``.

NOTE: allocation failure is a typed error (:class:`HostOOMError`, a ``MemoryError``), never a crash;
slot exhaustion is a value (``allocate`` returns ``None``). numpy views keep the native buffer alive:
after :meth:`HostPool.close` the memory is released once the last view is gone.
"""

from __future__ import annotations


import numpy as np

from jax_kvcm._slots import SlotAllocator, SlotPool
from jax_kvcm._types import check_count

__all__ = ["HostOOMError", "HostPool", "allocate_host_buffer", "pinned_memory_default"]


class HostOOMError(MemoryError):
    """Host-tier memory could not be allocated (pinned or plain)."""


def _cuda_module():
    """The CUDA extension module, or ``None`` when it was not built or failed to import."""
    from jax_kvcm import _ffi  # registers the handlers; the package imports it anyway

    return _ffi._kvcm_cuda


def pinned_memory_default() -> bool:
    """Whether ``pinned=None`` means pinned: the CUDA extension is present and JAX sees a GPU.

    NOTE: no backend is initialized when the answer is known without one: a missing CUDA extension,
    or ``jax_platforms`` (``JAX_PLATFORMS``) set without ``cuda``/``gpu``. Otherwise JAX's device
    list is consulted (initializing backends only if nothing did yet).
    """
    if _cuda_module() is None:
        return False
    import jax

    platforms = jax.config.jax_platforms
    if platforms:
        names = {p.strip().lower() for p in str(platforms).split(",")}
        if not names & {"cuda", "gpu"}:
            return False
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:  # no GPU backend
        return False


def allocate_host_buffer(nbytes: int, *, pinned: bool | None = None):
    """A native host buffer of ``nbytes`` zeroed bytes (``address``, ``device_address``,
    ``nbytes``, ``pinned``, ``view()``).

    ``pinned``: True -> ``PinnedHostBuffer`` (RuntimeError when the CUDA extension is not built:
    a configuration error, not an out-of-memory); False -> ``HostBuffer``; None ->
    :func:`pinned_memory_default`. Allocation failures raise :class:`HostOOMError`.
    """
    nbytes = check_count(nbytes, "nbytes", minimum=1)
    if pinned is None:
        pinned = pinned_memory_default()
    if pinned:
        cuda = _cuda_module()
        if cuda is None:
            from jax_kvcm import _ffi

            raise RuntimeError(
                "pinned host memory needs jax_kvcm's CUDA extension, which is unavailable here "
                f"({_ffi.CUDA_IMPORT_ERROR}); pass pinned=False for plain host memory")
        factory = cuda.PinnedHostBuffer
    else:
        from jax_kvcm import _kvcm_cpu

        factory = _kvcm_cpu.HostBuffer
    try:
        return factory(nbytes)
    except MemoryError as e:
        kind = "pinned" if pinned else "plain"
        raise HostOOMError(f"cannot allocate {nbytes} bytes of {kind} host memory: {e}") from e


class HostPool(SlotPool):
    """``num_slots`` cold-page slots of ``slot_bytes`` each in one native host buffer."""

    __slots__ = ("_buffer", "_allocator", "_num_slots", "_slot_bytes", "_base_address",
                 "_device_address", "_pinned")

    def __init__(self, num_slots: int, slot_bytes: int, *, pinned: bool | None = None) -> None:
        self._num_slots = check_count(num_slots, "num_slots", minimum=1)
        self._slot_bytes = check_count(slot_bytes, "slot_bytes", minimum=1)
        self._buffer = allocate_host_buffer(self._num_slots * self._slot_bytes, pinned=pinned)
        self._allocator = SlotAllocator(self._num_slots)
        self._base_address = int(self._buffer.address)
        self._device_address = int(self._buffer.device_address)
        self._pinned = bool(self._buffer.pinned)

    # -- geometry ------------------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    @property
    def nbytes(self) -> int:
        return self._num_slots * self._slot_bytes

    @property
    def base_address(self) -> int:
        """Host address of slot 0 (fixed while the pool is open)."""
        self._check_open()
        return self._base_address

    @property
    def device_address(self) -> int:
        """Device-accessible address of slot 0: the base the custom calls use."""
        self._check_open()
        return self._device_address

    @property
    def pinned(self) -> bool:
        return self._pinned

    @property
    def closed(self) -> bool:
        return self._buffer is None

    def slot_address(self, slot: int) -> int:
        """Host address of ``slot``."""
        self._check_open()
        return self._base_address + self._check_slot(slot) * self._slot_bytes

    # -- slots ---------------------------------------------------------------------------------

    def free(self, slots) -> None:
        """Returns ``slots``; ValueError (nothing changes) on out-of-range or double free."""
        self._check_open()
        self._allocator.free(slots)

    # -- inspection ----------------------------------------------------------------------------

    def view(self) -> np.ndarray:
        """``uint8 [num_slots, slot_bytes]`` over the pool's memory (no copy, writable)."""
        self._check_open()
        return self._buffer.view()[: self.nbytes].reshape(self._num_slots, self._slot_bytes)

    def slot_view(self, slot: int) -> np.ndarray:
        """``uint8 [slot_bytes]`` over one slot (no copy, writable)."""
        self._check_open()
        start = self._check_slot(slot) * self._slot_bytes
        return self._buffer.view()[start : start + self._slot_bytes]

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Drops the pool's reference to its memory (idempotent); outstanding views keep it."""
        self._buffer = None

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"num_free={self.num_free}"
        return (f"HostPool(num_slots={self._num_slots}, slot_bytes={self._slot_bytes}, "
                f"pinned={self._pinned}, {state})")

    def _check_open(self) -> None:
        if self._buffer is None:
            raise ValueError("HostPool is closed")

    def _check_slot(self, slot: int) -> int:
        s = check_count(slot, "slot", minimum=0)
        if s >= self._num_slots:
            raise ValueError(f"slot {s} is out of range [0, {self._num_slots})")
        return s
