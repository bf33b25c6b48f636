"""Pool ratios: layer-group weights, DEVICE split with hot floors, cold projection via slots."""

from __future__ import annotations

import math
from fractions import Fraction as F

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_kvcm._pool_ratios import (
    cold_byte_weights,
    normalize_weights,
    split_cold_budget,
    split_device_budget,
    weights_from_ratio,
    weights_from_typical_batch,
)
from jax_kvcm._types import CacheLevel, LayerGroupLayout

DEVICE, HOST, DISK = CacheLevel.DEVICE, CacheLevel.HOST, CacheLevel.DISK
KiB, MiB = 1 << 10, 1 << 20

# The module docstring's worked example: lg0 and lg1 share hot group 0 but not a cold group;
# lg1 and lg2 share cold group 1 but not a hot group.
EXAMPLE = (
    LayerGroupLayout(0, hot_pool_group=0, hot_page_bytes=2 * MiB, cold_pool_group=0,
                     cold_page_bytes=2 * MiB),
    LayerGroupLayout(1, hot_pool_group=0, hot_page_bytes=2 * MiB, cold_pool_group=1,
                     cold_page_bytes=1 * MiB),
    LayerGroupLayout(2, hot_pool_group=1, hot_page_bytes=1 * MiB, cold_pool_group=1,
                     cold_page_bytes=1 * MiB),
)


def slots(split) -> list[int]:
    return [s.num_slots for s in split]


# ---------------------------------------------------------------------------------------------
# Weights.


def test_weights_from_ratio_is_exact():
    assert weights_from_ratio((1, 1, 2)) == (F(1, 4), F(1, 4), F(1, 2))
    assert weights_from_ratio((0.1, 0.2, 0.7)) == (F(1, 10), F(1, 5), F(7, 10))
    assert weights_from_ratio([F(1, 3), np.int64(1), np.float64(1.5)]) == (
        F(2, 17), F(6, 17), F(9, 17))
    assert sum(weights_from_ratio((0.1, 0.1, 0.1))) == 1


@pytest.mark.parametrize("bad, exc", [
    ((), ValueError), ((1, 0), ValueError), ((1, -2), ValueError),
    ((1, float("nan")), ValueError), ((1, float("inf")), ValueError),
    ((1, True), TypeError), ((1, "2"), TypeError), ((1, None), TypeError),
])
def test_bad_weights(bad, exc):
    with pytest.raises(exc):
        weights_from_ratio(bad)


def test_weights_from_typical_batch():
    w = weights_from_typical_batch((4096, 1024, 4096), (128 * KiB, 128 * KiB, 64 * KiB))
    assert w == (F(4, 7), F(1, 7), F(2, 7))
    with pytest.raises(ValueError, match="entries"):
        weights_from_typical_batch((1, 2), (3,))
    with pytest.raises(ValueError, match="num_tokens"):
        weights_from_typical_batch((0, 2), (3, 3))
    with pytest.raises(TypeError, match="bytes_per_token"):
        weights_from_typical_batch((1, 2), (3, 2.5))


# ---------------------------------------------------------------------------------------------
# The worked example, by hand.


def test_worked_example_device():
    w = weights_from_ratio((1, 1, 2))
    split = split_device_budget(64 * MiB, w, EXAMPLE)
    assert slots(split) == [16, 32]
    assert [s.weight for s in split] == [F(1, 2), F(1, 2)]
    assert [s.slot_bytes for s in split] == [2 * MiB, 1 * MiB]
    assert [s.min_slots for s in split] == [2, 2]  # null slot + one usable slot
    assert [s.pool_group for s in split] == [0, 1] and {s.level for s in split} == {DEVICE}
    assert sum(s.nbytes for s in split) == 64 * MiB


