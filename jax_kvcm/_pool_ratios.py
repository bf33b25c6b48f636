"""Pool ratios: splitting each tier's byte budget into slot counts per pool group.

Memory is partitioned per *layer group*, not per pool group. One positive byte weight per layer
group (in layer-group id order, summing to exactly 1) says what fraction of the DEVICE budget its
hot pages should get. Each level then groups layer groups its own way (DEVICE by hot pool group,
HOST/DISK by cold pool group) and sums their weights:

- DEVICE: ``W_h = sum(w_lg for lg in hot group h)``; hot group ``h`` gets
  ``floor(budget * W_h / hot_page_bytes_h)`` slots. Its floor (the minimum number of slots) is
  ``num_reserved_slots + max(1, sum(min_slots[lg] for lg in h))``: the null slot 0, then the
  batch-constraint minimum of its members (they share slot space, so minima add), or one usable
  slot when no constraint is given.
- Cold levels (HOST, DISK): first the implied *slot-count* weight
  ``s_lg = w_lg / hot_page_bytes_lg``, then cold bytes ``c_lg = s_lg * slot_bytes[cold group
  of lg]``; cold group ``g`` gets the share ``C_g = sum(c_lg for lg in g) / sum(c_lg for all
  lg)`` of the tier budget, in slots of ``slot_bytes[g]``. This keeps the layer groups'
  slot-count proportions when hot and cold pages have different sizes or groupings. Batch
  constraints are NOT projected into cold tiers: each cold group's floor is only the structural
  minimum (``min_slots``, default 1).

``slot_bytes[g]`` is the cold tier's physical slot stride of cold group ``g``: by default the
largest ``cold_page_bytes`` of its members (equal to each member's cold page size when the
members agree, which makes ``c_lg`` exactly the design's "slot-count weight times the lifecycle's
cold-page size").
A tier that pads slots (e.g. to 4 KiB for direct I/O) passes its padded strides.

Floors. When a group's proportional share is below its floor it is fixed at the floor and the rest
of the budget is re-split among the other groups by their weights, repeatedly (water-filling), so
the total never exceeds the budget. If the floors alone exceed the budget, ``ValueError``: the
configuration is infeasible. Bytes left over by the per-group ``floor`` stay unused.

All arithmetic is exact (``fractions.Fraction``); float ratios are read through their shortest
decimal ``repr`` (``0.7`` means 7/10), so results do not depend on binary rounding.

Worked example (MiB = 2**20 bytes)::

    lg  hot group  hot page  cold group  cold page   weight
    0   0          2 MiB     0           2 MiB       1/4     full attention, lossless codec
    1   0          2 MiB     1           1 MiB       1/4     same hot layout, compressed cold
    2   1          1 MiB     1           1 MiB       1/2

    DEVICE, 64 MiB, num_reserved_slots=1:
      hot group 0: W = 1/4 + 1/4 = 1/2 -> 32 MiB / 2 MiB = 16 slots (slot 0 is the null page)
      hot group 1: W = 1/2             -> 32 MiB / 1 MiB = 32 slots
      implied slot-count proportions lg0 : lg1 : lg2 = 8 : 8 : 32
    HOST, 56 MiB:
      s = (1/4)/2, (1/4)/2, (1/2)/1 = 1/8, 1/8, 1/2 (per MiB)
      c = 1/8 * 2, 1/8 * 1, 1/2 * 1 = 1/4, 1/8, 1/2; total 7/8
      cold group 0: (1/4) / (7/8) = 2/7 -> 16 MiB / 2 MiB = 8 slots   (lg0: 8)
      cold group 1: (5/8) / (7/8) = 5/7 -> 40 MiB / 1 MiB = 40 slots  (lg1 + lg2: 8 + 32)
    DEVICE again with min_slots = [0, 0, 40] (a batch needs 40 pages of lg2):
      hot group 1 floor = 1 + 40 = 41 > its 32-slot share -> fixed at 41 slots (41 MiB)
      hot group 0 gets the rest: floor(23 MiB / 2 MiB) = 11 slots; 1 MiB unused
    HOST with the same constraints: unchanged (8 and 40 slots): hot-only floors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from numbers import Rational, Real

import numpy as np

from jax_kvcm._types import CacheLevel, LayerGroupLayout, PoolGroupIndex, check_count

__all__ = [
    "PoolGroupSplit",
    "cold_byte_weights",
    "normalize_weights",
    "split_cold_budget",
    "split_device_budget",
    "weights_from_ratio",
    "weights_from_typical_batch",
]


@dataclass(frozen=True, slots=True)
class PoolGroupSplit:
    """One pool group's share of one level's budget.

    ``num_slots * slot_bytes <= budget`` summed over the level's groups; ``num_slots >= min_slots``.
    """

    level: CacheLevel
    pool_group: PoolGroupIndex
    num_slots: int
    slot_bytes: int
    weight: Fraction  # the group's normalized byte weight at this level (before floors)
    min_slots: int    # the floor applied (constraints on DEVICE, structural on cold levels)

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes


def _as_fraction(x: object, name: str) -> Fraction:
    if isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be a number, got {x!r}")
    if isinstance(x, Rational):  # int, Fraction, numpy ints
        value = Fraction(int(x.numerator), int(x.denominator))
    elif isinstance(x, (Real, np.floating)):
        if not math.isfinite(float(x)):
            raise ValueError(f"{name} must be finite, got {x!r}")
        value = Fraction(repr(float(x)))  # NOTE: shortest decimal: 0.7 -> 7/10 exactly
    else:
        raise TypeError(f"{name} must be a number, got {type(x).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {x!r}")
    return value


def normalize_weights(raw: Sequence[object]) -> tuple[Fraction, ...]:
    """Positive finite numbers -> exact fractions summing to 1 (same order)."""
    values = [_as_fraction(x, f"weight[{i}]") for i, x in enumerate(raw)]
    if not values:
        raise ValueError("at least one layer-group weight is required")
    total = sum(values, Fraction(0))
    return tuple(v / total for v in values)


def weights_from_ratio(ratio: Sequence[object]) -> tuple[Fraction, ...]:
    """The DEVICE byte weights from an explicit ratio, one entry per layer group (id order).

    Example: ``(1, 1, 2)`` -> ``(1/4, 1/4, 1/2)``; ``(0.1, 0.2, 0.7)`` -> ``(1/10, 1/5, 7/10)``.
    """
    return normalize_weights(ratio)


def weights_from_typical_batch(num_tokens: Sequence[int],
                               bytes_per_token: Sequence[int]) -> tuple[Fraction, ...]:
    """Byte weights of a typical batch: ``num_tokens[lg] * bytes_per_token[lg]``, normalized.

    ``num_tokens[lg]``: tokens the batch keeps in layer group ``lg`` (e.g. ``min(len, window)``
    per sequence for sliding-window groups). ``bytes_per_token[lg]``: hot bytes of one token of
    ``lg`` across all its layers, K and V. Both must be positive.

    Example: tokens ``(4096, 1024, 4096)``, bytes/token ``(128 Ki, 128 Ki, 64 Ki)`` ->
    ``512 Mi : 128 Mi : 256 Mi`` -> ``(4/7, 1/7, 2/7)``.
    """
    if len(num_tokens) != len(bytes_per_token):
        raise ValueError(f"num_tokens has {len(num_tokens)} entries, bytes_per_token "
                         f"{len(bytes_per_token)}")
    raw = [check_count(t, f"num_tokens[{i}]", minimum=1)
           * check_count(b, f"bytes_per_token[{i}]", minimum=1)
           for i, (t, b) in enumerate(zip(num_tokens, bytes_per_token))]
    return normalize_weights(raw)


def _check_layouts(weights: Sequence[Fraction],
                   layouts: Sequence[LayerGroupLayout]) -> tuple[Fraction, ...]:
    """Layouts in dense id order, one weight each; returns the weights re-normalized exactly."""
    if len(layouts) != len(weights):
        raise ValueError(f"{len(weights)} weights for {len(layouts)} layer groups")
    for i, layout in enumerate(layouts):
        if layout.layer_group_id != i:
            raise ValueError(f"layouts must be in layer-group id order 0..{len(layouts) - 1}; "
                             f"entry {i} is layer group {layout.layer_group_id}")
    return normalize_weights(weights)


def _dense_groups(level: CacheLevel, layouts: Sequence[LayerGroupLayout]) -> int:
    """The number of pool groups at ``level``; ValueError unless they are exactly 0..n-1."""
    groups = {layout.pool_group(level) for layout in layouts}
    if groups != set(range(len(groups))):
        kind = "cold" if level.is_cold else "hot"
        raise ValueError(f"{kind} pool groups must be dense from 0, got {sorted(groups)}")
    return len(groups)


def _water_fill(budget: int, weights: Sequence[Fraction], slot_bytes: Sequence[int],
                floors: Sequence[int], level: CacheLevel) -> list[int]:
    """Slots per group: proportional to ``weights`` in bytes, at least ``floors``, total bytes
    within ``budget``. Groups whose share is below their floor are fixed there and the rest of
    the budget is re-split among the others, until no share is below its floor."""
    num_groups = len(weights)
    floor_bytes = [floors[g] * slot_bytes[g] for g in range(num_groups)]
    if sum(floor_bytes) > budget:
        raise ValueError(f"{level.name} budget of {budget} bytes is below the pool groups' minimum "
                         f"of {sum(floor_bytes)} bytes ({floors} slots of {slot_bytes} bytes)")
    fixed = [False] * num_groups
    while True:
        free = [g for g in range(num_groups) if not fixed[g]]
        rest = budget - sum(floor_bytes[g] for g in range(num_groups) if fixed[g])
        total = sum((weights[g] for g in free), Fraction(0))
        slots = {g: math.floor(rest * weights[g] / total / slot_bytes[g]) for g in free}
        low = [g for g in free if slots[g] < floors[g]]
        if not low:
            break
        for g in low:  # NOTE: a fixed group never un-fixes: the rest only shrinks
            fixed[g] = True
    return [floors[g] if fixed[g] else slots[g] for g in range(num_groups)]


def split_device_budget(budget_bytes: int, weights: Sequence[Fraction],
                        layouts: Sequence[LayerGroupLayout], *,
                        min_slots: Sequence[int] | None = None,
                        num_reserved_slots: int = 1) -> tuple[PoolGroupSplit, ...]:
    """Slots per hot (DEVICE) pool group, in pool-group order; see the module docstring.

    ``weights``: one per layer group (id order), e.g. from :func:`weights_from_ratio`.
    ``min_slots``: per layer group, pages a batch constraint needs (hot floors; default none).
    ``num_reserved_slots``: slots of every hot group not usable for pages (slot 0, the null page).
    Members of one hot pool group must have equal ``hot_page_bytes`` (identical hot layout).
    """
    budget = check_count(budget_bytes, "budget_bytes", minimum=0)
    weights = _check_layouts(weights, layouts)
    reserved = check_count(num_reserved_slots, "num_reserved_slots", minimum=0)
    if min_slots is None:
        min_slots = [0] * len(layouts)
    if len(min_slots) != len(layouts):
        raise ValueError(f"{len(min_slots)} min_slots for {len(layouts)} layer groups")
    mins = [check_count(m, f"min_slots[{i}]", minimum=0) for i, m in enumerate(min_slots)]
    level = CacheLevel.DEVICE
    num_groups = _dense_groups(level, layouts)
    group_weights = [Fraction(0)] * num_groups
    page_bytes: list[int | None] = [None] * num_groups
    group_mins = [0] * num_groups
    for layout, w, m in zip(layouts, weights, mins):
        h = layout.hot_pool_group
        if page_bytes[h] not in (None, layout.hot_page_bytes):
            raise ValueError(f"hot pool group {h} mixes hot page sizes {page_bytes[h]} and "
                             f"{layout.hot_page_bytes} (layer group {layout.layer_group_id})")
        page_bytes[h] = layout.hot_page_bytes
        group_weights[h] += w
        group_mins[h] += m
    slot_bytes = [int(b) for b in page_bytes]  # type: ignore[arg-type]  # dense: all set
    floors = [reserved + max(1, m) for m in group_mins]
    slots = _water_fill(budget, group_weights, slot_bytes, floors, level)
    return tuple(PoolGroupSplit(level, PoolGroupIndex(h), slots[h], slot_bytes[h],
                                group_weights[h], floors[h]) for h in range(num_groups))


def _cold_slot_bytes(layouts: Sequence[LayerGroupLayout],
                     slot_bytes: Mapping[int, int] | Sequence[int] | None) -> list[int]:
    num_groups = _dense_groups(CacheLevel.HOST, layouts)
    largest = [0] * num_groups
    for layout in layouts:
        g = layout.cold_pool_group
        largest[g] = max(largest[g], layout.cold_page_bytes)
    if slot_bytes is None:
        return largest
    if len(slot_bytes) != num_groups:
        raise ValueError(f"{len(slot_bytes)} slot_bytes for {num_groups} cold pool groups")
    strides = [check_count(slot_bytes[g], f"slot_bytes[{g}]", minimum=1) for g in range(num_groups)]
    for g in range(num_groups):
        if strides[g] < largest[g]:
            raise ValueError(f"slot_bytes[{g}] = {strides[g]} is below the cold page size "
                             f"{largest[g]} of a member layer group")
    return strides


def cold_byte_weights(weights: Sequence[Fraction], layouts: Sequence[LayerGroupLayout], *,
                      slot_bytes: Mapping[int, int] | Sequence[int] | None = None
                      ) -> tuple[Fraction, ...]:
    """Per layer group, its normalized cold byte weight: ``c_lg / sum(c)`` with
    ``c_lg = w_lg / hot_page_bytes_lg * slot_bytes[cold group of lg]`` (see the module docstring).

    Example (the module's worked example): ``(1/4, 1/4, 1/2)`` -> ``(2/7, 1/7, 4/7)``.
    """
    weights = _check_layouts(weights, layouts)
    strides = _cold_slot_bytes(layouts, slot_bytes)
    raw = [w / layout.hot_page_bytes * strides[layout.cold_pool_group]
           for w, layout in zip(weights, layouts)]
    return normalize_weights(raw)


def split_cold_budget(level: CacheLevel, budget_bytes: int, weights: Sequence[Fraction],
                      layouts: Sequence[LayerGroupLayout], *,
                      slot_bytes: Mapping[int, int] | Sequence[int] | None = None,
                      min_slots: int = 1) -> tuple[PoolGroupSplit, ...]:
    """Slots per cold pool group of ``level`` (HOST or DISK), in pool-group order.

    ``weights`` are the DEVICE byte weights (one per layer group); they are projected through slot
    counts (:func:`cold_byte_weights`). ``slot_bytes``: per cold group, this tier's slot stride
    (default: the largest member cold page). ``min_slots``: the structural minimum per group;
    batch constraints do not apply here.
    """
    level = CacheLevel(level)
    if not level.is_cold:
        raise ValueError(f"split_cold_budget is for HOST or DISK, got {level.name}")
    budget = check_count(budget_bytes, "budget_bytes", minimum=0)
    floor = check_count(min_slots, "min_slots", minimum=0)
    per_layer = cold_byte_weights(weights, layouts, slot_bytes=slot_bytes)
    strides = _cold_slot_bytes(layouts, slot_bytes)
    num_groups = len(strides)
    group_weights = [Fraction(0)] * num_groups
    for layout, c in zip(layouts, per_layer):
        group_weights[layout.cold_pool_group] += c
    floors = [floor] * num_groups
    slots = _water_fill(budget, group_weights, strides, floors, level)
    return tuple(PoolGroupSplit(level, PoolGroupIndex(g), slots[g], strides[g], group_weights[g],
                                floors[g]) for g in range(num_groups))
