"""ServeConfig.cascade: decode steps read shared prefixes once per group of rows.

A small random Llama (HF transformers, saved and loaded through the runner's loader) serves
requests that share a system prompt of several pages, with and without cascade: the greedy
generations must be identical, and equal HF's greedy continuation (teacher-forced HF logits).
The cascade run must have formed groups (the plan is checked on the step it was built for), and
misconfigurations are refused by name.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import hf_logits, shared_prefix_prompts, small_llama_checkpoint
import jax_kvcm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples.llama import serve  # noqa: E402
from examples.llama import step as serve_step  # noqa: E402

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return small_llama_checkpoint(tmp_path_factory.mktemp("hf_cascade"), seed=21)


def _serve(model, cascade: bool, prompts, n_new=12):
    _, config, params = model
    srv = serve.Server(params, config, serve.ServeConfig(
        page_size=4, device_pages=96, max_batch=8, max_tokens_per_step=64, max_seq_len=96,
        cascade=cascade))
    outs = srv.generate([serve.Request(p, n_new, eos_token_ids=()) for p in prompts])
    srv.manager.check_invariants()
    return [o.generated_ids for o in outs], srv


def test_cascade_serving_equals_plain_and_hf(model, monkeypatch):
    seed = 31
    print("seed", seed)
    rng = np.random.default_rng(seed)
    prompts = shared_prefix_prompts(rng, (17, 10), 7, (1, 7), 9)   # 4 and 2 whole pages
    plans = []
    real_plan = jax_kvcm.plan_cascade

    def spy(table, lens, **kw):
        plan = real_plan(table, lens, **kw)
        plans.append((np.asarray(table).copy(), np.asarray(lens).copy(), plan))
        return plan

    monkeypatch.setattr(serve_step.jax_kvcm, "plan_cascade", spy)
    got, srv = _serve(model, True, prompts)
    want, _ = _serve(model, False, prompts)
    assert got == want, "cascade changed the greedy tokens"
    grouped = [p for _, _, p in plans if (p.member_slot >= 0).any()]
    assert grouped, "no decode step formed a shared-prefix group"
    rep = srv.report()
    assert rep["cascade_grouped_rows"] == sum(int((p.member_slot >= 0).sum()) for _, _, p in plans)
    assert rep["cascade_tokens_saved"] == sum(p.tokens_saved for _, _, p in plans) > 0
    assert rep["decode_kv_tokens"] == sum(int(n.sum()) for _, n, _ in plans)
    for table, lens, p in plans:   # each plan's prefixes are pages its members hold
        for b in np.flatnonzero(p.member_slot >= 0):
            g = p.member_slot[b] // p.members.shape[1]
            k = p.prefix_lens[g] // 4
            assert np.array_equal(table[b, :k], p.prefix_table[g, :k])
    hf = model[0]
    for prompt, ids in zip(prompts, got):
        logits = hf_logits(hf, prompt + ids)
        want_ids = logits[len(prompt) - 1:-1].argmax(-1).tolist()
        assert ids == want_ids, f"not HF's greedy continuation (seed={seed})"


def test_cascade_refusals(model):
    _, config, params = model
    with pytest.raises(ValueError, match="cascade"):
        serve.ServeConfig(cascade=True, paged_decode=False)
    windowed = config.__class__.from_hf_dict({**config.to_hf_dict(), "sliding_window": 8,
                                              "model_type": "mistral",
                                              "use_sliding_window": True})
    if len(windowed.kv_groups()) == 1 and windowed.kv_groups()[0][0] is None:
        pytest.skip("this config has no sliding-window layers")
    with pytest.raises(ValueError, match="cascade needs one KV group"):
        serve.Server(params, windowed, serve.ServeConfig(page_size=4, device_pages=32,
                                                         cascade=True))
