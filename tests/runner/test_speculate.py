"""Speculative decoding by prompt lookup (examples/llama/speculate.py, issue 37): greedy output
equals the continuous-batching Server's greedy output token for token (the production path, not
speculating) on small random models, with drafts accepted and rejected ones rolled back through
``KVCacheManager.truncate``; the sampling rule's output distribution equals the model's (numpy,
seeded, the seed printed); the n-gram proposer."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import numpy as np
import pytest

import jax_kvcm  # noqa: F401  (the installed package first; the repo root goes on sys.path after)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples.llama import model as llama  # noqa: E402
from examples.llama.scheduler import Server  # noqa: E402
from examples.llama.serve_types import Request, ServeConfig  # noqa: E402
from examples.llama.speculate import (SpeculativeGenerator, accept_greedy,  # noqa: E402
                                      accept_sampled, propose_ngram)


def test_propose_ngram_takes_the_latest_longest_match():
    ctx = [5, 6, 7, 1, 5, 6, 8, 9, 5, 6]
    assert propose_ngram(ctx, 3) == [8, 9, 5]            # "5 6" last seen before 8
    assert propose_ngram(ctx, 3, max_ngram=1) == [8, 9, 5]
    assert propose_ngram([1, 2, 3], 4) == []              # nothing repeats
    assert propose_ngram([4, 4, 4, 4], 2) == [4]          # "4 4 4" at 0: then one token left
    assert propose_ngram([], 2) == [] and propose_ngram([3], 2) == []


def test_accept_greedy():
    assert accept_greedy([3, 4, 5], [3, 4, 9, 1]) == (2, 9)
    assert accept_greedy([3, 4], [3, 4, 7]) == (2, 7)
    assert accept_greedy([3], [8, 1]) == (0, 8)
    assert accept_greedy([], [6]) == (0, 6)


def _binomial_tail(k: int, m: int, p: float) -> float:
    """Two-sided exact tail of ``k`` successes in ``m`` draws of probability ``p``:
    ``min(1, 2 * min(P(X <= k), P(X >= k)))``."""
    if p <= 0.0 or p >= 1.0:
        return 1.0 if k == round(p * m) else 0.0
    x = np.arange(m + 1)
    log_pmf = (np.array([math.lgamma(m + 1) - math.lgamma(i + 1) - math.lgamma(m - i + 1)
                         for i in x]) + x * math.log(p) + (m - x) * math.log1p(-p))
    pmf = np.exp(log_pmf)
    return float(min(1.0, 2 * min(pmf[:k + 1].sum(), pmf[k:].sum())))


@pytest.mark.parametrize("case", ["likely drafts", "unlikely drafts", "impossible draft"])
def test_speculative_sampling_keeps_the_model_distribution(case):
    """Two fed drafts over a 6-token vocabulary: the first output token is distributed as p0,
    and the second, given the first was the draft, as p1, over 40,000 draws. Each token's count
    against an exact binomial test (two-sided tail >= 1e-6; the second token's sample can be a
    few dozen draws when the first draft is unlikely, where a normal approximation flakes)."""
    seed = int(np.random.default_rng().integers(1 << 30))
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(6), size=3)
    drafts = {"likely drafts": [int(p[0].argmax()), int(p[1].argmax())],
              "unlikely drafts": [int(p[0].argmin()), int(p[1].argmin())],
              "impossible draft": [0, 1]}[case]
    if case == "impossible draft":
        p[0, 0] = 0.0
        p[0] /= p[0].sum()
    n = 40_000
    first, second = np.zeros(6, np.int64), np.zeros(6, np.int64)
    for _ in range(n):
        a, nxt = accept_sampled(p, drafts, rng)
        out = drafts[:a] + [nxt]
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second[out[1]] += 1
    for counts, want in ((first, p[0]), (second, p[1])):
        m = int(counts.sum())
        tails = [_binomial_tail(int(k), m, float(w)) for k, w in zip(counts, want)]
        assert min(tails) >= 1e-6, (seed, case, counts.tolist(), want.tolist(), tails)


# (a model whose greedy output varies: a degenerate one repeating one token would hide stale K/V)
CONFIG = llama.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, eos_token_ids=(), dtype="float32")


@pytest.fixture(scope="module")
def params():
    return llama.init_params(CONFIG, seed=1)


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculation_equals_plain_greedy(params, k):
    """Repetitive prompts (so drafts are found and some accepted) and a shared prefix: the
    speculative generator's tokens equal the Server's greedy tokens exactly."""
    prompts = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [7, 8, 7, 8, 7, 8, 7], [3, 4, 5, 6, 3, 4, 9, 10],
               [11, 12, 13, 14, 15, 16]]
    reqs = [Request(prompt=p, max_new_tokens=24) for p in prompts]
    serve = ServeConfig(page_size=4, device_pages=128, max_batch=4,
                        max_tokens_per_step=4 * (k + 1) + 16, max_seq_len=64)
    want = [o.generated_ids for o in Server(params, CONFIG, serve).generate(reqs)]
    gen = SpeculativeGenerator(params, CONFIG, serve, num_draft_tokens=k)
    got = gen.generate(reqs)
    assert [o.generated_ids for o in got] == want
    assert gen.stats["drafted"] > 0 and gen.stats["accepted"] > 0, gen.stats
    assert gen.stats["accepted"] < gen.stats["drafted"], gen.stats   # some rolled back
    assert min(len(set(w)) for w in want) > 3, want                  # not one token repeated
    assert gen.stats["steps"] < sum(len(w) for w in want) // len(want), gen.stats
    gen.manager.check_invariants()


def test_bad_settings_are_refused(params):
    with pytest.raises(ValueError, match="max_tokens_per_step"):
        SpeculativeGenerator(params, CONFIG, ServeConfig(max_batch=8, max_tokens_per_step=16),
                             num_draft_tokens=4)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpeculativeGenerator(params, CONFIG, num_draft_tokens=-1)
    gen = SpeculativeGenerator(params, CONFIG, ServeConfig(max_batch=2, max_tokens_per_step=16))
    with pytest.raises(ValueError, match="top_p"):
        gen.generate([Request(prompt=[1, 2, 3], temperature=0.7, top_p=0.9)])


def test_cli_speculate_matches_the_plain_runner(capsys):
    """``run.py --speculate ngram`` on the built-in model: the same greedy tokens as the plain
    runner, and a speculation report last."""
    import json

    from examples.llama import run
    assert run.main(["--json", "--max-new-tokens", "12"]) == 0
    plain = [json.loads(x) for x in capsys.readouterr().out.splitlines() if '"request"' in x]
    assert run.main(["--json", "--max-new-tokens", "12", "--speculate", "ngram",
                     "--num-draft-tokens", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    spec = [json.loads(x) for x in lines if '"request"' in x]
    key = lambda d: d["request"]  # noqa: E731
    assert len(plain) == len(spec) > 1
    assert ([d["generated_ids"] for d in sorted(spec, key=key)]
            == [d["generated_ids"] for d in sorted(plain, key=key)])
    report = json.loads(lines[-1])["speculation_report"]
    assert report["steps"] > 0 and report["drafted"] > 0, report
    # a draft model (the model itself: every draft accepted), the same tokens
    assert run.main(["--json", "--max-new-tokens", "12", "--speculate", "draft",
                     "--num-draft-tokens", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    drafted = [json.loads(x) for x in lines if '"request"' in x]
    assert ([d["generated_ids"] for d in sorted(drafted, key=key)]
            == [d["generated_ids"] for d in sorted(plain, key=key)])
    report = json.loads(lines[-1])["speculation_report"]
    assert report["drafted"] > 0 and report["accepted"] == report["drafted"], report


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_greedy_speculation_equals_transformers(kind, tmp_path):
    """A random HF Llama / Mistral (sliding window 8: its window group holds no slack, so a
    rejected draft's cut must stay inside it) saved as a checkpoint and loaded back; each
    speculative greedy generation is the argmax of HF's teacher-forced logits at every
    position (HF's greedy decoding, by induction)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from conftest import hf_checkpoint, random_hf_llama, random_prompt
    from test_llama_serve import BASE, CONFIGS, _check_greedy

    _, extra = CONFIGS[kind]
    hf = random_hf_llama(kind, {**BASE, **extra}, 11)
    config, params = hf_checkpoint(hf, tmp_path)
    rng = np.random.default_rng(2)
    prompts = [random_prompt(rng, 9) * 2, random_prompt(rng, 14)]   # one repeats: drafts
    gen = SpeculativeGenerator(params, config, ServeConfig(page_size=4, device_pages=64,
                                                           max_batch=2, max_tokens_per_step=16,
                                                           max_seq_len=128), num_draft_tokens=3)
    outs = gen.generate([Request(p, 16) for p in prompts])
    for p, o in zip(prompts, outs):
        _check_greedy(hf, p, o.generated_ids, 16, f"{kind} speculative")
    assert gen.stats["drafted"] > 0, gen.stats


def test_a_draft_model_speculates_and_greedy_output_is_unchanged(params):
    """A draft model (another random model of the same vocabulary, and the model itself):
    greedy tokens equal the Server's; the model as its own draft has every draft accepted;
    the draft model's sequences are rolled back and closed with the target's."""
    prompts = [[3, 4, 5, 6, 3, 4, 5], [7, 8, 7, 8, 9], [11, 12, 13, 14, 15, 16]]
    reqs = [Request(prompt=p, max_new_tokens=20) for p in prompts]
    serve = ServeConfig(page_size=4, device_pages=128, max_batch=4, max_tokens_per_step=32,
                        max_seq_len=64)
    want = [o.generated_ids for o in Server(params, CONFIG, serve).generate(reqs)]
    other = llama.init_params(CONFIG, seed=7)
    for draft, every in ((other, False), (params, True)):
        gen = SpeculativeGenerator(params, CONFIG, serve, num_draft_tokens=3,
                                   draft=(draft, CONFIG))
        assert [o.generated_ids for o in gen.generate(reqs)] == want
        st = gen.stats
        assert st["drafted"] > 0 and (st["accepted"] == st["drafted"]) == every, st
        for m in (gen.manager, gen.draft.manager):
            m.check_invariants()
            assert m.stats()["pages"]["device"]["referenced"] == 0
    with pytest.raises(ValueError, match="draft: its vocabulary"):
        SpeculativeGenerator(params, CONFIG, serve, num_draft_tokens=3,
                             draft=(other, dataclasses.replace(CONFIG, vocab_size=65)))