def test_worked_example_cold_projection_keeps_slot_proportions():
    w = weights_from_ratio((1, 1, 2))
    assert cold_byte_weights(w, EXAMPLE) == (F(2, 7), F(1, 7), F(4, 7))
    host = split_cold_budget(HOST, 56 * MiB, w, EXAMPLE)
    assert slots(host) == [8, 40]
    assert [s.weight for s in host] == [F(2, 7), F(5, 7)]
    assert [s.slot_bytes for s in host] == [2 * MiB, 1 * MiB]
    assert [s.min_slots for s in host] == [1, 1]
    # Implied per-layer-group slot counts: device 8 : 8 : 32 (hot group 0's 16 slots split by
    # lg0 : lg1 weights), host 8 : (40 split 1/8 : 1/2 -> 8 : 32). Same proportions.
    # A naive byte-share projection (hot byte weights straight to cold groups) would differ:
    naive = [F(1, 4), F(3, 4)]  # lg0 -> cold 0; lg1 + lg2 -> cold 1
    assert [math.floor(56 * MiB * x / b) for x, b in zip(naive, (2 * MiB, MiB))] == [7, 42]


def test_hot_floors_clamp_device_only():
    w = weights_from_ratio((1, 1, 2))
    device = split_device_budget(64 * MiB, w, EXAMPLE, min_slots=[0, 0, 40])
    # Hot group 1: floor 1 + 40 = 41 > its 32-slot share -> 41; hot group 0 gets
    # floor((64 - 41) MiB / 2 MiB) = 11.
    assert slots(device) == [11, 41]
    assert [s.min_slots for s in device] == [2, 41]
    assert sum(s.nbytes for s in device) == 63 * MiB
    # Floors of members sharing a hot group add up (they share its slot space).
    device = split_device_budget(64 * MiB, w, EXAMPLE, min_slots=[10, 10, 0])
    assert slots(device) == [21, 22] and device[0].min_slots == 21
    # The cold split has no constraint input: it is the unconstrained projection.
    assert slots(split_cold_budget(HOST, 56 * MiB, w, EXAMPLE)) == [8, 40]


def test_num_reserved_slots():
    w = weights_from_ratio((1, 1, 2))
    split = split_device_budget(64 * MiB, w, EXAMPLE, min_slots=[0, 0, 40], num_reserved_slots=0)
    assert slots(split) == [12, 40]


def test_water_filling_cascades():
    layouts = [LayerGroupLayout(i, i, MiB, 0, MiB) for i in range(3)]
    w = weights_from_ratio((1, 1, 1))
    # Shares 10 each. Group 0's floor 20 is fixed first; the other two then get 5 each, below
    # group 1's floor 6, which is fixed next; group 2 gets what is left: 4.
    split = split_device_budget(30 * MiB, w, layouts, min_slots=[20, 6, 0], num_reserved_slots=0)
    assert slots(split) == [20, 6, 4]
    # Floors exactly equal to the budget: all at their floor.
    split = split_device_budget(30 * MiB, w, layouts, min_slots=[20, 6, 4], num_reserved_slots=0)
    assert slots(split) == [20, 6, 4]
    with pytest.raises(ValueError, match="DEVICE budget"):
        split_device_budget(30 * MiB, w, layouts, min_slots=[20, 6, 5], num_reserved_slots=0)


def test_cold_structural_minimum_only():
    w = weights_from_ratio((1, 1, 2))
    # 3 MiB: shares 6/7 MiB and 15/7 MiB give 0 and 2 slots; cold group 0 is raised to its
    # structural 1 slot (2 MiB), cold group 1 gets the remaining 1 MiB.
    assert slots(split_cold_budget(DISK, 3 * MiB, w, EXAMPLE)) == [1, 1]
    with pytest.raises(ValueError, match="DISK budget"):
        split_cold_budget(DISK, 3 * MiB - 1, w, EXAMPLE)
    assert slots(split_cold_budget(DISK, 0, w, EXAMPLE, min_slots=0)) == [0, 0]
    with pytest.raises(ValueError, match="HOST or DISK"):
        split_cold_budget(DEVICE, MiB, w, EXAMPLE)


