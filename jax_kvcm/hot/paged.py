"""The paged hot tier: one preallocated K and V array per hot pool group; a page is any slot.

Pools are ``[num_layers, num_slots, tokens_per_page, Hkv, D]`` (layer-major) ``jax.Array``s that
the user's step donates, so writes happen in place; slot 0 is the null page (allocated forever).
Each allocated slot charges its page's bytes to the governor's DEVICE level.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvcm._governor import Lease, MemoryGovernor
from jax_kvcm.hot import LeaseGrant
from jax_kvcm._slots import SlotAllocator
from jax_kvcm._types import CacheLevel

__all__ = ["PagedTier", "zero_pool"]

_D = CacheLevel.DEVICE


class PagedTier:
    """Paged pools of the hot pool groups ``groups`` (``{h: (num_slots, page_bytes)}``, usable
    slots without the null page). ``make_pool(h)`` builds one zeroed ``(k, v)`` pair."""

    kind = "paged"

    def __init__(self, groups: dict[int, tuple[int, int]], governor: MemoryGovernor,
                 make_pool: Callable[[int], tuple[Any, Any]]) -> None:
        self._governor = governor
        self._make_pool = make_pool
        self._page_bytes = {h: b for h, (_, b) in groups.items()}
        self._allocators: dict[int, SlotAllocator] = {}
        self._pools: dict[int, tuple[Any, Any]] = {}
        for h, (n, _) in groups.items():
            alloc = SlotAllocator(n + 1)
            taken = alloc.allocate(n + 1)
            alloc.free(taken[taken != 0])  # NOTE: slot 0 stays allocated forever (null page)
            self._allocators[h] = alloc
        for h in groups:
            self._pools[h] = make_pool(h)

    @property
    def groups(self) -> Sequence[int]:
        return list(self._allocators)

    def pools(self, h: int) -> tuple[Any, Any]:
        return self._pools[h]

    def set_pools(self, h: int, pools: tuple[Any, Any]) -> None:
        self._pools[h] = pools

    def allocator(self, h: int) -> SlotAllocator:
        return self._allocators[h]

    def num_free(self, h: int) -> int:
        return self._allocators[h].num_free

    def capacity_pages(self, h: int) -> int:
        """Usable pages of group ``h`` (the null page excluded)."""
        return self._allocators[h].num_slots - 1

    def allocate(self, h: int, n: int, at: np.ndarray | None = None) -> LeaseGrant | None:
        del at  # any slot will do
        lease = _reserve(self._governor, n * self._page_bytes[h])
        if lease is None:
            return None
        slots = self._allocators[h].allocate(n)
        if slots is None:
            lease.release()
            return None
        return LeaseGrant(slots, lease, self._allocators[h])

    def free(self, h: int, slots: np.ndarray) -> None:
        self._allocators[h].free(slots)
        self._governor.release_committed(_D, slots.size * self._page_bytes[h])

    def committed_bytes(self, h: int) -> int:
        a = self._allocators[h]
        return (a.num_slots - a.num_free - 1) * self._page_bytes[h]

    def note_use(self, h: int, token: Any) -> None:
        """Migrations are ordered on XLA's stream; nothing to remember."""

    def rebuild_pools(self) -> bool:
        for h in self._pools:
            self._pools[h] = self._make_pool(h)
        return False

    def close(self) -> None:
        """Frees the pools' device memory now, not when the last reference to them goes (a
        reference cycle or a stray holder would keep gigabytes alive into the next manager)."""
        for pair in self._pools.values():
            for arr in pair:
                if not arr.is_deleted():
                    arr.delete()
        self._pools = {}


def _reserve(governor: MemoryGovernor, nbytes: int) -> Lease | None:
    from jax_kvcm._governor import BudgetExceededError
    try:
        return governor.reserve(_D, nbytes)
    except BudgetExceededError:
        return None


def zero_pool(shape: tuple[int, ...], dtype: Any, placement: Any) -> jax.Array:
    """A zero pool on ``placement`` (a device or a ``NamedSharding``); a sharded one is created
    in place, shard by shard (never whole on one device first)."""
    if isinstance(placement, jax.sharding.NamedSharding):
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=placement)()
    return jax.device_put(jnp.zeros(shape, dtype), placement)
