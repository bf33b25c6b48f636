"""The serving step writes the manager's K/V pools in place: after prefill and decode steps the
pools are the buffers the manager allocated (donation honoured at run time, not only in the
compiled program), K and V distinct, with bf16 and FP8 weights and K/V. A pool the step could not
donate costs one pool-sized allocation (the H100 OOM of --workload trtllm-bench at c458)."""

from __future__ import annotations

import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvcm  # noqa: F401  (the installed package first)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.llama import fp8_weights  # noqa: E402
from examples.llama import model as llama  # noqa: E402
from examples.llama import serve  # noqa: E402
from examples.llama import step as llama_step  # noqa: E402

CONFIG = llama.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, dtype="bfloat16")


def _pointers(mgr) -> list[int]:
    return [a.unsafe_buffer_pointer() for pair in mgr.caches for a in pair]


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("quantize", [None, "fp8"])
def test_serving_steps_update_the_pools_in_place(backend, kv_dtype, quantize):
    backend.device   # noqa: B018  (fails here when the backend cannot run)
    params = llama.init_params(CONFIG, seed=1)
    if quantize:
        params = fp8_weights.quantize_params(params, fp8_weights.QUANTIZE_CHOICES[quantize])
    srv = serve.Server(params, CONFIG, serve.ServeConfig(
        page_size=4, device_pages=48, max_batch=4, max_tokens_per_step=32, max_seq_len=64,
        kv_dtype="auto" if kv_dtype == "bfloat16" else "fp8"))
    mgr = srv.manager
    before = _pointers(mgr)
    assert len(set(before)) == len(before), "K and V pools must be distinct buffers"
    rng = np.random.default_rng(5)
    print("seed", 5)
    outs = srv.generate([serve.Request(list(rng.integers(1, 96, n)), 6, eos_token_ids=())
                         for n in (9, 14, 3)])
    assert all(len(o.generated_ids) == 6 for o in outs)
    assert mgr.caches[0][0].dtype == jnp.dtype(kv_dtype)
    assert _pointers(mgr) == before, "a step copied a pool instead of writing it in place"


@pytest.mark.parametrize("cascade", [False, True])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
def test_serving_step_has_no_effect(kv_dtype, cascade):
    """The compiled serving step (prefill and decode) carries no effect: an effect (a checkify
    check on the traced FP8 K/V scales did) sends every ``jax.jit`` dispatch of it through
    jax's Python path, ~11 ms of host time per 8B step on the H100."""
    import functools

    import jax
    params = fp8_weights.quantize_params(llama.init_params(CONFIG, seed=1), "channel")
    srv = serve.Server(params, CONFIG, serve.ServeConfig(
        page_size=4, device_pages=48, max_batch=4, max_tokens_per_step=32, max_seq_len=64,
        kv_dtype="auto" if kv_dtype == "bfloat16" else "fp8", cascade=cascade))
    calls = []
    step = srv._model_step

    def recording(*args, **kwargs):
        calls.append((jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args),
                      kwargs))
        return step(*args, **kwargs)
    srv._model_step = recording
    shared = list(range(10, 22))   # three pages: two requests decode with it shared
    srv.generate([serve.Request([5, 6, 7, 8, 9], 3, eos_token_ids=())])
    srv.generate([serve.Request(shared + [30 + i], 4, eos_token_ids=()) for i in range(2)])
    kinds = {kw["decode"] for _, kw in calls}
    assert kinds == {True, False}, kinds
    assert cascade == any("cascade" in kw for _, kw in calls)
    # Traced as the plain jitted step: one compiled with XLA options (FP8 weights' default,
    # step.step_xla_options) is a top-level jit only; the traced program is the same.
    assert srv.serve.xla_options == llama_step.FP8_WEIGHTS_XLA_OPTIONS
    plain = functools.partial(llama_step.model_step, *step.args, **step.keywords)
    for args, kwargs in calls:
        jaxpr = jax.make_jaxpr(functools.partial(plain, **kwargs))(*args)
        assert jaxpr.effects == set(), (kwargs["decode"], jaxpr.effects)
