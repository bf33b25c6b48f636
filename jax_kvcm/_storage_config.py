"""The storage manager's configuration and records: layer-group layouts, tier sizes, events."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

from jax_kvcm._types import CacheLevel, hot_page_bytes

__all__ = ["LayerGroupSpec", "StorageConfig", "StorageEvent", "StorageStats"]


@dataclass(frozen=True, slots=True)
class LayerGroupSpec:
    """KV layout of one layer group; its hot page is ``[num_layers] x {K, V} x [page_size,
    num_kv_heads, head_dim]``."""

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: Any = jnp.bfloat16

    @property
    def hot_page_bytes(self) -> int:
        return hot_page_bytes(self.num_layers, self.page_size, self.num_kv_heads, self.head_dim,
                              self.dtype)

    def same_hot_layout(self, other: LayerGroupSpec) -> bool:
        return (self.num_layers, self.page_size, self.num_kv_heads, self.head_dim,
                jnp.dtype(self.dtype)) == (other.num_layers, other.page_size, other.num_kv_heads,
                                           other.head_dim, jnp.dtype(other.dtype))


@dataclass(frozen=True, slots=True)
class StorageConfig:
    """Tier sizes and groupings. Validated by :class:`StorageManager`.

    - ``device_slots``: usable slots per hot pool group (the null slot 0 comes on top).
    - ``hot_pool_groups``: layer-group ids per hot pool group (identical hot layouts share one
      slot space and one K/V array pair); default one group per layer group.
    - ``cold_pool_groups``: layer-group ids per cold pool group (one slot space and one pool per
      cold tier, HOST and DISK alike), independent of the hot grouping; members must encode to
      the same cold page size. Default: one group per distinct cold page size (ascending), so
      every layer group that can share a cold pool does.
    - ``pool_ratio``: per layer group, its share of hot bytes, projected into the cold tiers
      through slot counts; default: the hot split implied by ``device_slots``.
    - ``host_bytes`` / ``disk_bytes``: cold tier budgets (0 = no such tier); ``disk_dir`` is
      required with ``disk_bytes`` (created when missing; a file there is an error).
    - ``disk_io_threads``: native threads one disk read/write may use (default ``min(8, hardware
      threads)``).
    - ``arenas``: per hot pool group, None (paged pools of ``device_slots`` slots) or an
      :class:`~jax_kvcm.hot.arena.tier.ArenaSpec` (an arena; ``device_slots`` is then unused).
    """

    layer_groups: tuple[LayerGroupSpec, ...]
    device_slots: tuple[int, ...]
    hot_pool_groups: tuple[tuple[int, ...], ...] | None = None
    cold_pool_groups: tuple[tuple[int, ...], ...] | None = None
    pool_ratio: tuple[float, ...] | None = None
    host_bytes: int = 0
    disk_dir: str | None = None
    disk_bytes: int = 0
    pinned_host: bool | None = None
    disk_io_threads: int | None = None
    arenas: tuple[Any, ...] | None = None


@dataclass(frozen=True, slots=True)
class StorageEvent:
    """``kind`` is "stored", "removed" or "migrated"; ``slots`` at ``level`` (for "migrated":
    the destination, with ``src_level`` / ``src_slots`` the source)."""

    kind: str
    layer_group: int
    level: CacheLevel
    slots: np.ndarray
    src_level: CacheLevel | None = None
    src_slots: np.ndarray | None = None


@dataclass(slots=True)
class StorageStats:
    """The storage manager's counters (``StorageManager.stats()``)."""

    num_migrations: int = 0
    num_pages_migrated: int = 0
    bytes_migrated: int = 0
    num_host_fence_waits: int = 0       # host-slot accesses that waited for device work
    host_fence_wait_seconds: float = 0.0
    num_offloads_ahead: int = 0         # offload_ahead transactions
    num_pages_offloaded_ahead: int = 0
    num_side_stream_calls: int = 0      # of their encode calls, those on the side stream


def cold_grouping(groups: Any, sizes: list[int], batching_id: list[int]
                  ) -> tuple[tuple[tuple[int, ...], ...], list[int], list[int], list[int]]:
    """The cold lifecycle -> pool-group mapping: ``(cold_groups, cold_group_of,
    cold_slot_bytes, batching_id)`` from the cold page ``sizes`` per layer group and the codec's
    batching representatives, restricted to the grouping.

    A codec's batching class lies in one hot pool group and has one cold page size, but the
    cold grouping is the manager's choice: when it splits a class, pairs of members in
    different cold pools cannot share a codec call (one cold base address per call), so each
    member's representative becomes the smallest class member in its own cold pool group.
    With the default grouping (one group per distinct size, ascending) this changes nothing."""
    if groups is None:
        distinct = sorted(set(sizes))
        groups = [[lg for lg in range(len(sizes)) if sizes[lg] == b] for b in distinct]
    groups = tuple(tuple(g) for g in groups)
    members = sorted(lg for g in groups for lg in g)
    if members != list(range(len(sizes))) or not all(groups):
        raise ValueError("config.cold_pool_groups must assign every layer group id "
                         f"0..{len(sizes) - 1} to exactly one non-empty group, got {groups}")
    for g in groups:
        if len({sizes[lg] for lg in g}) != 1:
            raise ValueError(f"config.cold_pool_groups: layer groups {g} encode to different "
                             f"cold page sizes {[sizes[lg] for lg in g]}")
    cold_group_of = [0] * len(sizes)
    for c, g in enumerate(groups):
        for lg in g:
            cold_group_of[lg] = c
    reps = [min(m for m in range(len(sizes)) if batching_id[m] == batching_id[lg]
                and cold_group_of[m] == cold_group_of[lg]) for lg in range(len(sizes))]
    return groups, cold_group_of, [sizes[g[0]] for g in groups], reps


def validate_batching(batching_id: list[int], hot_group_of: list[int], sizes: list[int],
                      location: list[Any]) -> None:
    """Each batching representative is configured, <= every member, maps to itself, and shares
    the member's hot pool group, cold page size and index location (its cold pool group may
    differ under an explicit cold grouping: :func:`cold_grouping` then restricts the class)."""
    for lg, rep in enumerate(batching_id):
        if rep < 0 or rep >= len(batching_id):
            raise ValueError(f"codec: layer group {lg} has an unknown batching id {rep}")
        if rep > lg or batching_id[rep] != rep:
            raise ValueError(f"codec: batching id {rep} of layer group {lg} is not the "
                             "smallest member of its class or does not map to itself")
        same = (hot_group_of[rep] == hot_group_of[lg] and sizes[rep] == sizes[lg]
                and location[rep] == location[lg])
        if not same:
            raise ValueError(f"codec: layer group {lg} and its batching representative {rep} "
                             "differ in hot pool group, cold page size or index location")
