"""Round 3 of reliability (issue 34, item 2): the guarantees the paged path has, pinned one by
one on the arena hot tier, and a window ring under prefix reuse, suspend and resume.

Each test is deterministic and names the guarantee it pins, so a regression names itself (the
state machines of ``test_manager_stateful.py`` roam over the same ground at random):

- a step that raised before running, or consumed its donated arena pools (after writing some of
  them) and failed, rolls back; nothing it allocated or wrote is ever committed or reused;
- an observer that raises (on any event kind) cannot corrupt the arena's ranges, and it sees a
  consistent manager (it runs the invariants itself, from inside the event delivery);
- disk write errors (ENOSPC) during an arena suspend, disk read errors (EIO) during an arena
  resume: the sequence stays exactly as it was (its range too), or stays suspended with no
  range leaked;
- a sliding-window ring that wraps many times, with prefix reuse, suspend and resume (host and
  disk), on both hot tiers: every in-window position reads back, through each step's ring
  table, equal to a dense reference of what was written, and ``ragged_paged_attention`` with
  ``ring_table=True`` over the pools equals dense attention over that reference;
- and four arena bugs the long random run (``tools/random_run.py``) found, one test each: an
  admission's binding evicted pages that dropped its own host hits (KeyError); a refused resume
  and a refused step evicted the cached pages in a new range's way; an admission whose
  onboarding was refused kept the range chosen for its whole chain, where its device pages
  still sat (RuntimeError at a later step).

Oracles: the fake model and value checker of ``test_manager.py`` (every cached K/V value of
every active sequence, read back through its page table, from the arena's reservation for arena
groups), the manager's invariants (page census per tier, the arena's ranges and slot index), and
for the ring test a dense per-sequence copy of every K/V the test wrote. CPU only.
"""

from __future__ import annotations

import functools
import tempfile
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from faults import FOREVER, install_faulty_disks
from test_arena_hot import arena_config
from test_manager import (
    dense_attention,
    expected_values,
    make,
    prefix_hashes,
    read_tokens,
    tiny_config,
)

import jax_kvcm
from jax_kvcm._storage import CorruptPageError, UnreadablePageError
from jax_kvcm._types import CacheLevel
from jax_kvcm.manager import SequenceState, SuspendResult

D, H, K = CacheLevel.DEVICE, CacheLevel.HOST, CacheLevel.DISK
GARBAGE = -7777.0  # what a failed step wrote: no expected value is negative


@pytest.fixture
def diskdir():
    with tempfile.TemporaryDirectory() as d:
        yield d


def where(h):
    """Page counts per tier, where every committed page is, and the arena's ranges. (Not the
    mapped chunks: a chunk an aborted step mapped stays mapped in its range, its slots free,
    until reclaimed, as after any free on the arena.)"""
    st = h.mgr.stats()
    nodes = sorted((n.key, n.level, n.slots.tolist(), n.refcount)
                   for n in h.mgr.tree.nodes.values())
    ar = st["arena"]
    return repr((st["pages_per_pool"], nodes, st["num_committed_pages"], ar["num_bound"],
                 ar["num_parked"]))


def seq_view(s):
    return s.state, s.num_tokens, s.page_ids(0).tolist() if s.state is SequenceState.ACTIVE \
        else None


@functools.partial(jax.jit, donate_argnums=(0,))
def _partial_then_fail(pools, slots):
    """Writes GARBAGE at ``slots`` of every pool (the step's own new tokens), then fails at run
    time (an out-of-range slot refused by the CPU handler): the donated pools come back deleted,
    but an arena's memory keeps what the first write put there."""
    out = []
    for k, v in pools:
        g = jnp.full((slots.shape[0],) + k.shape[3:], GARBAGE, k.dtype)
        k, v = jax_kvcm.write_kv(k, v, g, g, slots, layer=0)
        z = jnp.zeros((1,) + k.shape[3:], k.dtype)
        out.append(jax_kvcm.write_kv(k, v, z, z, jnp.array([1 << 30], jnp.int32), layer=0))
    return out


# -- a failed or aborted step on the arena -----------------------------------------------------


