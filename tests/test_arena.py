"""The contiguous arena on CPU: the memfd reservation for real, the allocator/budget, adoption,
prefix aliasing, fence-gated reclaim, suspend/resume and the seed's four bugs.

Oracles: numpy copies of what was written (read back through the arena, through other mapped
addresses of the same physical memory, or through the paged-attention op against the pure-JAX
reference), and the native reservation's own counters.
"""

from __future__ import annotations

import numpy as np
import pytest

from jax_kvcm import _ffi
from jax_kvcm._arena import (Arena, ArenaConfig, ArenaHostStore, ArenaIndexRing, ArenaLayout,
                             ArenaSuspend)

GRAN = _ffi._kvcm_cpu.reservation_granularity()
LAYOUT = ArenaLayout(num_layers=2, tokens_per_page=4, num_kv_heads=2, head_dim=16)  # 512 B slots
PPC = GRAN // LAYOUT.slot_bytes  # pages per chunk with one-granule super-pages


class Fence:
    """A step's completion as the arena sees it: not ready until ``finish()`` or a wait.

    ``on_wait`` runs when a waiter blocks on it (the test checks what the arena did before)."""

    def __init__(self, on_wait=None) -> None:
        self.done = False
        self.num_waits = 0
        self.on_wait = on_wait

    def is_ready(self) -> bool:
        return self.done

    def block_until_ready(self) -> Fence:
        if not self.done:
            self.num_waits += 1
            if self.on_wait is not None:
                self.on_wait()
            self.done = True
        return self


def make_arena(*, max_sequences=4, max_pages=2 * PPC, budget_chunks=8, **kw) -> Arena:
    """Prefix keys are per chunk unless ``alias_unit_pages`` says otherwise."""
    kw.setdefault("alias_unit_pages", PPC)
    chunk_bytes = 2 * LAYOUT.num_layers * GRAN
    cfg = ArenaConfig(max_sequences=max_sequences, max_pages_per_sequence=max_pages,
                      budget_bytes=budget_chunks * chunk_bytes, super_page_bytes=GRAN, **kw)
    return Arena(cfg, LAYOUT, backend="cpu")


