"""KVCacheConfig.padding_batch: the all-padding StepBatch a jitted step is compiled with ahead of
serving. Its oracle is the manager's own prepare_step: in the same buckets both give the same
pytree of the same shapes and dtypes, and prepare_step's padded rows hold padding_batch's values.
CPU only."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jax_kvcm.manager import KVCacheManager

from test_manager import tiny_config

LAYOUTS = {"one group": dict(windows=None),
           "full + ring window": dict(windows=(None, 8), ring_tables=True),
           "two windows": dict(windows=(8, 12))}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_padding_batch_has_prepare_steps_shapes_and_padding(layout):
    cfg = tiny_config(max_batch=4, max_tokens=16, batch_buckets=(2, 4), token_buckets=(4, 16),
                      **LAYOUTS[layout])
    mgr = KVCacheManager(cfg)
    a = mgr.add_sequence(np.arange(1, 10, dtype=np.int32))
    b = mgr.add_sequence(np.arange(20, 26, dtype=np.int32))
    c = mgr.add_sequence(np.arange(40, 43, dtype=np.int32))
    real = mgr.prepare_step([(a, 9), (b, 6), (c, 1)])      # 3 rows, 16 tokens: buckets (4, 16)
    pad = cfg.padding_batch(4, 16)
    assert jax.tree_util.tree_structure(pad) == jax.tree_util.tree_structure(real)
    for name in ("page_table", "seq_lens", "query_start", "slot_mapping", "positions"):
        got, want = np.asarray(getattr(pad, name)), np.asarray(getattr(real, name))
        assert (got.shape, got.dtype) == (want.shape, want.dtype), name
    assert not pad.page_table.any() and not pad.seq_lens.any() and not pad.query_start.any()
    assert (pad.slot_mapping == -1).all() and not pad.positions.any()
    # prepare_step's padded row (row 3) is padding_batch's row; its tokens fill all 16 slots
    rt = np.asarray(real.page_table)
    assert not rt[..., 3, :].any() and real.seq_lens[3] == 0 and real.query_start[4] == 16
    mgr.abort_step()
    pad.seq_lens[0] = 5                        # fresh arrays: a second call is not aliased
    assert not cfg.padding_batch(4, 16).seq_lens.any()


def test_padding_batch_refuses_a_size_that_is_not_a_bucket():
    cfg = tiny_config(max_batch=4, max_tokens=16, batch_buckets=(2, 4), token_buckets=(4, 16))
    with pytest.raises(ValueError, match=r"batch_bucket 3 is not one of batch_buckets \(2, 4\)"):
        cfg.padding_batch(3, 16)
    with pytest.raises(ValueError, match=r"token_bucket 8 is not one of token_buckets"):
        cfg.padding_batch(4, 8)
