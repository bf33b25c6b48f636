"""truncate and export / import on the GPU (issue 37; run with ``pytest -m gpu``), on paged pools
and on the arena over CUDA VMM: the paths the CPU suite runs on memfd and host arrays.

- A cut inside a page the sequence adopted from another: the sharer's values stay, the cut
  sequence gets a private copy (on the arena: through the codec and a device scratch region)
  holding the kept tokens, and the tokens it writes after the cut read back as written.
- A suspended sequence (parked in pinned host memory) cut where it is parked resumes with the
  kept tokens' K/V byte-identical.
- A sequence exported from one manager and imported into another (arena -> paged, paged ->
  arena) holds byte-identical K/V and decodes on.

Oracle: the K/V arrays the test wrote (numpy), read back page by page from the device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_arena_hot_gpu import DIM, HKV, HQ, L, TPP, _kv, _step_fn, gpu_manager

from jax_kvcm import KVCacheConfig, KVCacheManager, LayerGroupConfig, SuspendResult

pytestmark = pytest.mark.gpu


def paged_manager(*, device_pages=512, host_bytes=0) -> KVCacheManager:
    lg = LayerGroupConfig(num_layers=L, num_kv_heads=HKV, head_dim=DIM, dtype=jnp.bfloat16)
    cfg = KVCacheConfig(tokens_per_page=TPP, layer_groups=(lg,), device_pages=device_pages,
                        max_seq_len=2048, max_batch=8, max_tokens_per_step=2048,
                        host_bytes=host_bytes)
    return KVCacheManager(cfg, device=jax.devices("gpu")[0])


def manager(hot: str, **kw) -> KVCacheManager:
    return gpu_manager(**kw) if hot == "arena" else paged_manager(**kw)


class Shadow:
    """The K/V the test wrote, per sequence: ``[L, n, HKV, DIM]`` bf16 as float32 (numpy)."""

    def __init__(self, mgr: KVCacheManager) -> None:
        self.mgr, self.step, self.kv, self.seed = mgr, _step_fn(), {}, 0

    def write(self, seq, n: int) -> None:
        self.write_many([(seq, n)])

    def write_many(self, work) -> None:
        """One step writing ``n`` new tokens of each ``(seq, n)``."""
        batch = self.mgr.prepare_step(work)
        self.seed += 1
        k, v = _kv(self.seed, jnp.asarray(batch.positions))
        q = jnp.zeros((batch.positions.shape[0], HQ, DIM), jnp.bfloat16)
        caches, _ = self.step(self.mgr.caches, batch, k, v, q)
        self.mgr.complete_step(caches)
        k, v = np.asarray(k, np.float32), np.asarray(v, np.float32)
        qs = np.asarray(batch.query_start)
        for b, (seq, n) in enumerate(work):
            new = (k[:, qs[b]:qs[b] + n], v[:, qs[b]:qs[b] + n])
            old = self.kv.get(seq.seq_id)
            start = seq.num_tokens - n
            self.kv[seq.seq_id] = new if old is None else tuple(
                np.concatenate([o[:, :start], x], axis=1) for o, x in zip(old, new))

    def cut(self, seq, n: int) -> None:
        assert self.mgr.truncate(seq, n)
        self.kv[seq.seq_id] = tuple(x[:, :n] for x in self.kv[seq.seq_id])

    def check(self, seq, what: str) -> None:
        """Every token of ``seq``, read back from its pages on the device."""
        got_k, got_v = read_tokens(self.mgr, seq)
        want_k, want_v = self.kv[seq.seq_id]
        n = seq.num_tokens
        assert want_k.shape[1] == n, (what, want_k.shape, n)
        np.testing.assert_array_equal(got_k[:, :n], want_k, err_msg=f"{what}: K")
        np.testing.assert_array_equal(got_v[:, :n], want_v, err_msg=f"{what}: V")


def read_tokens(mgr: KVCacheManager, seq) -> tuple[np.ndarray, np.ndarray]:
    """``(k, v)`` ``[L, pages * TPP, HKV, DIM]`` float32: the sequence's pages in order."""
    pages = [int(p) for p in seq.page_ids(0)]
    tier = mgr.storage.hot_tier(0)
    shape = (L, TPP, HKV, DIM)
    if hasattr(tier, "memory"):      # the arena: read the reservation page by page
        kv = [tier.memory.read_page(p) for p in pages]
        k = np.stack([kb.view(jnp.bfloat16).reshape(shape) for kb, _ in kv], axis=1)
        v = np.stack([vb.view(jnp.bfloat16).reshape(shape) for _, vb in kv], axis=1)
    else:
        (kc, vc), = mgr.caches
        k, v = (np.asarray(c[:, np.asarray(pages)]) for c in (kc, vc))
    return tuple(x.astype(np.float32).reshape(L, -1, HKV, DIM) for x in (k, v))


