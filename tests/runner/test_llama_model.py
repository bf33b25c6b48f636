"""The example Llama model and loader against HF transformers (torch CPU), through real checkpoints.

Small random LlamaForCausalLM / MistralForCausalLM models are saved with ``save_pretrained``
(safetensors) and loaded back through ``examples/llama/loader.py``; then:

- float32 logits within relative L2 1e-4 of transformers at every prompt position (one prefill)
  and at every decode step (runner with chunked prefill + batched decode);
- greedy generations identical token for token: single requests, a batch of mixed lengths, and
  shared-prefix prompts (which must reuse pages);
- Mistral's sliding window: a window smaller than the sequences, matched exactly, and a window one
  off on either side must not match (HF masks ``kv_idx > q_idx - W``: the last W positions
  including the query itself, the ops' convention).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import (decode_step_inputs, hf_checkpoint, hf_logits, random_hf_llama,
                      random_prompt)
import jax_kvcm  # noqa: F401  (the installed package first; the repo root goes on sys.path after)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.llama import loader as llama_loader  # noqa: E402
from examples.llama import model as llama  # noqa: E402
from llama_paged_runner import PagedRunner  # noqa: E402  (a test helper beside this file)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REL_L2 = 1e-4
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)

CONFIGS = {
    "llama": ("llama", dict(rope_theta=10000.0)),
    # head_dim 16, theta 5e5: wavelengths 6.3, 33, 170, ... against original_max 64 -> one high,
    # one medium (smoothed) and six low (divided by factor) frequencies.
    "llama3": ("llama", dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    # Tied embeddings: the last token's own logit (|e|^2 through the residual) dominates unless the
    # layers' contributions are larger, so this one gets smaller embeddings and larger layers.
    "tied": ("llama", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "mistral": ("mistral", dict(sliding_window=8)),
}


INIT = {"tied": (0.5, 1.5)}  # (embedding std, layer weight scale); default (1.0, 0.6)


def _hf_model(kind: str, extra: dict, seed: int, init=(1.0, 0.6)):
    return random_hf_llama(kind, {**BASE, **extra}, seed, embed_std=init[0],
                           weight_scale=init[1])


_CASES: dict[str, dict] = {}


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    """A saved-and-reloaded HF model per config (built once per module)."""
    name = request.param
    if name not in _CASES:
        _CASES[name] = _build_case(name, tmp_path_factory)
    return _CASES[name]


def _build_case(name, tmp_path_factory):
    kind, extra = CONFIGS[name]
    hf = _hf_model(kind, extra, seed=len(name), init=INIT.get(name, (1.0, 0.6)))
    path = tmp_path_factory.mktemp(f"hf_{name}")
    config, params = hf_checkpoint(hf, path)
    return dict(name=name, hf=hf, config=config, params=params, path=path)


def _rel_l2(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


_hf_logits = hf_logits


def _check_greedy(hf, prompt, got, n, what="", logits=None) -> None:
    """``got`` is HF's greedy continuation of ``prompt`` (up to ``n`` tokens, stopping after EOS
    2), checked with ONE teacher-forced HF forward over ``prompt + got``: every token must be the
    argmax of HF's logits at the position before it, so by induction ``got`` is exactly what HF
    greedy decoding produces (test_single_request_tokens_and_decode_logits also compares with
    ``hf.generate`` itself). With ``logits`` (ours, one row per generated token) also checks them
    within REL_L2 of HF's."""
    assert len(got) == n or (got and got[-1] == 2), f"{what}: stopped early: {got}"
    assert 2 not in got[:-1], f"{what}: ran past EOS: {got}"
    ref = _hf_logits(hf, list(prompt) + list(got))[len(prompt) - 1:len(prompt) - 1 + len(got)]
    want = ref.argmax(-1).tolist()
    assert got == want, f"{what}: {got} != HF greedy (first {len(got)} argmaxes) {want}"
    if logits is not None:
        errs = [_rel_l2(logits[j], ref[j]) for j in range(len(got))]
        assert max(errs) <= REL_L2, f"{what}: decode logits rel L2 {max(errs):.2e}"