def test_arena_abort_before_the_step_ran_commits_and_reuses_nothing():
    """The step raised before running: complete_step refuses the very arena pools prepare_step
    handed out (they would commit pages nobody wrote); abort_step returns [] and puts everything
    back (sequences, pages, committed pages, ranges, mapped chunks); the same prompt then reuses
    nothing, and the slots of the aborted step are written by the step that runs instead."""
    h = make(arena_config(device_pages=16, head_dim=128, host_pages=8))
    old = h.add(list(range(40, 53)))                 # an earlier holder leaves values behind
    h.run([(old, 13)], as_ids=[True])
    h.mgr.close(old)
    b = h.add(list(range(30, 35)))
    h.run([(b, 5)])
    a = h.add(list(range(9)))
    before = where(h), seq_view(a), seq_view(b)
    batch = h.mgr.prepare_step([(a, np.arange(9, dtype=np.int32)), (b, 1)])
    assert (np.asarray(batch.slot_mapping) >= 0).sum() == 10
    with pytest.raises(ValueError, match=r"caches\[0\]\[0\].*handed out"):
        h.mgr.complete_step(h.mgr.caches)
    assert h.mgr.abort_step() == []
    assert (where(h), seq_view(a), seq_view(b)) == before
    h.check()
    c = h.add(list(range(9)))
    assert c.num_reused_tokens == 0              # nothing was committed
    h.run([(a, 9), (c, 9), (b, 2)], as_ids=[True, True, False])
    h.check()
    d = h.add(list(range(9)) + [3])
    assert d.num_reused_tokens == 8
    h.run([(d, 2)])
    h.check()


def test_arena_step_that_wrote_then_failed_loses_and_reuses_nothing():
    """A step that donated the arena pools, wrote garbage into its new tokens' slots and then
    failed inside XLA: the pools come back deleted but the reservation keeps the garbage.
    complete_step refuses the deleted pools; abort_step loses nothing (the arena's memory
    outlived its arrays) and rolls the step back, so the garbage lies only past every
    sequence's length: no prefix match reuses it and the sequences' next step overwrites it."""
    h = make(arena_config(device_pages=16, head_dim=128, host_pages=8))
    a = h.add(list(range(1, 8)))
    b = h.add(list(range(20, 26)))
    h.run([(a, 7), (b, 6)], as_ids=[True, True])
    h.check()
    before = where(h), seq_view(a), seq_view(b)
    batch = h.mgr.prepare_step([(a, np.arange(8, 14, dtype=np.int32)), (b, 3)])
    sm = np.asarray(batch.slot_mapping)
    written = sm[sm >= 0]
    handed = h.mgr.caches
    with pytest.raises(jax.errors.JaxRuntimeError, match="outside the cache"):
        _partial_then_fail(handed, jnp.asarray(sm))
    assert handed[0][0].is_deleted()
    got_k, _ = read_tokens(h.mgr, 0, written)
    assert (got_k == GARBAGE).all()              # the failed step did write the reservation
    with pytest.raises(ValueError, match="deleted"):
        h.mgr.complete_step(handed)
    assert h.mgr.abort_step() == []
    assert not h.mgr.caches[0][0].is_deleted()
    assert (where(h), seq_view(a), seq_view(b)) == before
    assert h.mgr.stats()["num_lost_sequences"] == 0
    h.check()
    c = h.add(list(range(1, 14)))                # a's tokens up to where the step would go
    assert c.num_reused_tokens == 4              # a's one full committed page, nothing more
    h.tokens[a.seq_id] += list(range(8, 14))   # the same ids again, now through a step that runs
    h.run([(a, 6), (b, 3), (c, 9)], as_ids=[True, False, True])
    h.check()                                    # the garbage was overwritten
    h.run([(a, 1), (b, 1), (c, 1)])
    h.check()


# -- observers that raise --------------------------------------------------------------------


KINDS = ["stored", "removed", "migrated", "committed", "evicted", "dropped", "onboarded",
         "suspended", "resumed"]


