"""StagingRing: next-fit, wrap-around, fences kept by padding fragments, size/alignment rules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_kvcm._staging_ring import (
    MIN_STAGING_RING_BYTES,
    ArrayFence,
    Fence,
    StagingRing,
    staging_ring_capacity,
)

MiB = 1 << 20


class FakeFence:
    """A test fence: not ready until ``wait()`` or ``ready = True``; counts waits."""

    __slots__ = ("name", "ready", "num_waits")

    def __init__(self, name: str, ready: bool = False) -> None:
        self.name = name
        self.ready = ready
        self.num_waits = 0

    def is_ready(self) -> bool:
        return self.ready

    def wait(self) -> None:
        self.num_waits += 1
        self.ready = True

    def __repr__(self) -> str:
        return f"F({self.name}{', ready' if self.ready else ''})"


def layout(ring: StagingRing) -> list[tuple[int, int, str]]:
    """[(offset, end, 'L' | fence name | '-')] for compact comparisons."""
    out = []
    for r in ring.ranges():
        tag = "L" if r.live else ("-" if r.fence is None else r.fence.name)
        out.append((r.offset, r.end, tag))
    return out


def fill(ring: StagingRing, sizes: list[int], alignment: int = 1) -> list:
    """Allocates back to back from the cursor (each size is its own granularity)."""
    leases = [ring.allocate(n, granularity=n, alignment=alignment) for n in sizes]
    assert all(lease is not None for lease in leases)
    return leases


# ---------------------------------------------------------------------------------------------
# Capacity helper.


def test_staging_ring_capacity():
    assert staging_ring_capacity(2 * MiB) == 64 * MiB == MIN_STAGING_RING_BYTES
    assert staging_ring_capacity(40 * MiB) == 120 * MiB
    edge = MIN_STAGING_RING_BYTES // 3  # 3 * edge < 64 MiB <= 3 * (edge + 1)
    assert staging_ring_capacity(edge) == 64 * MiB
    assert staging_ring_capacity(edge + 1) == 3 * (edge + 1) > 64 * MiB
    assert staging_ring_capacity(1) == 64 * MiB
    biggest = ((1 << 63) - 1) // 3
    assert staging_ring_capacity(biggest) == 3 * biggest
    with pytest.raises(OverflowError):
        staging_ring_capacity(biggest + 1)
    with pytest.raises(ValueError, match="max_cold_page_bytes"):
        staging_ring_capacity(0)  # the codec's failure value
    with pytest.raises(ValueError):
        staging_ring_capacity(-5)
    for bad in (1.5, True, "2"):
        with pytest.raises(TypeError):
            staging_ring_capacity(bad)


# ---------------------------------------------------------------------------------------------
# Size and alignment rules.


def test_size_rounding():
    ring = StagingRing(100, base_alignment=64)
    lease = ring.allocate(5, granularity=4, alignment=4)  # min rounded up
    assert (lease.offset, lease.nbytes) == (0, 8)
    lease = ring.allocate(1, 11, granularity=4, alignment=4)  # max rounded down
    assert (lease.offset, lease.nbytes, lease.num_slices) == (8, 8, 2)
    # max larger than what is left: the available bytes are rounded down (100 - 16 = 84 -> 80).
    lease = ring.allocate(4, 1000, granularity=8, alignment=8)
    assert (lease.offset, lease.nbytes) == (16, 80)
    assert [lease.slice_offset(i) for i in (0, 1, 9)] == [16, 24, 88]
    with pytest.raises(IndexError):
        lease.slice_offset(10)
    ring.check_invariants()


def test_granularity_need_not_be_a_power_of_two():
    ring = StagingRing(200, base_alignment=64)
    ring.allocate(3, granularity=3, alignment=1)
    lease = ring.allocate(24, 72, granularity=24, alignment=8)
    assert (lease.offset, lease.nbytes) == (8, 72)
    assert all(lease.slice_offset(i) % 8 == 0 for i in range(lease.num_slices))
    assert layout(ring) == [(0, 3, "L"), (3, 8, "-"), (8, 80, "L"), (80, 200, "-")]


@pytest.mark.parametrize("kwargs, match", [
    (dict(min_bytes=8, granularity=8, alignment=3), "power of two"),
    (dict(min_bytes=8, granularity=8, alignment=0), "alignment"),
    (dict(min_bytes=12, granularity=12, alignment=8), "multiple of alignment"),
    (dict(min_bytes=8, granularity=0, alignment=1), "granularity"),
    (dict(min_bytes=128, granularity=128, alignment=128), "base alignment"),
    (dict(min_bytes=0, granularity=8, alignment=8), "min_bytes"),
    (dict(min_bytes=5, max_bytes=7, granularity=4, alignment=4), "no multiple"),
    (dict(min_bytes=8, max_bytes=4, granularity=4, alignment=4), "no multiple"),
    (dict(min_bytes=1001, granularity=1, alignment=1), "capacity"),
    (dict(min_bytes=997, granularity=12, alignment=4), "capacity"),  # rounds up to 1008
])
def test_bad_requests_raise_and_change_nothing(kwargs, match):
    ring = StagingRing(1000, base_alignment=64)
    ring.allocate(10, granularity=10, alignment=2)
    before = (layout(ring), ring.cursor)
    min_bytes = kwargs.pop("min_bytes")
    with pytest.raises(ValueError, match=match):
        ring.allocate(min_bytes, **kwargs)
    assert (layout(ring), ring.cursor) == before


def test_bad_constructor_args():
    with pytest.raises(ValueError):
        StagingRing(0)
    with pytest.raises(ValueError, match="power of two"):
        StagingRing(100, base_alignment=48)
    with pytest.raises(TypeError):
        StagingRing(100.0)


# ---------------------------------------------------------------------------------------------
# Next-fit and wrap-around.


def test_next_fit_continues_after_the_last_allocation():
    ring = StagingRing(100, base_alignment=64)
    a, b, c = fill(ring, [20, 20, 20])
    ring.release(a)  # a hole at [0, 20) before the cursor
    d = ring.allocate(20, granularity=20, alignment=1)
    assert d.offset == 60, "next-fit must not go back to the hole while there is room ahead"
    assert ring.cursor == 80
    e = ring.allocate(20, granularity=20, alignment=1)
    assert e.offset == 80 and ring.cursor == 0  # reached the physical end
    f = ring.allocate(20, granularity=20, alignment=1)  # wraps to the hole
    assert f.offset == 0 and ring.cursor == 20
    ring.check_invariants()


def test_wrap_around_when_the_tail_is_too_small():
    ring = StagingRing(100, base_alignment=64)
    a, b, c, d = fill(ring, [30, 30, 30, 5])
    assert ring.cursor == 95
    ring.release(a)
    ring.release(c)
    # [60, 90) is free but the cursor is at 95: tail [95, 100) is too small; the second pass
    # starts at 0 and takes the first run that fits.
    e = ring.allocate(25, granularity=25, alignment=1)
    assert e.offset == 0 and ring.cursor == 25
    f = ring.allocate(25, granularity=25, alignment=1)  # [25, 30) too small: next run ahead
    assert f.offset == 60 and ring.cursor == 85
    ring.check_invariants()


def test_second_pass_sees_the_run_containing_the_cursor_whole():
    ring = StagingRing(100, base_alignment=64)
    a, b = fill(ring, [40, 60])
    ring.release(a)
    ring.allocate(10, granularity=10, alignment=1)  # [0, 10), cursor 10
    ring.release(b)
    # Free: [10, 100), cursor 10; release everything and put the cursor mid-run.
    lease = ring.allocate(50, granularity=50, alignment=1)
    assert (lease.offset, ring.cursor) == (10, 60)
    ring.release(lease)
    # Free run [10, 100) contains the cursor (60); from the cursor only 40 bytes remain, but the
    # second pass sees the run from its start.
    big = ring.allocate(80, granularity=80, alignment=1)
    assert big is not None and big.offset == 10 and ring.cursor == 90


def test_fails_instead_of_waiting_on_live_leases():
    ring = StagingRing(64, base_alignment=64)
    fence = FakeFence("old")
    a, b = fill(ring, [32, 32])
    ring.release(a, fence)
    snapshot = (layout(ring), ring.cursor, ring.num_live)
    assert ring.allocate(40, granularity=8, alignment=8) is None  # only 32 retired bytes
    assert ring.allocate(33, granularity=1, alignment=1) is None
    assert (layout(ring), ring.cursor, ring.num_live) == snapshot, "failure changed the ring"
    assert fence.num_waits == 0, "allocation must never wait"
    # A retired run with an unready fence is allocatable: the fence goes to the new owner.
    c = ring.allocate(32, granularity=32, alignment=32)
    assert c.offset == 0 and c.wait_fences == (fence,) and fence.num_waits == 0
    assert ring.allocate(1, granularity=1, alignment=1) is None  # full of live leases


# ---------------------------------------------------------------------------------------------
# Fences.


def test_lease_waits_on_the_fences_it_covers_and_skips_ready_ones():
    ring = StagingRing(64, base_alignment=64)
    f0, f1, f2 = FakeFence("f0"), FakeFence("f1", ready=True), FakeFence("f2")
    a, b, c, d = fill(ring, [16, 16, 16, 16])
    for lease, fence in ((a, f0), (b, f1), (c, f2), (d, f0)):
        ring.release(lease, fence)
    assert layout(ring) == [(0, 16, "f0"), (16, 32, "f1"), (32, 48, "f2"), (48, 64, "f0")]
    whole = ring.allocate(64, granularity=64, alignment=64)
    assert whole.wait_fences == (f0, f2)  # distinct, in address order, f1 already ready
    whole.wait()
    assert (f0.num_waits, f1.num_waits, f2.num_waits) == (1, 0, 1)
    ring.release(whole, None)
    assert layout(ring) == [(0, 64, "-")]


def test_padding_fragments_keep_their_fences():
    ring = StagingRing(128, base_alignment=64)
    fences = [FakeFence(f"f{i}") for i in range(9)]
    leases = fill(ring, [8] * 8, alignment=8) + fill(ring, [64], alignment=64)
    for lease, fence in zip(leases, fences):
        ring.release(lease, fence)
    assert ring.cursor == 0
    small = ring.allocate(4, granularity=4, alignment=4)
    assert (small.offset, small.wait_fences) == (0, (fences[0],))
    assert layout(ring)[:2] == [(0, 4, "L"), (4, 8, "f0")]  # end slack keeps f0
    # Aligned to 32 from cursor 4: padding [4, 32) crosses f0..f3 and stays split there.
    lease = ring.allocate(32, granularity=32, alignment=32)
    assert (lease.offset, lease.nbytes) == (32, 32)
    assert lease.wait_fences == tuple(fences[4:8])
    assert layout(ring) == [(0, 4, "L"), (4, 8, "f0"), (8, 16, "f1"), (16, 24, "f2"),
                            (24, 32, "f3"), (32, 64, "L"), (64, 128, "f8")]
    # Ending inside a retired range: the slack keeps that range's fence.
    tail = ring.allocate(16, granularity=16, alignment=16)
    assert (tail.offset, tail.wait_fences) == (64, (fences[8],))
    assert layout(ring)[-2:] == [(64, 80, "L"), (80, 128, "f8")]
    # A later lease over the padding waits on exactly the fences of the bytes it takes.
    ring.release(small, fences[0])
    pad = ring.allocate(12, granularity=12, alignment=4)  # cursor 80: [80, 92), f8
    assert (pad.offset, pad.wait_fences) == (80, (fences[8],))
    assert all(f.num_waits == 0 for f in fences)
    ring.check_invariants()


def test_release_merges_neighbours_with_the_same_fence():
    ring = StagingRing(40, base_alignment=64)
    f, g = FakeFence("f"), FakeFence("g")
    a, b, c, d = fill(ring, [10, 10, 10, 10])
    ring.release(a, f)
    ring.release(c, f)
    ring.release(b, g)
    assert layout(ring) == [(0, 10, "f"), (10, 20, "g"), (20, 30, "f"), (30, 40, "L")]
    ring.release(d, f)
    assert layout(ring) == [(0, 10, "f"), (10, 20, "g"), (20, 40, "f")]
    ring.check_invariants()
    # Equal but distinct fence objects do not merge (identity, not equality).
    ring2 = StagingRing(20, base_alignment=64)
    x, y = fill(ring2, [10, 10])
    ring2.release(x, FakeFence("h"))
    ring2.release(y, FakeFence("h"))
    assert ring2.num_ranges == 2


def test_forget_ready_fences_and_drain():
    ring = StagingRing(40, base_alignment=64)
    f, g = FakeFence("f"), FakeFence("g")
    a, b, c, d = fill(ring, [10, 10, 10, 10])
    for lease, fence in ((a, f), (b, g), (c, f)):
        ring.release(lease, fence)
    assert ring.forget_ready_fences() == 0
    g.ready = True
    assert ring.forget_ready_fences() == 1
    assert layout(ring) == [(0, 10, "f"), (10, 20, "-"), (20, 30, "f"), (30, 40, "L")]
    with pytest.raises(RuntimeError, match="live"):
        ring.close()
    ring.release(d)
    assert layout(ring) == [(0, 10, "f"), (10, 20, "-"), (20, 30, "f"), (30, 40, "-")]
    ring.close()  # waits on f once, then everything is free
    assert f.num_waits == 1 and layout(ring) == [(0, 40, "-")]
    ring.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        ring.allocate(1, granularity=1, alignment=1)


def test_release_misuse():
    ring, other = StagingRing(40, base_alignment=64), StagingRing(40, base_alignment=64)
    lease = ring.allocate(8, granularity=8, alignment=8)
    with pytest.raises(ValueError, match="another"):
        other.release(lease)
    with pytest.raises(TypeError, match="fence"):
        ring.release(lease, object())
    ring.release(lease)
    assert lease.released
    with pytest.raises(RuntimeError, match="double release"):
        ring.release(lease)
    ring.check_invariants()


def test_array_fence_over_a_jax_array():
    x = jnp.arange(16) * 2
    fence = ArrayFence(x)
    assert isinstance(fence, Fence)
    fence.wait()
    assert fence.is_ready()
    ring = StagingRing(16, base_alignment=64)
    lease = ring.allocate(16, granularity=16, alignment=16)
    ring.release(lease, fence)
    assert ring.allocate(16, granularity=16, alignment=16).wait_fences == ()  # ready: no wait
    # A donated array cannot serve as a fence: a clear error, not a silent "ready".
    step = jax.jit(lambda a: a + 1, donate_argnums=0)
    y = step(jnp.ones(1024))
    step(y)
    with pytest.raises(RuntimeError, match="donated"):
        ArrayFence(y).is_ready()
    with pytest.raises(RuntimeError, match="donated"):
        ArrayFence(y).wait()


# ---------------------------------------------------------------------------------------------
# Randomized: random operation sequences against a byte-level model.


class ByteModel:
    """Per byte: live or not, and the fence its last owner left (None = nothing to wait for)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.live = [False] * capacity
        self.fence: list = [None] * capacity
        self.cursor = 0

    def runs(self) -> list[tuple[int, int]]:
        out, start = [], None
        for i, live in enumerate(self.live + [True]):
            if not live and start is None:
                start = i
            elif live and start is not None:
                out.append((start, i))
                start = None
        return out

    def next_fit(self, lo: int, hi: int, g: int, a: int) -> tuple[int, int] | None:
        """The reference answer: runs from the cursor to the end, then runs starting before it."""
        runs = self.runs()
        order = [(max(s, self.cursor), e) for s, e in runs if e > self.cursor]
        order += [(s, e) for s, e in runs if s < self.cursor]
        for s, e in order:
            start = -(-s // a) * a
            if e - start >= lo:
                return start, min(hi, (e - start) // g * g)
        return None


@settings(max_examples=250, deadline=None, print_blob=True)
@given(st.data())
def test_random_operations_match_byte_model(data):
    capacity = data.draw(st.integers(1, 300), label="capacity")
    base = data.draw(st.sampled_from([1, 8, 64]), label="base_alignment")
    ring = StagingRing(capacity, base_alignment=base)
    model = ByteModel(capacity)
    live: list = []
    fences: list[FakeFence] = []

    for _ in range(data.draw(st.integers(1, 60), label="num_ops")):
        op = data.draw(st.sampled_from(["alloc", "alloc", "alloc", "release", "release",
                                        "ready", "forget"]))
        if op == "alloc":
            a = data.draw(st.sampled_from([x for x in (1, 2, 4, 8, 16, 32, 64) if x <= base]))
            g = a * data.draw(st.integers(1, 6))
            lo = data.draw(st.integers(1, max(1, capacity // 2)))
            max_bytes = data.draw(st.one_of(st.none(), st.integers(lo, capacity + 20)))
            lo_r = -(-lo // g) * g
            hi_r = lo_r if max_bytes is None else max_bytes // g * g
            if hi_r < lo_r or lo_r > capacity:
                with pytest.raises(ValueError):
                    ring.allocate(lo, max_bytes, granularity=g, alignment=a)
                continue
            want = model.next_fit(lo_r, hi_r, g, a)
            lease = ring.allocate(lo, max_bytes, granularity=g, alignment=a)
            if want is None:
                assert lease is None
                # It failed only because no retired run anywhere fits the minimum.
                for s, e in model.runs():
                    assert e - (-(-s // a) * a) < lo_r
                continue
            assert lease is not None and (lease.offset, lease.nbytes) == want
            span = range(lease.offset, lease.end)
            assert not any(model.live[i] for i in span)
            covered = {id(model.fence[i]): model.fence[i] for i in span
                       if model.fence[i] is not None and not model.fence[i].ready}
            assert {id(f) for f in lease.wait_fences} == set(covered)
            assert len(lease.wait_fences) == len(covered)  # distinct
            for i in span:
                model.live[i] = True
            model.cursor = lease.end % capacity
            live.append(lease)
        elif op == "release" and live:
            lease = live.pop(data.draw(st.integers(0, len(live) - 1)))
            choice = data.draw(st.sampled_from(["none", "new", "old"]))
            if choice == "none":
                fence = None
            elif choice == "old" and fences:
                fence = data.draw(st.sampled_from(fences))
            else:
                fence = FakeFence(str(len(fences)))
                fences.append(fence)
            ring.release(lease, fence)
            for i in range(lease.offset, lease.end):
                model.live[i] = False
                model.fence[i] = fence
        elif op == "ready" and fences:
            data.draw(st.sampled_from(fences)).ready = True
        elif op == "forget":
            ring.forget_ready_fences()
            model.fence = [None if f is not None and f.ready else f for f in model.fence]
        ring.check_invariants()
        assert ring.cursor == model.cursor
        for r in ring.ranges():
            for i in range(r.offset, r.end):
                assert model.live[i] == r.live
                # Retired bytes keep exactly the fence of their last owner (None once
                # forget_ready_fences dropped it as ready).
                if not r.live:
                    assert r.fence is model.fence[i], (i, r, model.fence[i])
    assert all(f.num_waits == 0 for f in fences), "the ring waited on a fence"
