"""Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm) and mixed-layer models (HF ``layer_types``:
full and sliding-window layers in one model) in the example runner, against HF transformers.

Tiny random ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` models are built with transformers' own
config and model classes, saved with ``save_pretrained`` and loaded back through
``examples/llama/loader.py``. The mixed models (3 of 4 layers sliding, window 16) run in the
serving loop over two KV layer groups (full; window with ring tables), so the model writes and
reads each layer in its group's pool. Greedy generations must be HF's token for token (checked by
one teacher-forced HF forward, and against ``hf.generate`` with its sliding-window cache), up to
120 new tokens (far past the window), through the overlapped loop with prefix reuse and with so
few device pages that sequences are suspended to host and resumed. transformers masks sliding
layers with ``kv_idx > q_idx - W`` (the last W positions including the query), the ops' own
convention; a model run with W - 1 or W + 1 must not match.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import hf_checkpoint, hf_logits, random_hf_llama, random_prompt
import jax_kvcm  # noqa: F401  (the installed package first; the repo root goes on sys.path after)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.llama import model as llama  # noqa: E402
from examples.llama import serve  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

EOS = 2
WINDOW = 16
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=EOS,
            pad_token_id=0)
MIXED = dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=WINDOW,
             layer_types=["sliding_attention", "full_attention", "sliding_attention",
                          "sliding_attention"])
CONFIGS = {
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen2_mixed": ("qwen2", MIXED),
    "qwen3_mixed": ("qwen3", MIXED),
    # The older Qwen2 fields: layers from max_window_layers on slide (no layer_types written by
    # us; transformers derives them the same way).
    "qwen2_max_window_layers": ("qwen2", dict(num_hidden_layers=3, use_sliding_window=True,
                                              sliding_window=WINDOW, max_window_layers=1)),
}

_CASES: dict[str, dict] = {}


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    name = request.param
    if name not in _CASES:
        kind, extra = CONFIGS[name]
        hf = random_hf_llama(kind, {**BASE, **extra}, seed=11 + len(name))
        config, params = hf_checkpoint(hf, tmp_path_factory.mktemp(f"hf_{name}"))
        assert config.model_type == kind
        _CASES[name] = dict(name=name, hf=hf, config=config, params=params)
    return _CASES[name]


_hf_logits = hf_logits


def _check_greedy(hf, prompt, got, what="", logits=None) -> None:
    """``got`` (no EOS stop) must be HF's greedy continuation: every token the argmax of one
    teacher-forced HF forward at the position before it; ``logits`` within rel L2 1e-4."""
    ref = _hf_logits(hf, list(prompt) + list(got))[len(prompt) - 1:len(prompt) - 1 + len(got)]
    want = ref.argmax(-1).tolist()
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    assert first is None, f"{what}: token {first} differs: {got} != {want}"
    if logits is not None:
        err = max(float(np.linalg.norm(logits[j] - ref[j]) / np.linalg.norm(ref[j]))
                  for j in range(len(got)))
        assert err <= 1e-4, f"{what}: logits rel L2 {err:.2e}"


def _hf_generate(hf, prompt, n) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([list(prompt)]),
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                          eos_token_id=EOS)
    return out[0, len(prompt):].tolist()


def _server(case, **kw) -> serve.Server:
    cfg = dict(page_size=4, device_pages=96, max_batch=4, max_tokens_per_step=16,
               max_seq_len=160)
    cfg.update(kw)
    return serve.Server(case["params"], case["config"], serve.ServeConfig(**cfg))


# ---------------------------------------------------------------------------------------------


def test_config_layer_types_and_families(case):
    hf, c = case["hf"], case["config"]
    assert c.layer_windows() == tuple(WINDOW if t == "sliding_attention" else None
                                      for t in hf.config.layer_types)
    assert c.qkv_bias == (c.model_type == "qwen2") and c.qk_norm == (c.model_type == "qwen3")
    groups = c.kv_groups()
    assert sorted(i for _, layers in groups for i in layers) == list(range(c.num_hidden_layers))
    if "mixed" in case["name"]:
        assert groups == ((None, (1,)), (WINDOW, (0, 2, 3)))
    # to_hf_dict round-trips through transformers' own config class.
    cls = type(hf.config)
    again = llama.LlamaConfig.from_hf_dict(cls(**c.to_hf_dict()).to_dict())
    assert again == c


def test_older_qwen2_fields_and_bad_layer_types():
    d = dict(model_type="qwen2", vocab_size=8, hidden_size=8, intermediate_size=8,
             num_hidden_layers=3, num_attention_heads=2, sliding_window=4,
             max_window_layers=1)
    # use_sliding_window false (the Qwen2.5 checkpoints) or absent: no window anywhere.
    for off in ({"use_sliding_window": False}, {}):
        assert llama.LlamaConfig.from_hf_dict({**d, **off}).layer_windows() == (None,) * 3
        assert transformers.Qwen2Config(**{**d, **off}).layer_types == ["full_attention"] * 3
    on = {**d, "use_sliding_window": True}
    assert llama.LlamaConfig.from_hf_dict(on).layer_windows() == (None, 4, 4)
    assert transformers.Qwen2Config(**on).layer_types == ["full_attention"] + \
        ["sliding_attention"] * 2
    with pytest.raises(ValueError, match="layer_types"):
        llama.LlamaConfig.from_hf_dict({**d, "layer_types": ["full_attention"] * 2})
    with pytest.raises(ValueError, match="layer_types"):
        llama.LlamaConfig.from_hf_dict({**d, "layer_types": ["chunked_attention"] * 3})
    with pytest.raises(ValueError, match="attention_bias"):
        llama.LlamaConfig.from_hf_dict({**d, "model_type": "qwen3", "attention_bias": True})


def test_single_request_matches_hf_generate(case):
    hf = case["hf"]
    prompt = random_prompt(np.random.default_rng(1), 13)
    srv = _server(case, max_tokens_per_step=8, record_logits=True)   # two prefill chunks
    (out,) = srv.generate([serve.Request(prompt, 24, eos_token_ids=())])
    want = _hf_generate(hf, prompt, 24)
    assert out.generated_ids == want, (out.generated_ids, want)
    assert len(set(want)) > 3, f"degenerate generation {want}"
    _check_greedy(hf, prompt, out.generated_ids, case["name"], out.logits)
    srv.manager.check_invariants()


@pytest.mark.parametrize("case", ["qwen2_mixed", "qwen3_mixed"], indirect=True)
def test_long_generation_past_the_window(case):
    """120 new tokens with W = 16: the window group's ring wraps many times; the sliding cache of
    hf.generate and the teacher-forced forward both agree with us."""
    hf = case["hf"]
    rng = np.random.default_rng(4)
    prompts = [random_prompt(rng, n) for n in (5, 23)]
    srv = _server(case, record_logits=True)
    widths = srv.kv_config.table_widths
    assert widths[1] < widths[0] and widths[1] == srv.manager.config.table_widths[1]
    outs = srv.generate([serve.Request(p, 120, eos_token_ids=()) for p in prompts])
    for p, o in zip(prompts, outs):
        assert len(o.generated_ids) == 120
        _check_greedy(hf, p, o.generated_ids, case["name"], o.logits)
    assert outs[0].generated_ids == _hf_generate(hf, prompts[0], 120)
    srv.manager.check_invariants()


@pytest.mark.parametrize("case", ["qwen3_mixed"], indirect=True)
@pytest.mark.parametrize("overlap", [True, False])
def test_prefix_reuse_and_page_pressure(case, overlap):
    """Shared-prefix requests (later ones reuse pages of both groups) in the overlapped loop, with
    so few device pages that sequences are suspended to host and resumed: still HF's tokens."""
    hf = case["hf"]
    rng = np.random.default_rng(7)
    shared = random_prompt(rng, 24)
    prompts = [shared + rng.integers(3, 128, n).tolist() for n in (3, 9, 5, 12)]
    reqs = [serve.Request(p, 48, eos_token_ids=()) for p in prompts]
    srv = _server(case, device_pages=40, host_bytes=1 << 20, overlap=overlap)
    first = srv.generate(reqs[:1])
    rest = srv.generate(reqs[1:])
    for p, o in zip(prompts, first + rest):
        _check_greedy(hf, p, o.generated_ids, f"overlap={overlap}")
    assert all(o.prefix_hit_tokens >= 20 for o in rest), [o.prefix_hit_tokens for o in rest]
    rep = srv.report()
    assert rep["suspends"] > 0 and rep["resumes"] > 0, rep
    srv.manager.check_invariants()


