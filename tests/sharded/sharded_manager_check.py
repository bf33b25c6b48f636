"""A :class:`jax_kvcm.KVCacheManager` whose pools are split over KV heads on a mesh, driven
through prepare_step / complete_step by a step that calls :mod:`jax_kvcm.sharded`'s ops (run by
``sharded_worker.py --manager`` in a process with several devices).

Oracle: every token's K/V is a closed-form function of (token id, position, layer, head, dim), so
the attention output of every new token is recomputed in numpy (float64, dense causal attention
over the sequence's own tokens, GQA) without the manager's pages; prefix reuse (a sequence that
reads pages another one wrote) must give the same outputs. The pools themselves are also read
back page by page against the same closed form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvcm import KVCacheConfig, KVCacheManager, LayerGroupConfig, SuspendResult, sharded

NUM_LAYERS, PAGE, HEAD_DIM, GQA = 2, 4, 8, 2


def kv_of(tokens: np.ndarray, positions: np.ndarray, layer: int, hkv: int) -> np.ndarray:
    """``[2, n, Hkv, D]`` float32: K and V of tokens at positions (exact in float32 inputs)."""
    t = np.asarray(tokens, np.float64)[None, :, None, None]
    p = np.asarray(positions, np.float64)[None, :, None, None]
    kv = np.arange(2)[:, None, None, None]
    h = np.arange(hkv)[None, None, :, None]
    d = np.arange(HEAD_DIM)[None, None, None, :]
    return np.sin(t * 1.37 + p * 0.71 + layer * 0.3 + kv * 2.1 + h * 0.53 + d * 0.29).astype(
        np.float32)


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnums=(0,))
def sharded_step(caches, batch, kv_new, q, *, mesh):
    """write_kv then ragged attention per layer, all per KV-head shard."""
    (k, v), = caches
    outs = []
    for layer in range(NUM_LAYERS):
        k, v = sharded.write_kv(k, v, kv_new[layer, 0], kv_new[layer, 1], batch.slot_mapping,
                                mesh=mesh, layer=layer)
        outs.append(sharded.ragged_paged_attention(q[layer], k, v, batch.page_table,
                                                   batch.seq_lens, batch.query_start, mesh=mesh,
                                                   layer=layer))
    return [(k, v)], jnp.stack(outs)


def assert_pages_hold(mgr, seq, tokens: list[int], hkv: int, what: str) -> None:
    """Every token of ``seq`` (``tokens``: its ids) holds ``kv_of``'s K and V in the page its
    table names (the pools read back whole: ``np.asarray`` gathers the shards)."""
    k_all, v_all = (np.asarray(x) for x in mgr.caches[0])
    pages = np.asarray(seq.page_ids()).reshape(-1)
    toks = np.asarray(tokens[:seq.num_tokens])
    for layer in range(NUM_LAYERS):
        want = kv_of(toks, np.arange(len(toks)), layer, hkv)
        for i in range(len(toks)):
            page, off = pages[i // PAGE], i % PAGE
            assert np.array_equal(k_all[layer, page, off], want[0, i]), (what, layer, i)
            assert np.array_equal(v_all[layer, page, off], want[1, i]), (what, layer, i)


def dense_attention(q: np.ndarray, kv: np.ndarray, pos: int) -> np.ndarray:
    """q ``[H, D]`` at position ``pos`` over ``kv [2, n, Hkv, D]`` (positions 0..n-1)."""
    k, v = kv[0, :pos + 1].astype(np.float64), kv[1, :pos + 1].astype(np.float64)
    k, v = np.repeat(k, GQA, axis=1), np.repeat(v, GQA, axis=1)   # [n, H, D]
    logits = np.einsum("hd,nhd->hn", q.astype(np.float64), k) / np.sqrt(HEAD_DIM)
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    return np.einsum("hn,nhd->hd", w, v)


def check_manager(mesh, seed: int, diskdir: str | None = None) -> int:
    """With ``diskdir``, the pools also have a host and a disk tier, and at the end a sequence
    is suspended (its own pages to the host tier), a new sequence onboards its prefix from
    there, and it is resumed; every step's outputs are checked against the oracle."""
    tp = int(mesh.shape["tp"])
    hkv = 2 * tp
    heads = GQA * hkv
    rng = np.random.default_rng(seed)
    cfg = KVCacheConfig(tokens_per_page=PAGE,
                        layer_groups=(LayerGroupConfig(NUM_LAYERS, hkv, HEAD_DIM, jnp.float32),),
                        device_pages=24, max_batch=4, max_tokens_per_step=32, max_seq_len=48,
                        mesh=mesh, **({} if diskdir is None else dict(
                            host_bytes=1 << 20, disk_dir=diskdir, disk_bytes=1 << 20)))
    try:
        KVCacheConfig(tokens_per_page=PAGE, layer_groups=(
            LayerGroupConfig(NUM_LAYERS, tp + 1, HEAD_DIM, jnp.float32),), device_pages=4,
            mesh=mesh)
    except ValueError as e:
        assert "layer_groups[0].num_kv_heads" in str(e) and "divisible" in str(e), e
    else:
        raise AssertionError("num_kv_heads not divisible by the mesh axis accepted")
    try:
        KVCacheManager(cfg, device=jax.devices()[0])
    except ValueError as e:
        assert "not both" in str(e), e
    else:
        raise AssertionError("device and mesh both accepted")
    mgr = KVCacheManager(cfg)
    k_pool = mgr.caches[0][0]
    assert k_pool.sharding.is_equivalent_to(cfg.pool_sharding, 5), k_pool.sharding
    shard_shapes = {s.data.shape for s in k_pool.addressable_shards}
    assert shard_shapes == {(NUM_LAYERS, 25, PAGE, hkv // tp, HEAD_DIM)}, shard_shapes
    per = mgr.stats()["per_device"]
    page_bytes = NUM_LAYERS * 2 * PAGE * (hkv // tp) * HEAD_DIM * 4
    assert per == dict(num_shards=tp, page_bytes=[page_bytes], pool_bytes=25 * page_bytes), per

    tokens: dict[int, list[int]] = {}
    num_steps = 0

    def run(work):
        nonlocal num_steps
        items = []
        for seq, n in work:
            toks = tokens[seq.seq_id]
            while len(toks) < seq.num_tokens + n:
                toks.append(int(rng.integers(0, 100)))
            items.append((seq, np.asarray(toks[seq.num_tokens:seq.num_tokens + n], np.int32)))
        batch = mgr.prepare_step(items)
        T = batch.slot_mapping.shape[0]
        kv_new = np.zeros((NUM_LAYERS, 2, T, hkv, HEAD_DIM), np.float32)
        q = rng.standard_normal((NUM_LAYERS, T, heads, HEAD_DIM)).astype(np.float32)
        qs = np.asarray(batch.query_start)
        for b, (seq, _) in enumerate(work):
            rows = np.arange(qs[b], qs[b + 1])
            pos = np.asarray(batch.positions)[rows]
            toks = np.asarray(tokens[seq.seq_id])[pos]
            for layer in range(NUM_LAYERS):
                kv_new[layer, :, rows] = kv_of(toks, pos, layer, hkv).transpose(1, 0, 2, 3)
        caches, out = sharded_step(mgr.caches, batch, jnp.asarray(kv_new), jnp.asarray(q),
                                   mesh=mesh)
        mgr.complete_step(caches)
        out = np.asarray(out)
        for b, (seq, _) in enumerate(work):
            all_toks = np.asarray(tokens[seq.seq_id][:seq.num_tokens])
            for layer in range(NUM_LAYERS):
                kv = kv_of(all_toks, np.arange(len(all_toks)), layer, hkv)
                for r in range(qs[b], qs[b + 1]):
                    want = dense_attention(q[layer, r], kv, int(np.asarray(batch.positions)[r]))
                    err = float(np.abs(out[layer, r] - want).max())
                    assert err < 1e-4, (f"step {num_steps} seq {seq.seq_id} row {r} layer "
                                        f"{layer}: error {err} (seed={seed})")
        num_steps += 1

    def add(toks):
        seq = mgr.add_sequence(toks)
        tokens[seq.seq_id] = list(toks)
        return seq

    a = add([int(t) for t in rng.integers(0, 100, size=10)])
    b = add([int(t) for t in rng.integers(0, 100, size=7)])
    run([(a, 10), (b, 7)])
    for _ in range(3):
        run([(a, 1), (b, 1)])
    c = add(tokens[a.seq_id][:9] + [5, 6])     # reuses a's first two full pages
    assert c.num_reused_tokens == 8, c.num_reused_tokens
    run([(c, 11 - 8), (a, 1)])
    mgr.close(b)
    run([(c, 1), (a, 2)])

    for seq in (a, c):
        assert_pages_hold(mgr, seq, tokens[seq.seq_id], hkv, f"seq {seq.seq_id} (seed={seed})")
    mgr.check_invariants()
    if diskdir is not None:
        moved = []
        mgr.add_observer(lambda ev: moved.append(ev) if ev.kind == "migrated" else None)
        assert mgr.suspend(a) is SuspendResult.SUSPENDED
        assert any(ev.src_level == 0 for ev in moved), "suspend moved nothing off the device"
        d = add(tokens[a.seq_id][:13])            # a's pages 0-1 (shared with c), 2 (host)
        assert d.num_reused_tokens == 12, d.num_reused_tokens
        assert any(ev.level == 0 for ev in moved), "nothing onboarded"
        run([(d, 1), (c, 1)])
        run([(d, 2)])
        assert mgr.resume(a)
        run([(a, 1), (d, 1), (c, 1)])
        mgr.check_invariants()
    return num_steps
