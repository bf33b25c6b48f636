"""KVCacheManager: configs, steps through write_kv with a checked fake model, prefix reuse (with a
forced constant hash), eviction down the tiers, suspend/resume, fences, exhaustion, threads and
recompilation. CPU only.

The fake model writes, for the token at position ``p`` of a sequence whose tokens are ``t``, K/V
values that are a function of (a hash of ``t[:p+1]``, ``p``, layer, K or V, head, dim); the
checker gathers every cached value of every ACTIVE sequence through its page table and compares.
"""

from __future__ import annotations

import functools
import os
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvcm
from jax_kvcm._manager import (KVCacheConfig, KVCacheManager, LayerGroupConfig, OutOfPagesError,
                               SequenceState, StepInFlightError, SuspendResult)
from jax_kvcm._step_batch import StepBatch
from jax_kvcm._types import CacheLevel

D, H, K = CacheLevel.DEVICE, CacheLevel.HOST, CacheLevel.DISK
TPP = 4


def tiny_config(*, device_pages=12, host_pages=0, disk_dir=None, disk_pages=0, groups=1,
                prefix=True, max_batch=4, max_tokens=32, max_seq_len=64) -> KVCacheConfig:
    lgs = tuple(LayerGroupConfig(num_layers=1 + (g % 2), num_kv_heads=1 + (g % 2), head_dim=8,
                                 dtype=jnp.float32) for g in range(groups))
    # Cold pages of the default codec are a little larger than hot ones: size by hot bytes + 25%.
    hot = sum(2 * g.num_layers * TPP * g.num_kv_heads * g.head_dim * 4 for g in lgs)
    return KVCacheConfig(tokens_per_page=TPP, layer_groups=lgs, device_pages=device_pages,
                         host_bytes=int(host_pages * hot * 1.25), disk_dir=disk_dir,
                         disk_bytes=int(disk_pages * hot * 1.25), enable_prefix_reuse=prefix,
                         max_batch=max_batch, max_tokens_per_step=max_tokens,
                         max_seq_len=max_seq_len)


# -- the fake model --------------------------------------------------------------------------


def prefix_hashes(tokens) -> np.ndarray:
    h, out = 17, np.empty(len(tokens), np.int64)
    for i, t in enumerate(tokens):
        h = (h * 1000003 + int(t) + 1) % 1048573
        out[i] = h
    return out


def expected_values(hashes: np.ndarray, pos: np.ndarray, num_layers: int, hkv: int,
                    d: int) -> np.ndarray:
    """[L, 2, n, Hkv, D] float32, exact (integers < 2^20 plus multiples of 1/8)."""
    layer = np.arange(num_layers)[:, None, None, None, None]
    kv = np.arange(2)[None, :, None, None, None]
    base = (hashes[None, None, :, None, None] * 131 + pos[None, None, :, None, None] * 7
            + layer * 3 + kv) % (1 << 20)
    heads = np.arange(hkv)[None, None, None, :, None]
    dims = np.arange(d)[None, None, None, None, :]
    return (base + heads * 0.5 + dims * 0.125).astype(np.float32)


@functools.partial(jax.jit, donate_argnums=(0,))
def fake_step(caches, batch: StepBatch, vals):
    out = []
    multi = len(caches) > 1
    for g, ((k, v), val) in enumerate(zip(caches, vals)):
        sm = batch.slot_mapping[g] if multi else batch.slot_mapping
        for layer in range(k.shape[0]):
            k, v = jax_kvcm.write_kv(k, v, val[layer, 0], val[layer, 1], sm, layer=layer)
        out.append((k, v))
    return out


