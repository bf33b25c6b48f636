"""Randomized state machine over the arena's allocator and budget (hypothesis; the failing example
is printed by hypothesis): admit (with or without a shared prefix), grow, dispatch steps whose
fences complete later, close (registering committed chunks), suspend / resume, trim.

Oracles after every rule, all from the test's own model:
- every active sequence's written and aliased pages read back as written (the arena on CPU is a
  real memfd reservation: a wrong mapping, an unmap or an adoption that clobbers live pages shows);
- budget: used chunks <= budget; the native physical and mapped bytes equal what the ranges map;
- no super-page a pending step may read was unmapped or remapped (snapshots taken at dispatch);
- a refused admission or growth changed nothing; a suspend refused for lack of host memory left
  the sequence active and intact.
``KVCM_STATEFUL_EXAMPLES`` raises the number of examples (default 100).
"""

from __future__ import annotations

import os

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, initialize, invariant,
                                 precondition, rule)

from jax_kvcm._arena import ArenaHostStore, ArenaSuspend
from test_arena import LAYOUT, PPC, make_arena

EXAMPLES = int(os.environ.get("KVCM_STATEFUL_EXAMPLES", "100"))
MAX_PAGES = 3 * PPC


class StreamFence:
    """Steps on one stream: a fence completes only after every earlier one."""

    def __init__(self, prior: StreamFence | None) -> None:
        self.prior, self.done = prior, False

    def is_ready(self) -> bool:
        return self.done

    def block_until_ready(self) -> StreamFence:
        f: StreamFence | None = self
        while f is not None and not f.done:
            f.done = True
            f = f.prior
        return self