@pytest.mark.parametrize("case", ["qwen2_mixed"], indirect=True)
def test_window_off_by_one_does_not_match(case):
    """The window bites: the same model with W - 1 or W + 1 on its sliding layers is far from
    HF's logits (ours are within 1e-4), so the tests above pin the convention."""
    hf = case["hf"]
    prompt = random_prompt(np.random.default_rng(9), 9)
    req = serve.Request(prompt, 40, eos_token_ids=())
    (ref,) = _server(case, record_logits=True).generate([req])
    _check_greedy(hf, prompt, ref.generated_ids, logits=ref.logits)
    for w in (WINDOW - 1, WINDOW + 1):
        other = dict(case, config=dataclasses.replace(case["config"], sliding_window=w))
        # Teacher-forced: the other window's logits at the same tokens (one prefill).
        (out,) = _server(other, record_logits=True).generate(
            [serve.Request(prompt + ref.generated_ids[:-1], 1, eos_token_ids=())])
        (last,) = _server(case, record_logits=True).generate(
            [serve.Request(prompt + ref.generated_ids[:-1], 1, eos_token_ids=())])
        err = float(np.linalg.norm(out.logits - last.logits) / np.linalg.norm(last.logits))
        assert err > 1e-2, f"window {w} indistinguishable from {WINDOW} (rel L2 {err:.2e})"


