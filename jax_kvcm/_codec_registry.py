"""The CUDA extension's host index registry, which the HOST-location codecs (the concat codec)
read their index pairs from: the C entry points are in ``ffi/cuda/codec_host.cc``; the codec's
``register_host_index_pairs`` / ``unregister_host_index_pairs`` (``jax_kvcm/_codec.py``) use it.
"""

from __future__ import annotations

import ctypes
from typing import Any

import jax
import numpy as np

from jax_kvcm import _ffi

__all__ = ["index_registry", "on_accelerator"]


def on_accelerator(array: Any) -> bool:
    if isinstance(array, jax.core.Tracer):
        raise TypeError("register/unregister_host_index_pairs need a concrete jax.Array, "
                        "not a traced value")
    return any(d.platform != "cpu" for d in array.devices())


class _IndexRegistry:
    """The CUDA extension's host index registry (C entry points in ffi/cuda/codec_host.cc).

    register/unregister use the module's bindings when ``module.cc`` provides them, else the
    exported C symbols through ctypes (they are exported with default visibility either way).
    """

    def __init__(self, module: Any) -> None:
        lib = ctypes.CDLL(module.__file__)  # NOTE: the already loaded library, not a second copy
        for fn, args, res in (
                (lib.kvcm_register_host_index_pairs,
                 [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int64], ctypes.c_int),
                (lib.kvcm_register_host_index_pairs_ticket,
                 [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64], ctypes.c_int),
                (lib.kvcm_unregister_host_index_pairs, [ctypes.c_size_t], ctypes.c_int),
                (lib.kvcm_lookup_host_index_pairs,
                 [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int64], ctypes.c_int64),
                (lib.kvcm_num_host_index_registrations, [], ctypes.c_int64),
                (lib.kvcm_concat_mover_calls, [ctypes.c_int], ctypes.c_int64)):
            fn.argtypes, fn.restype = args, res
        self._lib = lib
        self.register_ticket = lib.kvcm_register_host_index_pairs_ticket
        bound = hasattr(module, "register_host_index_pairs")
        self.register = (module.register_host_index_pairs if bound
                         else lib.kvcm_register_host_index_pairs)
        self.unregister = (module.unregister_host_index_pairs if bound
                           else lib.kvcm_unregister_host_index_pairs)

    def lookup(self, device_ptr: int) -> np.ndarray | None:
        """A copy of the pairs registered for ``device_ptr``, or None."""
        n = self._lib.kvcm_lookup_host_index_pairs(device_ptr, None, 0)
        if n < 0:
            return None
        out = np.empty((n, 2), np.int32)
        self._lib.kvcm_lookup_host_index_pairs(device_ptr, out.ctypes.data, n)
        return out

    def count(self) -> int:
        """Number of registered device buffers."""
        return int(self._lib.kvcm_num_host_index_registrations())

    def concat_mover_calls(self) -> tuple[int, int]:
        """(copy-kernel calls, memcpy calls) of the CUDA concat codec since load."""
        return (int(self._lib.kvcm_concat_mover_calls(0)),
                int(self._lib.kvcm_concat_mover_calls(1)))


_registry: _IndexRegistry | None = None


def index_registry() -> _IndexRegistry:
    global _registry
    if _registry is None:
        if _ffi._kvcm_cuda is None:
            raise RuntimeError("host index pairs for a GPU array need the jax_kvcm CUDA "
                               f"extension: {_ffi.CUDA_IMPORT_ERROR}")
        _registry = _IndexRegistry(_ffi._kvcm_cuda)
    return _registry
