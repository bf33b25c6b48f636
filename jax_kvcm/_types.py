"""Ids, cache levels and small shared records of the host side.

The ids are ``typing.NewType`` over ``int``: free at run time, distinct for the type checker, so a
``PoolGroupIndex`` cannot be passed where a ``LayerGroupId`` is expected.

NOTE: pool-group indices are per cache level. The DEVICE level groups layer groups by identical
hot layout, the cold levels (HOST, DISK) by compatible encoded page size; the two mappings are
independent, so never compare a DEVICE ``PoolGroupIndex`` with a HOST/DISK one
(docs/ARCHITECTURE.md §1).
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field
from typing import Any, NewType

import numpy as np

__all__ = [
    "CacheLevel",
    "LayerGroupId",
    "LayerGroupLayout",
    "PageIndex",
    "PoolGroupIndex",
    "PoolLayout",
    "SlotId",
    "hot_page_bytes",
]

LayerGroupId = NewType("LayerGroupId", int)
"""Layers with the same KV layout and lifecycle (TensorRT-LLM's LifeCycleId); dense from 0."""

PoolGroupIndex = NewType("PoolGroupIndex", int)
"""A physical pool group at one cache level; dense from 0 within that level."""

SlotId = NewType("SlotId", int)
"""A slot inside one pool group at one level (slot 0 of a DEVICE pool group is the null page)."""

PageIndex = NewType("PageIndex", int)
"""A page's position in a sequence's page list of one layer group."""


class CacheLevel(enum.IntEnum):
    """Storage tiers, hottest first. DEVICE holds hot pages; HOST and DISK hold cold pages."""

    DEVICE = 0
    HOST = 1
    DISK = 2

    @property
    def is_cold(self) -> bool:
        """True for the tiers that store codec-encoded blobs (HOST, DISK)."""
        return self is not CacheLevel.DEVICE


def check_count(value: object, name: str, *, minimum: int) -> int:
    """``value`` as a Python int >= ``minimum``.

    Integers (Python or numpy) pass; bools, floats and other types raise TypeError; values below
    ``minimum`` raise ValueError. Errors name the argument.
    """
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        result = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if result < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {result}")
    return result


def hot_page_bytes(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                   dtype: Any) -> int:
    """Bytes of one hot page of a layer group: one slot across all ``2 * num_layers`` pools (K
    and V), ``2 * num_layers * page_size * num_kv_heads * head_dim * itemsize``. The one place
    this formula lives (configs, storage and capacity planning all call it)."""
    import numpy as _np  # NOTE: jnp dtypes (bfloat16, float8) are numpy-compatible dtypes
    return 2 * num_layers * page_size * num_kv_heads * head_dim * _np.dtype(dtype).itemsize


@dataclass(frozen=True, slots=True)
class LayerGroupLayout:
    """How one layer group is stored at every level, as the pool-ratio split needs it.

    - ``hot_pool_group``: its DEVICE pool group. Layer groups sharing one have identical hot
      layouts, hence equal ``hot_page_bytes`` (checked where layouts are combined).
    - ``hot_page_bytes``: bytes of one hot page = one slot across all 2 * num_layers pools of the
      group, i.e. ``2 * num_layers * tokens_per_page * num_kv_heads * head_dim * itemsize``.
    - ``cold_pool_group``: its pool group at every cold level (HOST and DISK share one mapping,
      so host<->disk is a raw blob copy).
    - ``cold_page_bytes``: the codec's fixed encoded size of one page (``cold_page_bytes(lg)``).
    """

    layer_group_id: LayerGroupId
    hot_pool_group: PoolGroupIndex
    hot_page_bytes: int
    cold_pool_group: PoolGroupIndex
    cold_page_bytes: int

    def __post_init__(self) -> None:
        # NOTE: normalized to Python ints (numpy ints are accepted) so equality and hashing agree.
        for name, minimum in (("layer_group_id", 0), ("hot_pool_group", 0), ("hot_page_bytes", 1),
                              ("cold_pool_group", 0), ("cold_page_bytes", 1)):
            object.__setattr__(self, name, check_count(getattr(self, name), name, minimum=minimum))

    def pool_group(self, level: CacheLevel) -> PoolGroupIndex:
        """This layer group's pool group at ``level`` (hot for DEVICE, cold otherwise)."""
        if CacheLevel(level) is CacheLevel.DEVICE:
            return self.hot_pool_group
        return self.cold_pool_group

    def page_bytes(self, level: CacheLevel) -> int:
        """Bytes of one of this layer group's pages at ``level`` (hot or encoded payload)."""
        if CacheLevel(level) is CacheLevel.DEVICE:
            return self.hot_page_bytes
        return self.cold_page_bytes


@dataclass(frozen=True)
class PoolLayout:
    """Where every layer group lives at every level that exists, computed once by the storage
    manager and read by everything above it (the KV-cache manager, its group managers, stats).

    - ``layer_groups``: one :class:`LayerGroupLayout` per layer group (id order): hot / cold pool
      group and page bytes.
    - ``levels``: the cache levels that exist (DEVICE first).
    - ``batching_ids``: the codec's batching representative of each layer group (restricted to
      its cold pool group).

    :meth:`pool_of` and :meth:`page_bytes` return read-only ``[G]`` arrays (cached).
    """

    layer_groups: tuple[LayerGroupLayout, ...]
    levels: tuple[CacheLevel, ...]
    batching_ids: tuple[int, ...]
    _pools: dict = field(default_factory=dict, repr=False, compare=False)
    _bytes: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for lv in self.levels:
            pools = np.asarray([lg.pool_group(lv) for lg in self.layer_groups], np.int64)
            nbytes = np.asarray([lg.page_bytes(lv) for lg in self.layer_groups], np.int64)
            pools.flags.writeable = nbytes.flags.writeable = False
            self._pools[lv], self._bytes[lv] = pools, nbytes

    @property
    def num_layer_groups(self) -> int:
        return len(self.layer_groups)

    def pool_of(self, level: CacheLevel) -> np.ndarray:
        """``[G]`` int64: the pool group of each layer group at ``level``."""
        return self._pools[CacheLevel(level)]

    def page_bytes(self, level: CacheLevel) -> np.ndarray:
        """``[G]`` int64: bytes of one page of each layer group at ``level``."""
        return self._bytes[CacheLevel(level)]

    def num_pools(self, level: CacheLevel) -> int:
        return int(self._pools[CacheLevel(level)].max()) + 1