def _hf_generate(hf, prompt, n) -> list[int]:
    """``hf.generate`` greedy, one request, no padding."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([list(prompt)]), attention_mask=torch.ones(1, len(prompt),
                          dtype=torch.long), max_new_tokens=n, do_sample=False,
                          pad_token_id=0, eos_token_id=2)
    return out[0, len(prompt):].tolist()


def _prefill_logits(config, params, prompt, page_size=8, num_pages=32):
    """One ragged step over the whole prompt; logits at every position."""
    T = len(prompt)
    kc, vc = llama.make_caches(config, num_pages, page_size)
    pages = np.arange(1, num_pages, dtype=np.int32)[: -(-T // page_size)][::-1].copy()  # reversed
    page_table = np.zeros((1, num_pages - 1), np.int32)
    page_table[0, :len(pages)] = pages
    pos = np.arange(T, dtype=np.int32)
    slots = (pages[pos // page_size] * page_size + pos % page_size).astype(np.int32)
    logits, kc, vc = llama.forward_step(
        params, kc, vc, jnp.asarray(prompt, jnp.int32), jnp.asarray(pos), jnp.asarray(slots),
        jnp.asarray(page_table), jnp.asarray([T], jnp.int32), jnp.asarray([0, T], jnp.int32),
        jnp.arange(T, dtype=jnp.int32), config=config)
    return np.asarray(logits)


# ---------------------------------------------------------------------------------------------


def test_prefill_logits_every_position(case):
    prompt = random_prompt(np.random.default_rng(0), 29)
    got = _prefill_logits(case["config"], case["params"], prompt)
    want = _hf_logits(case["hf"], prompt)
    errs = [_rel_l2(got[i], want[i]) for i in range(len(prompt))]
    print(f"{case['name']}: prefill rel L2 max over positions {max(errs):.2e}, "
          f"all {_rel_l2(got, want):.2e}")
    assert max(errs) <= REL_L2, (case["name"], errs)


def test_single_request_tokens_and_decode_logits(case):
    hf, config = case["hf"], case["config"]
    prompt = random_prompt(np.random.default_rng(1), 13)
    runner = PagedRunner(case["params"], config, num_pages=32, page_size=8, max_batch=4,
                         max_seq_len=128, chunk_size=8)   # two prefill chunks
    (got,), (logits,) = runner.generate([prompt], 24, record_logits=True)
    want = _hf_generate(hf, prompt, 24)
    assert got == want, f"{case['name']}: {got} != {want}"
    _check_greedy(hf, prompt, got, 24, case["name"])  # the fast check the other tests use
    assert len(set(got)) > 3, f"degenerate generation {got}"  # the check must have teeth
    ref = _hf_logits(hf, prompt + got[:-1])[len(prompt) - 1:]
    errs = [_rel_l2(logits[j], ref[j]) for j in range(len(got))]
    print(f"{case['name']}: decode rel L2 max over {len(got)} steps {max(errs):.2e}")
    assert max(errs) <= REL_L2, errs
    assert runner.stats.prefill_steps == 2 and runner.stats.decode_steps == len(got) - 1


@pytest.mark.parametrize("case,paged_decode", [
    (name, True) for name in CONFIGS] + [("llama", False), ("mistral", False)],
    indirect=["case"], ids=[f"{n}-paged_decode" for n in CONFIGS] + [
        "llama-ragged_decode", "mistral-ragged_decode"])
def test_batch_of_mixed_lengths(case, paged_decode):
    hf, config = case["hf"], case["config"]
    rng = np.random.default_rng(2)
    prompts = [random_prompt(rng, n) for n in (3, 17, 9, 33, 1, 24)]
    # The ragged-decode variant also uses a token budget below the batch size (3 < 4): prompts
    # advance one token per step while three sequences decode.
    runner = PagedRunner(case["params"], config, num_pages=48, page_size=8, max_batch=4,
                         max_seq_len=128, chunk_size=16 if paged_decode else 3,
                         paged_decode=paged_decode)
    got, logits = runner.generate(prompts, 16, record_logits=True)
    for i, p in enumerate(prompts):
        _check_greedy(hf, p, got[i], 16, f"{case['name']} prompt {i} (len {len(p)})", logits[i])
    # Mixed steps happened (decodes riding along prefill chunks), and pages all came back.
    assert runner.stats.prefill_steps > 2
    assert runner.available_pages() == 47


@pytest.mark.parametrize("case", ["llama", "llama3", "mistral"], indirect=True)
def test_shared_prefix(case):
    hf, config = case["hf"], case["config"]
    rng = np.random.default_rng(3)
    system = random_prompt(rng, 21)   # two full pages of 8 plus 5 tokens
    prompts = [system + rng.integers(3, 128, n).tolist() for n in (4, 11, 1)]
    runner = PagedRunner(case["params"], config, num_pages=48, page_size=8, max_batch=4,
                         max_seq_len=128, chunk_size=16)
    first, first_logits = runner.generate([system], 10, record_logits=True)
    assert runner.stats.prefix_hit_tokens == 0
    later, later_logits = runner.generate(prompts, 10, record_logits=True)
    assert runner.stats.prefix_hit_tokens == 3 * 16, runner.stats
    again = runner.generate(prompts[:1], 10)   # whole-prompt pages cached now: 3 pages hit
    assert runner.stats.prefix_hit_tokens == 3 * 16 + 24, runner.stats
    _check_greedy(hf, system, first[0], 10, "system prompt", first_logits[0])
    for i, (p, g, lg) in enumerate(zip(prompts, later, later_logits)):
        _check_greedy(hf, p, g, 10, f"shared-prefix prompt {i}", lg)
    assert again[0] == later[0]


def test_sliding_window_matches_hf_and_is_exercised():
    """HF (eager, masking_utils.sliding_window_overlay) keeps kv_idx > q_idx - W: the last W
    positions including the query, the ops' convention. W = 8 over 40 tokens must match; a model
    run with W - 1 or W + 1 must not (so the window really bites)."""
    try:  # transformers >= 4.53: the mask is built from this overlay on the causal mask
        from transformers.masking_utils import sliding_window_overlay
    except ImportError:
        sliding_window_overlay = None
    if sliding_window_overlay is not None:
        keep = sliding_window_overlay(8)
        assert [kv for kv in range(11) if keep(0, 0, 10, kv)] == list(range(3, 11))
    kind, extra = CONFIGS["mistral"]
    hf = _hf_model(kind, extra, seed=11)
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d, safe_serialization=True)
        config, params, _ = llama_loader.load_checkpoint(d, progress=False)
    assert config.sliding_window == 8 and config.model_type == "mistral"
    prompt = random_prompt(np.random.default_rng(4), 40)
    want = _hf_logits(hf, prompt)
    assert _rel_l2(_prefill_logits(config, params, prompt), want) <= REL_L2
    for w in (7, 9, None):
        other = dataclasses.replace(config, sliding_window=w)
        err = _rel_l2(_prefill_logits(other, params, prompt)[9:], want[9:])
        assert err > 1e-2, f"window {w} indistinguishable from 8 (rel L2 {err:.2e})"


@pytest.mark.parametrize("case", ["llama"], indirect=True)
def test_bfloat16_close_to_transformers(case):
    config16, params16, _ = llama_loader.load_checkpoint(case["path"], dtype="bfloat16",
                                                         progress=False)
    assert params16["layers"][0]["wqkv"].dtype == jnp.bfloat16
    prompt = random_prompt(np.random.default_rng(5), 20)
    got = _prefill_logits(config16, params16, prompt)
    want = _hf_logits(case["hf"], prompt)
    assert got.dtype == np.float32 and np.isfinite(got).all()
    print(f"bfloat16 prefill logits vs transformers float32: rel L2 {_rel_l2(got, want):.2e}")
    assert _rel_l2(got, want) < 5e-2


@pytest.mark.parametrize("case", ["mistral"], indirect=True)
def test_steps_donate_caches(case):
    """Both step functions update the caches in place: the inputs are donated (deleted) and no
    'donated buffers were not usable' warning is raised."""
    config, params = case["config"], case["params"]
    forward, decode = llama.bind(config)
    kc, vc = llama.make_caches(config, 8, 8)
    table = jnp.asarray([[3, 5, 0, 0]], jnp.int32)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        logits, kc2, vc2 = forward(params, kc, vc, jnp.asarray([1, 7, 9], jnp.int32),
                                   jnp.arange(3, dtype=jnp.int32),
                                   jnp.asarray([24, 25, 26], jnp.int32), table,
                                   jnp.asarray([3], jnp.int32), jnp.asarray([0, 3], jnp.int32),
                                   jnp.asarray([2], jnp.int32))
        assert kc.is_deleted() and vc.is_deleted() and logits.shape == (1, config.vocab_size)
        logits2, kc3, vc3 = decode(params, kc2, vc2, jnp.asarray([4, 0], jnp.int32),
                                   jnp.asarray([3, 0], jnp.int32), jnp.asarray([27, -1], jnp.int32),
                                   jnp.concatenate([table, jnp.zeros_like(table)]),
                                   jnp.asarray([4, 0], jnp.int32))
        assert kc2.is_deleted() and vc2.is_deleted()
    want = _hf_logits(case["hf"], [1, 7, 9, 4])
    assert _rel_l2(logits[0], want[2]) <= REL_L2 and _rel_l2(logits2[0], want[3]) <= REL_L2
    # Page 3 holds the 4 tokens (slots 24..27); nothing else was written.
    written = np.abs(np.asarray(kc3)).sum(axis=(0, 2, 3, 4))
    assert written.nonzero()[0].tolist() == [3]


# ---------------------------------------------------------------------------------------------
# Loader: our own checkpoints (sharded), errors.


def test_random_checkpoint_roundtrip_sharded(tmp_path):
    config = llama.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=8, eos_token_ids=(2,), bos_token_id=1)
    a = llama_loader.write_random_checkpoint(tmp_path / "a", config, seed=7, shards=2)
    b = llama_loader.write_random_checkpoint(tmp_path / "b", config, seed=7, dtype="bfloat16")
    assert (a / "model.safetensors.index.json").is_file()
    index = json.loads((a / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    cfg_a, pa, _ = llama_loader.load_checkpoint(a, progress=False)
    cfg_b, pb, _ = llama_loader.load_checkpoint(b, progress=False)
    assert cfg_a == config and cfg_b == dataclasses.replace(config, dtype="bfloat16")
    assert pb["embed"].dtype == jnp.bfloat16
    # Same seed: the bf16 checkpoint is the f32 one rounded.
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
        np.testing.assert_array_equal(np.asarray(x.astype(jnp.bfloat16)), np.asarray(y))
    # A tokenizer.json next to the weights comes back as a tokenizers.Tokenizer.
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "<s>": 1, "hello": 5, "world": 6},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(a / "tokenizer.json"))
    assert llama_loader.load_checkpoint(a, progress=False)[2].encode("hello world").ids == [5, 6]
    # init_params (host and on-device) give the loader's tree structure, shapes and dtypes.
    for on_device in (False, True):
        p = llama.init_params(cfg_b, seed=3, on_device=on_device)
        assert jax.tree.structure(p) == jax.tree.structure(pb)
        assert all(x.shape == y.shape and x.dtype == y.dtype
                   for x, y in zip(jax.tree.leaves(p), jax.tree.leaves(pb)))
    # And HF reads our checkpoint identically.
    hf = transformers.AutoModelForCausalLM.from_pretrained(a, attn_implementation="eager")
    prompt = random_prompt(np.random.default_rng(6), 12, vocab=96)
    assert _rel_l2(_prefill_logits(cfg_a, pa, prompt), _hf_logits(hf, prompt)) <= REL_L2


def test_loader_errors(tmp_path):
    config = llama.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=8)
    with pytest.raises(llama_loader.CheckpointError, match="config.json"):
        llama_loader.load_checkpoint(tmp_path, progress=False)
    d = llama_loader.write_random_checkpoint(tmp_path / "c", config, seed=0)
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(llama_loader.CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj"):
        llama_loader.load_checkpoint(d, progress=False)
    tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((32, 15), np.float32)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(llama_loader.CheckpointError, match=r"up_proj.*\(32, 15\).*\(32, 16\)"):
        llama_loader.load_checkpoint(d, progress=False)
    bad = json.loads((d / "config.json").read_text())
    bad["rope_scaling"] = {"rope_type": "yarn", "factor": 2.0}
    (d / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="yarn"):
        llama_loader.load_checkpoint(d, progress=False)


def test_decode_step_copies_no_weights():
    """The compiled decode step (CPU) has no instruction that materializes a layer's weight
    matrix: each GEMM reads its per-layer buffer as it is. The same step over stacked weights
    (``stack_layers``, ``lax.scan``) does slice them out every step, which shows the probe sees
    the copies it is meant to catch."""
    from benchmarks.harness.device_profile import weight_copy_ops
    config = llama.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48,
                               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=8)
    params = llama.init_params(config)
    kc, vc = llama.make_caches(config, 9, 4)
    B = 4
    args = (jnp.zeros(B, jnp.int32), jnp.zeros(B, jnp.int32), jnp.full(B, -1, jnp.int32),
            jnp.zeros((B, 2), jnp.int32), jnp.zeros(B, jnp.int32))
    T = 8
    fargs = (jnp.zeros(T, jnp.int32), jnp.zeros(T, jnp.int32), jnp.full(T, -1, jnp.int32),
             jnp.zeros((B, 2), jnp.int32), jnp.zeros(B, jnp.int32),
             jnp.zeros(B + 1, jnp.int32))

    def hlo(step, p, a):
        return step.lower(p, kc, vc, *a, config=config).compile().as_text()

    for step, a in ((llama.decode_step, args), (llama.forward_step, fargs)):
        assert weight_copy_ops(hlo(step, params, a), params) == []
        stacked = weight_copy_ops(hlo(step, llama.stack_layers(params), a), params)
        assert len(stacked) >= 4, stacked   # wqkv, wo, w_gate_up, w_down sliced per layer


def test_decode_step_breakdown_categories():
    """benchmarks/bench_decode_step.py's attribution of a step's ops
    (benchmarks/harness/device_profile.py): the compiled HLO of the tiny decode step has one paged
    attention and one write_kv custom call per layer and (at least) the 4 weight GEMMs per layer
    plus the lm_head; a profiled step puts time in each."""
    from benchmarks.bench_decode_step import COLUMNS
    from benchmarks.harness.device_profile import hlo_categories, step_breakdown
    config = llama.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48,
                               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=8)
    params = llama.init_params(config)
    B = 4
    state = dict(zip("kv", llama.make_caches(config, 9, 4)))
    args = (jnp.zeros(B, jnp.int32), jnp.full(B, 5, jnp.int32),
            jnp.asarray([6, 14, 22, 30], jnp.int32),
            jnp.asarray([[1, 2], [3, 4], [5, 6], [7, 8]], jnp.int32), jnp.full(B, 6, jnp.int32))
    hlo = llama.decode_step.lower(params, state["k"], state["v"], *args,
                                  config=config).compile().as_text()
    counts = collections.Counter(hlo_categories(hlo, params).values())
    L = config.num_hidden_layers
    assert counts["paged attention"] == L and counts["K/V writes"] == L, counts
    assert counts["ragged attention"] == counts["sampling"] == counts["FP8 scales"] == 0, counts
    assert counts["weight GEMMs"] >= 4 * L + 1 and counts["weight copies"] == 0, counts
    # FP8 weights: the activation quantization and the scale multiplies are their own category
    # (fp8_weights.SCALES_SCOPE), the GEMMs stay GEMMs.
    from examples.llama import fp8_weights
    fp8_params = fp8_weights.quantize_params(params)
    fp8_hlo = llama.decode_step.lower(fp8_params, state["k"], state["v"], *args,
                                      config=config).compile().as_text()
    fp8_counts = collections.Counter(hlo_categories(fp8_hlo).values())
    assert fp8_counts["FP8 scales"] >= 1 and fp8_counts["weight GEMMs"] >= 4 * L + 1, fp8_counts

    def step():
        logits, state["k"], state["v"] = llama.decode_step(params, state["k"], state["v"],
                                                           *args, config=config)
        logits.block_until_ready()

    step()
    row = step_breakdown(step, hlo, params, 3, 1e-3, COLUMNS)
    assert row["weight GEMMs"] > 0 and row["paged attention"] > 0 and row["K/V writes"] > 0, row


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["gpu"], indirect=True)
def test_decode_step_copies_no_weights_gpu(backend):
    """The bf16 decode step compiled for the GPU feeds its GEMMs the per-layer weight buffers
    as they are: no instruction materializes a layer's weight matrix (no slice, copy or
    transpose of weights, e.g. for a GEMM layout). Sizes where XLA picks library GEMMs."""
    from benchmarks.harness.device_profile import weight_copy_ops
    config = llama.LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1536,
                               num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                               head_dim=64, dtype="bfloat16")
    params = jax.device_put(llama.init_params(config), backend.device)
    kc, vc, args = decode_step_inputs(backend, config)
    hlo = llama.decode_step.lower(params, kc, vc, *args, config=config).compile().as_text()
    assert weight_copy_ops(hlo, params) == []
    stacked = llama.decode_step.lower(llama.stack_layers(params), kc, vc, *args,
                                      config=config).compile().as_text()
    print("weight-copy instructions with stacked layers under lax.scan:",
          len(weight_copy_ops(stacked, params)))