@pytest.mark.parametrize("case", ["qwen3_mixed"], indirect=True)
def test_forward_step_grouped_absolute_tables(case):
    """The model alone, without the manager: make_caches gives one pool per KV group, and one
    ragged step over absolute [G, B, P] tables (rings=None) gives HF's logits at every position."""
    import jax.numpy as jnp

    config, params = case["config"], case["params"]
    prompt = random_prompt(np.random.default_rng(5), 45)
    T, page, num_pages = len(prompt), 4, 16
    kc, vc = llama.make_caches(config, num_pages, page)
    assert [k.shape[0] for k in kc] == [1, 3]
    pos = np.arange(T, dtype=np.int32)
    tables, slots = [], []
    for g in range(2):  # the groups' pools are separate: give them different page orders
        pages = (np.arange(1, num_pages) if g else np.arange(num_pages - 1, 0, -1)).astype(np.int32)
        tables.append(pages[None, :])
        slots.append(pages[pos // page] * page + pos % page)
    logits, _, _ = llama.forward_step(
        params, kc, vc, jnp.asarray(prompt, jnp.int32), jnp.asarray(pos),
        jnp.asarray(np.stack(slots)), jnp.asarray(np.stack(tables)),
        jnp.asarray([T], jnp.int32), jnp.asarray([0, T], jnp.int32),
        jnp.arange(T, dtype=jnp.int32), config=config)
    want = _hf_logits(case["hf"], prompt)
    err = float(np.linalg.norm(np.asarray(logits) - want) / np.linalg.norm(want))
    assert err <= 1e-4, f"rel L2 {err:.2e}"
    with pytest.raises(ValueError, match="PagedRunner"):
        from llama_paged_runner import PagedRunner
        PagedRunner(params, config)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["gpu"], indirect=True)
@pytest.mark.parametrize("case", ["qwen3_mixed"], indirect=True)
def test_mixed_layers_long_generation_gpu(case, backend):
    """On the GPU (the CUDA kernels over ring tables): the mixed model, 120 new tokens with
    W = 16, overlapped loop under page pressure. Teacher-forced against HF: every token is HF's
    argmax given our prefix, unless HF's top two are within 1e-3 there (a near tie a GEMM's
    rounding may flip); logits within rel L2 1e-3."""
    import jax
    hf = case["hf"]
    case = dict(case, params=jax.device_put(case["params"], backend.device))
    rng = np.random.default_rng(13)
    prompts = [random_prompt(rng, n) for n in (5, 23, 40)]
    srv = _server(case, device_pages=48, host_bytes=1 << 20, record_logits=True)
    outs = srv.generate([serve.Request(p, 120, eos_token_ids=()) for p in prompts])
    for p, o in zip(prompts, outs):
        got = o.generated_ids
        ref = _hf_logits(hf, p + got)[len(p) - 1:len(p) - 1 + len(got)]
        top2 = np.sort(ref, axis=-1)[:, -2:]
        bad = [j for j, t in enumerate(got)
               if t != ref[j].argmax() and top2[j, 1] - top2[j, 0] > 1e-3]
        assert not bad, f"tokens {bad} are not HF's argmax"
        err = max(float(np.linalg.norm(o.logits[j] - ref[j]) / np.linalg.norm(ref[j]))
                  for j in range(len(got)))
        assert err <= 1e-3, f"logits rel L2 {err:.2e}"
    srv.manager.check_invariants()