def test_padded_cold_slots_keep_slot_proportions():
    # A disk tier padding cold pages to 4 KiB: 6000-byte pages take 8 KiB slots.
    layouts = [LayerGroupLayout(0, 0, 16 * KiB, 0, 6000),
               LayerGroupLayout(1, 1, 8 * KiB, 1, 3000)]
    w = weights_from_ratio((2, 1))  # device: 2/3 -> 16 KiB pages, 1/3 -> 8 KiB pages: 1 : 1 slots
    assert cold_byte_weights(w, layouts, slot_bytes=[8 * KiB, 4 * KiB]) == (F(2, 3), F(1, 3))
    disk = split_cold_budget(DISK, 1200 * KiB, w, layouts, slot_bytes=[8 * KiB, 4 * KiB])
    assert slots(disk) == [100, 100]
    # Unpadded (host): 6000 : 3000 bytes per slot, still 1 : 1 slots.
    host = split_cold_budget(HOST, 900_000, w, layouts)
    assert slots(host) == [100, 100] and [s.slot_bytes for s in host] == [6000, 3000]
    with pytest.raises(ValueError, match="below the cold page size"):
        split_cold_budget(DISK, MiB, w, layouts, slot_bytes=[4 * KiB, 4 * KiB])
    with pytest.raises(ValueError, match="slot_bytes for 2"):
        split_cold_budget(DISK, MiB, w, layouts, slot_bytes=[8 * KiB])


def test_cold_group_stride_defaults_to_largest_member():
    layouts = [LayerGroupLayout(0, 0, 4 * KiB, 0, 3000), LayerGroupLayout(1, 1, 4 * KiB, 0, 4000)]
    split = split_cold_budget(HOST, 40_000, weights_from_ratio((1, 1)), layouts)
    assert [(s.num_slots, s.slot_bytes) for s in split] == [(10, 4000)]


@pytest.mark.parametrize("layouts, weights, match", [
    ((LayerGroupLayout(1, 0, 8, 0, 8), LayerGroupLayout(0, 0, 8, 0, 8)), (1, 1), "id order"),
    ((LayerGroupLayout(0, 0, 8, 0, 8), LayerGroupLayout(1, 0, 16, 0, 8)), (1, 1),
     "mixes hot page"),
    ((LayerGroupLayout(0, 0, 8, 0, 8), LayerGroupLayout(1, 2, 8, 0, 8)), (1, 1), "dense"),
    ((LayerGroupLayout(0, 0, 8, 0, 8),), (1, 1), "2 weights for 1"),
])
def test_bad_layouts(layouts, weights, match):
    with pytest.raises(ValueError, match=match):
        split_device_budget(1000, weights, layouts)


def test_bad_cold_layouts():
    layouts = (LayerGroupLayout(0, 0, 8, 1, 8), LayerGroupLayout(1, 0, 8, 2, 8))
    with pytest.raises(ValueError, match="cold pool groups must be dense"):
        split_cold_budget(HOST, 1000, (1, 1), layouts)


def test_layout_validation():
    with pytest.raises(ValueError, match="hot_page_bytes"):
        LayerGroupLayout(0, 0, 0, 0, 8)
    with pytest.raises(TypeError, match="cold_page_bytes"):
        LayerGroupLayout(0, 0, 8, 0, 8.0)
    lay = LayerGroupLayout(np.int32(0), 0, np.int64(8), 1, 4)
    assert type(lay.hot_page_bytes) is int and lay == LayerGroupLayout(0, 0, 8, 1, 4)
    assert (lay.pool_group(DEVICE), lay.pool_group(DISK), lay.page_bytes(HOST)) == (0, 1, 4)
    with pytest.raises(ValueError, match="min_slots"):
        split_device_budget(1000, (F(1),), (lay,), min_slots=[1, 2])


# ---------------------------------------------------------------------------------------------
# Randomized layouts.