class Harness:
    """The manager plus the test's shadow of every sequence's tokens."""

    def __init__(self, mgr: KVCacheManager) -> None:
        self.mgr = mgr
        self.tokens: dict[int, list[int]] = {}   # seq_id -> every token (prompt + generated)
        self.rng = np.random.default_rng(0)

    def add(self, tokens, salt=None):
        seq = self.mgr.add_sequence(tokens, salt=salt)
        self.tokens[seq.seq_id] = list(int(t) for t in tokens)
        return seq

    def run(self, work, as_ids=None):
        """work: [(seq, n)]; prompt tokens first, then new random tokens (passed as ids when
        ``as_ids`` says so, else as counts the manager does not know)."""
        mgr, cfg = self.mgr, self.mgr.config
        items, spans = [], []
        for i, (seq, n) in enumerate(work):
            toks = self.tokens[seq.seq_id]
            start = seq.num_tokens
            while len(toks) < start + n:
                toks.append(int(self.rng.integers(0, 50)))
            ids = as_ids[i] if as_ids is not None else bool(self.rng.integers(0, 2))
            items.append((seq, np.asarray(toks[start:start + n], np.int32) if ids else n))
            spans.append((seq.seq_id, start, n))
        batch = mgr.prepare_step(items)
        vals = []
        Tb = batch.positions.shape[0]
        for lg in cfg.layer_groups:
            val = np.zeros((lg.num_layers, 2, Tb, lg.num_kv_heads, lg.head_dim), np.float32)
            t = 0
            for sid, start, n in spans:
                h = prefix_hashes(self.tokens[sid][:start + n])[start:]
                val[:, :, t:t + n] = expected_values(h, np.arange(start, start + n),
                                                     lg.num_layers, lg.num_kv_heads, lg.head_dim)
                t += n
            vals.append(jnp.asarray(val))
        caches = fake_step(mgr.caches, batch, vals)
        mgr.complete_step(caches)
        return batch

    def check_values(self) -> int:
        mgr = self.mgr
        pools = [(np.asarray(k), np.asarray(v)) for k, v in mgr.storage.pools]
        checked = 0
        for seq in list(mgr._seqs.values()):
            if seq.state is not SequenceState.ACTIVE:
                continue
            n = seq.num_tokens
            if n == 0:
                continue
            toks = self.tokens[seq.seq_id][:n]
            pos = np.arange(n)
            for g, lg in enumerate(mgr.config.layer_groups):
                pages = seq.page_ids(g)
                slots = pages[pos // TPP] * TPP + pos % TPP
                want = expected_values(prefix_hashes(toks), pos, lg.num_layers,
                                       lg.num_kv_heads, lg.head_dim)
                k, v = pools[g]
                for kv, arr in enumerate((k, v)):
                    flat = arr.reshape(arr.shape[0], -1, arr.shape[-2], arr.shape[-1])
                    got = flat[:, slots]
                    assert np.array_equal(got, want[:, kv]), (
                        f"{seq!r} group {g} {'KV'[kv]}: cached values differ at positions "
                        f"{np.flatnonzero((got != want[:, kv]).any(axis=(0, 2, 3))).tolist()}")
            checked += n
        return checked

    def check(self) -> None:
        self.mgr.check_invariants()
        self.check_values()


def flip_disk_bit(h: Harness, slot: int) -> None:
    """Corrupts one byte of disk slot ``slot`` (layer group 0's pool): its checksum fails."""
    pool = h.mgr.storage.disk_pools[0]
    with open(pool.path, "r+b") as f:
        f.seek(int(slot) * pool.slot_bytes + 5)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.fixture
def diskdir():
    with tempfile.TemporaryDirectory() as d:
        yield d


def make(cfg, **kw) -> Harness:
    return Harness(KVCacheManager(cfg, device=jax.devices("cpu")[0], **kw))


# -- config ----------------------------------------------------------------------------------


def test_config_defaults_and_buckets():
    cfg = tiny_config(max_batch=6, max_tokens=40)
    assert cfg.batch_buckets == (1, 2, 4, 6)
    assert cfg.token_buckets == (4, 8, 16, 32, 40)
    assert cfg.device_pages == (12,)
    assert cfg.pages_per_seq == 16


@pytest.mark.parametrize("kw, field", [
    (dict(tokens_per_page=0), "tokens_per_page"),
    (dict(layer_groups=()), "layer_groups"),
    (dict(layer_groups=(LayerGroupConfig(0, 1, 8),)), "layer_groups[0].num_layers"),
    (dict(layer_groups=(LayerGroupConfig(1, 1, 8, sliding_window=0),)),
     "layer_groups[0].sliding_window"),
    (dict(device_pages=0), "device_pages"),
    (dict(device_pages=None), "device_pages"),
    (dict(device_pages=(4, 4)), "device_pages"),
    (dict(host_bytes=-1), "host_bytes"),
    (dict(disk_bytes=100), "disk_dir"),
    (dict(max_batch=0), "max_batch"),
    (dict(max_tokens_per_step=0), "max_tokens_per_step"),
    (dict(max_seq_len=0), "max_seq_len"),
    (dict(batch_buckets=(1, 2)), "batch_buckets"),
    (dict(batch_buckets=(2, 1, 4)), "batch_buckets"),
    (dict(token_buckets=(8,)), "token_buckets"),
    (dict(enable_prefix_reuse=1), "enable_prefix_reuse"),
])
def test_config_errors_name_the_field(kw, field):
    base = dict(tokens_per_page=4, layer_groups=(LayerGroupConfig(1, 1, 8),), device_pages=8,
                max_batch=4, max_tokens_per_step=16, max_seq_len=64)
    base.update(kw)
    with pytest.raises((ValueError, TypeError), match=field.replace("[", r"\[").replace("]", r"\]")):
        KVCacheConfig(**base)


def test_device_bytes_budget():
    lg = LayerGroupConfig(1, 1, 8, jnp.float32)  # 256-byte pages at tpp 4
    cfg = KVCacheConfig(tokens_per_page=4, layer_groups=(lg, lg), device_bytes=512 * 5 + 100)
    assert cfg.device_pages == (5, 5)


def test_step_batch_is_a_pytree_with_no_static_fields():
    h = make(tiny_config())
    s = h.add(list(range(6)))
    b = h.mgr.prepare_step([(s, 6)])
    leaves, tree = jax.tree_util.tree_flatten(b)
    assert len(leaves) == 5 and all(x.dtype == np.int32 for x in leaves)
    assert b.page_table.shape == (1, 16) and b.slot_mapping.shape == (8,)
    assert b.query_start.tolist() == [0, 6] and b.seq_lens.tolist() == [6]
    assert b.slot_mapping[6:].tolist() == [-1, -1] and b.positions[:6].tolist() == list(range(6))
    assert (b.page_table[0, 2:] == 0).all()
    h.mgr.complete_step(h.mgr.storage.pools)
    b2 = h.mgr.prepare_step([(s, 1)])
    assert jax.tree_util.tree_structure(b2) == tree
    h.mgr.complete_step(h.mgr.storage.pools)


# -- steps and values ------------------------------------------------------------------------


@pytest.mark.parametrize("groups", [1, 2])
def test_prefill_decode_values_roundtrip(groups):
    h = make(tiny_config(groups=groups))
    a = h.add(list(range(10)))
    b = h.add([7] * 3)
    h.run([(a, 10), (b, 3)])
    for _ in range(6):
        h.run([(a, 1), (b, 1)])
        h.check()
    assert a.num_tokens == 16 and b.num_tokens == 9
    assert h.check_values() == 25


def test_prefix_reuse_shares_committed_pages():
    h = make(tiny_config())
    prompt = list(range(1, 14))
    a = h.add(prompt)
    h.run([(a, 13)], as_ids=[True])
    b = h.add(prompt + [99])
    assert b.num_reused_tokens == 12
    assert np.array_equal(b.page_ids()[:3], a.page_ids()[:3])
    h.run([(b, 2)])
    h.check()
    c = h.add(prompt[:8])             # all but the last token at most: 1 page
    assert c.num_reused_tokens == 4
    d = h.add(prompt, salt="lora-1")  # another salt: no reuse
    assert d.num_reused_tokens == 0
    e = h.add([0] + prompt[1:])       # first page differs: nothing
    assert e.num_reused_tokens == 0
    h.check()
    stats = h.mgr.stats()
    assert stats["num_prefix_hit_tokens"] == 16 and stats["num_committed_pages"] >= 3


def test_duplicate_pages_are_adopted():
    h = make(tiny_config(device_pages=12))
    prompt = list(range(1, 11))
    a, b = h.add(prompt), h.add(prompt)  # neither is committed yet: both compute everything
    h.run([(a, 10), (b, 10)], as_ids=[True, True])
    assert np.array_equal(a.page_ids()[:2], b.page_ids()[:2])
    assert h.mgr.stats()["num_adopted_pages"] == 2
    assert h.mgr.stats()["pages"]["device"]["pending"] == 2
    h.check()
    h.run([(a, 6), (b, 6)])  # both keep committing past the shared pages
    h.check()
    h.mgr.close(a)
    h.check()
    c = h.add(prompt + [5])
    assert c.num_reused_tokens == 8
    h.check()


def test_constant_hash_never_reuses_other_tokens():
    h = make(tiny_config(device_pages=32, max_batch=8), _hash_fn=lambda data: b"same")
    rng = np.random.default_rng(1)
    seqs = []
    for i in range(30):
        toks = rng.integers(0, 3, size=int(rng.integers(2, 14))).tolist()
        s = h.add(toks)
        if s.num_reused_tokens:
            n = s.num_reused_tokens
            assert h.tokens[s.seq_id][:n] == list(toks[:n])
        h.run([(s, len(toks) - s.num_reused_tokens)], as_ids=[True])
        h.check()
        seqs.append(s)
        if len(seqs) > 3:
            h.mgr.close(seqs.pop(0))
    # With every key equal, at most one node exists and only identical first pages share it.
    assert len(h.mgr.tree) <= 1


def test_constant_hash_check_is_what_protects(monkeypatch):
    """Break the token check: the value checker must catch the wrong reuse."""
    h = make(tiny_config(), _hash_fn=lambda data: b"same")
    tree = h.mgr.tree

    def unchecked_match(tokens, salt, page_size, max_pages):  # keys only, no token check
        out, key = [], b""
        for p in range(max_pages):
            key = tree.key(key, tokens[p * page_size:(p + 1) * page_size], salt)
            if key not in tree.nodes:
                break
            out.append(tree.nodes[key])
        return out

    a = h.add([1, 2, 3, 4, 5])
    h.run([(a, 5)], as_ids=[True])
    monkeypatch.setattr(tree, "match", unchecked_match)
    b = h.add([9, 9, 9, 9, 9])
    monkeypatch.undo()
    assert b.num_reused_tokens == 4
    h.run([(b, 1)])
    with pytest.raises(AssertionError, match="cached values differ"):
        h.check_values()


# -- eviction --------------------------------------------------------------------------------


@pytest.mark.parametrize("tiers", ["none", "host", "host+disk", "disk"])
def test_eviction_cascades_and_onboards(tiers, diskdir):
    cfg = tiny_config(device_pages=6, host_pages=3 if "host" in tiers else 0,
                      disk_dir=diskdir if "disk" in tiers else None,
                      disk_pages=3 if "disk" in tiers else 0)
    h = make(cfg)
    prompts = [[p * 10 + i for i in range(9)] for p in range(6)]
    for p in prompts:  # each leaves 2 committed pages cached after close
        s = h.add(p)
        h.run([(s, 9)], as_ids=[True])
        h.check()
        h.mgr.close(s)
        h.check()
    st = h.mgr.stats()
    if tiers == "none":
        assert st["num_dropped_pages"] > 0 and st["num_evicted_pages"] == [0, 0, 0]
    else:
        assert sum(st["num_evicted_pages"]) > 0
    # Re-adding the prompts: hits on lower tiers are onboarded, values checked.
    total = 0
    for p in reversed(prompts):  # most recent first (in order, LRU would thrash)
        s = h.add(p)
        total += s.num_reused_tokens
        h.run([(s, 9 - s.num_reused_tokens)], as_ids=[True])
        h.check()
        h.mgr.close(s)
    if tiers != "none":
        assert h.mgr.stats()["num_onboarded_pages"] > 0
    assert total > 0


def test_freed_pages_wait_for_the_last_step_fence():
    h = make(tiny_config(device_pages=4, prefix=False))
    a = h.add(list(range(16)))
    h.run([(a, 16)])
    mgr = h.mgr
    fence = mgr._fence

    class NotReady:  # the step that last read a's pages has "not finished"
        def __init__(self):
            self.ready = False

        def is_deleted(self):
            return False

        def is_ready(self):
            return self.ready

        def block_until_ready(self):
            self.ready = True

    mgr._fence = NotReady()
    mgr._ready_upto = 0
    mgr.close(a)
    assert mgr.stats()["pages"]["device"]["pending"] == 4
    b = h.add([1, 2, 3])
    mgr._reclaim()
    assert mgr.stats()["pages"]["device"]["pending"] == 4  # not ready: not reclaimed
    h.run([(b, 3)])  # nothing else is free: blocks on the fence, then reuses
    assert mgr._stats.num_fence_waits == 1 and mgr._fence is not fence
    h.check()


def test_fence_donated_into_a_migration_still_tells():
    """The latest step's fence array was donated into a later migration (a decode donates the
    pools): the pending frees must still come back, through the pools that migration made."""
    h = make(tiny_config(device_pages=4, prefix=False))
    a = h.add(list(range(16)))
    h.run([(a, 16)])
    mgr = h.mgr
    donated = jnp.zeros(1)
    donated.delete()
    mgr._fence, mgr._ready_upto = donated, 0
    mgr.close(a)
    assert mgr.stats()["pages"]["device"]["pending"] == 4
    b = h.add([1, 2, 3])
    h.run([(b, 3)])  # every page is pending behind the donated fence
    h.check()


def test_close_during_step_waits_for_that_step(diskdir):
    h = make(tiny_config(device_pages=4, prefix=False))
    mgr = h.mgr
    a = h.add(list(range(8)))
    b = mgr.prepare_step([(a, 8)])
    caches = mgr.storage.pools
    with pytest.raises(StepInFlightError):
        mgr.suspend(a)
    mgr.close(a)
    assert mgr._pending[0][0] is None
    mgr.complete_step(caches)
    assert mgr._pending[0][0] == mgr._step_index
    mgr.check_invariants()


# -- suspend / resume ------------------------------------------------------------------------


def test_suspend_resume_byte_identical(diskdir):
    h = make(tiny_config(device_pages=8, host_pages=4, disk_dir=diskdir, disk_pages=8))
    a = h.add(list(range(13)))
    h.run([(a, 13)])
    before = h.mgr.stats()["pages"]["device"]["free"]
    assert h.mgr.suspend(a) is SuspendResult.SUSPENDED
    assert a.state is SequenceState.SUSPENDED
    assert h.mgr.stats()["pages"]["device"]["free"] == before + a.num_pages
    h.check()
    with pytest.raises(ValueError):
        h.mgr.prepare_step([(a, 1)])
    # Fill the device with another sequence's private pages, then resume must refuse.
    b = h.add(list(range(100, 130)))
    h.run([(b, 30)])
    assert h.mgr.resume(a) is False and a.state is SequenceState.SUSPENDED
    h.check()
    h.mgr.close(b)
    assert h.mgr.resume(a) is True
    h.check()  # byte-identical: the checker reads a's values back through its page table
    h.run([(a, 1)])
    h.check()


def test_suspend_without_room_must_recompute(diskdir):
    h = make(tiny_config(device_pages=8, host_pages=1))
    a = h.add(list(range(13)))
    h.run([(a, 13)])
    pt = a.page_ids().copy()
    ledger = h.mgr.storage.governor.ledger()
    assert h.mgr.suspend(a) is SuspendResult.MUST_RECOMPUTE
    assert a.state is SequenceState.ACTIVE and np.array_equal(a.page_ids(), pt)
    assert h.mgr.storage.governor.ledger() == ledger
    h.check()
    h2 = make(tiny_config(device_pages=8))  # no cold tier at all
    s = h2.add([1, 2, 3])
    h2.run([(s, 3)])
    assert h2.mgr.suspend(s) is SuspendResult.MUST_RECOMPUTE
    h2.check()


@pytest.mark.parametrize("chunk", [1, 3])
def test_disk_hops_are_split_to_fit_the_staging_ring(diskdir, chunk):
    h = make(tiny_config(device_pages=10, disk_dir=diskdir, disk_pages=10))
    h.mgr._disk_chunk = chunk
    a = h.add(list(range(30)))
    h.run([(a, 30)])
    migrations = h.mgr.storage.stats()["num_migrations"]
    assert h.mgr.suspend(a) is SuspendResult.SUSPENDED and a._parked[0] is K
    # 1 private page + 7 committed ones, in chunks
    assert h.mgr.storage.stats()["num_migrations"] - migrations == 1 + -(-7 // chunk)
    h.check()
    assert h.mgr.resume(a)
    h.check()


def test_corrupt_disk_page_on_resume_leaves_it_suspended(diskdir):
    from jax_kvcm._storage import CorruptPageError
    h = make(tiny_config(device_pages=10, disk_dir=diskdir, disk_pages=10, prefix=False))
    h.mgr._disk_chunk = 1  # the bad page is the last chunk: earlier chunks must be rolled back
    a = h.add(list(range(12)))
    h.run([(a, 12)])
    assert h.mgr.suspend(a) is SuspendResult.SUSPENDED
    lv, parked = a._parked
    flip_disk_bit(h, parked[0, -1])
    free = h.mgr.stats()["pages"]["device"]["free"]
    with pytest.raises(CorruptPageError):
        h.mgr.resume(a)
    assert a.state is SequenceState.SUSPENDED
    assert h.mgr.stats()["pages"]["device"]["free"] == free
    h.check()
    h.mgr.close(a)  # drop and recompute
    h.check()


def test_resume_is_all_or_nothing(diskdir):
    """A sequence parked on disk with its own committed pages (two moves back: the nodes, then
    the private page). The private page fails its checksum after the nodes came back: resume
    raises and leaves everything exactly as before (nodes still on disk, ledger, free counts)."""
    from jax_kvcm._storage import CorruptPageError
    h = make(tiny_config(device_pages=10, disk_dir=diskdir, disk_pages=10))
    a = h.add(list(range(13)))
    h.run([(a, 13)], as_ids=[True])
    assert h.mgr.suspend(a) is SuspendResult.SUSPENDED
    lv, parked = a._parked
    assert lv is K and len(a._nodes) == 3 and all(n.level is K for n in a._nodes)
    flip_disk_bit(h, parked[0, -1])
    st = h.mgr.storage
    before = (st.governor.ledger(), [st.num_free(lv_, 0) for lv_ in (D, K)],
              [n.slots.copy() for n in a._nodes], parked.copy(), st.stats())
    with pytest.raises(CorruptPageError):
        h.mgr.resume(a)
    assert a.state is SequenceState.SUSPENDED and all(n.level is K for n in a._nodes)
    after = (st.governor.ledger(), [st.num_free(lv_, 0) for lv_ in (D, K)],
             [n.slots.copy() for n in a._nodes], a._parked[1].copy(), st.stats())
    assert repr(after) == repr(before)
    h.check()
    h.mgr.close(a)  # drop and recompute: the good nodes stay cached on disk
    h.check()
    c = h.add(list(range(13)))
    assert c.num_reused_tokens == 12
    h.run([(c, 1)])
    h.check()


def test_resume_refusal_changes_nothing(diskdir):
    """Not enough device room even after evicting every cached page: resume refuses before
    evicting anything (cached pages stay where they were)."""
    h = make(tiny_config(device_pages=8, host_pages=8))
    a = h.add(list(range(100, 113)))
    h.run([(a, 13)], as_ids=[True])
    assert h.mgr.suspend(a) is SuspendResult.SUSPENDED  # 4 pages parked on host
    c = h.add(list(range(9)))
    h.run([(c, 9)], as_ids=[True])
    h.mgr.close(c)                                       # 2 cached device pages
    b = h.add(list(range(50, 70)))
    h.run([(b, 20)])                                     # 5 private pages: 1 free + 2 cached
    st = h.mgr.storage
    before = (st.governor.ledger(), h.mgr.stats()["pages"], st.stats())
    assert h.mgr.resume(a) is False and a.state is SequenceState.SUSPENDED
    after = (st.governor.ledger(), h.mgr.stats()["pages"], st.stats())
    assert after[0] == before[0] and after[1] == before[1] and after[2] == before[2]
    h.check()


def test_corrupt_disk_hit_is_a_miss_and_is_dropped(diskdir):
    h = make(tiny_config(device_pages=4, disk_dir=diskdir, disk_pages=10))
    a = h.add(list(range(9)))
    h.run([(a, 9)], as_ids=[True])
    h.mgr.close(a)
    b = h.add(list(range(50, 66)))  # pushes a's two cached pages to disk
    h.run([(b, 16)])
    h.mgr.close(b)
    nodes = [n for n in h.mgr.tree.nodes.values() if n.level is K]
    assert len(nodes) >= 2
    first = h.mgr.tree.match(np.arange(9, dtype=np.int32), b"", TPP, 2)[0]
    assert first.level is K
    flip_disk_bit(h, first.slots[0])
    c = h.add(list(range(9)))
    assert c.num_reused_tokens == 0 and not first.alive
    h.check()
    h.run([(c, 9)], as_ids=[True])
    h.check()


def test_suspend_falls_to_disk_when_host_is_full(diskdir):
    h = make(tiny_config(device_pages=8, host_pages=1, disk_dir=diskdir, disk_pages=8))
    a = h.add(list(range(13)))
    h.run([(a, 13)])
    assert h.mgr.suspend(a) is SuspendResult.SUSPENDED
    assert a._parked[0] is K
    h.check()
    assert h.mgr.resume(a)
    h.check()


# -- exhaustion ------------------------------------------------------------------------------


def test_device_exhaustion_is_typed_and_changes_nothing():
    h = make(tiny_config(device_pages=4))
    a = h.add(list(range(12)))
    h.run([(a, 12)])
    b = h.add(list(range(50, 58)))
    pt, n = a.page_ids(), b.num_tokens
    ledger = h.mgr.storage.governor.ledger()
    with pytest.raises(OutOfPagesError):
        h.mgr.prepare_step([(a, 1), (b, 8)])
    assert np.array_equal(a.page_ids(), pt) and b.num_tokens == n and a.num_tokens == 12
    assert h.mgr.storage.governor.ledger() == ledger
    h.check()
    h.run([(a, 1)])  # still usable afterwards
    h.check()


def _state(h):
    """Everything a refusal must leave alone: ledger (peaks too), page counts, storage and
    manager stats, and where every committed page is (LRU order included)."""
    m = h.mgr
    st = m.stats()
    nodes = [(n.key, n.level, n.slots.tolist(), n.refcount) for n in m.tree.nodes.values()]
    lru = [[n.key for n in m.tree.lru[lv].values()] for lv in CacheLevel]
    return repr((m.storage.governor.ledger(), st.get("pages_per_pool", st["pages"]), st["storage"],
                 st["num_evicted_pages"], st["num_dropped_pages"], nodes, lru))


def test_refused_step_evicts_nothing():
    """Cached pages that could move to host do not, when even evicting all of them (and waiting
    for every pending free) would not make room: the refusal happens before eviction."""
    h = make(tiny_config(device_pages=6, host_pages=3))
    a = h.add(list(range(9)))
    h.run([(a, 9)], as_ids=[True])
    h.mgr.close(a)                      # 2 cached device pages, 1 pending
    b = h.add(list(range(100, 104)))
    h.run([(b, 4)])
    c = h.add(list(range(50, 74)))
    before = _state(h)
    with pytest.raises(OutOfPagesError):
        h.mgr.prepare_step([(c, 24)])   # 6 pages: 3 free + 2 cached + 1 pending is 6, b holds 1
    assert _state(h) == before
    h.check()
    h.run([(c, 20)])                    # 5 pages fit: now the cached ones do move to host
    assert h.mgr.stats()["num_evicted_pages"][H] == 2
    h.check()


def test_refused_suspend_evicts_nothing():
    """A host tier holding cached pages but too small for the sequence even without them:
    MUST_RECOMPUTE, and the cached host pages were not dropped to find that out."""
    h = make(tiny_config(device_pages=6, host_pages=3))
    a = h.add(list(range(9)))
    h.run([(a, 9)], as_ids=[True])
    h.mgr.close(a)
    b = h.add(list(range(50, 74)))
    h.run([(b, 24)])                    # evicts a's 2 cached pages to host
    assert h.mgr.stats()["pages"]["host"]["cached"] == 2
    before = _state(h)
    assert h.mgr.suspend(b) is SuspendResult.MUST_RECOMPUTE  # 6 pages > 3 host pages
    assert _state(h) == before
    h.check()


def test_refused_onboarding_evicts_nothing(diskdir):
    """A prefix hit on host that the device cannot take even by evicting: the sequence is added
    without it and no cached page moved."""
    h = make(tiny_config(device_pages=4, host_pages=4))
    a = h.add(list(range(9)))
    h.run([(a, 9)], as_ids=[True])
    h.mgr.close(a)
    b = h.add(list(range(50, 59)))
    h.run([(b, 9)], as_ids=[True])      # a's 2 pages go to host; b: 2 committed + 1 private
    h.mgr.close(b)
    c = h.add(list(range(70, 74)))
    h.run([(c, 4)])                     # c: 1 private; b's 2 cached pages stay on the device
    d = h.add([9, 9, 9, 9, 9])
    h.run([(d, 5)])                     # d: 2 private: device full (1 + 2 + 2 cached... )
    free = h.mgr.stats()["pages"]["device"]
    assert free["free"] + free["pending"] + free["cached"] < 2, free
    before = _state(h)
    e = h.add(list(range(9)))           # hit on host: 2 pages, no room for them
    assert e.num_reused_tokens == 0
    assert _state(h).replace("'num_active': 3", "") == before.replace("'num_active': 3", "")
    h.check()


def test_misuse_is_an_error():
    h = make(tiny_config())
    a = h.add([1, 2, 3])
    for work in ([], [(a, 0)], [(a, 1), (a, 1)], [(a, 100)]):
        with pytest.raises(ValueError):
            h.mgr.prepare_step(work)
    with pytest.raises(ValueError, match="contradict"):
        h.mgr.prepare_step([(a, np.array([1, 2, 4]))])
    with pytest.raises(RuntimeError):
        h.mgr.complete_step(h.mgr.storage.pools)
    h.mgr.close(a)
    with pytest.raises(ValueError):
        h.mgr.close(a)
    with pytest.raises(ValueError):
        h.add(list(range(65)))
    h.check()


# -- capacity planning -----------------------------------------------------------------------


def test_capacity_planning():
    h = make(tiny_config(device_pages=12))
    m = h.mgr
    assert m.max_num_sequences(16) == 3 and m.max_num_sequences(17) == 2
    assert m.max_num_sequences(10_000) == 0  # clamped to max_seq_len 64 = 16 pages > 12
    assert m.max_seq_len_for(3) == 16 and m.max_seq_len_for(1) == 48
    assert m.max_seq_len_for(13) == 0
    for n in range(1, 13):
        assert m.max_num_sequences(max(1, m.max_seq_len_for(n))) >= n or m.max_seq_len_for(n) == 0


# -- threads ---------------------------------------------------------------------------------


def test_eight_threads_no_corruption_no_deadlock(diskdir):
    h = make(tiny_config(device_pages=24, host_pages=8, max_batch=4))
    mgr = h.mgr
    shadow_lock = threading.Lock()  # the harness' own dicts, not the manager
    errors: list[BaseException] = []
    done = [0]

    def worker(i: int) -> None:
        rng = np.random.default_rng(i)
        try:
            for it in range(25):
                toks = [i % 3] * 4 + rng.integers(0, 5, size=int(rng.integers(1, 9))).tolist()
                with shadow_lock:
                    s = h.add(toks)
                for _ in range(3):
                    try:
                        with shadow_lock:  # one step at a time through the harness
                            h.run([(s, max(1, len(toks) - s.num_tokens))])
                    except (OutOfPagesError, StepInFlightError):
                        pass
                mgr.stats()
                mgr.max_num_sequences(16)
                if rng.integers(0, 2):
                    try:
                        if mgr.suspend(s) is SuspendResult.SUSPENDED:
                            mgr.resume(s)
                    except StepInFlightError:
                        pass
                mgr.close(s)
            done[0] += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "watchdog: threads still running (deadlock?)"
    assert not errors, errors
    assert done[0] == 8
    h.check()


# -- compilation -----------------------------------------------------------------------------


def test_serving_loop_compiles_once_per_bucket():
    cfg = tiny_config(device_pages=40, host_pages=16, max_batch=8, max_tokens=32)
    h = make(cfg)
    mgr, rng = h.mgr, np.random.default_rng(5)
    active = []

    def one_step():
        while len(active) < 6:
            toks = rng.integers(0, 4, size=int(rng.integers(2, 12))).tolist()
            active.append(h.add(toks))
        work, total = [], 0
        for s in active:
            want = len(h.tokens[s.seq_id]) - s.num_tokens
            n = want if want > 0 else 1
            if total + n <= 32 and s.num_tokens + n <= 64:
                work.append((s, n))
                total += n
        try:
            h.run(work)
        except OutOfPagesError:
            pass
        for s in list(active):
            if s.num_tokens >= 40 or rng.random() < 0.05:
                mgr.close(s)
                active.remove(s)

    for _ in range(300):  # warm-up: every bucket and migration shape
        one_step()
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *a, **k: compiles.append(name) if "backend_compile" in name else None)
    sizes = fake_step._cache_size()
    for _ in range(1000):
        one_step()
    h.check()
    assert fake_step._cache_size() == sizes
    assert compiles == [], compiles
    st = mgr.stats()
    assert st["num_steps"] > 1200 and st["num_prefix_hit_tokens"] > 0, st
    assert st["num_evicted_pages"][1] > 0 and st["num_onboarded_pages"] > 0, st
    jax.jit(lambda x: x * 3 + 1)(jnp.ones(7))  # the listener does see a compilation
    assert compiles
