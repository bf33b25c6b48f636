"""Server.precompile: the device step compiled ahead for every (kind, batch bucket, token bucket)
a step can take, so that serving compiles nothing. Oracles: a brute-force walk over every
(rows, tokens) a step can have for ``step_shapes``; JAX's own compile events (none of the step
while serving after ``precompile``, one a program during it) and a server without it (the same
tokens) for ``precompile``. CPU."""

from __future__ import annotations

import bisect
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_kvcm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.llama import model as llama  # noqa: E402
from examples.llama import serve  # noqa: E402
from examples.llama.step import step_shapes  # noqa: E402

STEP_COMPILES: list[str] = []   # the model step's XLA compiles, in order


def _on_duration(event: str, duration: float, *args, **kwargs) -> None:
    if (event == "/jax/core/compile/backend_compile_duration"
            and kwargs.get("fun_name") == "jit(model_step)"):
        STEP_COMPILES.append(event)


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def _buckets(draw, most: int) -> tuple[int, ...]:
    """Strictly increasing sizes whose last reaches ``most`` (KVCacheConfig's rule)."""
    below = draw(st.lists(st.integers(1, most), max_size=4, unique=True))
    return tuple(sorted(set(below) | {draw(st.integers(most, most + 3))}))


@st.composite
def _configs(draw):
    max_batch, max_tokens = draw(st.integers(1, 10)), draw(st.integers(1, 24))
    return jax_kvcm.KVCacheConfig(
        tokens_per_page=4, layer_groups=(jax_kvcm.LayerGroupConfig(1, 1, 8, np.float32),),
        device_pages=8, max_batch=max_batch, max_tokens_per_step=max_tokens,
        batch_buckets=_buckets(draw, max_batch), token_buckets=_buckets(draw, max_tokens))


@settings(max_examples=300, deadline=None)
@given(cfg=_configs(), paged_decode=st.booleans())
def test_step_shapes_are_exactly_the_shapes_a_step_can_take(cfg, paged_decode):
    def bucket(buckets, n):
        return buckets[bisect.bisect_left(buckets, n)]
    want = {(paged_decode and rows == tokens, bucket(cfg.batch_buckets, rows),
             bucket(cfg.token_buckets, tokens))
            for rows in range(1, cfg.max_batch + 1)
            for tokens in range(rows, cfg.max_tokens_per_step + 1)}   # a row has >= 1 token
    assert set(step_shapes(cfg, paged_decode)) == want


VARIANTS = {"greedy": dict(), "sampled": dict(temperature=0.8),
            "cascade": dict(cascade=True), "no paged decode": dict(paged_decode=False)}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_precompile_leaves_serving_nothing_to_compile(variant):
    """Requests of several lengths (rows 1-4 in steps, prompts in chunks, decodes beside them):
    after ``precompile`` no step compiles while serving, and the tokens are those of a server
    that compiled as it went."""
    kw = dict(VARIANTS[variant])
    temperature = kw.pop("temperature", 0.0)
    # a model of its own per variant (the config is a static argument): a cold jit cache
    config = llama.LlamaConfig(vocab_size=64 + 8 * list(VARIANTS).index(variant), hidden_size=32,
                               intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=8, dtype="float32")
    params = llama.init_params(config, seed=5)
    scfg = serve.ServeConfig(page_size=4, device_pages=96, max_batch=4, max_tokens_per_step=16,
                             prefill_chunk_tokens=8, max_seq_len=64, batch_buckets=(2, 4),
                             token_buckets=(4, 8, 16), record_steps=True, **kw)
    seed = 1234 + list(VARIANTS).index(variant)
    print("seed", seed)
    rng = np.random.default_rng(seed)
    system = rng.integers(3, config.vocab_size, 12).tolist()     # three pages shared (cascade)
    reqs = [serve.Request(system + rng.integers(3, config.vocab_size, n).tolist(), m,
                          temperature=temperature, seed=i, eos_token_ids=())
            for i, (n, m) in enumerate([(3, 9), (11, 4), (1, 7), (6, 2), (9, 5), (2, 8)])]

    srv = serve.Server(params, config, scfg)
    n0 = len(STEP_COMPILES)
    n = srv.precompile(sampling=temperature > 0)
    assert n == len(step_shapes(srv.kv_config, scfg.paged_decode)) * (1 + (temperature > 0))
    assert len(STEP_COMPILES) - n0 == n
    outs = srv.generate(reqs)
    assert len(STEP_COMPILES) == n0 + n, "a step compiled while serving after precompile"
    rep = srv.report()
    assert rep["mixed_steps"] and (rep["decode_steps"] or not scfg.paged_decode)
    assert len(rep["compiled_shapes"]) == n   # the report lists the precompiled shapes
    used = {(r.program, r.batch_bucket, r.token_bucket) for r in srv.step_records}
    assert len(used) >= 4, used             # the workload reached several of them
    plain = serve.Server(params, config, scfg).generate(reqs)
    assert [o.generated_ids for o in outs] == [o.generated_ids for o in plain]
    assert len({len(o.generated_ids) for o in outs}) > 3