@pytest.mark.parametrize("hot", ["paged", "arena"])
def test_a_cut_inside_a_shared_page_copies_it(hot):
    """a and b compute one prompt in one step: b adopts a's committed pages. b is cut inside
    the second: it gets a private copy (on the arena in its own range, through the codec and a
    device scratch region) and a's page is never written."""
    mgr = manager(hot, host_bytes=32 << 20)
    sh = Shadow(mgr)
    prompt = np.arange(1, 41)                     # 2 full pages of 16 + 8 tokens
    a, b = mgr.add_sequence(prompt), mgr.add_sequence(prompt)
    sh.write_many([(a, 40), (b, 40)])
    shared = [int(p) for p in a.page_ids(0)[:2]]
    assert [int(p) for p in b.page_ids(0)[:2]] == shared, "b adopts a's committed pages"
    sh.kv[b.seq_id] = sh.kv[a.seq_id]             # what b reads now: a's pages
    sh.cut(b, 20)                                 # inside the second shared page
    assert int(b.page_ids(0)[1]) != shared[1], "the cut page must be a private copy"
    assert [int(p) for p in a.page_ids(0)[:2]] == shared
    sh.check(b, f"{hot}: b's copy holds the kept tokens")
    sh.write(b, 12)                               # different K/V after the cut
    sh.write(a, 3)
    sh.check(a, f"{hot}: the sharer a")
    sh.check(b, f"{hot}: the cut sequence b")
    newcomer = mgr.add_sequence(prompt[:33])
    assert newcomer.num_reused_tokens == 32       # a's pages are still the prefix
    mgr.check_invariants()
    mgr.shutdown()


@pytest.mark.parametrize("hot", ["paged", "arena"])
def test_a_suspended_sequence_is_cut_where_it_is_parked(hot):
    mgr = manager(hot, host_bytes=64 << 20)
    sh = Shadow(mgr)
    a = mgr.add_sequence(np.arange(1, 70))
    sh.write(a, 69)
    for _ in range(5):
        sh.write(a, 1)
    assert mgr.suspend(a) is SuspendResult.SUSPENDED
    sh.cut(a, 50)
    assert mgr.resume(a)
    sh.check(a, f"{hot}: resumed after the cut")
    sh.write(a, 3)
    sh.check(a, f"{hot}: written after the resume")
    mgr.check_invariants()
    mgr.shutdown()


@pytest.mark.parametrize("src_hot,dst_hot", [("arena", "paged"), ("paged", "arena")])
def test_export_import_between_managers_on_the_device(src_hot, dst_hot):
    src, dst = manager(src_hot, host_bytes=64 << 20), manager(dst_hot, host_bytes=64 << 20)
    sh = Shadow(src)
    a = src.add_sequence(np.arange(1, 90) % 61 + 1)
    sh.write(a, 89)
    exp = src.export_sequence(a, "gpu-test")
    b = dst.import_sequence(exp, "gpu-test")
    assert b is not None and b.num_tokens == 89
    sh_dst = Shadow(dst)
    sh_dst.seed = 1000
    sh_dst.kv[b.seq_id] = sh.kv[a.seq_id]
    sh_dst.check(b, f"{src_hot} -> {dst_hot}: imported")
    sh_dst.write(b, 7)
    sh_dst.check(b, f"{src_hot} -> {dst_hot}: decoded on")
    sh.check(a, f"{src_hot}: the exported sequence unchanged")
    for m in (src, dst):
        m.check_invariants()
        m.shutdown()
