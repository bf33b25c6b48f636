"""The request lifecycle and views of the manager (the bounded-window design):
phases, ``state``, ``private_pages_per_sequence``, ``free_page_count``, ``compact`` and
``shutdown``; and per-group pool sizing from ``pool_ratio`` / ``typical_batch``."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

from jax_kvcm.manager import (KVCacheConfig, LayerGroupConfig, SequencePhase, SequenceState,
                               StepInFlightError)
from test_manager import TPP, NotReadyFence, make, stepped, tiny_config
from test_window_ring import read_back, ring_config


def test_phases_follow_the_fence():
    h = make(ring_config((None, 6), device_pages=30))
    m = h.mgr
    a, b = h.add(list(range(1, 10))), h.add(list(range(20, 25)))
    assert a.phase is b.phase is SequencePhase.ADMITTED
    batch, spans = h.prepare([(a, 9)], as_ids=[True])
    assert a.phase is SequencePhase.EXECUTING and b.phase is SequencePhase.ADMITTED
    m.complete_step(h.write(batch, spans))
    fence = m._ledger._fence = NotReadyFence()  # the step that last read a's pages has "not finished"
    m.close(a)
    assert a.phase is SequencePhase.FINISHING
    view = m.state(a)
    assert view.state is SequenceState.CLOSED and view.phase is SequencePhase.FINISHING
    assert view.pending_retirements == (1, 1)  # its private tail page in both groups
    fence.block_until_ready()
    assert a.phase is SequencePhase.FINISHED
    assert m.state(a).pending_retirements == (0, 0)
    m.check_invariants()


def test_state_shows_the_ring_and_pending_retirements():
    """A window-6 group (4 tokens a page): as the sequence decodes, pages leave its window; they
    are pending (the step that last read them has not finished) until the fence passes."""
    cfg = ring_config((None, 6), chunk=4, device_pages=30, max_seq_len=64)
    h = make(cfg)
    m = h.mgr
    R = cfg.table_widths[1]
    assert R == -(-(6 + 4 - 2) // TPP) + 1
    assert m.private_pages_per_sequence() == (16, R)
    a = h.add(list(range(1, 9)))
    h.run([(a, 4)], as_ids=[True])
    h.run([(a, 4)], as_ids=[True])
    v = m.state(a)
    assert v.num_tokens == 8 and v.ring_entries == (16, R)
    assert v.retained == ((0, 2), ((8 + 1 - 6) // TPP, 2))
    total = 0
    for _ in range(9):
        batch, spans = h.prepare([(a, 1)], as_ids=[False])
        m.complete_step(h.write(batch, spans))
        fence = m._ledger._fence = NotReadyFence()
        v = m.state(a)
        first = (a.num_tokens + 1 - 6) // TPP
        assert v.retained == ((0, a.num_pages), (first, a.num_pages))
        total = max(total, v.pending_retirements[1])
        assert v.pending_retirements[0] == 0
        fence.block_until_ready()
        assert m.state(a).pending_retirements == (0, 0)
        read_back(h, batch, spans)
        h.check()
    assert total == 1  # one page left the window at a time, pending until the fence


def test_free_page_count():
    h = make(tiny_config(device_pages=(12, 9), windows=(None, 6)))
    m = h.mgr
    assert m.free_page_count() == (12, 9)
    a = h.add(list(range(1, 10)))
    h.run([(a, 9)], as_ids=[True])
    assert m.free_page_count() == (12 - 3, 9 - 3)  # the fence of a finished step has passed
    m._ledger._fence = NotReadyFence()
    m.close(a)  # committed pages stay cached; the private tail waits for the fence
    assert m.free_page_count() == (12 - 3, 9 - 3)
    m._ledger._fence.block_until_ready()
    assert m.free_page_count() == (12 - 2, 9 - 2)


def test_pages_freed_before_the_latest_step_come_back_while_it_runs():
    """An overlapped loop completes step n before step n - 1 has run on the device. Pages freed
    after step n - 1 must come back once step n - 1 finished, while step n still runs (not only
    once the latest step is ready: then an overlapped loop never reclaims and evicts instead)."""
    h = make(tiny_config(device_pages=12))
    m = h.mgr
    a, b = h.add(list(range(1, 10))), h.add(list(range(20, 25)))
    h.run([(a, 9), (b, 5)], as_ids=[True, True])
    older = m._ledger._fence = NotReadyFence()  # step 1 "still runs"
    m.close(a)                           # its private tail page waits for step 1
    free = m.free_page_count()
    batch, spans = h.prepare([(b, 1)], as_ids=[False])
    m.complete_step(h.write(batch, spans))
    latest = m._ledger._fence = NotReadyFence()  # step 2 handed back and "running"
    assert m.free_page_count() == free   # step 1 not finished: the page is still pending
    older.block_until_ready()            # step 1 finished; step 2 still runs
    assert m.free_page_count() == (free[0] + 1,)
    assert not latest.is_ready()
    m.check_invariants()


def test_older_step_fences_stay_bounded_without_pending_frees():
    """With nothing pending nobody polls the fences; the older ones kept must stay bounded (each
    is a small device array) while a later one still covers the pages freed before it."""
    h = make(tiny_config(device_pages=12))
    m = h.mgr
    a = h.add(list(range(1, 10)))
    h.run([(a, 9)], as_ids=[True])
    fences = []
    for _ in range(20):
        batch, spans = h.prepare([(a, 1)], as_ids=[False])
        m.complete_step(h.write(batch, spans))
        m._ledger._fence = NotReadyFence()
        fences.append(m._ledger._fence)
    assert len(m._ledger._older) <= 4
    m.close(a)  # its pages wait for the latest step ("running")
    free = m.free_page_count()
    pending = m.stats()["pages"]["device"]["pending"]
    assert pending > 0
    fences[-2].block_until_ready()  # only the step before the latest finished
    assert m.free_page_count() == free  # the latest step still runs: nothing freed after it
    fences[-1].block_until_ready()
    assert m.free_page_count() == (free[0] + pending,)
    assert m.stats()["pages"]["device"]["pending"] == 0
    m.check_invariants()


def test_compact_moves_rows_without_rebuilding():
    """Four sequences, two closed: compacting the survivors to rows 0 and 1 moves their ring
    rows; later steps keep writing and reading the right pages."""
    cfg = ring_config((None, 5), chunk=4, device_pages=60, max_seq_len=64, max_batch=4)
    h = make(cfg)
    m = h.mgr
    seqs = [h.add(list(range(10 * i + 1, 10 * i + 8))) for i in range(4)]
    h.run([(s, 4) for s in seqs], as_ids=[True] * 4)
    h.run([(s, 3) for s in seqs], as_ids=[True] * 4)
    rows = [s.row for s in seqs]
    before = {s.seq_id: (s.page_ids(0), s.page_ids(1)) for s in seqs}
    m.close(seqs[0])
    m.close(seqs[2])
    keep = [seqs[1], seqs[3]]
    old_to_new = np.full(max(rows) + 1, -1)
    old_to_new[keep[0].row], old_to_new[keep[1].row] = 1, 0
    new_to_old = m.compact(old_to_new)
    assert (keep[0].row, keep[1].row) == (1, 0)
    assert new_to_old.tolist() == [rows[3], rows[1]]
    for s in keep:
        assert np.array_equal(s.page_ids(0), before[s.seq_id][0])
        assert np.array_equal(s.page_ids(1), before[s.seq_id][1])
    h.check()
    for _ in range(8):
        batch, spans = h.prepare([(s, 1) for s in keep], as_ids=[True, False])
        m.complete_step(h.write(batch, spans))
        read_back(h, batch, spans)
        h.check()
    c = h.add(list(range(90, 95)))  # a free row is reused
    assert c.row not in (0, 1)
    h.run([(c, 4)], as_ids=[True])
    h.check()


def test_compact_refuses_bad_maps_and_steps():
    h = make(tiny_config(device_pages=20, windows=(None, 6)))
    m = h.mgr
    a, b = h.add([1, 2, 3]), h.add([4, 5, 6])
    with pytest.raises(ValueError, match="two sequences"):
        m.compact([0, 0])
    with pytest.raises(ValueError, match="-1"):
        m.compact([0, -1])
    with pytest.raises(ValueError, match="old_to_new has 1"):
        m.compact([0])
    with pytest.raises(ValueError, match="1-D"):
        m.compact([[0, 1]])
    m.prepare_step([(a, 1)])
    with pytest.raises(StepInFlightError):
        m.compact([1, 0])
    m.complete_step(stepped(m.storage.pools))
    assert m.compact([1, 0]).tolist() == [1, 0]
    assert (a.row, b.row) == (1, 0)
    m.check_invariants()


def test_shutdown_waits_closes_and_removes_files(tmp_path):
    cfg = tiny_config(device_pages=8, host_pages=4, disk_dir=str(tmp_path), disk_pages=6,
                      windows=(None, 6))
    h = make(cfg)
    m = h.mgr
    a = h.add(list(range(1, 12)))
    h.run([(a, 11)], as_ids=[True])
    m.prepare_step([(a, 1)])
    with pytest.raises(StepInFlightError):
        m.shutdown()
    m.complete_step(stepped(m.storage.pools))
    m._ledger._fence = fence = NotReadyFence()
    m.close(a)
    assert not any(p.closed for p in m.storage.disk_pools + m.storage.host_pools)
    pools = [x for pair in m.storage.pools for x in pair]
    m.shutdown()
    assert fence.ready  # waited for the last step
    assert all(x.is_deleted() for x in pools)  # device memory freed now, not at the last ref
    assert m.stats()["pages"]["device"]["pending"] == 0
    assert not os.listdir(tmp_path)  # no disk file left (unlinked at creation, closed now)
    assert all(p.closed for p in m.storage.disk_pools + m.storage.host_pools)
    assert m.storage._ring_buffer is None  # the pinned staging memory
    m.shutdown()  # a second call does nothing
    for call in (lambda: m.add_sequence([1, 2]), lambda: m.prepare_step([(a, 1)]),
                 lambda: m.compact([]), lambda: m.close(a)):
        with pytest.raises(RuntimeError, match="shut down"):
            call()


# -- per-group pool sizing -------------------------------------------------------------------


def _mixed(**kw) -> KVCacheConfig:
    """1 full layer and 3 window-4096 layers vs the same 4 layers all full (16 tokens a page)."""
    lg = dict(num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16)
    return KVCacheConfig(tokens_per_page=16, max_seq_len=32768, max_tokens_per_step=2048,
                         layer_groups=(LayerGroupConfig(1, **lg),
                                       LayerGroupConfig(3, sliding_window=4096, **lg)), **kw)


def test_device_bytes_split_by_pool_ratio():
    page = 2 * 16 * 8 * 128 * 2
    cfg = _mixed(device_bytes=1000 * page * 4, pool_ratio=(1, 3))
    assert cfg.device_pages == (1000, 1000)  # 1/4 of the bytes to 1 layer, 3/4 to 3 layers
    cfg = _mixed(device_bytes=1000 * page * 4, pool_ratio=(3, 1))
    assert cfg.device_pages == (3000, 333)
    with pytest.raises(ValueError, match="pool_ratio has 3"):
        _mixed(device_bytes=10 ** 9, pool_ratio=(1, 2, 3))
    with pytest.raises(ValueError, match="device_bytes"):
        _mixed(device_pages=100, pool_ratio=(1, 1))
    with pytest.raises(ValueError, match="at most one"):
        _mixed(device_bytes=10 ** 9, pool_ratio=(1, 1), typical_batch=(100,))
    with pytest.raises(ValueError, match="positive"):
        _mixed(device_bytes=10 ** 9, pool_ratio=(1, 0))


def test_typical_batch_sizing_triples_capacity():
    """At 32k-token contexts, 3 of 4 layers windowed (W = 4,096): sized for that batch, the same
    device bytes hold ~2.9x the sequences of the all-full model (the bound is 4 * 32768 /
    (32768 + 3 * W') with W' the window's peak in tokens)."""
    budget = 40 * 2 ** 30
    lg = dict(num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16)
    full = KVCacheConfig(tokens_per_page=16, max_seq_len=32768, max_tokens_per_step=2048,
                         layer_groups=(LayerGroupConfig(4, **lg),), device_bytes=budget)
    equal = _mixed(device_bytes=budget)
    sized = _mixed(device_bytes=budget, typical_batch=(32768,) * 8, max_window_chunk=256)
    from jax_kvcm.manager import KVCacheManager
    import jax
    n = {}
    for name, cfg in (("full", full), ("equal", equal), ("sized", sized)):
        # capacity planning only: tiny pools would do, but the manager sizes its pools from the
        # config, so plan with the config's numbers directly.
        peak = cfg.peak_pages(32768)
        n[name] = int((np.asarray(cfg.device_pages) // peak).min())
    assert n["equal"] < n["sized"]
    ratio = n["sized"] / n["full"]
    bound = 4 * 32768 / (32768 + 3 * (sized.peak_pages(32768)[1] * 16))
    assert ratio >= 0.97 * bound and ratio > 2.8, (n, ratio, bound)
    # The manager's max_num_sequences is the same computation.
    small = _mixed(device_bytes=2 ** 22, typical_batch=(32768,), max_window_chunk=256)
    m = KVCacheManager(small, device=jax.devices("cpu")[0])
    peak = small.peak_pages(32768)
    assert m.max_num_sequences(32768) == int((np.asarray(small.device_pages) // peak).min())
    m.shutdown()


@pytest.mark.parametrize("kw,name,exc", [
    (dict(ring_tables="yes"), "ring_tables", TypeError),
    (dict(max_window_chunk=0), "max_window_chunk", ValueError),
    (dict(max_window_chunk=2.5), "max_window_chunk", TypeError),
    (dict(device_bytes=10 ** 8, device_pages=None, typical_batch=()), "typical_batch", ValueError),
    (dict(device_bytes=10 ** 8, device_pages=None, typical_batch=(0,)), "typical_batch[0]",
     ValueError),
    (dict(device_bytes=10 ** 8, device_pages=None, typical_batch=5), "typical_batch", TypeError),
    (dict(device_bytes=10 ** 8, device_pages=None, pool_ratio=(1, "a")), "pool_ratio",
     TypeError),
    (dict(device_bytes=10, device_pages=None, pool_ratio=(1, 1)), "device_bytes", ValueError),
])
def test_new_config_fields_refuse_bad_values(kw, name, exc):
    with pytest.raises(exc, match=name.replace("[", r"\[").replace("]", r"\]")):
        tiny_config(windows=(None, 6), **kw)


def test_pool_ratio_config_is_hashable_and_drives_the_manager():
    cfg = tiny_config(windows=(None, 6), device_pages=None, device_bytes=6000,
                      pool_ratio=[1, 2])
    assert cfg.pool_ratio == (1, 2) and hash(cfg)
    h = make(cfg)
    assert tuple(a.num_slots - 1 for a in h.mgr.storage.device_allocators) == cfg.device_pages
    a = h.add(list(range(1, 10)))
    h.run([(a, 9)], as_ids=[True])
    h.check()