def content(key: tuple, page: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic K/V of page ``page`` of a prefix (equal keys imply equal content)."""
    r = np.random.default_rng(abs(hash((key, page))) % (1 << 32))
    shape = (LAYOUT.num_layers, 1, LAYOUT.tokens_per_page, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return (r.standard_normal(shape).astype(np.float32),
            r.standard_normal(shape).astype(np.float32))


def prompt_page(prefix: tuple, page: int) -> tuple[np.ndarray, np.ndarray]:
    name, diverge = prefix
    return content(name if page < diverge else (name, diverge), page)


class Model:
    __slots__ = ("seq", "prefix", "pages", "suspended")

    def __init__(self, seq, prefix) -> None:
        self.seq, self.prefix = seq, prefix
        self.pages: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # page -> expected K, V
        self.suspended = False


class ArenaMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.a = None
        self.live: list[Model] = []
        self.suspended: list[Model] = []
        self.last_fence: StreamFence | None = None
        self.pending: list[tuple[StreamFence, dict[int, int]]] = []  # fence, offset -> handle
        self.host = ArenaHostStore(0)
        self.counter = 0

    @initialize(budget=st.integers(4, 12), adoption=st.booleans(), aliasing=st.booleans(),
                protected=st.sampled_from([0.0, 0.3]), max_seqs=st.integers(2, 3),
                unit=st.sampled_from([PPC, 1, PPC // 2]), remap=st.booleans())
    def setup(self, budget, adoption, aliasing, protected, max_seqs, unit, remap):
        self.max_seqs, self.unit = max_seqs, unit
        self.a = make_arena(max_sequences=self.max_seqs, max_pages=MAX_PAGES, budget_chunks=budget,
                            adoption=adoption, prefix_aliasing=aliasing,
                            protected_span_fraction=protected, alias_unit_pages=unit,
                            remap_spans=remap)

    def teardown(self) -> None:
        if self.a is not None:
            self.a.close_arena()
            n = self.a.native_counters()
            assert n["num_map_calls"] == n["num_unmap_calls"]
            assert n["num_create_calls"] == n["num_release_calls"] and n["num_physical"] == 0

    # -- helpers ------------------------------------------------------------------------

    def keys(self, prefix) -> tuple:
        """One key per alias unit of the prompt (its first ``2 * PPC`` pages): the key through
        page ``e`` names the content of pages ``[0, e)``."""
        if prefix is None:
            return ()
        name, diverge = prefix
        return tuple((name, e) if e <= diverge else ((name, diverge), e)
                     for e in range(self.unit, 2 * PPC + 1, self.unit))

    def write(self, m: Model, first: int, last: int) -> None:
        """Writes pages [first, last) of ``m``: prefix content for its prompt pages, unique
        values elsewhere."""
        for p in range(first, last):
            if m.prefix is not None and p < 2 * PPC:
                k, v = prompt_page(m.prefix, p)
            else:
                self.counter += 1
                k, v = content(("private", self.counter), p)
            self.a.write_pages(m.seq, p, k, v)
            m.pages[p] = (k, v)

    # -- rules --------------------------------------------------------------------------

    # NOTE: prompts ("x", d) share x's pages before page d (partial chunks alias).
    @rule(prefix=st.sampled_from([None, ("x", 2 * PPC), ("x", PPC // 2), ("x", PPC + 1),
                                  ("y", 2 * PPC)]))
    def admit(self, prefix):
        before = self.a.stats()
        seq = self.a.admit(self.keys(prefix))
        if seq is None:
            assert before.num_active == self.max_seqs and self.a.stats() == before
            return
        m = Model(seq, prefix)
        for p in range(seq.num_aliased_pages):
            m.pages[p] = prompt_page(prefix, p)
        self.live.append(m)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10), n=st.integers(1, MAX_PAGES))
    def grow(self, i, n):
        self._grow(self.live[i % len(self.live)], n)

    @precondition(lambda self: any(m.prefix is not None for m in self.live))
    @rule(i=st.integers(0, 10))
    def prefill(self, i):
        """Grows a prompted sequence over its whole prompt (what a later admission aliases)."""
        ms = [m for m in self.live if m.prefix is not None]
        self._grow(ms[i % len(ms)], 2 * PPC)

    def _grow(self, m: Model, n: int) -> None:
        before, old = self.a.stats(), m.seq.num_pages
        if self.a.ensure(m.seq, n):
            start = max(old, m.seq.num_aliased_pages)
            self.write(m, start, max(start, n))
        else:
            assert m.seq.num_pages == old
            s = self.a.stats()
            assert s.used_chunks == before.used_chunks or s.num_reclaimed_ranges > \
                before.num_reclaimed_ranges or s.num_spilled_spans > before.num_spilled_spans

    @precondition(lambda self: self.live)
    @rule(mask=st.integers(1, 7))
    def step(self, mask):
        seqs = [m.seq for j, m in enumerate(self.live) if mask >> j & 1] or [self.live[0].seq]
        f = StreamFence(self.last_fence)
        self.last_fence = f
        self.a.record_step(seqs, f)
        snap = {}
        for s in seqs:
            rng = s._range
            for c in range(len(rng.chunks)):
                for off in self.a._offsets(rng.first_chunk + c):
                    h = self.a._res.handle_at(off)
                    if h >= 0:
                        snap[off] = h
        self.pending.append((f, snap))

    @precondition(lambda self: self.pending)
    @rule(j=st.integers(0, 10))
    def finish(self, j):
        self.pending[j % len(self.pending)][0].block_until_ready()

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10))
    def close(self, i):
        m = self.live.pop(i % len(self.live))
        committed = ()
        if m.prefix is not None:  # the prompt's units fully written
            committed = self.keys(m.prefix)[:min(2 * PPC, m.seq.num_pages) // self.unit]
        self.a.close(m.seq, committed)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10), room=st.booleans())
    def suspend(self, i, room):
        m = self.live[i % len(self.live)]
        need = m.seq.num_pages * 2 * LAYOUT.num_layers * LAYOUT.slot_bytes
        self.host.capacity_bytes = self.host.used_bytes + (need if room else max(0, need - 1))
        before = self.a.stats()
        r = self.a.suspend(m.seq, self.host)
        if r is ArenaSuspend.MUST_RECOMPUTE:
            assert need > 0 and not room and m.seq.active and self.a.stats() == before
        else:
            self.live.remove(m)
            self.suspended.append(m)

    @precondition(lambda self: self.suspended)
    @rule(i=st.integers(0, 10))
    def resume(self, i):
        m = self.suspended[i % len(self.suspended)]
        if self.a.resume(m.seq, self.host):
            self.suspended.remove(m)
            # Pages never written were restored as saved; aliased ones are now private copies.
            self.live.append(m)
        else:
            assert m.seq.suspended is not None

    @rule()
    def trim(self):
        self.a.trim()

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def pending_steps_see_their_pages(self):
        if self.a is None:
            return
        for f, snap in self.pending:
            if not f.done:
                for off, h in snap.items():
                    assert self.a._res.handle_at(off) == h, "unmapped under a pending step"
        self.pending = [p for p in self.pending if not p[0].done]

    @invariant()
    def budget_matches_the_native_counters(self):
        if self.a is None:
            return
        a, s = self.a, self.a.stats()
        assert 1 <= s.used_chunks <= s.budget_chunks
        n = a.native_counters()
        assert n["physical_bytes"] == s.used_chunks * a.chunk_bytes
        mapped = 1 + sum(r.num_mapped() for r in a._ranges)
        assert n["mapped_bytes"] == mapped * a.chunk_bytes
        assert s.num_active == len(self.live)

    @invariant()
    def live_pages_read_back(self):
        if self.a is None:
            return
        for m in self.live:
            for p, (k, v) in m.pages.items():
                if p >= m.seq.num_pages:
                    continue
                # NOTE: read without waiting for the range's fence (read_pages would complete
                # every pending step and hide unmaps under them); CPU memory is coherent.
                got_k, got_v = np.empty_like(k), np.empty_like(v)
                self.a._page_io(m.seq, p, got_k, got_v, write=False)
                np.testing.assert_array_equal(got_k, k, err_msg=f"page {p} of {m.seq}")
                np.testing.assert_array_equal(got_v, v)


ArenaMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestArenaMachine = ArenaMachine.TestCase