@st.composite
def configs(draw):
    num_lg = draw(st.integers(1, 6), label="num_layer_groups")
    num_hot = draw(st.integers(1, num_lg))
    num_cold = draw(st.integers(1, num_lg))
    hot_of = draw(st.permutations(list(range(num_hot)) + draw(st.lists(
        st.integers(0, num_hot - 1), min_size=num_lg - num_hot, max_size=num_lg - num_hot))))
    cold_of = draw(st.permutations(list(range(num_cold)) + draw(st.lists(
        st.integers(0, num_cold - 1), min_size=num_lg - num_cold, max_size=num_lg - num_cold))))
    hot_bytes = [draw(st.integers(1, 64)) * 512 for _ in range(num_hot)]
    cold_bytes = [draw(st.integers(1, 64)) * 256 for _ in range(num_lg)]
    layouts = [LayerGroupLayout(i, hot_of[i], hot_bytes[hot_of[i]], cold_of[i], cold_bytes[i])
               for i in range(num_lg)]
    ratio = draw(st.lists(st.integers(1, 100), min_size=num_lg, max_size=num_lg))
    return layouts, weights_from_ratio(ratio)


@settings(max_examples=300, deadline=None, print_blob=True)
@given(configs(), st.integers(0, 1 << 24), st.data())
def test_random_device_split(config, budget, data):
    layouts, w = config
    mins = data.draw(st.lists(st.integers(0, 50), min_size=len(layouts), max_size=len(layouts)))
    num_groups = 1 + max(lay.hot_pool_group for lay in layouts)
    page = {lay.hot_pool_group: lay.hot_page_bytes for lay in layouts}
    floors = [1 + max(1, sum(m for m, lay in zip(mins, layouts) if lay.hot_pool_group == h))
              for h in range(num_groups)]
    if sum(f * page[h] for h, f in enumerate(floors)) > budget:
        with pytest.raises(ValueError):
            split_device_budget(budget, w, layouts, min_slots=mins)
        return
    split = split_device_budget(budget, w, layouts, min_slots=mins)
    assert [s.min_slots for s in split] == floors
    assert sum(s.nbytes for s in split) <= budget
    assert all(s.num_slots >= s.min_slots for s in split)
    assert sum(s.weight for s in split) == 1
    share = [math.floor(budget * s.weight / s.slot_bytes) for s in split]
    if all(q >= f for q, f in zip(share, floors)):  # no floor binds: exactly proportional
        assert slots(split) == share
    else:  # a group not held at its floor gets at most its unconstrained share
        assert all(s.num_slots == s.min_slots or s.num_slots <= q for s, q in zip(split, share))
    # More budget never takes slots away from any group.
    more = split_device_budget(budget + data.draw(st.integers(0, 1 << 22)), w, layouts,
                               min_slots=mins)
    assert all(b.num_slots >= a.num_slots for a, b in zip(split, more))


@settings(max_examples=300, deadline=None, print_blob=True)
@given(configs(), st.integers(1 << 16, 1 << 30))
def test_random_cold_projection_preserves_slot_proportions(config, budget):
    layouts, w = config
    c = cold_byte_weights(w, layouts)
    stride = {}
    for lay in layouts:
        stride[lay.cold_pool_group] = max(stride.get(lay.cold_pool_group, 0), lay.cold_page_bytes)
    # Implied cold slots per layer group over implied hot slots is one constant for all groups.
    ratios = {c[i] / stride[lay.cold_pool_group] / (w[i] / lay.hot_page_bytes)
              for i, lay in enumerate(layouts)}
    assert len(ratios) == 1
    if sum(stride.values()) > budget:  # below the structural minimum of one slot per group
        with pytest.raises(ValueError):
            split_cold_budget(HOST, budget, w, layouts)
        return
    split = split_cold_budget(HOST, budget, w, layouts)
    assert sum(s.nbytes for s in split) <= budget
    assert all(s.num_slots >= 1 for s in split)
    group_weight = {}
    for i, lay in enumerate(layouts):
        group_weight[lay.cold_pool_group] = group_weight.get(lay.cold_pool_group, 0) + c[i]
    share = [math.floor(budget * group_weight[g] / stride[g]) for g in range(len(split))]
    if all(q >= 1 for q in share):
        assert slots(split) == share
    assert [s.weight for s in split] == [group_weight[g] for g in range(len(split))]


def test_normalize_weights_keeps_order():
    assert normalize_weights([3, 1]) == (F(3, 4), F(1, 4))
