"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) in plain JAX over a params pytree,
attending through jax_kvcm's paged custom calls.

Params pytree (weights stored ``[in, out]``, i.e. transposed from HF's ``[out, in]``; one dict per
layer, so every layer's weights are their own buffers)::

    {"embed": [V, D],
     "layers": [{"attn_norm": [D], "wqkv": [D, (H + 2*Hkv)*Dh], "wo": [H*Dh, D],
                 "mlp_norm": [D], "w_gate_up": [D, 2*I], "w_down": [I, D]}, ...],   # L dicts
     "norm": [D],
     "lm_head": [D, V],          # absent when config.tie_word_embeddings (embed.T is used)
     "kv_scales": {"k": [L, Hkv], "v": [L, Hkv]}}   # optional, float32: FP8 K/V scales

The four linear weights may instead be ``fp8_weights.Fp8Weight`` (FP8 values ``[out, in]`` with
float32 scales; ``--quantize fp8`` or an FP8 checkpoint): :func:`_mm` runs them as FP8 GEMMs.

``wqkv`` is ``[wq | wk | wv]`` and ``w_gate_up`` is ``[w_gate | w_up]`` along the output axis: one
GEMM each instead of three and two. Qwen2 layers add ``"bqkv": [(H + 2*Hkv)*Dh]`` (the q/k/v
projection biases, fused like ``wqkv``); Qwen3 layers add ``"q_norm": [Dh], "k_norm": [Dh]`` (an
RMSNorm over each head's q and k, before RoPE). The layer loop is a Python loop (unrolled at trace
time), so XLA sees L separate weight buffers and feeds each GEMM its weights as they are.
(Stacking the layers along a leading axis and running ``lax.scan`` makes every step slice each
layer's weights out of the stack: a copy of all the weights per step, which at batch 64 cost about
as much as the rest of the step; :func:`stack_layers` builds that layout, kept for comparison in
``benchmarks/bench_decode_step.py``.)

KV caches are ``[L, num_pages, page_size, Hkv, Dh]`` in the params' dtype; page 0 is the null page.
The caches keep their layer axis (they are the manager's pools) and the ops take a static
``layer=`` index; ``write_kv`` aliases its outputs to the donated caches, so K/V are written in
place.

**Layer groups.** Layers attend either to everything (``"full_attention"``) or to a sliding window
(``"sliding_attention"``), per HF's ``config.layer_types``; :meth:`LlamaConfig.kv_groups` groups
the layers by kind (full layers first, then the window layers), one KV pool per group (the
manager's layer groups). With one group (Llama, Mistral, most Qwen2/3 checkpoints) the caches are
one ``[L, ...]`` pair and the tables ``[B, P]`` / ``[T]``; with ``G`` groups the caches are tuples
of ``G`` pools ``[L_g, ...]``, ``page_table`` is ``[G, B, P]`` and ``slot_mapping`` ``[G, T]`` (the
manager's ``StepBatch``), and layer ``l`` writes and reads its group's pool at its index within the
group. The steps' static ``rings`` argument says, per group, whether its table is a ring
(``KVCacheConfig(ring_tables=True)``): ``rings[g] = R > 0`` reads ``page_table[g, :, :R]`` with
``ring_table=True``; 0 reads the whole absolute row.

FP8 K/V: caches in ``float8_e4m3fn`` (``make_caches(..., kv_dtype=jnp.float8_e4m3fn)``, or the
manager's pools with ``LayerGroupConfig(kv_dtype=...)``) store ``saturate(k / k_scale)``; the step
sees the cache dtype at trace time and passes ``params["kv_scales"]`` (float32 ``[L, Hkv]`` over the model's layers,
from the checkpoint: see ``loader.py``; each group's pool gets the rows of its layers) to ``write_kv`` and the attention op, or 1.0 everywhere when the
params have none. Caches in the compute dtype ignore ``kv_scales`` (the bf16 program is unchanged).

Every step (prefill chunks, mixed prefill+decode batches, pure decode) goes through
:func:`forward_step`: ``write_kv`` of the new tokens' K/V, then ``ragged_paged_attention``.
:func:`decode_step` is the one-token-per-sequence form that uses ``paged_attention``.
Both are jitted with the caches donated (written in place); ``config`` is a static argument
(:func:`bind` fixes it). Shapes (tokens T, batch B, page-table width P) are part of the compiled
program: callers bucket them. Both produce logits only for the last new token of each sequence
(the lm_head GEMM is ``[B, D] x [D, V]``, not ``[T, D] x [D, V]``), and :func:`sample_tokens`
samples on the device (greedy, or temperature/top-p with a fixed per-request key).

HF conventions followed (checked against transformers in tests/runner/test_llama_model.py): RoPE with
``rotate_half`` over ``cat(freqs, freqs)`` (the HF checkpoint layout, q/k already permuted),
"llama3" / "linear" inverse-frequency scaling, RMSNorm in float32 then cast back before the weight,
SwiGLU ``down(silu(gate(x)) * up(x))``, GQA head ``h`` -> kv head ``h // (H // Hkv)``, scale
``Dh ** -0.5``, and the sliding window W of Mistral and Qwen2/3 = the last W positions including
the query (transformers' ``sliding_window_overlay``: ``kv_idx > q_idx - W``; its sliding cache
keeps ``W - 1`` past tokens plus the new one), the ops' own convention. Matmuls use
``Precision.HIGHEST`` for float32 models (float32 stays float32 on GPUs: no TF32) and the default
precision for bf16/f16 ones.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_kvcm

from . import fp8_weights
from .config import LlamaConfig

__all__ = ["LlamaConfig", "init_params", "init_scales", "make_caches", "kv_scales", "forward_step",
           "decode_step", "with_xla_options", "bind", "rope_inv_freq", "param_shapes", "sample_tokens",
           "greedy_tokens", "stack_layers"]


def param_shapes(config: LlamaConfig) -> dict[str, Any]:
    """The params pytree's shapes (same structure as :func:`init_params`)."""
    c = config
    D, I, V = c.hidden_size, c.intermediate_size, c.vocab_size
    q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = {"attn_norm": (D,), "wqkv": (D, q_dim + 2 * kv_dim), "wo": (q_dim, D),
             "mlp_norm": (D,), "w_gate_up": (D, 2 * I), "w_down": (I, D)}
    if c.qkv_bias:
        layer["bqkv"] = (q_dim + 2 * kv_dim,)
    if c.qk_norm:
        layer["q_norm"] = layer["k_norm"] = (c.head_dim,)
    shapes = {
        "embed": (V, D),
        "layers": [dict(layer) for _ in range(c.num_hidden_layers)],
        "norm": (D,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (D, V)
    return shapes


def stack_layers(params: dict[str, Any]) -> dict[str, Any]:
    """The same params with the layers stacked: ``"layers"`` becomes one dict of ``[L, ...]``
    arrays, which :func:`forward_step` / :func:`decode_step` run under ``lax.scan`` (the layout
    that copies each layer's weights out of the stack every step; for comparison only)."""
    layers = params["layers"]
    stacked = {name: jax.tree.map(lambda *xs: jnp.stack(xs), *[lp[name] for lp in layers])
               for name in layers[0]}   # (a tree map: FP8 weights are pytrees)
    return {**params, "layers": stacked}


def init_scales(config: LlamaConfig) -> tuple[float, float]:
    """``(embedding std, gain)`` for random weights; a linear layer with fan-in ``n`` gets std
    ``gain / sqrt(n)``. HF's default (std 0.02 everywhere) gives near-uniform logits and
    generations that repeat one token; these give varied greedy generations. Tied embeddings
    need smaller embeddings and larger layers (else each token's own logit dominates)."""
    return (0.5, 1.5) if config.tie_word_embeddings else (1.0, 0.6)


def init_params(config: LlamaConfig, seed: int = 0, *, on_device: bool = False) -> dict[str, Any]:
    """Deterministic random params (norm weights ``1 + 0.1 N(0,1)``, scales from
    :func:`init_scales`).

    Default: numpy RNG on the host (same values on every backend). ``on_device=True`` draws with
    ``jax.random`` directly in the model dtype on the default device (fast for large models such
    as an 8B-shaped benchmark; different values from the host path).
    """
    dtype = config.jnp_dtype
    embed_std, gain = init_scales(config)
    rng = np.random.default_rng(seed)
    key = jax.random.PRNGKey(seed)

    def std_of(name, shape):
        if name.endswith("norm"):
            return None
        if name == "bqkv":
            return gain / math.sqrt(config.hidden_size)
        return embed_std if name == "embed" else gain / math.sqrt(shape[-2])

    def make(path, shape):
        nonlocal key
        name = path[-1].key
        std = std_of(name, shape)
        if on_device:
            key, sub = jax.random.split(key)
            noise = jax.random.normal(sub, shape, dtype)
            return (1 + 0.1 * noise) if std is None else (std * noise).astype(dtype)
        w = rng.standard_normal(shape, dtype=np.float32)
        w = 1.0 + 0.1 * w if std is None else std * w
        return jnp.asarray(w, dtype)

    return jax.tree_util.tree_map_with_path(
        make, param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))


def make_caches(config: LlamaConfig, num_pages: int, page_size: int, *, kv_dtype: Any = None):
    """Zeroed ``(k_cache, v_cache)`` ``[L, num_pages, page_size, Hkv, Dh]`` in ``kv_dtype`` (None:
    the model dtype; ``jnp.float8_e4m3fn`` for FP8 K/V); with several
    :meth:`LlamaConfig.kv_groups`, tuples of one ``[L_g, ...]`` pool per group."""
    dtype = config.jnp_dtype if kv_dtype is None else kv_dtype

    def pools(num_layers):
        shape = (num_layers, num_pages, page_size, config.num_key_value_heads, config.head_dim)
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)

    groups = config.kv_groups()
    if len(groups) == 1:
        return pools(config.num_hidden_layers)
    k, v = zip(*(pools(len(layers)) for _, layers in groups))
    return tuple(k), tuple(v)


def kv_scales(params, config: LlamaConfig, k_cache) -> dict[str, jax.Array]:
    """The ops' ``k_scale`` / ``v_scale`` keyword arguments (float32 ``[L, Hkv]``, rows in the
    model's layer order) for caches in ``float8_e4m3fn``: ``params["kv_scales"]`` when present,
    else 1.0; ``{}`` for caches in any other dtype (they take no scales). ``k_cache``: one pool
    or a tuple of per-group pools."""
    first = k_cache[0] if isinstance(k_cache, tuple) else k_cache
    if first.dtype != jnp.float8_e4m3fn:
        return {}
    scales = params.get("kv_scales")
    if scales is None:
        ones = jnp.ones((config.num_hidden_layers, config.num_key_value_heads), jnp.float32)
        return {"k_scale": ones, "v_scale": ones}
    return {"k_scale": scales["k"], "v_scale": scales["v"]}


# ---------------------------------------------------------------------------------------------
# Building blocks.


def rope_inv_freq(config: LlamaConfig) -> np.ndarray:
    """RoPE inverse frequencies [Dh/2] (float32), with "linear" / "llama3" scaling as in HF."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if config.rope_type == "linear":
        inv_freq = inv_freq / config.rope_factor
    elif config.rope_type == "llama3":
        factor = config.rope_factor
        low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
        old_len = config.rope_original_max_position_embeddings
        low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """``(cos, sin)`` ``[T, 1, Dh]`` float32 over ``cat(freqs, freqs)`` (HF's layout)."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, Dh/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """HF convention: ``x * cos + rotate_half(x) * sin`` with ``rotate_half([a, b]) = [-b, a]``.
    x [T, heads, Dh]; cos/sin from :func:`rope_tables`, cast to x's dtype (as HF does)."""
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF LlamaRMSNorm: normalize in float32, cast back, then scale by the weight."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def _mm(x, w):
    if isinstance(w, fp8_weights.Fp8Weight):  # FP8 weights: an FP8 GEMM, scales after it
        return fp8_weights.fp8_matmul(x, w)
    # HIGHEST keeps float32 models out of TF32; bf16/f16 products are exact in the default
    # precision already (f32 accumulation), and HIGHEST could only cost there.
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return jnp.matmul(x, w, precision=precision)


def _layer(lp, config: LlamaConfig, h, cos, sin, k_cache, v_cache, layer, kv_attend,
           reduce=None):
    """One decoder layer on ``h [T, D]``; ``lp`` is the layer's weights (see the module doc).
    ``reduce`` (None: identity) is applied to the O and down projections' outputs before the
    residual adds: under tensor parallelism (``tp.py``) each shard's product is a partial sum
    and ``reduce`` is the block's all-reduce."""
    reduce = reduce or (lambda x: x)
    c = config
    T = h.shape[0]
    H, Hkv, Dh, I = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size
    x = rms_norm(h, lp["attn_norm"], c.rms_norm_eps)
    qkv = _mm(x, lp["wqkv"])                                  # [T, (H + 2 Hkv) Dh]
    if c.qkv_bias:                                            # Qwen2
        qkv = qkv + lp["bqkv"]
    q = qkv[:, :H * Dh].reshape(T, H, Dh)
    k = qkv[:, H * Dh:(H + Hkv) * Dh].reshape(T, Hkv, Dh)
    v = qkv[:, (H + Hkv) * Dh:].reshape(T, Hkv, Dh)
    if c.qk_norm:                                             # Qwen3
        q = rms_norm(q, lp["q_norm"], c.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], c.rms_norm_eps)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    o, k_cache, v_cache = kv_attend(q, k, v, k_cache, v_cache, layer)
    h = h + reduce(_mm(o.reshape(T, H * Dh), lp["wo"]))
    x = rms_norm(h, lp["mlp_norm"], c.rms_norm_eps)
    gate_up = _mm(x, lp["w_gate_up"])                         # [T, 2 I]
    h = h + reduce(_mm(jax.nn.silu(gate_up[:, :I]) * gate_up[:, I:], lp["w_down"]))
    return h, k_cache, v_cache


def _decoder(params, config: LlamaConfig, k_cache, v_cache, tokens, positions, kv_attend,
             reduce=None):
    """Embeds ``tokens``, runs every layer, returns ``(h, k_cache, v_cache)``.

    ``kv_attend(q, k, v, k_cache, v_cache, layer) -> (o, k_cache, v_cache)`` stores the layer's
    new K/V (``[T, Hkv, Dh]``, RoPE applied) and attends (:func:`_paged`: ``write_kv`` then a
    paged op; ``benchmarks/harness/dense_llama.py`` plugs a dense per-sequence cache in here).
    ``layer`` is a Python int (a traced one under :func:`stack_layers`' scan). ``reduce``: see
    :func:`_layer`."""
    cos, sin = rope_tables(positions, rope_inv_freq(config))  # once per step, shared by layers
    h = params["embed"][tokens]  # [T, D]
    layers = params["layers"]
    if isinstance(layers, dict):  # stacked weights (stack_layers): one lax.scan, for comparison
        if len(config.kv_groups()) > 1:
            raise ValueError("stacked layers need one KV group (all layers of one kind)")
        def body(carry, xs):
            h, kc, vc = carry
            lp, layer = xs
            return _layer(lp, config, h, cos, sin, kc, vc, layer, kv_attend, reduce), None

        ids = jnp.arange(config.num_hidden_layers, dtype=jnp.int32)
        (h, k_cache, v_cache), _ = jax.lax.scan(body, (h, k_cache, v_cache), (layers, ids))
        return h, k_cache, v_cache
    for layer, lp in enumerate(layers):  # NOTE: unrolled: each layer reads its own buffers
        h, k_cache, v_cache = _layer(lp, config, h, cos, sin, k_cache, v_cache, layer, kv_attend,
                                     reduce)
    return h, k_cache, v_cache


def _paged(config: LlamaConfig, slot_mapping, page_table, rings, attend, scales):
    """``kv_attend`` for :func:`_decoder` over the paged pools of :meth:`LlamaConfig.kv_groups`:
    layer ``l`` of group ``g`` (the ``i``-th layer there) does ``write_kv`` into pool ``g`` at
    ``slot_mapping[g]``, then ``attend(q, k_pool, v_pool, table, i, window, ring, scales)`` (a
    paged op) with group ``g``'s table, window and FP8 scales (see the module doc for the shapes
    and ``rings``; ``scales``: :func:`kv_scales`, ``{}`` unless the caches are fp8)."""
    groups = config.kv_groups()
    rings = rings or (0,) * len(groups)
    if len(rings) != len(groups):
        raise ValueError(f"rings must have one entry per KV group ({len(groups)}), got {rings}")

    def table(g):
        t = page_table if len(groups) == 1 else page_table[g]
        return t[:, :rings[g]] if rings[g] else t

    if len(groups) == 1:  # one pool: the layer index is the pool's (a traced one under scan)
        def kv_attend(q, k, v, kc, vc, layer):
            kc, vc = jax_kvcm.write_kv(kc, vc, k, v, slot_mapping, layer=layer, **scales)
            return attend(q, kc, vc, table(0), layer, groups[0][0], rings[0] > 0, scales), kc, vc
        return kv_attend

    where = {layer: (g, i) for g, (_, layers) in enumerate(groups)
             for i, layer in enumerate(layers)}
    group_scales = [{name: a[np.asarray(layers)] for name, a in scales.items()}
                    for _, layers in groups]

    def kv_attend_grouped(q, k, v, kcs, vcs, layer):
        g, i = where[layer]
        kc, vc = jax_kvcm.write_kv(kcs[g], vcs[g], k, v, slot_mapping[g], layer=i,
                                   **group_scales[g])
        o = attend(q, kc, vc, table(g), i, groups[g][0], rings[g] > 0, group_scales[g])
        return o, kcs[:g] + (kc,) + kcs[g + 1:], vcs[:g] + (vc,) + vcs[g + 1:]
    return kv_attend_grouped


def ragged_attend(seq_lens, query_start):
    """The ``attend`` of :func:`_paged` for ragged steps (``ragged_paged_attention``)."""
    def attend(q, kc, vc, table, layer, window, ring, scales):
        return jax_kvcm.ragged_paged_attention(q, kc, vc, table, seq_lens, query_start,
                                               layer=layer, sliding_window=window,
                                               ring_table=ring, **scales)
    return attend


def decode_attend(seq_lens):
    """The ``attend`` of :func:`_paged` for one-token-per-row steps (``paged_attention``)."""
    def attend(q, kc, vc, table, layer, window, ring, scales):
        return jax_kvcm.paged_attention(q, kc, vc, table, seq_lens, layer=layer,
                                        sliding_window=window, ring_table=ring, **scales)
    return attend


def cascade_attend(cascade):
    """The ``attend`` of :func:`_paged` for decode steps that read shared prefixes once per
    group (``cascade_paged_attention`` with the step's :class:`jax_kvcm.CascadeBatch`)."""
    def attend(q, kc, vc, table, layer, window, ring, scales):
        del table  # the cascade's prefix and suffix tables replace it
        if window is not None or ring:
            raise ValueError("cascade attention needs full attention (no sliding window, no "
                             "ring table)")
        return jax_kvcm.cascade_paged_attention(q, kc, vc, cascade, layer=layer, **scales)
    return attend


def _logits(params, config: LlamaConfig, h):
    x = rms_norm(h, params["norm"], config.rms_norm_eps)
    if config.tie_word_embeddings:
        out = _mm(x, params["embed"].T)
    else:
        out = _mm(x, params["lm_head"])
    return out.astype(jnp.float32)


# forward_step's and decode_step's jit arguments (the caches donated: updated in place).
_STEP_JIT = dict(static_argnames=("config", "rings"), donate_argnames=("k_cache", "v_cache"))


@functools.partial(jax.jit, **_STEP_JIT)
def forward_step(params, k_cache, v_cache, tokens, positions, slot_mapping, page_table, seq_lens,
                 query_start, logits_index=None, *, config: LlamaConfig,
                 rings: tuple[int, ...] | None = None):
    """One ragged step (prefill chunks, decode tokens, or a mix) for a batch of sequences.

    Args:
      tokens, positions, slot_mapping: int32 ``[T]``: the new tokens packed by sequence;
        sequence ``b`` owns rows ``query_start[b]:query_start[b+1]``, its positions are the last
        ``query_start[b+1]-query_start[b]`` of ``seq_lens[b]``. Padding rows (at or past
        ``query_start[B]``) have slot ``-1`` (not written) and any token/position.
      page_table: int32 ``[B, P]`` (padding -> null page 0); seq_lens: int32 ``[B]`` (0 = padded
        row), counting the new tokens; query_start: int32 ``[B+1]``.
      logits_index: int32 ``[N]``: rows of ``tokens`` to produce logits for; None (default):
        ``query_start[1:] - 1``, the last new token of each sequence (``N = B``; a padded row
        gets the last real token's logits); ``arange(T)`` for all.
      rings: per KV group, its ring-table width or 0 (absolute table); None: all absolute. With
        several groups the caches are tuples, ``slot_mapping`` ``[G, T]`` and ``page_table``
        ``[G, B, P]`` (see the module doc).

    Returns:
      ``(logits [N, vocab] float32, k_cache, v_cache)``; the caches are donated (updated in
      place).
    """
    h, k_cache, v_cache = _decoder(
        params, config, k_cache, v_cache, tokens, positions,
        _paged(config, slot_mapping, page_table, rings, ragged_attend(seq_lens, query_start),
               kv_scales(params, config, k_cache)))
    if logits_index is None:
        logits_index = jnp.maximum(query_start[1:] - 1, 0)
    return _logits(params, config, h[logits_index]), k_cache, v_cache


@functools.partial(jax.jit, **_STEP_JIT)
def decode_step(params, k_cache, v_cache, tokens, positions, slot_mapping, page_table, seq_lens,
                cascade=None, *, config: LlamaConfig, rings: tuple[int, ...] | None = None):
    """Pure decode: one new token per sequence (``tokens [B]`` at ``positions = seq_lens - 1``),
    attention by ``paged_attention``. Padded rows: ``seq_lens[b] = 0`` and ``slot_mapping[b] = -1``
    (``[..., b]`` with several KV groups; ``rings`` as in :func:`forward_step`).

    ``cascade``: None, or the step's :class:`jax_kvcm.CascadeBatch` (``jax_kvcm.plan_cascade``
    of ``page_table`` and ``seq_lens``): attention by ``cascade_paged_attention``, which reads
    each shared prefix once per group. One KV group of full attention only.

    Returns ``(logits [B, vocab] float32, k_cache, v_cache)`` (caches donated).
    """
    if cascade is not None and len(config.kv_groups()) != 1:
        raise ValueError("cascade attention needs one KV group (a model without sliding-window "
                         "layers)")
    attend = decode_attend(seq_lens) if cascade is None else cascade_attend(cascade)
    h, k_cache, v_cache = _decoder(
        params, config, k_cache, v_cache, tokens, positions,
        _paged(config, slot_mapping, page_table, rings, attend,
               kv_scales(params, config, k_cache)))
    return _logits(params, config, h), k_cache, v_cache


def with_xla_options(step, xla_options: tuple[tuple[str, Any], ...]):
    """``step`` (:func:`forward_step` or :func:`decode_step`) jitted again with these XLA
    compiler options (e.g. ``examples.llama.step.FP8_WEIGHTS_XLA_OPTIONS``); ``step`` itself
    when there are none."""
    if not xla_options:
        return step
    return jax.jit(step.__wrapped__, **_STEP_JIT, compiler_options=dict(xla_options))


def bind(config: LlamaConfig):
    """``(forward_step, decode_step)`` with ``config`` bound (still jitted, caches donated)."""
    return (functools.partial(forward_step, config=config),
            functools.partial(decode_step, config=config))


# ---------------------------------------------------------------------------------------------
# Sampling on the device.


def _sample_row(logits, temperature, top_p, seed, stream, counter):
    greedy = jnp.argmax(logits).astype(jnp.int32)
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), stream), counter)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled)
    sorted_logits = scaled[order]
    probs = jax.nn.softmax(sorted_logits)
    before = jnp.cumsum(probs) - probs           # mass strictly before each token
    keep_sorted = before < top_p                 # always keeps the most likely token
    keep = jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)
    masked = jnp.where(keep, scaled, -jnp.inf)
    sampled = jax.random.categorical(key, masked).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


@jax.jit
def sample_tokens(logits, temperature, top_p, seed, stream, counter):
    """Next tokens ``[B]`` int32 from ``logits [B, V]``; per row temperature (0: argmax), top-p,
    seed, stream and counter (the key is ``fold_in(fold_in(PRNGKey(seed), stream), counter)``,
    so a row's sample depends only on its own logits and these numbers: reproducible whatever
    the batch)."""
    return jax.vmap(_sample_row)(logits, temperature, top_p, seed, stream, counter)


@jax.jit
def greedy_tokens(logits):
    """``argmax`` per row: :func:`sample_tokens` when every temperature is 0, without its sort
    over the vocabulary (a full-vocabulary argsort per row costs milliseconds at batch 256)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
