"""Sliding-window groups as bounded rings (``KVCacheConfig.ring_tables``).

The oracle: the fake model of test_manager writes known K/V for every position; a small numpy
gather reads a row's window back through the ring exactly as the ops' ``ring_table=True``
contract says ("the page of position p of row b is ``page_table[b, (p // page_size) %
page_table.shape[-1]]``"), and attention over that is compared with dense numpy attention.
The tests that call the ops with ``ring_table=True`` skip until the ops have the keyword.
"""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvcm
from jax_kvcm.manager import KVCacheConfig, KVCacheManager, LayerGroupConfig
from jax_kvcm._window_group import ring_width
from test_manager import (TPP, Harness, dense_attention, expected_values, make, prefix_hashes,
                          read_tokens, stepped, tiny_config)

HAS_RING_OPS = "ring_table" in inspect.signature(jax_kvcm.paged_attention).parameters
needs_ring_ops = pytest.mark.skipif(not HAS_RING_OPS,
                                    reason="the attention ops have no ring_table keyword yet")


def ring_config(windows, *, chunk=None, **kw) -> KVCacheConfig:
    return tiny_config(windows=windows, ring_tables=True, max_window_chunk=chunk, **kw)


def read_back(h: Harness, batch, spans) -> int:
    """Every window position of every row of ``batch`` (its last query's window; every position
    of full groups) read back through ``batch.page_table`` as a ring must equal what the fake
    model wrote. Returns the number of positions checked."""
    mgr = h.mgr
    widths = mgr.config.table_widths
    G = len(mgr.config.layer_groups)
    checked = 0
    for b, (sid, start, n) in enumerate(spans):
        length = start + n
        assert batch.seq_lens[b] == length
        toks = h.tokens[sid][:length]
        for g, lg in enumerate(mgr.config.layer_groups):
            pt = batch.page_table[g] if G > 1 else batch.page_table
            row = pt[b, :widths[g]]
            assert not pt[b, widths[g]:].any(), "entries past the group's width"
            lo = max(0, length - lg.sliding_window) if lg.sliding_window else 0
            pos = np.arange(lo, length)
            want = expected_values(prefix_hashes(toks)[pos], pos, lg.num_layers,
                                   lg.num_kv_heads, lg.head_dim)
            tpp = mgr.config.tokens_per_page
            slots = row[(pos // tpp) % row.shape[0]] * tpp + pos % tpp
            for kv, got in enumerate(read_tokens(mgr, g, slots)):
                assert np.array_equal(got, want[:, kv]), (
                    f"row {b} group {g} {'KV'[kv]}: positions "
                    f"{pos[(got != want[:, kv]).any(axis=(0, 2, 3))].tolist()} differ")
            checked += pos.size
    return checked


@pytest.mark.parametrize("window,chunk", [(1, None), (3, 2), (4, None), (6, 5), (9, 1),
                                          (13, None)])
def test_ring_rows_hold_the_window(window, chunk):
    """A full group and a window group with ring tables, prefill in chunks then decode well
    past the window: the window group's row is R entries wide whatever the length, and every
    window position reads back through the ring (and every position of the full group)."""
    cfg = ring_config((None, window), chunk=chunk, device_pages=40, max_seq_len=64,
                      max_tokens=16)
    h = make(cfg)
    m = h.mgr
    R = cfg.table_widths[1]
    assert R == ring_width(window, TPP, chunk or 16, 16)
    assert cfg.table_widths[0] == 16
    rng = np.random.default_rng(window)
    print("seed", window)
    a, b = h.add(list(range(1, 20))), h.add(list(range(30, 37)))
    done = {a.seq_id: False, b.seq_id: False}
    checked = 0
    for _ in range(40):
        work = []
        for s in (a, b):
            left = len(h.tokens[s.seq_id]) - s.num_tokens
            n = min(left, int(rng.integers(1, min(chunk or 8, 8) + 1))) if left > 0 else 1
            if s.num_tokens + n <= 60:
                work.append((s, n))
        if not work:
            break
        batch, spans = h.prepare(work, as_ids=[True] * len(work))
        assert batch.page_table.shape[-1] == 16  # [G, B, max width]: the full group's P
        m.complete_step(h.write(batch, spans))
        checked += read_back(h, batch, spans)
        h.check()
        for s in (a, b):
            held = np.count_nonzero(s.page_ids(1))
            assert held <= R, (held, R)
            done[s.seq_id] |= s.num_tokens > window + 2 * TPP
    assert all(done.values()) and checked > 0
    assert m.stats()["num_window_released_pages"] > 0


def test_ring_table_width_independent_of_context():
    """W = 4,096 at 32k (and 128k) tokens of context: the window group's table is R wide, the
    full group's max_seq_len / P; a window-only model's StepBatch table is [B, R]."""
    def cfg(max_seq_len, windows=(None, 4096), **kw):
        lgs = tuple(LayerGroupConfig(1, 1, 8, jnp.float32, sliding_window=w) for w in windows)
        return KVCacheConfig(tokens_per_page=16, layer_groups=lgs, device_pages=2100,
                             max_seq_len=max_seq_len, max_tokens_per_step=2048, max_batch=4,
                             ring_tables=True, **kw)
    R = -(-(4096 + 2048 - 2) // 16) + 1
    assert cfg(32768).table_widths == (2048, R)
    assert cfg(131072).table_widths == (8192, R)
    assert cfg(32768, max_window_chunk=1).table_widths == (2048, 4096 // 16 + 1)
    assert dataclasses.replace(cfg(32768), ring_tables=False).table_widths == (2048, 2048)
    # A window-only model driven to 32k tokens: the table stays [B, R].
    m = KVCacheManager(cfg(32768, windows=(4096,), max_window_chunk=1024),
                       device=jax.devices("cpu")[0])
    R = m.config.table_widths[0]
    assert R == -(-(4096 + 1022) // 16) + 1 < 32768 // 16
    s = m.add_sequence(np.arange(32768) % 1000)
    while s.num_tokens < 32768:
        batch = m.prepare_step([(s, min(1024, 32768 - s.num_tokens))])
        assert batch.page_table.shape == (1, R)
        m.complete_step(stepped(m.storage.pools))
        assert np.count_nonzero(batch.page_table) <= R
    m.check_invariants()
    assert np.count_nonzero(s.page_ids()) <= -(-4095 // 16) + 1
    assert m.private_pages_per_sequence() == (R,)
    m.shutdown()


def test_window_chunk_limit_refused_unchanged():
    h = make(ring_config((None, 6), chunk=4, device_pages=20))
    a = h.add(list(range(1, 12)))
    before = h.mgr.stats()
    with pytest.raises(ValueError, match="max_window_chunk"):
        h.mgr.prepare_step([(a, 5)])
    assert h.mgr.stats() == before and a.num_tokens == 0
    h.run([(a, 4)])
    h.check()


def test_ring_attention_matches_dense_through_absolute_ops():
    """The ring rows, unrolled into absolute tables (page j at entry j), drive today's ops to the
    dense answer: what a kernel reading the ring reads is the right data."""
    h = make(ring_config((None, 6), chunk=3, device_pages=40, max_seq_len=64))
    rng = np.random.default_rng(7)
    print("seed", 7)
    a, b = h.add(list(range(1, 14))), h.add(list(range(20, 25)))
    lg = h.mgr.config.layer_groups[1]
    R = h.mgr.config.table_widths[1]
    for _ in range(20):
        work = [(a, int(rng.integers(1, 4))), (b, int(rng.integers(1, 4)))]
        batch, spans = h.prepare(work, as_ids=[True, True])
        caches = h.write(batch, spans)
        k, v = caches[1]
        ring = np.asarray(batch.page_table[1])[:, :R]
        absolute = np.zeros((ring.shape[0], 16), np.int32)
        for i, (sid, start, n) in enumerate(spans):
            j = np.arange(max(0, start + 1 - lg.sliding_window) // TPP, -(-(start + n) // TPP))
            absolute[i, j] = ring[i, j % R]
        Tb = batch.positions.shape[0]
        q = (rng.standard_normal((Tb, 4, lg.head_dim)) * 1e-6).astype(np.float32)
        out = np.asarray(jax_kvcm.ragged_paged_attention(
            jnp.asarray(q), k, v, jnp.asarray(absolute), jnp.asarray(batch.seq_lens),
            jnp.asarray(batch.query_start), layer=lg.num_layers - 1,
            sliding_window=lg.sliding_window))
        t = 0
        for sid, start, n in spans:
            ev = expected_values(prefix_hashes(h.tokens[sid][:start + n]), np.arange(start + n),
                                 lg.num_layers, lg.num_kv_heads, lg.head_dim)[-1]
            want = dense_attention(q[t:t + n], ev[0], ev[1], np.arange(start, start + n),
                                   lg.sliding_window)
            np.testing.assert_allclose(out[t:t + n], want, rtol=1e-4)
            t += n
        h.mgr.complete_step(caches)
        h.check()


@needs_ring_ops
@pytest.mark.parametrize("impl", ["op", "reference"])
def test_ring_tables_drive_ring_ops(backend, impl):
    """The StepBatch's ring rows passed to the ops with ``ring_table=True`` (sliced to the
    group's width): ragged and decode attention equal dense attention over the written K/V.
    The null page is NaN, so a read of a released entry shows."""
    from jax_kvcm.ops import reference
    # The reference jitted (its semantics, without seconds of op-by-op dispatch per step).
    static = ("layer", "sliding_window", "ring_table")
    fn = {"op": (jax_kvcm.ragged_paged_attention, jax_kvcm.paged_attention),
          "reference": (jax.jit(reference.ragged_paged_attention, static_argnames=static),
                        jax.jit(reference.paged_attention, static_argnames=static))}[impl]
    cfg = ring_config((None, 6), chunk=3, device_pages=40, max_seq_len=64)
    h = Harness(KVCacheManager(cfg, device=backend.device))
    rng = np.random.default_rng(11)
    print("seed", 11)
    a, b = h.add(list(range(1, 14))), h.add(list(range(20, 25)))
    R = cfg.table_widths[1]
    checked = 0
    for step in range(24):
        work = [(a, int(rng.integers(1, 4))), (b, int(rng.integers(1, 4)))] if step < 12 else \
            [(a, 1), (b, 1)]
        batch, spans = h.prepare(work, as_ids=[True, True])
        caches = h.write(batch, spans)
        caches = [(k.at[:, 0].set(jnp.nan), v.at[:, 0].set(jnp.nan)) for k, v in caches]
        for g, lg in enumerate(cfg.layer_groups):
            width = cfg.table_widths[g]
            k, v = caches[g]
            Tb = batch.positions.shape[0]
            q = (rng.standard_normal((Tb, 4, lg.head_dim)) * 1e-6).astype(np.float32)
            pt, sl, qs = backend.put(np.asarray(batch.page_table[g])[:, :width],
                                     batch.seq_lens, batch.query_start)
            ring = {"ring_table": True} if lg.sliding_window else {}
            out = np.asarray(fn[0](backend.put(q), k, v, pt, sl, qs, layer=lg.num_layers - 1,
                                   sliding_window=lg.sliding_window, **ring))
            t = 0
            for sid, start, n in spans:
                ev = expected_values(prefix_hashes(h.tokens[sid][:start + n]),
                                     np.arange(start + n), lg.num_layers, lg.num_kv_heads,
                                     lg.head_dim)[-1]
                want = dense_attention(q[t:t + n], ev[0], ev[1], np.arange(start, start + n),
                                       lg.sliding_window)
                np.testing.assert_allclose(out[t:t + n], want, rtol=1e-4)
                t += n
                checked += 1
            if all(n == 1 for _, _, n in spans):
                dec = np.asarray(fn[1](backend.put(q[:sl.shape[0]]), k, v, pt, sl,
                                       layer=lg.num_layers - 1,
                                       sliding_window=lg.sliding_window, **ring))
                np.testing.assert_allclose(dec[:len(spans)], out[:len(spans)], rtol=1e-4)
        h.mgr.complete_step(caches)
        h.check()
    assert R < 16 and checked == 2 * 2 * 24
