"""KVCacheManager.record_token_ids: ids learned one step late (a loop that feeds sampled tokens to
the next step on the device and passes prepare_step a count) commit the same prefix pages as ids
given to prepare_step directly (the oracle: a second manager fed the ids up front)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jax_kvcm.manager import (KVCacheConfig, KVCacheManager, LayerGroupConfig,
                               StepInFlightError)
from test_manager import stepped

TPP = 4


def _manager(window=None) -> KVCacheManager:
    group = LayerGroupConfig(num_layers=1, num_kv_heads=1, head_dim=8, dtype=jnp.float32,
                             sliding_window=window)
    return KVCacheManager(KVCacheConfig(tokens_per_page=TPP, layer_groups=(group,),
                                        device_pages=32, max_batch=4, max_tokens_per_step=16,
                                        max_seq_len=40))


def _run(mgr, seq, n):
    batch = mgr.prepare_step([(seq, n)])
    mgr.complete_step(stepped(mgr.caches))
    return batch


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_late_ids_commit_like_ids_given_up_front(seed):
    rng = np.random.default_rng(seed)
    print("seed", seed)
    prompt = rng.integers(0, 50, 6).astype(np.int32)
    generated = rng.integers(0, 50, 13).astype(np.int32)
    late, early = _manager(), _manager()
    a = late.add_sequence(prompt)
    b = early.add_sequence(prompt)
    _run(late, a, 6)
    _run(early, b, prompt)
    for i, tok in enumerate(generated):
        # the late loop: step i+1 consumes generated[i] as a count; the id arrives afterwards
        _run(late, a, 1)
        late.record_token_ids(a, [int(tok)])
        _run(early, b, np.asarray([tok]))
        assert a.num_known_tokens == b.num_known_tokens == len(prompt) + i + 1
        assert late.stats()["num_committed_pages"] == early.stats()["num_committed_pages"]
    full = np.concatenate([prompt, generated])
    want_pages = len(full) // TPP
    assert late.stats()["num_committed_pages"] == want_pages
    # A later sequence with the same text reuses every full page of it, generated ones included.
    for mgr in (late, early):
        c = mgr.add_sequence(np.concatenate([full, [7]]).astype(np.int32))
        assert c.num_reused_tokens == want_pages * TPP
    late.check_invariants()


def test_ids_ahead_of_the_sequence_are_checked_by_prepare_step():
    mgr = _manager()
    seq = mgr.add_sequence(np.arange(5, dtype=np.int32))
    _run(mgr, seq, 5)
    mgr.record_token_ids(seq, np.asarray([9, 10], np.int32))   # ahead of num_tokens (5)
    assert seq.num_tokens == 5 and seq.num_known_tokens == 7
    with pytest.raises(ValueError, match="contradict"):
        mgr.prepare_step([(seq, np.asarray([9, 11], np.int32))])
    _run(mgr, seq, np.asarray([9, 10], np.int32))
    _run(mgr, seq, 1)                                         # position 7: an id not known yet
    mgr.record_token_ids(seq, [3])
    assert mgr.stats()["num_committed_pages"] == 2


def test_misuse_is_raised_and_changes_nothing():
    mgr = _manager()
    seq = mgr.add_sequence(np.arange(5, dtype=np.int32))
    mgr.prepare_step([(seq, 5)])
    with pytest.raises(StepInFlightError):
        mgr.record_token_ids(seq, [1])
    mgr.complete_step(stepped(mgr.caches))
    with pytest.raises(ValueError, match="1-D"):
        mgr.record_token_ids(seq, [[1]])
    with pytest.raises(ValueError, match="1-D"):
        mgr.record_token_ids(seq, np.asarray([1.5]))
    with pytest.raises(ValueError, match="max_seq_len"):
        mgr.record_token_ids(seq, np.zeros(36, np.int32))
    with pytest.raises(ValueError, match="outside"):  # would wrap in int32 and alias a prompt
        mgr.record_token_ids(seq, np.array([7, 2**32 + 1], np.int64))
    assert seq.num_known_tokens == 5
    mgr.close(seq)
    with pytest.raises(ValueError, match="closed"):
        mgr.record_token_ids(seq, [1])


def test_sliding_window_group():
    """A window group: pages released by the window end the committed chain, as with ids given
    to prepare_step (compared with a second manager)."""
    late, early = _manager(window=6), _manager(window=6)
    prompt = np.arange(3, dtype=np.int32)
    a, b = late.add_sequence(prompt), early.add_sequence(prompt)
    _run(late, a, 3)
    _run(early, b, prompt)
    for tok in range(20, 35):
        _run(late, a, 1)
        late.record_token_ids(a, [tok])
        _run(early, b, np.asarray([tok], np.int32))
        assert late.stats()["num_committed_pages"] == early.stats()["num_committed_pages"]
    late.check_invariants()
