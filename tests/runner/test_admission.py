"""ServeConfig.defer_shared_prompts: a request whose prompt shares pages with a prompt another
running request is still writing waits until those pages are written, then reuses them.

A small random HF Llama (saved and loaded through the runner's loader) serves a burst of
requests over two system prompts of several pages, all submitted at once, with and without the
deferral: the same greedy tokens (and HF's greedy continuation), more prompt tokens reused and
fewer steps with it, every request finished (no starvation), and a request with no shared
prefix is never deferred.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import (hf_logits, random_prompt, shared_prefix_prompts,
                      small_llama_checkpoint)
import jax_kvcm  # noqa: F401  (the installed package first; the repo root goes on sys.path after)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples.llama import serve  # noqa: E402

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return small_llama_checkpoint(tmp_path_factory.mktemp("hf_admission"), seed=23)


def _run(model, prompts, defer: bool):
    _, config, params = model
    srv = serve.Server(params, config, serve.ServeConfig(
        page_size=4, device_pages=160, max_batch=6, max_tokens_per_step=24,
        prefill_chunk_tokens=8, max_seq_len=96, defer_shared_prompts=defer))
    outs = srv.generate([serve.Request(p, 8, eos_token_ids=()) for p in prompts])
    srv.manager.check_invariants()
    assert all(o.finish_reason == "length" for o in outs)
    return [o.generated_ids for o in outs], srv.report()


def test_deferred_admission_reuses_the_prefix_and_keeps_the_tokens(model):
    seed = 41
    print("seed", seed)
    rng = np.random.default_rng(seed)
    prompts = shared_prefix_prompts(rng, (24, 17), 10, (2, 9), 11)   # 6 and 4 whole pages
    plain, rep_plain = _run(model, prompts, defer=False)
    got, rep = _run(model, prompts, defer=True)
    assert got == plain, "deferral changed the generated tokens"
    assert rep_plain["deferred_admissions"] == 0 < rep["deferred_admissions"]
    assert rep["prefix_hit_tokens"] > rep_plain["prefix_hit_tokens"], (rep["prefix_hit_tokens"],
                                                                       rep_plain["prefix_hit_tokens"])
    assert rep["steps"] <= rep_plain["steps"], (rep["steps"], rep_plain["steps"])
    hf = model[0]
    for prompt, ids in zip(prompts, got):
        logits = hf_logits(hf, prompt + ids)
        assert ids == logits[len(prompt) - 1:-1].argmax(-1).tolist(), f"seed={seed}"


def test_unshared_prompts_are_never_deferred(model):
    rng = np.random.default_rng(43)
    prompts = [random_prompt(rng, int(n)) for n in rng.integers(9, 30, size=8)]
    _, rep = _run(model, prompts, defer=True)
    assert rep["deferred_admissions"] == 0
