"""KVCacheManager: configs, steps through write_kv with a checked fake model, prefix reuse (with a
forced constant hash), eviction down the tiers, suspend/resume, fences, exhaustion, threads and
recompilation. CPU only.

The fake model writes, for the token at position ``p`` of a sequence whose tokens are ``t``, K/V
values that are a function of (a hash of ``t[:p+1]``, ``p``, layer, K or V, head, dim); the
checker gathers every cached value of every ACTIVE sequence through its page table and compares.
"""

from __future__ import annotations

import functools
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvcm
from jax_kvcm.manager import (KVCacheConfig, KVCacheManager, LayerGroupConfig, OutOfPagesError,
                               SequenceState, StepInFlightError, SuspendResult)
from jax_kvcm._step_batch import StepBatch
from jax_kvcm._types import CacheLevel

D, H, K = CacheLevel.DEVICE, CacheLevel.HOST, CacheLevel.DISK
TPP = 4


def tiny_config(*, device_pages=12, host_pages=0, disk_dir=None, disk_pages=0, groups=1,
                prefix=True, max_batch=4, max_tokens=32, max_seq_len=64, windows=None,
                same_layout=False, tpp=TPP, head_dim=8, **extra) -> KVCacheConfig:
    """``windows``: a sliding window (or None) per layer group; ``same_layout``: every group
    1 layer x 1 kv head (then their cold pages are equal and share one cold pool)."""
    windows = windows or (None,) * groups
    groups = len(windows)
    lgs = tuple(LayerGroupConfig(num_layers=1 + (g % 2) * (not same_layout),
                                 num_kv_heads=1 + (g % 2) * (not same_layout), head_dim=head_dim,
                                 dtype=jnp.float32, sliding_window=w)
                for g, w in enumerate(windows))
    # Cold pages of the default codec are a little larger than hot ones: size by hot bytes + 25%.
    hot = sum(2 * g.num_layers * tpp * g.num_kv_heads * g.head_dim * 4 for g in lgs)
    return KVCacheConfig(tokens_per_page=tpp, layer_groups=lgs, device_pages=device_pages,
                         host_bytes=int(host_pages * hot * 1.25), disk_dir=disk_dir,
                         disk_bytes=int(disk_pages * hot * 1.25), enable_prefix_reuse=prefix,
                         max_batch=max_batch, max_tokens_per_step=max_tokens,
                         max_seq_len=max_seq_len, **extra)


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
        batch, spans = self.prepare(work, as_ids)
        self.mgr.complete_step(self.write(batch, spans))
        return batch

    def prepare(self, work, as_ids=None):
        """``prepare_step`` for ``work`` (see :meth:`run`); returns (batch, spans)."""
        items, spans = [], []
        for i, (seq, n) in enumerate(work):
            toks = self.tokens[seq.seq_id]
            start = seq.num_tokens
            while len(toks) < start + n:
                toks.append(int(self.rng.integers(0, 50)))
            ids = as_ids[i] if as_ids is not None else bool(self.rng.integers(0, 2))
            items.append((seq, np.asarray(toks[start:start + n], np.int32) if ids else n))
            spans.append((seq.seq_id, start, n))
        return self.mgr.prepare_step(items), spans

    def write(self, batch, spans):
        """The fake model's write_kv of the new tokens; returns the new caches."""
        mgr, cfg = self.mgr, self.mgr.config
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
        return fake_step(mgr.caches, batch, vals)

    def check_values(self) -> int:
        mgr = self.mgr
        tpp = mgr.config.tokens_per_page
        checked = 0
        for seq in list(mgr._rows.seqs.values()):
            if seq.state is not SequenceState.ACTIVE:
                continue
            n = seq.num_tokens
            if n == 0:
                continue
            toks = self.tokens[seq.seq_id][:n]
            for g, lg in enumerate(mgr.config.layer_groups):
                pos = np.arange(n)
                pages = seq.page_ids(g)
                if lg.sliding_window:  # pages outside every future query's window: released
                    first = max(0, (n + 1 - mgr.config.kept_window(lg)) // tpp)
                    need = max(0, (n + 1 - lg.sliding_window) // tpp)  # (a truncation may
                    assert (pages[:first] == 0).all() and (pages[need:] > 0).all(), pages
                    pos = pos[pages[pos // tpp] > 0]   # leave released pages in between)
                slots = pages[pos // tpp] * tpp + pos % tpp
                want = expected_values(prefix_hashes(toks)[pos], pos, lg.num_layers,
                                       lg.num_kv_heads, lg.head_dim)
                for kv, got in enumerate(read_tokens(mgr, g, slots)):
                    assert np.array_equal(got, want[:, kv]), (
                        f"{seq!r} group {g} {'KV'[kv]}: cached values differ at positions "
                        f"{np.flatnonzero((got != want[:, kv]).any(axis=(0, 2, 3))).tolist()}")
            checked += n
        return checked

    def check(self) -> None:
        self.mgr.check_invariants()
        self.check_values()
        # stats() derives "referenced" from the identity (O(pools)); the census counts it
        census = {lv.name.lower(): self.mgr._check.page_counts(lv)
                  for lv in self.mgr._planner.levels}
        assert self.mgr.stats()["pages_per_pool"] == census


def read_tokens(mgr: KVCacheManager, g: int, slots: np.ndarray) -> tuple[np.ndarray, ...]:
    """K and V ``[L, n, Hkv, D]`` of layer group ``g`` at flat token ``slots``, read back from
    the device pools (paged arrays, or an arena's reservation page by page)."""
    tier = mgr.storage.hot_tier(g)
    lg, tpp = mgr.config.layer_groups[g], mgr.config.tokens_per_page
    if tier.kind == "paged":
        out = []
        for arr in tier.pools(mgr.storage.hot_group_of[g]):
            arr = np.asarray(arr)
            out.append(arr.reshape(arr.shape[0], -1, arr.shape[-2], arr.shape[-1])[:, slots])
        return tuple(out)
    dtype = np.dtype(lg.pool_dtype)
    shape = (lg.num_layers, tpp, lg.num_kv_heads, lg.head_dim)
    pages = {int(p): [b.view(dtype).reshape(shape) for b in tier.memory.read_page(int(p))]
             for p in np.unique(slots // tpp)}
    return tuple(np.stack([pages[int(t) // tpp][kv][:, int(t) % tpp] for t in slots], axis=1)
                 for kv in range(2))


class NotReadyFence:
    """Stands for the output array of a step that has not finished until waited on."""

    def __init__(self) -> None:
        self.ready = False

    def is_deleted(self) -> bool:
        return False

    def is_ready(self) -> bool:
        return self.ready

    def block_until_ready(self) -> None:
        self.ready = True


def flip_disk_bit(h: Harness, slot: int) -> None:
    """Corrupts one byte of disk slot ``slot`` (layer group 0's pool): its checksum fails."""
    pool = h.mgr.storage.disk_pools[0]
    with open(f"/proc/self/fd/{pool.fileno}", "r+b") as f:  # its name is unlinked
        f.seek(int(slot) * pool.slot_bytes + 5)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.fixture
def diskdir():
    with tempfile.TemporaryDirectory() as d:
        yield d


def stepped(pools):
    """New arrays equal to ``pools``: what a step that wrote nothing the test checks returns
    (complete_step refuses the very pools prepare_step handed out)."""
    return [(k + 0, v + 0) for k, v in pools]


def make(cfg, **kw) -> Harness:
    kw.setdefault("record_events", True)  # some tests read mgr.events
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
    h.mgr.complete_step(stepped(h.mgr.storage.pools))
    b2 = h.mgr.prepare_step([(s, 1)])
    assert jax.tree_util.tree_structure(b2) == tree
    h.mgr.complete_step(stepped(h.mgr.storage.pools))


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


def test_onboarding_a_chain_with_device_pages_after_a_host_one():
    """A prefix whose first page was suspended to host with the sequence holding it, and whose
    second page stayed cached on the device: the hit brings the first back, keeps the second."""
    h = make(tiny_config(host_pages=4))
    a = h.add(list(range(1, 9)))
    h.run([(a, 8)], as_ids=[True])
    h.mgr.close(a)
    b = h.add([1, 2, 3, 4, 0])
    assert b.num_reused_tokens == 4
    assert h.mgr.suspend(b) is SuspendResult.SUSPENDED
    c = h.add(list(range(1, 9)) + [0])
    assert c.num_reused_tokens == 8 and all(n.level is D for n in c._nodes)
    h.check()
    h.run([(c, 1)])
    assert h.mgr.resume(b)
    h.check()


def test_freed_pages_wait_for_the_last_step_fence():
    h = make(tiny_config(device_pages=4, prefix=False))
    a = h.add(list(range(16)))
    h.run([(a, 16)])
    mgr = h.mgr
    fence = mgr._ledger._fence
    mgr._ledger._fence = NotReadyFence()  # the step that last read a's pages has "not finished"
    mgr._ledger._ready_upto = 0
    mgr.close(a)
    assert mgr.stats()["pages"]["device"]["pending"] == 4
    b = h.add([1, 2, 3])
    mgr._planner.reclaim()
    assert mgr.stats()["pages"]["device"]["pending"] == 4  # not ready: not reclaimed
    h.run([(b, 3)])  # nothing else is free: blocks on the fence, then reuses
    assert mgr._stats.num_fence_waits == 1 and mgr._ledger._fence is not fence
    h.check()


def test_allocation_evicts_cached_pages_rather_than_wait_for_a_running_step():
    """Pending frees that would cover an allocation but wait for a step still running (an
    overlapped loop prepares step n+1 while step n runs): cached pages are evicted (here to the
    host tier) instead, so prepare_step does not wait for the device; the pending pages come
    back once the step is known complete, and the evicted prefix still hits (onboarded)."""
    h = make(tiny_config(device_pages=8, host_pages=8))
    mgr = h.mgr
    c = h.add(list(range(100, 116)))
    h.run([(c, 16)], as_ids=[True])
    mgr.close(c)                                   # 4 committed pages: cached
    a = h.add([1, 2])
    h.run([(a, 2)], as_ids=[True])
    h.run([(a, 14)], as_ids=[False])               # ids unknown: a's 4 pages stay private
    dev = mgr.stats()["pages"]["device"]
    assert (dev["cached"], dev["referenced"], dev["free"]) == (4, 4, dev["capacity"] - 8)
    fence = mgr._ledger._fence = NotReadyFence()           # the step that read a's pages still runs
    mgr._ledger._ready_upto = 0
    mgr.close(a)
    assert mgr.stats()["pages"]["device"]["pending"] == 4
    b = h.add(list(range(200, 216 + 4 * (dev["capacity"] - 8))))
    batch, spans = h.prepare([(b, len(h.tokens[b.seq_id]))], as_ids=[True])
    assert not fence.ready and mgr._stats.num_fence_waits == 0
    st = mgr.stats()
    assert st["num_evicted_pages"][int(H)] == 4
    assert st["pages"]["device"]["pending"] == 4 and st["pages"]["host"]["cached"] == 4
    mgr.complete_step(h.write(batch, spans))
    h.check()
    mgr.close(b)
    mgr._planner.reclaim(block=True)                       # the old step completes: pages come back
    assert mgr.stats()["pages"]["device"]["pending"] == 0
    d = h.add(list(range(100, 116)) + [0])
    assert d.num_reused_tokens == 16
    h.run([(d, 1)])
    assert mgr.stats()["num_onboarded_pages"] == 4
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
    mgr._ledger._fence, mgr._ledger._ready_upto = donated, 0
    mgr.close(a)
    assert mgr.stats()["pages"]["device"]["pending"] == 4
    b = h.add([1, 2, 3])
    h.run([(b, 3)])  # every page is pending behind the donated fence
    h.check()


def test_close_during_step_waits_for_that_step(diskdir):
    h = make(tiny_config(device_pages=4, prefix=False))
    mgr = h.mgr
    a = h.add(list(range(8)))
    mgr.prepare_step([(a, 8)])
    caches = stepped(mgr.storage.pools)
    with pytest.raises(StepInFlightError):
        mgr.suspend(a)
    mgr.close(a)
    assert mgr._ledger.pending[0].step is None
    mgr.complete_step(caches)
    assert mgr._ledger.pending[0].step == mgr._ledger.step_index
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
    h.mgr._planner.disk_chunk = chunk
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
    h.mgr._planner.disk_chunk = 1  # the bad page is the last chunk: earlier chunks must be rolled back
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


def on_disk_prefix(diskdir, **kw):
    """A manager whose prompt range(9) has its two committed pages on disk (no host tier)."""
    h = make(tiny_config(device_pages=4, disk_dir=diskdir, disk_pages=10, **kw))
    a = h.add(list(range(9)))
    h.run([(a, 9)], as_ids=[True])
    h.mgr.close(a)
    b = h.add(list(range(50, 66)))  # pushes a's two cached pages to disk
    h.run([(b, 16)])
    h.mgr.close(b)
    hit = h.mgr.tree.match(np.arange(9, dtype=np.int32), b"", TPP, 2)
    assert [n.level for n in hit] == [K, K]
    return h, hit


def test_corrupt_disk_hit_is_a_miss_and_is_dropped(diskdir):
    h, _ = on_disk_prefix(diskdir)
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


def test_io_error_while_onboarding_gives_back_every_reference(diskdir):
    """A disk read fails with an I/O error while a prefix hit is brought back: add_sequence
    raises, the hit's pages did not move and no reference is left behind (cached pages evicted
    to make room stay evicted: a failure is not a refusal); the retry succeeds."""
    h = make(tiny_config(device_pages=4, disk_dir=diskdir, disk_pages=10, windows=(None, 6)))
    a = h.add(list(range(9)))
    h.run([(a, 9)], as_ids=[True])
    h.mgr.close(a)
    b = h.add(list(range(50, 66)))
    h.run([(b, 16)])  # pushes a's two cached pages to disk
    h.mgr.close(b)
    hit = h.mgr.tree.match(np.arange(9, dtype=np.int32), b"", TPP, 2)
    before = [(n.level, n.slots.tolist(), n.refcount) for n in hit]
    assert [lv for lv, _, _ in before] == [K, K]

    def hook(point):
        if point == "disk_read":
            raise OSError(5, "injected")
    h.mgr.storage._fault_hook = hook
    with pytest.raises(OSError):
        h.add(list(range(9)))
    h.mgr.storage._fault_hook = None
    assert [(n.level, n.slots.tolist(), n.refcount) for n in hit] == before
    assert len(h.mgr._rows.seqs) == 0
    h.check()
    c = h.add(list(range(9)))
    assert c.num_reused_tokens == 8
    h.run([(c, 1)])
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
        h.mgr.complete_step(stepped(h.mgr.storage.pools))
    h.mgr.close(a)
    with pytest.raises(ValueError):
        h.mgr.close(a)
    with pytest.raises(ValueError):
        h.add(list(range(65)))
    h.check()


# -- sliding windows -------------------------------------------------------------------------


def window_bound(w: int, n: int = 1) -> int:
    """Pages a sequence holds at most in a window-``w`` group during a step of ``n`` new
    tokens (the design's ceil(w / TPP) + 1, for n = 1)."""
    return -(-(w + n - 2) // TPP) + 1


@pytest.mark.parametrize("w", [1, 4, 5, 8])
def test_window_pages_are_released_as_the_window_moves(w):
    """One full-attention group and one window-``w`` group: the windowed group holds a bounded
    number of pages however long the sequence gets, the full group all of them; released pages
    come back to the allocator (after the fence), entries read 0, in-window values check."""
    h = make(tiny_config(device_pages=20, windows=(None, w), max_seq_len=64, prefix=False))
    a = h.add(list(range(6)))
    h.run([(a, 6)])
    h.check()
    held = []
    for _ in range(50):
        batch = h.run([(a, 1)])  # what the step's page table shows
        held.append(int(np.count_nonzero(batch.page_table[1, 0])))
        assert held[-1] <= window_bound(w) <= -(-w // TPP) + 1
        assert np.count_nonzero(batch.page_table[0, 0]) == a.num_pages  # full: every page
        h.check()
    assert a.num_tokens == 56 and a.num_pages == 14 and max(held) == window_bound(w)
    held.append(int(np.count_nonzero(a.page_ids(1))))  # after the step
    c = h.mgr.stats()["pages_per_pool"]["device"]
    assert c[1]["referenced"] == held[-1] and c[0]["referenced"] == 14
    assert c[1]["free"] + c[1]["pending"] == 20 - held[-1]
    assert h.mgr.stats()["num_window_released_pages"] == 14 - held[-1]
    # A second sequence fills the full group but still fits: window pages were reused.
    b = h.add(list(range(100, 124)))
    h.run([(b, 24)])
    h.check()


def test_window_release_waits_for_the_step_that_last_read_it():
    """Two device pages, window 4: every page the window leaves is needed again four steps
    later; it is not handed out before the step that last read it is known complete."""
    h = make(tiny_config(device_pages=2, windows=(4,), prefix=False))
    a = h.add(list(range(8)))
    h.run([(a, 8)])
    mgr = h.mgr
    for _ in range(12):  # every 4 steps a page leaves the window and a new one is needed
        fence = mgr._ledger._fence = NotReadyFence()  # the last step has "not finished"
        mgr._ledger._ready_upto = 0  # no step is known complete
        h.run([(a, 1)])
        h.check()
        if a.num_tokens % 4 == 1:  # this step needed the page the previous crossing released
            assert fence.ready
    assert mgr._stats.num_fence_waits == 3


def test_window_prefix_reuse_shares_and_bounds_pages():
    """Sequences sharing a prompt: shared window pages stay while some holder's window covers
    them; once none does they are cached (evictable), and a later request for the same prompt
    still reuses them; a prefix whose needed window pages are gone is not reused that far."""
    h = make(tiny_config(device_pages=40, windows=(None, 6), same_layout=True, max_batch=4))
    prompt = list(range(1, 14))
    a = h.add(prompt)
    h.run([(a, 13)], as_ids=[True])
    b = h.add(prompt + [50])
    assert b.num_reused_tokens == 12
    h.run([(b, 2)])
    h.check()
    for _ in range(12):  # both decode: their windows leave the shared pages
        h.run([(a, 1), (b, 1)])
        h.check()
    shared = a._nodes[:3]
    assert all(n.refcount == 2 and n.need[1] == 0 for n in shared)
    assert all(n.slots[1] > 0 for n in shared)  # cached in wlru: still there
    assert h.mgr.stats()["pages"]["device"]["cached"] == 3
    c = h.add(prompt + [60])  # same prompt again: its window needs the last shared pages
    assert c.num_reused_tokens == 12
    h.run([(c, 2)])
    h.check()
    # Drop the wlru pages (pressure) and ask again: the match is cut where pages are missing.
    h.mgr._planner.drop_window_pages(1, 10)
    h.mgr._planner.reclaim(block=True)
    h.check()
    d = h.add(prompt + [70])
    n = d.num_reused_tokens
    assert n < 12
    h.run([(d, 14 - n)])
    h.check()
    for s in (a, b, c, d):
        h.mgr.close(s)
    h.check()


def test_window_duplicate_page_donates_a_released_window_page():
    """Two identical prompts computed in the same step: the second adopts the first's pages;
    later, a duplicate of a node whose window page was dropped gives it its own."""
    h = make(tiny_config(device_pages=30, windows=(None, 4), same_layout=True))
    prompt = list(range(1, 11))
    a, b = h.add(prompt), h.add(prompt)
    h.run([(a, 10), (b, 10)], as_ids=[True, True])
    h.check()
    assert np.array_equal(a.page_ids(0)[:2], b.page_ids(0)[:2])
    h.mgr.close(b)
    for _ in range(8):
        h.run([(a, 1)])
    h.check()
    node = a._nodes[1]
    h.mgr._planner.drop_window_pages(1, 10)
    assert node.slots[1] == -1
    h.check()
    c, d = h.add(prompt[:8] + [3]), h.add(prompt[:8] + [3])
    assert c.num_reused_tokens == 0  # the window pages of pages 0 and 1 are gone: no reuse
    h.run([(c, 9), (d, 9)], as_ids=[True, True])
    h.check()
    assert node.slots[1] > 0  # c computed page 1 again; its page went into the node
    h.check_values()


@pytest.mark.parametrize("tiers", ["host", "disk"])
def test_window_suspend_resume_and_tiers(tiers, diskdir):
    cfg = tiny_config(device_pages=14, host_pages=12 if tiers == "host" else 0,
                      disk_dir=diskdir if tiers == "disk" else None,
                      disk_pages=12 if tiers == "disk" else 0, windows=(None, 5))
    h = make(cfg)
    prompt = list(range(1, 18))
    a = h.add(prompt)
    h.run([(a, 17)], as_ids=[True])
    for _ in range(6):
        h.run([(a, 1)])
    h.check()
    assert h.mgr.suspend(a) is SuspendResult.SUSPENDED
    h.check()
    b = h.add(prompt)  # matches a's parked nodes: needs their window pages, which moved too
    h.check()
    h.run([(b, 17 - b.num_reused_tokens)], as_ids=[True])
    h.check()
    assert h.mgr.resume(a)
    h.check()
    h.run([(a, 2), (b, 1)])
    h.check()
    h.mgr.close(b)
    h.mgr.close(a)
    h.check()
    for p in range(4):  # pressure: cached pages with partial window pages go down the tiers
        s = h.add([p * 7] * 13)
        h.run([(s, 13)], as_ids=[True])
        h.check()
        h.mgr.close(s)
        h.check()
    c = h.add(prompt + [1])
    h.run([(c, 18 - c.num_reused_tokens)], as_ids=[True])
    h.check()


def test_window_onboarding_takes_only_the_window_pages_it_needs():
    """A prompt's committed pages all pushed to host; a hit brings back every full-attention
    page but only the window pages its window needs (the others are freed, not moved). Under
    pressure, device-resident cached hits are not counted as evictable room for the rest."""
    h = make(tiny_config(device_pages=8, host_pages=10, windows=(None, 4)))
    prompt = list(range(1, 18))
    a = h.add(prompt)
    h.run([(a, 17)], as_ids=[True])
    h.mgr.close(a)
    b = h.add(list(range(50, 82)))
    h.run([(b, 32)], as_ids=[True])     # 8 pages: a's 4 cached pages go to host
    h.mgr.close(b)
    nodes = h.mgr.tree.match(np.asarray(prompt, np.int32), b"", TPP, 4)
    assert [n.level for n in nodes] == [H] * 4 and all((n.slots >= 0).all() for n in nodes)
    seen = len(h.mgr.events)
    c = h.add(prompt + [99])            # window 4 at 16 tokens: only page 3's window page
    assert c.num_reused_tokens == 16 and all(n.level is D for n in nodes)
    assert [int(n.slots[1] >= 0) for n in nodes] == [0, 0, 0, 1]
    onboarded = [0, 0]
    for e in list(h.mgr.events)[seen:]:
        if getattr(e, "kind", None) == "migrated" and e.src_level is H and e.level is D:
            onboarded[e.layer_group] += e.slots.size
    assert onboarded == [4, 1]
    h.check()
    h.run([(c, 2)])
    h.check()
    # Pressure: nodes 0-2 on the device (cached), node 3 on host; the device is full. The hit
    # cannot count its own cached device pages as room: it stops at the device prefix.
    h2 = make(tiny_config(device_pages=8, host_pages=8, windows=(None, 4)))
    a = h2.add(prompt)
    h2.run([(a, 17)], as_ids=[True])
    h2.mgr.close(a)
    b = h2.add(list(range(50, 70)))
    h2.run([(b, 20)])                   # 5 pages: the oldest cached page (page 3) goes to host
    nodes = h2.mgr.tree.match(np.asarray(prompt, np.int32), b"", TPP, 4)
    assert [n.level for n in nodes] == [D, D, D, H]
    before = h2.mgr.stats()["pages"]
    c = h2.add(prompt + [99])
    assert c.num_reused_tokens == 12 and nodes[3].level is H
    assert h2.mgr.stats()["pages"]["host"] == before["host"]
    h2.check()
    with pytest.raises(OutOfPagesError):  # the full-attention group is full: 5 + 3 pages
        h2.run([(c, 6)])
    h2.mgr.close(b)
    h2.run([(c, 6)])
    h2.check()


def test_window_close_during_step_with_row_reuse():
    """A sequence closed while its step is in flight, its row taken by a new sequence before
    complete_step: the window release at complete_step leaves the new sequence alone."""
    h = make(tiny_config(device_pages=20, windows=(4,), prefix=False))
    a, b = h.add(list(range(12))), h.add(list(range(30, 42)))
    h.run([(a, 12), (b, 12)])
    mgr = h.mgr
    mgr.prepare_step([(a, 4), (b, 4)])
    caches = stepped(mgr.storage.pools)
    row = a._row
    mgr.close(a)
    c = h.add(list(range(60, 63)))
    assert c._row == row
    mgr.complete_step(caches)
    h.tokens[b.seq_id].extend([0] * 4)  # b's values are not checked past here
    mgr.check_invariants()
    assert c.num_tokens == 0 and c.page_ids(0).size == 0
    h.run([(c, 3)])
    mgr.check_invariants()
    assert (c.page_ids(0) > 0).all()


def dense_attention(q, keys, values, q_pos, window):
    """q [n, H, D] at positions q_pos over keys/values [S, Hkv, D] (positions 0..S-1), float64."""
    group = q.shape[1] // keys.shape[1]
    k = np.repeat(keys, group, axis=1).astype(np.float64)
    v = np.repeat(values, group, axis=1).astype(np.float64)
    out = np.zeros(q.shape, np.float64)
    for i, p in enumerate(q_pos):
        lo = max(0, p + 1 - window) if window else 0
        logits = np.einsum("hd,shd->hs", q[i], k[lo:p + 1]) / np.sqrt(q.shape[-1])
        w = np.exp(logits - logits.max(axis=1, keepdims=True))
        out[i] = np.einsum("hs,shd->hd", w / w.sum(axis=1, keepdims=True), v[lo:p + 1])
    return out


@pytest.mark.parametrize("impl", ["op", "reference"])
def test_step_batch_per_group_drives_attention(impl):
    """A full-attention group (1 kv head) and a window-6 group (2 kv heads, 2 layers), so the
    groups have different page assignments: the StepBatch's [G, ...] page_table and
    slot_mapping give each group's write_kv and attention what they need. The null page is NaN:
    an attention that read a released (null) entry of the windowed group would return NaN."""
    from jax_kvcm.ops import reference
    # The reference jitted (its semantics, without seconds of op-by-op dispatch per step).
    static = ("layer", "sliding_window")
    fn = {"op": (jax_kvcm.ragged_paged_attention, jax_kvcm.paged_attention),
          "reference": (jax.jit(reference.ragged_paged_attention, static_argnames=static),
                        jax.jit(reference.paged_attention, static_argnames=static))}[impl]
    h = make(tiny_config(device_pages=30, windows=(None, 6), max_seq_len=64, max_tokens=32))
    mgr, rng = h.mgr, np.random.default_rng(3)
    a, b = h.add(list(range(1, 12))), h.add(list(range(20, 27)))
    num_heads = 4
    checked = 0
    for step in range(24):
        work = [(a, 11), (b, 7)] if step == 0 else [(a, 1), (b, int(rng.integers(1, 4)))]
        batch, spans = h.prepare(work, as_ids=[True, True])
        assert batch.page_table.shape[0] == 2 and batch.slot_mapping.shape[0] == 2
        Tb = batch.positions.shape[0]
        caches = h.write(batch, spans)
        caches = [(k.at[:, 0].set(jnp.nan), v.at[:, 0].set(jnp.nan)) for k, v in caches]
        for g, lg in enumerate(mgr.config.layer_groups):
            # NOTE: cached values are ~1e6: small queries keep the logits O(1).
            q = (rng.standard_normal((Tb, num_heads, lg.head_dim)) * 1e-6).astype(np.float32)
            k, v = caches[g]
            layer = lg.num_layers - 1
            pt, sl, qs = (jnp.asarray(x) for x in (batch.page_table[g], batch.seq_lens,
                                                   batch.query_start))
            out = np.asarray(fn[0](jnp.asarray(q), k, v, pt, sl, qs, layer=layer,
                                   sliding_window=lg.sliding_window))
            t = 0
            for sid, start, n in spans:
                ev = expected_values(prefix_hashes(h.tokens[sid][:start + n]),
                                     np.arange(start + n), lg.num_layers, lg.num_kv_heads,
                                     lg.head_dim)[layer]
                want = dense_attention(q[t:t + n], ev[0], ev[1], np.arange(start, start + n),
                                       lg.sliding_window)
                np.testing.assert_allclose(out[t:t + n], want, rtol=1e-4)
                t += n
                checked += 1
            if all(n == 1 for _, _, n in spans):  # a decode batch: the decode op too
                dec = np.asarray(fn[1](jnp.asarray(q[:sl.shape[0]]), k, v, pt, sl,
                                       layer=layer, sliding_window=lg.sliding_window))
                np.testing.assert_allclose(dec[:len(spans)], out[:len(spans)], rtol=1e-4)
        mgr.complete_step(caches)
        h.check()
    assert checked == 2 * 2 * 24
    assert np.count_nonzero(a.page_ids(1)) < a.num_pages  # the window did release pages


def test_window_capacity_planning():
    h = make(tiny_config(device_pages=(20, 8), windows=(None, 8), max_tokens=8,
                         max_seq_len=64))
    m = h.mgr
    # window 8, steps of up to 8 tokens: ceil(14 / 4) + 1 = 5 pages at most per sequence.
    assert m.max_num_sequences(64) == 1          # 16 full pages; 5 window pages
    assert m.max_num_sequences(16) == 2          # 4 pages in both groups
    assert m.max_num_sequences(8) == 4           # 2 pages in both groups
    assert m.max_seq_len_for(1) == 64
    assert m.max_seq_len_for(2) == 16            # 4 window pages each < 5: 4 pages long
    assert m.max_seq_len_for(4) == 8
    for n in range(1, 9):
        assert m.max_seq_len_for(n) == 0 or m.max_num_sequences(m.max_seq_len_for(n)) >= n


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