@pytest.mark.parametrize("kind", KINDS)
def test_arena_observer_that_raises_cannot_corrupt_ranges(kind, diskdir):
    """An observer that raises on every event of ``kind`` while the arena binds, adopts and
    reclaims ranges (prefix in place, shared prefixes, evictions on binding, chunks unmapped
    under pressure), suspends to host and disk and resumes: each event reaches it once the
    call left the manager consistent (it checks the invariants itself, arena included, from
    inside the delivery), its error is recorded, never raised, and every cached value stays
    right."""
    h = make(arena_config(device_pages=12, head_dim=128, max_seq_len=64, max_sequences=4,
                          host_pages=4, disk_dir=diskdir, disk_pages=8))
    mgr = h.mgr
    seen = []

    def observer(event):
        mgr.check_invariants()               # consistent whenever an observer runs
        seen.append(event.kind)
        if event.kind == kind:
            raise RuntimeError(f"observer fails on {kind}")
    mgr.add_observer(observer)
    rng = np.random.default_rng(3)
    print("seed", 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        prompt = list(range(1, 18))
        a = h.add(prompt)
        h.run([(a, 17)], as_ids=[True])
        h.check()
        b = h.add(prompt[:16] + [77])        # shares a's four committed pages
        h.run([(b, 1)], as_ids=[True])
        h.check()
        assert mgr.suspend(a) is SuspendResult.SUSPENDED
        h.check()
        for s in (b,):
            mgr.close(s)
        h.check()
        fill = [h.add(rng.integers(50, 90, 16).tolist()) for _ in range(2)]
        h.run([(s, 16) for s in fill], as_ids=[True, True])   # pressure: reclaim, evictions
        h.check()
        for s in fill:
            mgr.close(s)
        h.check()
        assert mgr.resume(a)
        h.check()
        c = h.add(prompt + [5, 6])           # a prefix hit on the host or disk: onboarded
        h.run([(a, 3), (c, c.num_known_tokens - c.num_tokens)])
        h.check()
        for s in (a, c):
            mgr.close(s)
        h.check()
        d = h.add(prompt[:12] + [8])         # adopts a parked range, maybe its prefix in place
        h.run([(d, d.num_known_tokens - d.num_tokens)])
        for _ in range(12):
            h.run([(d, 1)])
        h.check()
        mgr.close(d)
        prompts = []
        for i in range(4):                   # rounds of new prompts: host, disk, then drops
            prompts.append(rng.integers(100 + 10 * i, 110 + 10 * i, 21).tolist())
            s = h.add(prompts[-1])
            h.run([(s, 21)], as_ids=[True])
            mgr.close(s)
            h.check()
        onboarded = mgr.stats()["num_onboarded_pages"]
        lower = [p for p in prompts if (chain := mgr.tree.match(
            np.asarray(p[:16], np.int32), b"", 4, 4)) and all(n.level is not D for n in chain)]
        assert lower, "some prompt's pages went down a tier"
        e = h.add(lower[-1][:16] + [3])      # its pages went down a tier: onboarded
        assert e.num_reused_tokens > 0
        h.run([(e, e.num_known_tokens - e.num_tokens)])
        assert mgr.stats()["num_onboarded_pages"] > onboarded
        h.check()
    print(kind, sorted(set(seen)))
    assert kind in seen, (kind, sorted(set(seen)))
    errors = mgr.stats()["num_observer_errors"]
    assert errors == seen.count(kind) and errors == len(mgr.observer_errors) or errors > 64
    st = mgr.stats()["arena"]
    assert st["adoptions"] > 0 and st["reclaimed_chunks"] + st["evicted_on_bind"] > 0, st


# -- disk errors during arena suspend and resume ------------------------------------------------


def test_arena_suspend_to_a_failing_disk_changes_nothing(diskdir):
    """No host tier: an arena sequence's suspend writes its pages to disk; the write fails
    (ENOSPC) once: MUST_RECOMPUTE with the sequence, its range and its values as they were;
    the next suspend succeeds and the resume brings it back byte-identical at its range's
    base + j."""
    h = make(arena_config(device_pages=16, head_dim=128, disk_dir=diskdir, disk_pages=16))
    a = h.add(list(range(1, 15)))
    h.run([(a, 14)], as_ids=[True])
    b = h.add(list(range(40, 47)))
    h.run([(b, 7)])
    disk = install_faulty_disks(h.mgr)[0]
    disk.fail_writes = 1
    before = seq_view(a), h.mgr.stats()["arena"]["num_bound"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert h.mgr.suspend(a) is SuspendResult.MUST_RECOMPUTE
    assert disk.num_failed_writes == 1
    assert (seq_view(a), h.mgr.stats()["arena"]["num_bound"]) == before
    h.check()
    h.run([(a, 1), (b, 1)])
    h.check()
    assert h.mgr.suspend(a) is SuspendResult.SUSPENDED and a._parked[0] is K
    h.check()
    h.run([(b, 5)])                              # b grows while a is on disk
    assert h.mgr.resume(a)
    pages = a.page_ids(0)
    assert (np.diff(pages[len(a._nodes):]) == 1).all()  # private pages at base + j
    h.check()
    h.run([(a, 2), (b, 1)])
    h.check()


def test_arena_resume_from_an_unreadable_disk_leaks_no_range(diskdir):
    """The disk fails every read (EIO): resume raises UnreadablePageError (a CorruptPageError)
    and leaves the sequence suspended; the range it was bound to for the resume is parked
    again (no range leaked: every later admission still finds one); close it and recompute:
    its pages were a miss, nothing unreadable is reused."""
    h = make(arena_config(device_pages=16, head_dim=128, disk_dir=diskdir, disk_pages=16,
                          max_sequences=2))
    a = h.add(list(range(1, 11)))
    h.run([(a, 10)], as_ids=[True])
    assert h.mgr.suspend(a) is SuspendResult.SUSPENDED and a._parked[0] is K
    disk = install_faulty_disks(h.mgr)[0]
    disk.fail_reads = FOREVER
    bound = h.mgr.stats()["arena"]["num_bound"]
    for _ in range(3):                           # each attempt binds and must unbind
        with pytest.raises(UnreadablePageError) as e:
            h.mgr.resume(a)
        assert isinstance(e.value, CorruptPageError)
        assert a.state is SequenceState.SUSPENDED
        assert h.mgr.stats()["arena"]["num_bound"] == bound
        h.check()
    assert h.mgr.stats()["num_disk_read_errors"] >= 1
    b, c = h.add(list(range(60, 66))), h.add(list(range(70, 75)))  # both ranges still free
    h.run([(b, 6), (c, 5)])
    h.check()
    h.mgr.close(a)
    h.check()
    disk.fail_reads = 0
    a2 = h.add(list(range(1, 11)))
    assert a2.num_reused_tokens == 0
    h.mgr.close(b)
    h.run([(a2, 10), (c, 1)])
    h.check()


def test_arena_reclaim_to_a_failing_disk_drops_cached_pages(diskdir):
    """Pressure on the arena evicts cached pages down to a disk whose writes fail: they are
    dropped (counted), never left half-moved; the ranges and every active value stay right,
    and a later prompt with the dropped prefix recomputes it."""
    h = make(arena_config(device_pages=12, head_dim=128, max_seq_len=64, max_sequences=4,
                          disk_dir=diskdir, disk_pages=16))
    disk = install_faulty_disks(h.mgr)[0]
    old = [h.add(list(range(100 * i, 100 * i + 9))) for i in (1, 2, 3)]
    h.run([(s, 9) for s in old], as_ids=[True] * 3)
    for s in old:
        h.mgr.close(s)                           # their committed pages are cached
    h.check()
    disk.fail_writes = 2
    a = h.add(list(range(1, 22)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for lo in range(0, 21, 4):
            h.run([(a, min(4, 21 - lo))])
            h.check()
    print(h.mgr.stats()["arena"])
    st = h.mgr.stats()
    assert st["num_disk_write_errors"] >= 1 and st["num_dropped_on_disk_error"] >= 1, st
    again = h.add(list(range(100, 109)))
    h.run([(again, 9 - again.num_reused_tokens)])
    h.check()


# -- a window ring that wraps many times ---------------------------------------------------------


@pytest.mark.parametrize("hot", ["paged", "arena"])
def test_window_ring_wraps_under_reuse_suspend_and_resume(hot, diskdir):
    """A full group and a window-6 group with ring tables (chunks of at most 4: a ring of R = 3
    entries), decoding to 160 tokens: the ring wraps ~13 times. Meanwhile sequences with
    prefixes of its tokens (short ones, and ones deep past the window) are admitted and reuse
    what is still cached, and it is suspended (to host, then disk when the host is full) and
    resumed. After every step every position of every row's window, read through the step's
    own ring table, equals a dense reference of what the test wrote, and attention over the
    pools through the ring (``ring_table=True``) equals dense attention over that reference."""
    W, tpp, chunk, L = 6, 4, 4, 160
    seed = 34
    print("seed", seed)
    if hot == "arena":
        cfg = arena_config(windows=(None, W), device_pages=160, head_dim=128, max_seq_len=L,
                           max_tokens_per_step=16, host_pages=6, disk_dir=diskdir,
                           disk_pages=80, max_window_chunk=chunk)
    else:
        cfg = tiny_config(windows=(None, W), device_pages=160, max_seq_len=L, max_tokens=16,
                          host_pages=6, disk_dir=diskdir, disk_pages=80, ring_tables=True,
                          max_window_chunk=chunk)
    h = make(cfg)
    mgr = h.mgr
    R = cfg.table_widths[1]
    assert R == 3 and cfg.table_widths[0] == L // tpp
    assert (mgr.storage.hot_tier(0).kind == "arena") == (hot == "arena")
    rng = np.random.default_rng(seed)
    dense: dict[int, dict[int, np.ndarray]] = {}   # seq id -> group -> [n, L, 2, Hkv, D]

    def written(sid, start, n):
        toks = h.tokens[sid][:start + n]
        for g, lg in enumerate(cfg.layer_groups):
            ev = expected_values(prefix_hashes(toks)[start:], np.arange(start, start + n),
                                 lg.num_layers, lg.num_kv_heads, lg.head_dim)
            new = np.moveaxis(ev, 2, 0)          # [n, L, 2, Hkv, D]
            have = dense.setdefault(sid, {}).get(g)
            if have is None:                     # reused positions: what the prefix's writer
                have = np.moveaxis(expected_values(prefix_hashes(toks)[:start],
                                                   np.arange(start), lg.num_layers,
                                                   lg.num_kv_heads, lg.head_dim), 2, 0)
            dense[sid][g] = np.concatenate([have[:start], new])

    def step(work):
        batch, spans = h.prepare(work, as_ids=[True] * len(work))
        for sid, start, n in spans:
            written(sid, start, n)
        caches = h.write(batch, spans)
        caches = [(k.at[:, 0].set(jnp.nan), v.at[:, 0].set(jnp.nan)) if g == 1 else (k, v)
                  for g, (k, v) in enumerate(caches)]   # the null page of the paged window group
        for b, (sid, start, n) in enumerate(spans):   # the ring, read back against the reference
            length = start + n
            for g, lg in enumerate(cfg.layer_groups):
                row = np.asarray(batch.page_table[g])[b, :cfg.table_widths[g]]
                lo = max(0, length - W) if lg.sliding_window else 0
                pos = np.arange(lo, length)
                slots = row[(pos // tpp) % row.shape[0]] * tpp + pos % tpp
                want = dense[sid][g][lo:length]
                if mgr.storage.hot_tier(g).kind == "paged":   # the step's output pools
                    got = [np.asarray(c).reshape(c.shape[0], -1, *c.shape[-2:])[:, slots]
                           for c in caches[g]]
                else:                                           # the arena's reservation
                    got = read_tokens(mgr, g, slots)
                for kv in range(2):
                    np.testing.assert_array_equal(got[kv], want[:, :, kv].swapaxes(0, 1),
                                                  err_msg=f"row {b} group {g} {'KV'[kv]}")
        lg = cfg.layer_groups[1]                      # attention through the ring
        k, v = caches[1]
        Tb = batch.positions.shape[0]
        q = (rng.standard_normal((Tb, 2, lg.head_dim)) * 1e-6).astype(np.float32)
        out = np.asarray(jax_kvcm.ragged_paged_attention(
            jnp.asarray(q), k, v, jnp.asarray(np.asarray(batch.page_table[1])[:, :R]),
            batch.seq_lens, batch.query_start, layer=lg.num_layers - 1, sliding_window=W,
            ring_table=True))
        t = 0
        for sid, start, n in spans:
            ref = dense[sid][1][:, lg.num_layers - 1]    # [n, 2, Hkv, D]
            want = dense_attention(q[t:t + n], ref[:, 0], ref[:, 1],
                                   np.arange(start, start + n), W)
            np.testing.assert_allclose(out[t:t + n], want, rtol=1e-4)
            t += n
        mgr.complete_step(caches)
        h.check()

    def prefill(s):
        while s.num_tokens < s.num_known_tokens:
            step([(s, min(chunk, s.num_known_tokens - s.num_tokens))])

    a = h.add(list(range(1, 23)))
    prefill(a)
    others, suspends, reused = [], 0, []
    while a.num_tokens < L:
        work = [(a, 1)] + [(s, 1) for s in others if s.num_tokens < L]
        step(work[:4])
        n = a.num_tokens
        if n % 23 == 0 and n + 20 < L:               # a prompt sharing a prefix of a's tokens
            cut = int(rng.choice([8, 16, n - 1 - (n - 1) % tpp]))
            s = h.add(h.tokens[a.seq_id][:cut] + [int(rng.integers(60, 90))])
            reused.append(s.num_reused_tokens)
            prefill(s)
            others.append(s)
            if len(others) > 2:
                mgr.close(others.pop(0))
        if n % 17 == 0:                              # suspend, run the others, resume
            assert mgr.suspend(a) is SuspendResult.SUSPENDED
            suspends += 1
            h.check()
            for s in others[:2]:
                if s.num_tokens < L:
                    step([(s, 1)])
            assert mgr.resume(a)
            h.check()
    assert a.num_tokens // tpp // R >= 13            # the ring wrapped that many times
    assert suspends >= 8 and max(reused) >= 16, (suspends, reused)
    levels = {e.level for e in mgr.events if getattr(e, "kind", None) == "suspended"}
    assert {H, K} <= levels, levels                  # suspended to host and to disk
    st = mgr.stats()
    assert st["num_window_released_pages"] > 30 and st["num_prefix_hit_tokens"] > 0


# -- found by the random run (tools/random_run.py --seed 3402 --hot arena, operation 10044) -----


def test_arena_binding_keeps_the_admitted_prompts_lower_tier_hit():
    """An admission whose prompt hits pages on the host binds a parked range whose cached
    device pages sit where the new holder writes: they are evicted to the host first. Making
    room on a full host for them used to drop the prompt's own matched host pages (cached,
    unreferenced until onboarded), and the admission then raised KeyError onboarding dead
    nodes (a crash of add_sequence for a valid request). The chain is held while the range's
    pages are evicted: the hit is onboarded, the values are right."""
    h = make(arena_config(device_pages=16, head_dim=128, max_sequences=1, host_pages=2))
    p, q = list(range(1, 10)), list(range(50, 59))
    x = h.add(p)
    h.run([(x, 9)], as_ids=[True])
    h.mgr.close(x)                        # p's two pages cached in the only range
    y = h.add(q)                          # adopts it: p's pages are evicted to the host
    assert y.num_reused_tokens == 0
    h.run([(y, 9)], as_ids=[True])
    h.mgr.close(y)                        # q's two pages cached where the next holder writes
    assert h.mgr.stats()["pages"]["host"]["cached"] == 2   # the host is full of p's pages
    h.check()
    z = h.add(p + [7])                    # hits p on the host; binding evicts q's pages there
    assert z.num_reused_tokens == 8
    assert h.mgr.stats()["arena"]["evicted_on_bind"] >= 4
    h.check()
    h.run([(z, 2)])
    h.check()


# -- found by the random run (tests/manager/test_random_run.py, seed 102, arena, operation 404) ---------


def _parked_range_and_a_suspended_sequence():
    """Two ranges of 3 chunks on a 12-page arena: range 0 parked with x's two cached pages; s
    (5 pages, a fresh range) suspended to the host; y admitted (not yet stepped)."""
    h = make(arena_config(device_pages=12, head_dim=128, max_seq_len=32, max_sequences=2,
                          host_pages=8))
    x = h.add(list(range(1, 10)))
    h.run([(x, 9)], as_ids=[True])
    h.mgr.close(x)                               # range 0 parked, x's two pages cached there
    s = h.add(list(range(20, 37)))
    h.run([(s, 17)], as_ids=[True])              # a fresh range: 5 pages, 3 chunks
    assert h.mgr.suspend(s) is SuspendResult.SUSPENDED
    return h, s, h.add(list(range(40, 65)))


def test_a_refused_arena_resume_evicts_nothing():
    """A suspended sequence's resume binds the only parked range, where cached pages sit in
    its way, while a bound sequence holds the rest of the budget: the device cannot take it,
    so resume returns False, and a refusal changes nothing, not even where cached pages are.
    (Binding used to evict the pages in the way before the room was planned, so the refused
    resume had moved them to the host.)"""
    from test_manager import _state
    h, s, y = _parked_range_and_a_suspended_sequence()
    h.run([(y, 25)], as_ids=[True])              # adopts s's empty range: 7 pages, 4 chunks
    h.check()
    before = _state(h)
    assert not h.mgr.resume(s)                   # 3 chunks needed, 2 mapped in range 0, 0 free
    assert s.state is SequenceState.SUSPENDED
    assert _state(h) == before
    h.check()
    h.mgr.close(y)
    assert h.mgr.resume(s)
    h.check()
    h.run([(s, 1)])
    h.check()
    z = h.add(list(range(1, 10)))                # x's pages: still cached (on the host or not)
    assert z.num_reused_tokens == 8


def test_a_refused_arena_step_evicts_nothing():
    """The same on a step (random run seed 3402, arena, operation 12079): a sequence admitted
    while a step was in flight gets its range at its first step; the only parked range holds
    cached pages where it writes, and the budget cannot map the rest: prepare_step raises
    OutOfPagesError and changes nothing (no eviction, no binding left behind)."""
    from test_manager import _state

    from jax_kvcm.manager import OutOfPagesError
    h, s, y = _parked_range_and_a_suspended_sequence()
    h.run([(y, 24)], as_ids=[True])              # adopts s's empty range
    batch, spans = h.prepare([(y, 1)])
    n = h.add(list(range(70, 87)))               # admitted mid-step: no range yet
    h.mgr.complete_step(h.write(batch, spans))
    h.check()
    before = _state(h), h.mgr.stats()["arena"]["num_bound"], h.mgr.stats()["arena"]["num_parked"]
    with pytest.raises(OutOfPagesError):
        h.mgr.prepare_step([(n, 17)])            # 3 chunks: 2 mapped in range 0, none free
    assert (_state(h), h.mgr.stats()["arena"]["num_bound"],
            h.mgr.stats()["arena"]["num_parked"]) == before
    h.check()
    h.mgr.close(y)
    h.run([(n, 17)])
    h.check()


def test_arena_admission_rebinds_when_its_onboarding_is_refused():
    """A prompt hits two pages on the host then one on the device, the latter in place in a
    parked range, which the admission binds (prefix-affine); onboarding the host pages finds no
    room, so the sequence keeps no prefix and writes every page itself, in that range, where
    the device page it no longer holds still sits. Its range is chosen again for what it holds
    (that page evicted first); the next steps used to find the committed page where they write
    (RuntimeError "arena slot ... holds a committed page"; random run seed 3402, arena,
    operation 83845)."""
    h = make(arena_config(device_pages=10, head_dim=128, max_seq_len=32, max_sequences=2,
                          host_pages=8))
    p = list(range(1, 14))
    x = h.add(p)
    h.run([(x, 13)], as_ids=[True])
    y = h.add(list(range(40, 69)))               # range 1 (none parked yet)
    h.run([(y, 4)], as_ids=[True])
    h.mgr.close(x)                               # pages 0-2 cached in range 0 (chunks 0, 1)
    for lo in range(4, 29, 4):
        h.run([(y, min(4, 29 - lo))])            # the budget's last chunk: range 0's chunk 0
    h.check()
    levels = [n.level for n in h.mgr.tree.match(np.asarray(p, np.int32), b"", 4, 3)]
    assert levels == [H, H, D], levels
    n = h.add(p[:12] + [99])                     # binds range 0; onboarding finds no room
    assert n.num_reused_tokens == 0
    h.check()
    h.mgr.close(y)
    h.run([(n, 13)])
    h.check()
    h.run([(n, 1)])
    h.check()


@pytest.mark.parametrize("hot", ["paged", "arena"])
def test_a_failed_device_to_host_copy_is_never_served(hot, diskdir):
    """A device -> host encode that fails at run time (here on the one device; one shard of a
    mesh in tests/sharded/sharded_tiers_check.py) is not waited for, and its device source is
    freed at once, so its pages are lost. They are never served: resuming the suspended
    sequence raises CorruptPageError (level HOST) and leaves it suspended; closed, its prefix
    is a miss for the next prompt (its nodes dropped), which recomputes it; cached pages that
    went to the host through a failed copy are dropped when evicted to disk."""
    import faults
    if hot == "paged":
        cfg = tiny_config(device_pages=8, host_pages=7, disk_dir=diskdir, disk_pages=16)
    else:
        cfg = arena_config(device_pages=8, head_dim=128, host_pages=7, disk_dir=diskdir,
                           disk_pages=16, max_sequences=2)
    h = make(cfg)
    prompt = list(range(1, 15))
    a = h.add(prompt)
    h.run([(a, 14)], as_ids=[True])
    with faults.failed_encodes(h.mgr.storage):
        assert h.mgr.suspend(a) is SuspendResult.SUSPENDED and a._parked[0] is H
    h.check()
    for _ in range(2):                      # every attempt refuses, nothing changes
        with pytest.raises(CorruptPageError) as e:
            h.mgr.resume(a)
        assert e.value.level == "HOST" and "never written" in str(e.value), e.value
        assert a.state is SequenceState.SUSPENDED
        h.check()
    assert h.mgr.stats()["num_unwritten_host_reads"] == 2
    h.mgr.close(a)
    h.check()
    a2 = h.add(prompt + [99])
    assert a2.num_reused_tokens == 0        # the lost prefix is a miss, never served
    h.run([(a2, 15)], as_ids=[True])
    h.check()
    # Cached pages pushed to the host by a failed copy, then on to disk: dropped there.
    h.mgr.close(a2)
    with faults.failed_encodes(h.mgr.storage):  # (the arena evicts when it binds b's range)
        b = h.add(list(range(30, 58)))      # 7 pages: a2's cached pages leave the device
        h.run([(b, 28)], as_ids=[True])
    assert h.mgr.stats()["num_evicted_pages"][H] > 0, h.mgr.stats()
    h.check()
    reads, dropped = (h.mgr.stats()[k] for k in ("num_unwritten_host_reads",
                                                 "num_dropped_pages"))
    assert h.mgr.storage.num_free(H, 0) < 7      # b's suspend needs a2's host pages' room
    assert h.mgr.suspend(b) is SuspendResult.SUSPENDED and b._parked[0] is H
    assert h.mgr.stats()["num_unwritten_host_reads"] > reads
    assert h.mgr.stats()["num_dropped_pages"] > dropped
    h.check()
    assert h.mgr.resume(b)
    h.check()
    h.mgr.close(b)
    a3 = h.add(prompt + [98])
    assert a3.num_reused_tokens <= 4        # a2's first page never left the device; the lost
    #                                         ones are a miss (the values are checked below)
    h.run([(a3, 15 - a3.num_reused_tokens)], as_ids=[True])
    h.check()
