"""Device pages as bytes, in and out, staged through the host tier (sequence export and import),
and page copies between any two tiers (a truncated suspended sequence's private copy).

:class:`PageIO` is a mixin of :class:`~jax_kvcm._storage.StorageManager` (the same object). A
page leaves as its cold-page bytes (the codec's host format: the same bytes whichever hot
layout, paged or arena, held it), so two managers exchange pages whenever their layer groups and
codecs agree. Each call stages through host slots it allocates and frees, under the governor's
HOST budget like any migration: the device pages are copied, never moved.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jax_kvcm._types import CacheLevel

__all__ = ["PageIO"]

H = CacheLevel.HOST


class PageIO:
    """See the module docstring."""

    def _staging_slots(self: Any, lg: int, n: int) -> np.ndarray:
        if not self.has_level(H):
            raise ValueError("sequence export and import stage pages through the host tier: "
                             "configure host_bytes")
        slots = self.allocate(H, lg, n)
        if slots is None:
            raise RuntimeError(f"the host tier has no room to stage {n} pages of layer group "
                               f"{lg}")
        return slots

    def read_device_pages(self: Any, lg: int, src: np.ndarray) -> np.ndarray:
        """Device pages ``src [n]`` of ``lg`` as bytes ``uint8 [n, cold_page_bytes[lg]]`` (a copy:
        the device pages stay)."""
        self._check_open()
        src = np.asarray(src, np.int32).reshape(-1)
        g = self.cold_group_of[lg]
        slots = self._staging_slots(lg, src.size)
        try:
            pool = self.host_pools[g]
            self._wait_fences(g, slots, read=False)
            self._encode(lg, src, slots, pool.device_address, pool.num_slots).wait()
            return pool.view()[slots].copy()
        finally:
            self.free(H, lg, slots)

    def write_device_pages(self: Any, lg: int, data: np.ndarray, dst: np.ndarray) -> None:
        """Bytes ``data [n, cold_page_bytes[lg]]`` (from :meth:`read_device_pages`) into the
        allocated device pages ``dst [n]`` of ``lg``."""
        self._check_open()
        dst = np.asarray(dst, np.int32).reshape(-1)
        data = np.ascontiguousarray(data, np.uint8)
        if data.shape != (dst.size, self.cold_page_bytes[lg]):
            raise ValueError(f"data: shape {data.shape}, expected "
                             f"{(dst.size, self.cold_page_bytes[lg])}")
        g = self.cold_group_of[lg]
        slots = self._staging_slots(lg, dst.size)
        try:
            pool = self.host_pools[g]
            self._wait_fences(g, slots, read=False)
            pool.view()[slots] = data
            fence = self._decode(lg, slots, dst, pool.device_address, pool.num_slots)
            self._host_fences[g][slots] = fence  # the next writer of these slots waits for it
        finally:
            self.free(H, lg, slots)

    def copy_pages(self: Any, moves: Any) -> list[np.ndarray] | None:
        """Copies ``(lg, src_level, src_slots [n], dst_level)`` as one transaction, like
        :meth:`migrate_many` (every destination allocated before anything is submitted; None
        when one cannot be, a failure raises; either way nothing changed) except that the
        sources stay allocated and unchanged. Returns the destination slots of each copy."""
        out = self._migrate(moves, ahead=False, keep=True)
        return None if out is None else out[0]
