"""KVCacheManager.num_obtainable_pages against stats() (free + pending + cached), through
admissions, steps, closes (pending frees, cached prefix pages), suspends to host and sliding
windows."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jax_kvcm import CacheLevel
from jax_kvcm.manager import KVCacheConfig, KVCacheManager, LayerGroupConfig


def _oracle(mgr, level):
    c = mgr.stats()["pages"][level.name.lower()]
    return c["free"] + c["pending"] + c["cached"]


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_stats(seed, window):
    print("seed", seed, "window", window)
    rng = np.random.default_rng(seed)
    group = LayerGroupConfig(num_layers=1, num_kv_heads=1, head_dim=8, dtype=jnp.float32,
                             sliding_window=window)
    page = 2 * 4 * 8 * 4
    mgr = KVCacheManager(KVCacheConfig(tokens_per_page=4, layer_groups=(group,),
                                       device_pages=40, host_bytes=30 * page, max_batch=4,
                                       max_tokens_per_step=32, max_seq_len=64))
    system = rng.integers(0, 9, 10).astype(np.int32)
    live = []
    seen = {"pending": 0, "cached": 0}
    for _ in range(80):
        op = rng.choice(4, p=[0.3, 0.4, 0.15, 0.15])
        if op == 0 and len(live) < 4:
            live.append(mgr.add_sequence(np.concatenate([system, rng.integers(0, 9, 5)])
                                         .astype(np.int32)))
        elif op == 1 and live:
            work = [(s, int(rng.integers(1, 5))) for s in live if s.num_tokens < 40]
            if work:
                mgr.prepare_step(work)
                mgr.complete_step([(k + 0, v + 0) for k, v in mgr.caches])
        elif op == 2 and live:
            mgr.close(live.pop(int(rng.integers(len(live)))))
        elif op == 3 and live:
            s = live.pop(int(rng.integers(len(live))))
            mgr.suspend(s)
            mgr.close(s)
        for level in (CacheLevel.DEVICE, CacheLevel.HOST):
            assert mgr.num_obtainable_pages(level) == _oracle(mgr, level)
        dev = mgr.stats()["pages"]["device"]
        for k in seen:
            seen[k] += dev[k] > 0
    assert all(seen.values()), seen     # the sum was checked with pending and cached pages
    with pytest.raises(ValueError, match="DISK"):
        mgr.num_obtainable_pages(CacheLevel.DISK)