def pages(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    shape = (LAYOUT.num_layers, n, LAYOUT.tokens_per_page, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return (rng.standard_normal(shape).astype(np.float32),
            rng.standard_normal(shape).astype(np.float32))


# -- the native reservation ------------------------------------------------------------------


def test_reservation_maps_shares_and_counts():
    r = _ffi._kvcm_cpu.Reservation(8 * GRAN, GRAN)
    view = r.view()
    h = r.create_physical()
    r.map(0, h)
    r.map(3 * GRAN, h)  # the same physical page at a second address
    assert r.is_mapped(0) and r.is_mapped(3 * GRAN) and not r.is_mapped(GRAN)
    assert r.handle_at(3 * GRAN) == h and r.handle_at(GRAN) == -1
    assert not view[:GRAN].any()  # fresh physical memory reads zero
    data = np.random.default_rng(0).integers(0, 256, GRAN, dtype=np.uint8)
    view[:GRAN] = data
    assert np.array_equal(view[3 * GRAN:4 * GRAN], data)  # written through one, seen in the other
    with pytest.raises(ValueError, match="still mapped"):
        r.release_physical(h)
    with pytest.raises(ValueError, match="already mapped"):
        r.map(0, h)
    with pytest.raises(ValueError, match="unmapped super-page"):
        r.read(0, np.empty(2 * GRAN, np.uint8).ctypes.data, 2 * GRAN)
    r.unmap(0)
    r.unmap(3 * GRAN)
    r.release_physical(h)
    h2 = r.create_physical()  # the released page comes back zeroed (hole punched)
    r.map(GRAN, h2)
    assert not view[GRAN:2 * GRAN].any()
    assert (r.num_map_calls, r.num_unmap_calls, r.num_create_calls, r.num_release_calls) == \
        (3, 2, 2, 1)
    assert r.mapped_bytes == GRAN and r.physical_bytes == GRAN
    r.close()
    assert r.closed and r.num_unmap_calls == 3 and r.num_release_calls == 2
    assert r.mapped_bytes == 0 and r.physical_bytes == 0
    with pytest.raises(ValueError, match="closed"):
        r.create_physical()


def test_reservation_bad_arguments():
    with pytest.raises(ValueError, match="super_page_bytes must be a positive multiple"):
        _ffi._kvcm_cpu.Reservation(8 * GRAN, GRAN // 2)
    with pytest.raises(ValueError, match="nbytes must be a positive multiple"):
        _ffi._kvcm_cpu.Reservation(GRAN + 1, GRAN)
    with pytest.raises(MemoryError, match="address space"):
        _ffi._kvcm_cpu.Reservation(1 << 62, GRAN)
    r = _ffi._kvcm_cpu.Reservation(4 * GRAN, GRAN)
    with pytest.raises(ValueError, match="offset must be a multiple"):
        r.map(GRAN + 8, r.create_physical())
    with pytest.raises(ValueError, match="not a live physical handle"):
        r.map(0, 99)
    with pytest.raises(ValueError, match="not mapped"):
        r.unmap(0)
    r.close()


# -- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize("field,value,exc", [
    ("max_sequences", 0, ValueError), ("max_pages_per_sequence", -1, ValueError),
    ("budget_bytes", 0, ValueError), ("super_page_bytes", 3 * 4096, ValueError),
    ("super_page_bytes", 2.0, TypeError), ("adoption", 1, TypeError),
    ("prefix_aliasing", None, TypeError), ("protected_span_fraction", 1.0, ValueError),
    ("protected_span_fraction", -0.1, ValueError)])
def test_config_names_the_bad_field(field, value, exc):
    kw = dict(max_sequences=2, max_pages_per_sequence=8, budget_bytes=1 << 20)
    kw[field] = value
    with pytest.raises(exc, match=f"ArenaConfig.{field}"):
        ArenaConfig(**kw)


def test_arena_construction_errors_name_the_field():
    ok = dict(max_sequences=2, max_pages_per_sequence=8, budget_bytes=1 << 22)
    with pytest.raises(ValueError, match="ArenaConfig.super_page_bytes .* granularity"):
        Arena(ArenaConfig(**ok, super_page_bytes=GRAN // 2), LAYOUT, backend="cpu")
    with pytest.raises(ValueError, match="ArenaConfig.max_sequences"):
        Arena(ArenaConfig(max_sequences=1 << 30, max_pages_per_sequence=1 << 20,
                          budget_bytes=1 << 22, super_page_bytes=GRAN), LAYOUT, backend="cpu")
    with pytest.raises(ValueError, match="ArenaConfig.budget_bytes"):
        Arena(ArenaConfig(max_sequences=2, max_pages_per_sequence=8, budget_bytes=GRAN,
                          super_page_bytes=GRAN), LAYOUT, backend="cpu")
    with pytest.raises(ValueError, match="ArenaLayout.head_dim"):
        ArenaLayout(num_layers=1, tokens_per_page=4, num_kv_heads=1, head_dim=0)


# -- growth, adoption, capacity --------------------------------------------------------------


def test_growth_maps_chunks_on_demand_and_fails_as_a_value():
    with make_arena(max_sequences=3, max_pages=3 * PPC, budget_chunks=4) as a:
        base_maps = a.stats().num_map_calls
        per_chunk = 2 * LAYOUT.num_layers  # one super-page per pool-layer
        s = a.admit()
        assert s.base_slot == a.chunks_per_range * 0 * PPC + PPC  # range 0 starts after chunk 0
        assert a.ensure(s, 1) and a.stats().num_map_calls == base_maps + per_chunk
        assert a.ensure(s, PPC) and a.stats().num_map_calls == base_maps + per_chunk  # same chunk
        assert a.ensure(s, PPC + 1) and a.stats().used_chunks == 3
        t = a.admit()
        assert t.base_slot == s.base_slot + 3 * PPC  # ranges are contiguous and disjoint
        assert a.ensure(t, PPC)
        before = a.stats()
        assert not a.ensure(t, 2 * PPC)  # budget exhausted, nothing parked: refused
        assert a.stats() == before and t.num_pages == PPC
        np.testing.assert_array_equal(t.page_table(), np.arange(t.base_slot, t.base_slot + PPC))
        with pytest.raises(ValueError, match="max_pages_per_sequence"):
            a.ensure(t, 3 * PPC + 1)
        assert a.max_num_sequences(PPC) == 3 and a.max_num_sequences(2 * PPC) == 1
        assert a.max_pages_for(1) == 3 * PPC and a.max_pages_for(2) == PPC
        assert a.max_pages_for(3) == PPC and a.max_pages_for(4) == 0
        for n in range(1, 4):  # the two planners agree
            assert a.max_num_sequences(a.max_pages_for(n)) >= n


def test_adoption_steady_state_has_no_map_calls_and_flat_memory():
    rng = np.random.default_rng(1)
    print("seed 1")
    with make_arena(max_sequences=4, max_pages=2 * PPC, budget_chunks=9) as a:
        live = [a.admit() for _ in range(4)]
        for s in live:
            assert a.ensure(s, 2 * PPC)
        warm = a.stats()
        for cycle in range(1000):
            i = int(rng.integers(4))
            a.close(live[i])
            live[i] = a.admit()
            assert a.ensure(live[i], int(rng.integers(1, 2 * PPC + 1)))
        st = a.stats()
        assert st.num_map_calls == warm.num_map_calls and st.num_unmap_calls == 0
        assert st.mapped_bytes == warm.mapped_bytes and st.num_adoptions == 1000
        # The adopted range still holds the previous owner's bytes; the new one overwrites them.
        k, v = pages(rng, 2 * PPC)
        a.write_pages(live[0], 0, k, v)
        got = a.read_pages(live[0], 0, 2 * PPC)
        np.testing.assert_array_equal(got[0], k)
        np.testing.assert_array_equal(got[1], v)


def test_create_close_cycles_without_adoption_keep_mapped_bytes_flat():
    with make_arena(max_sequences=2, budget_chunks=3, adoption=False) as a:
        floor = a.stats().mapped_bytes
        for _ in range(1000):
            s = a.admit()
            assert a.ensure(s, 2 * PPC)
            a.close(s)
            assert a.stats().mapped_bytes == floor
        st = a.stats()
        assert st.num_map_calls - 2 * LAYOUT.num_layers == st.num_unmap_calls  # null chunk stays


def test_admission_refused_when_every_range_is_active():
    with make_arena(max_sequences=2) as a:
        s, t = a.admit(), a.admit()
        assert a.admit() is None
        a.close(s)
        assert a.admit() is not None
        with pytest.raises(ValueError, match="not an active sequence"):
            a.ensure(s, 1)
        a.close(t)
        with pytest.raises(ValueError, match="not an active sequence"):
            a.close(t)


def test_teardown_returns_every_range_and_handle():
    with make_arena(max_sequences=4, budget_chunks=8) as a:
        seqs = [a.admit(keys) for keys in ((), ("p0",), (), ())]
        for s in seqs:
            a.ensure(s, 2 * PPC)
        a.close(seqs[0], ("p0", "p1"))
        t = a.admit(("p0", "p1"))  # aliases both chunks
        a.record_step([t], Fence())
        a.close(seqs[2])
        a.close_arena()
        n = a.native_counters()
        assert n["num_map_calls"] == n["num_unmap_calls"] > 0
        assert n["num_create_calls"] == n["num_release_calls"] > 0
        assert n["mapped_bytes"] == n["physical_bytes"] == n["num_physical"] == 0
        assert a._res.closed
        with pytest.raises(ValueError, match="closed"):
            a.admit()


# -- prefix aliasing -------------------------------------------------------------------------


def _owner_with_prefix(a: Arena, rng, keys=("a", "b")):
    s = a.admit()
    assert a.ensure(s, 2 * PPC)
    k, v = pages(rng, 2 * PPC)
    a.write_pages(s, 0, k, v)
    return s, k, v


def test_alias_maps_the_same_physical_pages_with_zero_budget():
    rng = np.random.default_rng(2)
    with make_arena() as a:
        s, k, v = _owner_with_prefix(a, rng)
        a.close(s, ("a", "b"))
        used = a.stats().used_chunks
        u = a.admit(("a", "b"))  # the owner's parked range, both spans in place
        assert u.num_aliased_pages == 2 * PPC and u.base_slot == s.base_slot
        # A second admission (while u lives) where only the first chunk matches: a fresh range.
        t = a.admit(("a", "x"))
        assert t.num_aliased_pages == PPC and t.base_slot != u.base_slot
        assert a.stats().used_chunks == used  # zero budget for the aliases
        got_k, got_v = a.read_pages(t, 0, PPC)
        np.testing.assert_array_equal(got_k, k[:, :PPC])
        np.testing.assert_array_equal(got_v, v[:, :PPC])
        k2, _ = pages(rng, 1)
        a.write_pages(u, 0, k2, k2)  # NOTE: written through u: shared, so t sees it
        np.testing.assert_array_equal(a.read_pages(t, 0, 1)[0], k2)
        assert a.stats().num_alias_hits == 2


@pytest.mark.parametrize("order", ["owner_first", "alias_first", "both_then_pressure",
                                   "under_pressure"])
def test_alias_refcount_matrix(order):
    rng = np.random.default_rng(3)
    budget = 4 if order == "under_pressure" else 6
    with make_arena(max_sequences=3, budget_chunks=budget, protected_span_fraction=0.0) as a:
        owner, k, v = _owner_with_prefix(a, rng)
        if order == "owner_first":
            a.close(owner, ("a", "b"))
            alias = a.admit(("a", "b"))
            assert alias.num_aliased_pages == 2 * PPC
            a.close(alias, ("a", "b"))
        elif order == "alias_first":
            a.close(owner, ("a", "b"))
            alias = a.admit(("a", "b"))
            other = a.admit(("a",))
            a.close(alias, ("a", "b"))
            np.testing.assert_array_equal(a.read_pages(other, 0, PPC)[0], k[:, :PPC])
            a.close(other, ("a",))
        elif order == "both_then_pressure":
            a.close(owner, ("a", "b"))
            alias = a.admit(("a", "b"))
            a.close(alias, ("a", "b"))
        else:  # pressure while the alias lives: the spans it maps must survive
            a.close(owner, ("a", "b"))
            alias = a.admit(("a", "b"))
            a.close(a.admit())  # a parked range with nothing mapped
            big = a.admit()
            # null + 2 span chunks + 1 = 4 of 4: a second chunk would need a span the alias maps.
            assert a.ensure(big, PPC) and not a.ensure(big, 2 * PPC)
            assert a.stats().num_spans == 2
            got = a.read_pages(alias, 0, 2 * PPC)
            np.testing.assert_array_equal(got[0], k)
            np.testing.assert_array_equal(got[1], v)
            a.close(alias)  # now only the registry holds them: pressure may spill one
            assert a.ensure(big, 2 * PPC)
            assert a.stats().num_spans == 1 and a.stats().num_spilled_spans == 1
            a.close(big)
        # Everything closed: full pressure frees every chunk but the null one.
        a.trim()
        st = a.stats()
        assert st.used_chunks == 1 and st.num_spans == 0
        n = a.native_counters()
        assert n["physical_bytes"] == a.chunk_bytes and n["num_physical"] == 2 * LAYOUT.num_layers


def _page_keys(shared: int, tag: str, n: int) -> list:
    """Per-page prefix keys of a prompt whose first ``shared`` pages are the common "x"
    prefix (the key through page ``e`` names pages ``[0, e)``)."""
    return [("x", e) if e <= shared else (tag, e) for e in range(1, n + 1)]


def test_partial_alias_shares_part_of_a_chunk_and_skips_the_rest():
    rng = np.random.default_rng(19)
    print("seed 19")
    half = PPC // 2
    with make_arena(max_sequences=3, budget_chunks=8, adoption=False, alias_unit_pages=1) as a:
        assert a.max_skip == PPC - 1 and a.chunks_per_range == 3
        s = a.admit()
        assert a.ensure(s, PPC + 2)
        k, v = pages(rng, PPC + 2)
        a.write_pages(s, 0, k, v)
        a.close(s, _page_keys(half, "own", PPC + 2))  # chunk 0 whole, 2 pages of chunk 1
        st = a.stats()
        assert st.num_spans == 2
        t = a.admit(_page_keys(half, "t", 2 * PPC))  # shares the first half chunk only
        assert (t.num_aliased_pages, t.skip_from, t.skip) == (half, half, PPC - half)
        assert a.stats().used_chunks == st.used_chunks  # the alias costs no budget
        assert a.ensure(t, half + 3) and a.stats().used_chunks == st.used_chunks + 1
        np.testing.assert_array_equal(  # two runs: the shared chunk's rest is skipped
            t.page_table(), np.r_[t.base_slot + np.arange(half), t.base_slot + PPC + np.arange(3)])
        kt, vt = pages(rng, 3)
        a.write_pages(t, half, kt, vt)
        got = a.read_pages(t, 0, half + 3)
        np.testing.assert_array_equal(got[0], np.concatenate([k[:, :half], kt], axis=1))
        np.testing.assert_array_equal(got[1], np.concatenate([v[:, :half], vt], axis=1))
        # Token writes never reach the skipped slots (someone else's pages in the shared chunk).
        tok = np.zeros((LAYOUT.num_layers, 1, LAYOUT.num_kv_heads, LAYOUT.head_dim), np.float32)
        with pytest.raises(ValueError, match="not a private mapped chunk"):
            a.write_tokens(np.array([(t.base_slot + half) * LAYOUT.tokens_per_page]), tok, tok)
        # The owner's whole prompt: chunk 0 whole, then 2 pages of its chunk 1 (partial again).
        u = a.admit(_page_keys(half, "own", PPC + 2))
        assert (u.num_aliased_pages, u.skip_from, u.skip) == (PPC + 2, PPC + 2, PPC - 2)
        got = a.read_pages(u, 0, PPC + 2)  # t's writes never touched the shared chunk
        np.testing.assert_array_equal(got[0], k)
        np.testing.assert_array_equal(got[1], v)
        assert a.ensure(u, 2 * PPC)  # the skip fits the range at the per-request maximum
        assert a.stats().used_chunks == st.used_chunks + 1 + 1  # t's chunk 1, u's chunk 2
        st = a.stats()
        assert (st.num_alias_hits, st.num_partial_aliases) == (2, 2)
        assert st.num_aliased_pages == half + PPC + 2
        assert st.aliased_bytes == st.num_aliased_pages * 2 * LAYOUT.num_layers * LAYOUT.slot_bytes
        # Suspend / resume restore the pages byte-identical into a fresh range, without a skip.
        host = ArenaHostStore(1 << 20)
        assert a.suspend(t, host) is ArenaSuspend.SUSPENDED
        assert a.resume(t, host) and t.skip == 0
        got = a.read_pages(t, 0, half + 3)
        np.testing.assert_array_equal(got[0], np.concatenate([k[:, :half], kt], axis=1))


def test_a_chunk_registered_after_a_skip_aliases_at_its_first_page():
    rng = np.random.default_rng(20)
    print("seed 20")
    half = PPC // 2
    with make_arena(max_sequences=3, max_pages=3 * PPC, budget_chunks=10, adoption=False,
                    alias_unit_pages=1) as a:
        s = a.admit()
        assert a.ensure(s, PPC)
        a.write_pages(s, 0, *pages(rng, PPC))
        a.close(s, _page_keys(half, "s", PPC))
        t = a.admit(_page_keys(half, "t", 3 * PPC))
        assert t.num_aliased_pages == half
        assert a.ensure(t, half + PPC + 1)  # its own pages half.. from chunk 1 on
        kt, vt = pages(rng, PPC + 1)
        a.write_pages(t, half, kt, vt)
        a.close(t, _page_keys(half, "t", half + PPC + 1))
        # t's chunk 1 holds pages [half, half + PPC): it aliases right after the shared half;
        # t's last page (a partial chunk again) does not: one skip per sequence.
        u = a.admit(_page_keys(half, "t", 3 * PPC))
        assert (u.num_aliased_pages, u.skip_from, u.skip) == (half + PPC, half, PPC - half)
        got = a.read_pages(u, half, PPC)
        np.testing.assert_array_equal(got[0], kt[:, :PPC])
        np.testing.assert_array_equal(got[1], vt[:, :PPC])
        assert a.stats().num_aliased_chunks == 1 + 2


def test_prefix_affine_adoption_reuses_the_range_mapping_the_span():
    rng = np.random.default_rng(4)
    with make_arena(max_sequences=3) as a:
        s, _, _ = _owner_with_prefix(a, rng)
        plain = a.admit()
        a.ensure(plain, PPC)
        a.close(plain)  # parked first (older): private only
        a.close(s, ("a", "b"))
        maps = a.stats().num_map_calls
        t = a.admit(("a", "b"))
        assert t.base_slot == s.base_slot  # the owner's range, its span already in place
        assert a.stats().num_map_calls == maps  # nothing mapped
        u = a.admit()  # a plain admission gets the private parked range, not the span's
        assert u.base_slot == plain.base_slot and a.stats().num_unmap_calls == 0


def test_adoption_by_another_prefix_never_writes_into_a_span():
    rng = np.random.default_rng(8)
    with make_arena(max_sequences=1, budget_chunks=6) as a:
        s, k, v = _owner_with_prefix(a, rng)
        a.close(s, ("a", "b"))
        _hit(a, ("a", "b"))
        t = a.admit(("z",))  # the only range maps spans a and b: they leave it first
        assert t.base_slot == s.base_slot and t.num_aliased_pages == 0
        assert a.stats().num_unmap_calls == 2 * 2 * LAYOUT.num_layers
        assert a.ensure(t, 2 * PPC)
        a.write_pages(t, 0, *pages(rng, 2 * PPC))
        a.close(t)
        u = a.admit(("a", "b"))
        assert u.num_aliased_pages == 2 * PPC
        got = a.read_pages(u, 0, 2 * PPC)
        np.testing.assert_array_equal(got[0], k)
        np.testing.assert_array_equal(got[1], v)


def _hit(a: Arena, keys) -> None:
    """Aliases ``keys`` once (a span ever aliased is kept when its range is adopted)."""
    s = a.admit(keys)
    assert s.num_aliased_pages == len(keys) * PPC
    a.close(s)


def test_never_aliased_spans_are_taken_over_by_adoption():
    rng = np.random.default_rng(18)
    with make_arena(max_sequences=2, budget_chunks=8) as a:
        s, k, v = _owner_with_prefix(a, rng)
        a.close(s, ("a", "b"))
        other = a.admit()  # the fresh range, before any adoption of a range with spans
        assert other.base_slot != s.base_slot
        before = a.stats()
        t = a.admit(("z",))  # the parked range: its spans were never aliased
        st = a.stats()
        assert t.base_slot == s.base_slot and t.num_aliased_pages == 0
        assert st.num_consumed_spans == 2 and st.num_spans == 0
        assert (st.num_map_calls, st.num_unmap_calls) == (before.num_map_calls, 0)
        assert a.ensure(t, 2 * PPC) and a.stats().num_map_calls == before.num_map_calls
        assert st.used_chunks == before.used_chunks
        a.write_pages(t, 0, *pages(rng, 2 * PPC))  # private now: writable
        a.close(t, ("y",))
        assert a.admit(("a",)).num_aliased_pages == 0


def test_without_remap_an_adoption_starts_after_a_foreign_span():
    rng = np.random.default_rng(22)
    print("seed 22")
    with make_arena(max_sequences=1, budget_chunks=8, remap_spans=False) as a:
        assert a.chunks_per_range == 3  # one chunk more than the per-request maximum needs
        s, k, v = _owner_with_prefix(a, rng)
        a.close(s, ("a",))  # chunk 0 registered, chunk 1 private
        _hit(a, ("a",))
        before = a.stats()
        t = a.admit(("z",))  # the only range maps span "a" at chunk 0: t starts after it
        assert t.base_slot == s.base_slot + PPC and t.num_aliased_pages == 0
        assert a.ensure(t, PPC)  # the range's chunk 1, still mapped
        st = a.stats()
        assert (st.num_map_calls, st.num_unmap_calls, st.num_front_skips) == (
            before.num_map_calls, 0, 1)
        assert a.ensure(t, 2 * PPC)  # its second chunk is the range's third
        kt, vt = pages(rng, 2 * PPC)
        a.write_pages(t, 0, kt, vt)
        tok = np.zeros((LAYOUT.num_layers, 1, LAYOUT.num_kv_heads, LAYOUT.head_dim), np.float32)
        with pytest.raises(ValueError, match="not a private mapped chunk"):
            a.write_tokens(np.array([s.base_slot * LAYOUT.tokens_per_page]), tok, tok)
        a.close(t, ("z", "y"))
        u = a.admit(("a", "q"))  # the span is still in place, untouched
        assert u.base_slot == s.base_slot and u.num_aliased_pages == PPC
        got = a.read_pages(u, 0, PPC)
        np.testing.assert_array_equal(got[0], k[:, :PPC])
        np.testing.assert_array_equal(got[1], v[:, :PPC])
        a.close(u)
        w = a.admit(("z", "y"))  # t's chunks, registered relative to its first page
        assert w.base_slot == s.base_slot + PPC and w.num_aliased_pages == 0  # consumed by u
        assert a.stats().num_unmap_calls == 0


def test_span_spill_protection_keeps_a_bounded_fraction():
    rng = np.random.default_rng(5)
    # budget 9 chunks, 25% protected: the 2 newest span chunks survive any pressure.
    with make_arena(max_sequences=4, budget_chunks=9, protected_span_fraction=0.25) as a:
        for key in ("a", "b", "c"):
            s = a.admit()
            a.ensure(s, PPC)
            a.write_pages(s, 0, *pages(rng, 1))
            a.close(s, (key,))
            _hit(a, (key,))
        assert a.stats().num_spans == 3
        hogs = [a.admit() for _ in range(3)]
        got = [a.ensure(h, 2 * PPC) for h in hogs]
        # 1 null + 3 spans + 3 x 2 = 10 > 9: the LRU span ("a") is spilled for the last hog.
        assert got == [True, True, True]
        st = a.stats()
        assert st.num_spans == 2 and st.num_spilled_spans == 1
        a.close(hogs[0])
        assert a.admit(("a",)).num_aliased_pages == 0
        assert not a.can_grow(1)  # what is left is protected (or in use)
        b = a.admit(("b",))
        assert b.num_aliased_pages == PPC  # a protected span, still there


def test_span_spill_unprotected_spills_everything_under_pressure():
    with make_arena(max_sequences=4, budget_chunks=4, protected_span_fraction=0.0) as a:
        for key in ("a", "b"):
            s = a.admit()
            a.ensure(s, PPC)
            a.close(s, (key,))
            _hit(a, (key,))
        h = a.admit()
        assert a.ensure(h, 2 * PPC)
        assert a.stats().num_spans == 1  # one spilled, one still free to keep
        h2 = a.admit()
        assert not a.ensure(h2, 2 * PPC)


# -- fences and the seed's bugs --------------------------------------------------------------


def test_bug_c_unmap_waits_for_the_step_reading_the_range():
    with make_arena(max_sequences=2, budget_chunks=3) as a:
        s = a.admit()
        u = a.admit()
        a.ensure(s, 2 * PPC)
        unmaps_at_wait = []
        fence = Fence(on_wait=lambda: unmaps_at_wait.append(a.stats().num_unmap_calls))
        a.record_step([s], fence)
        a.close(s)  # parked; the step may still be reading it
        assert a.ensure(u, 2 * PPC)  # forces the parked range out
        assert fence.num_waits == 1 and unmaps_at_wait == [0]  # waited before the first unmap
        assert a.stats().num_unmap_calls == 4 * LAYOUT.num_layers


def test_bug_c_teardown_and_trim_wait_too():
    with make_arena(max_sequences=2, budget_chunks=3, adoption=False) as a:
        s = a.admit()
        a.ensure(s, PPC)
        seen = []
        f = Fence(on_wait=lambda: seen.append(a.stats().num_unmap_calls))
        a.record_step([s], f)
        a.close(s)  # adoption off: reclaimed now, after the fence
        assert seen == [0]
        t = a.admit()
        a.ensure(t, PPC)
        g = Fence(on_wait=lambda: seen.append(a.stats().num_unmap_calls))
        a.record_step([t], g)
        unmaps = a.stats().num_unmap_calls
    assert seen == [0, unmaps]  # close_arena waited before unmapping t's range


def test_bug_b_pending_fence_does_not_deadlock_allocation():
    """Frees whose fence is still pending are reclaimed by a blocking drain inside the
    allocation (then retried), instead of failing it while the memory is about to come free."""
    with make_arena(max_sequences=3, budget_chunks=5) as a:
        busy, pending = a.admit(), a.admit()
        for s in (busy, pending):
            a.ensure(s, 2 * PPC)
        new = a.admit()  # admitted in the same scheduling pass, before the step's fence is known
        waiting = Fence()
        a.record_step([busy, pending], waiting)
        a.close(pending)  # the scheduler's own eviction: its fence is still pending
        assert a.ensure(new, 2 * PPC)  # blocking drain of that fence, then the retry succeeds
        assert waiting.num_waits == 1 and a.stats().num_blocking_drains == 1


def test_bug_b_ready_ranges_are_reclaimed_before_blocking():
    with make_arena(max_sequences=4, budget_chunks=6, adoption=True) as a:
        seqs = [a.admit() for _ in range(2)]
        for s in seqs:
            a.ensure(s, 2 * PPC)
        pending = Fence()
        ready = Fence()
        ready.done = True
        a.record_step([seqs[0]], pending)
        a.record_step([seqs[1]], ready)
        a.close(seqs[0])
        a.close(seqs[1])
        busy = [a.admit(), a.admit(), a.admit()]
        assert busy[0].base_slot == seqs[0].base_slot and busy[1].base_slot == seqs[1].base_slot
        a.close(busy[0])
        a.close(busy[1])
        assert a.ensure(busy[2], 2 * PPC)
        assert pending.num_waits == 0  # the ready range was enough


def test_bug_a_index_ring_never_rewrites_a_buffer_a_pending_step_reads():
    with make_arena(max_sequences=3) as a:
        seqs = [a.admit() for _ in range(3)]
        for s in seqs:
            a.ensure(s, PPC)
        ring = ArenaIndexRing(2, rows=3, width=PPC)
        b0 = ring.fill(seqs, [PPC, 1, 2])
        snapshot = b0.copy()
        f0 = Fence()
        ring.publish(f0)
        b1 = ring.fill(seqs[:1], [3])
        assert b1 is not b0 and np.array_equal(b0, snapshot)  # step 0's indices untouched
        ring.publish(Fence())
        read_at_wait = []
        f0.on_wait = lambda: read_at_wait.append(b0.copy())
        b2 = ring.fill(seqs[:2], [1, 1])  # the ring wraps to b0: it must wait for step 0
        assert b2 is b0 and f0.num_waits == 1 and ring.num_waits == 1
        np.testing.assert_array_equal(read_at_wait[0], snapshot)
        np.testing.assert_array_equal(snapshot[0], np.arange(seqs[0].base_slot,
                                                             seqs[0].base_slot + PPC))
        assert (snapshot[1, 1:] == 0).all()  # padded with the null page


def test_bug_d_host_exhaustion_during_suspend_leaves_the_sequence_intact():
    rng = np.random.default_rng(6)
    with make_arena() as a:
        s = a.admit()
        a.ensure(s, 2 * PPC)
        k, v = pages(rng, 2 * PPC)
        a.write_pages(s, 0, k, v)
        need = 2 * PPC * 2 * LAYOUT.num_layers * LAYOUT.slot_bytes
        host = ArenaHostStore(need - 1)
        before = a.stats()
        assert a.suspend(s, host) is ArenaSuspend.MUST_RECOMPUTE
        assert s.active and host.used_bytes == 0 and a.stats() == before
        got = a.read_pages(s, 0, 2 * PPC)
        np.testing.assert_array_equal(got[0], k)
        host = ArenaHostStore(need)
        assert a.suspend(s, host) is ArenaSuspend.SUSPENDED and not s.active
        assert host.used_bytes == need
        # Someone else adopts the range and overwrites it.
        t = a.admit()
        a.ensure(t, 2 * PPC)
        a.write_pages(t, 0, *pages(rng, 2 * PPC))
        assert a.resume(s, host)
        got = a.read_pages(s, 0, 2 * PPC)
        np.testing.assert_array_equal(got[0], k)
        np.testing.assert_array_equal(got[1], v)
        assert host.used_bytes == 0 and s.base_slot != t.base_slot


def test_resume_without_room_stays_suspended():
    with make_arena(max_sequences=1, budget_chunks=3) as a:
        s = a.admit()
        a.ensure(s, PPC)
        host = ArenaHostStore(1 << 20)
        assert a.suspend(s, host) is ArenaSuspend.SUSPENDED
        t = a.admit()
        assert not a.resume(s, host)  # the only range is t's
        assert s.suspended is not None and not s.active
        a.close(t)
        assert a.resume(s, host)


# -- XLA reads the arena itself --------------------------------------------------------------


def test_ops_read_the_arena_in_place_on_cpu():
    """The pools imported with DLPack are the arena's own bytes (same pointer) and the decode
    op reads a sequence's pages through ``base + arange`` page tables, unmapped chunks and all."""
    import jax
    import jax.numpy as jnp

    import jax_kvcm
    from jax_kvcm.ops import reference

    seed = 7
    print("seed", seed)
    rng = np.random.default_rng(seed)
    with make_arena(max_sequences=4, max_pages=2 * PPC, budget_chunks=8) as a:
        seqs = [a.admit() for _ in range(3)]
        lens = [5, PPC * LAYOUT.tokens_per_page + 3, 2 * PPC * LAYOUT.tokens_per_page]
        data = []
        for s, n in zip(seqs, lens):
            np_ = -(-n // LAYOUT.tokens_per_page)
            assert a.ensure(s, np_)
            k, v = pages(rng, np_)
            a.write_pages(s, 0, k, v)
            data.append((k, v))
        kp, vp = a.pool_arrays()
        assert kp.unsafe_buffer_pointer() == a.base_address
        ring = ArenaIndexRing(2, rows=4, width=2 * PPC)
        table = ring.fill(seqs, [-(-n // LAYOUT.tokens_per_page) for n in lens])
        q = rng.standard_normal((4, 4, LAYOUT.head_dim)).astype(np.float32)
        seq_lens = np.array(lens + [0], np.int32)
        for layer in range(LAYOUT.num_layers):
            out = jax_kvcm.paged_attention(jnp.asarray(q), kp, vp, jnp.asarray(table),
                                           jnp.asarray(seq_lens), layer=layer)
            ring.publish(out)
            # Oracle: a dense pool built from the numpy copies, same page tables.
            dense_k = np.zeros((1, 1 + 3 * 2 * PPC) + kp.shape[2:], np.float32)
            dense_v = np.zeros_like(dense_k)
            dense_table = np.zeros_like(table)
            for b, (k, v) in enumerate(data):
                n = k.shape[1]
                dense_k[0, 1 + b * 2 * PPC:1 + b * 2 * PPC + n] = k[layer]
                dense_v[0, 1 + b * 2 * PPC:1 + b * 2 * PPC + n] = v[layer]
                dense_table[b, :n] = np.arange(1 + b * 2 * PPC, 1 + b * 2 * PPC + n)
            want = reference.paged_attention(jnp.asarray(q), jnp.asarray(dense_k),
                                             jnp.asarray(dense_v), jnp.asarray(dense_table),
                                             jnp.asarray(seq_lens), layer=0)
            np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)
            table = ring.fill(seqs, [-(-n // LAYOUT.tokens_per_page) for n in lens])
        del kp, vp
        jax.clear_caches()


def test_bug_c_unmap_waits_for_a_real_kernel_still_reading():
    """A jitted attention loop (XLA runs it asynchronously on CPU too) still reads a parked range
    when pressure asks for its memory: the unmap waits for it, and its result is right."""
    import jax
    import jax.numpy as jnp

    import jax_kvcm
    from jax_kvcm.ops import reference

    seed = 9
    print("seed", seed)
    rng = np.random.default_rng(seed)
    # NOTE: XLA's CPU client runs small computations inline at dispatch; pages of 16 tokens x 64
    # dims make the loop big enough to run asynchronously, as a GPU step does.
    lay = ArenaLayout(num_layers=2, tokens_per_page=16, num_kv_heads=2, head_dim=64)
    cfg = ArenaConfig(max_sequences=2, max_pages_per_sequence=1, super_page_bytes=2 * GRAN,
                      budget_bytes=2 * 4 * 2 * GRAN)
    with Arena(cfg, lay, backend="cpu") as a:
        assert a.pages_per_chunk == 1
        s, u = a.admit(), a.admit()
        assert a.ensure(s, 1)
        shape = (2, 1, 16, 2, 64)
        k = rng.standard_normal(shape).astype(np.float32)
        v = rng.standard_normal(shape).astype(np.float32)
        a.write_pages(s, 0, k, v)
        kp, vp = a.pool_arrays()
        q = jnp.asarray(rng.standard_normal((2, 4, 64)).astype(np.float32))
        table = jnp.asarray(np.tile(s.page_table(1), (2, 1)))
        lens = jnp.asarray([16, 5], jnp.int32)

        @jax.jit
        def reader(q, k, v, table, lens):
            def body(i, acc):
                return jnp.maximum(acc, jax_kvcm.paged_attention(q + i * 0.0, k, v, table, lens,
                                                               layer=1))
            return jax.lax.fori_loop(0, 20000, body, jnp.full(q.shape, -jnp.inf, jnp.float32))

        reader(q, kp, vp, table, lens).block_until_ready()
        out = reader(q, kp, vp, table, lens)
        a.record_step([s], out)
        a.close(s)
        running = not out.is_ready()
        assert a.ensure(u, 1)  # needs s's chunk: waits for the reader, then unmaps
        assert running and a.stats().num_blocking_drains == 1
        dense = np.concatenate([np.zeros_like(k[:, :1]), k], 1)
        dense_v = np.concatenate([np.zeros_like(v[:, :1]), v], 1)
        want = reference.paged_attention(q, jnp.asarray(dense), jnp.asarray(dense_v),
                                         jnp.asarray(np.ones((2, 1), np.int32)),
                                         lens, layer=1)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)
        del kp, vp


def test_bug_a_a_dispatched_step_reads_its_own_page_table():
    """JAX dispatches asynchronously and, on CPU, reads a numpy argument when the step runs, not
    when it is dispatched (measured: rewriting the buffer right after dispatch changes the
    result). The ring makes the next fill wait for the step that reads the buffer."""
    import jax
    import jax.numpy as jnp

    with make_arena(max_sequences=2, budget_chunks=4) as a:
        s, t = a.admit(), a.admit()
        ring = ArenaIndexRing(1, rows=2, width=PPC)
        big = jnp.ones((1000, 1000), jnp.float32)

        @jax.jit
        def step(big, table):
            x = big
            for _ in range(20):
                x = x @ big * 1e-3
            # NOTE: the table is read in a fusion that needs x: after the busy part.
            return (table + (x[0, 0] * 0).astype(jnp.int32)).sum()

        step(big, ring.fill([s], [1])).block_until_ready()
        ring.publish(jnp.zeros(()))
        table = ring.fill([s, t], [PPC, PPC])
        want = int(table.sum())
        out = step(big, table)
        ring.publish(out)
        ring.fill([s], [1])  # the only buffer again: must wait for ``out``
        assert ring.num_waits == 1 and int(out) == want


def test_prepare_step_builds_base_plus_arange_batches():
    with make_arena(max_sequences=3, max_pages=2 * PPC, budget_chunks=5) as a:
        s, t = a.admit(), a.admit()
        tpp = LAYOUT.tokens_per_page
        batch = a.prepare_step([(s, 9), (t, 1)], batch=4, tokens=16)
        assert s.num_tokens == 9 and t.num_tokens == 1 and s.num_pages == -(-9 // tpp)
        np.testing.assert_array_equal(batch.seq_lens, [9, 1, 0, 0])
        np.testing.assert_array_equal(batch.query_start, [0, 9, 10, 10, 10])
        pos = np.r_[np.arange(9), np.arange(1)]
        row = np.r_[np.zeros(9, int), np.ones(1, int)]
        want = batch.page_table[row, pos // tpp] * tpp + pos % tpp  # the table convention
        np.testing.assert_array_equal(batch.slot_mapping[:10], want)
        assert (batch.slot_mapping[10:] == -1).all() and (batch.positions[:10] == pos).all()
        np.testing.assert_array_equal(batch.page_table[0, :3], s.base_slot + np.arange(3))
        assert (batch.page_table[0, 3:] == 0).all() and (batch.page_table[2:] == 0).all()
        nxt = a.prepare_step([(s, 1)], batch=1, tokens=1)
        assert nxt.slot_mapping[0] == (s.base_slot + 9 // tpp) * tpp + 9 % tpp
        # Budget: null + s's 1 chunk + t's 1 chunk of 5; a third sequence may take 2 more.
        u = a.admit()
        assert a.prepare_step([(u, 2 * PPC * tpp)], batch=1, tokens=2 * PPC * tpp) is not None
        before = (s.num_tokens, a.stats())
        assert a.prepare_step([(s, 2 * PPC * tpp - 10)], batch=1, tokens=1024) is None
        assert (s.num_tokens, a.stats()) == before
        with pytest.raises(ValueError, match="exceeds batch"):
            a.prepare_step([(s, 1), (t, 1)], batch=1, tokens=4)


def test_cuda_backend_without_a_usable_driver_is_a_clear_error():
    """Here (no GPU): the CUDA arena refuses with a message saying why; the paged ops still run."""
    import jax
    import jax.numpy as jnp

    import jax_kvcm

    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present (tests/test_arena_gpu.py covers the CUDA arena)")
    cfg = ArenaConfig(max_sequences=1, max_pages_per_sequence=4, budget_bytes=1 << 24)
    with pytest.raises(RuntimeError, match="CUDA extension|virtual memory management"):
        Arena(cfg, LAYOUT, backend="cuda")
    k = jnp.zeros((2, 4, 2, 16))
    k2, _ = jax_kvcm.write_kv(k, k, jnp.ones((1, 2, 16)), jnp.ones((1, 2, 16)),
                              jnp.asarray([5], jnp.int32))
    assert float(k2[1, 1].sum()) == 32.0
