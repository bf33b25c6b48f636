"""Tensor parallelism for the example Llama model: Megatron-style weight sharding over a mesh
axis ``"tp"``, the K/V pools split over KV heads (the manager's ``KVCacheConfig(mesh=...)``).

**Layout** (``n`` devices on the axis; ``H`` query heads, ``Hkv`` KV heads, ``I`` the MLP width):

- ``wqkv`` and ``bqkv`` are split by columns, ``w_gate_up`` by columns, ``wo`` and ``w_down`` by
  rows; ``lm_head`` by columns (vocabulary) when ``n`` divides it; embeddings and norms are
  replicated. ``wqkv`` is fused ``[wq | wk | wv]`` and ``w_gate_up`` ``[gate | up]``, so a plain
  contiguous column shard would not hold matching heads: :func:`shard_params` reorders the fused
  columns once, at load time, to ``[q_0 | k_0 | v_0 | q_1 | k_1 | v_1 | ...]`` (and
  ``[gate_0 | up_0 | gate_1 | ...]``), so column shard ``s`` is exactly the fused weight of a
  model with shard ``s``'s ``H/n`` query heads, ``Hkv/n`` KV heads and ``I/n`` MLP columns.
- **GQA with fewer KV heads than devices** (``Hkv < n``, ``n % Hkv == 0``): each KV head is
  replicated ``n / Hkv`` times (its ``wk``/``wv`` columns, biases and FP8 scales), giving a model
  with ``n`` KV heads that computes the same function: query head ``h`` reads new KV head
  ``h // (H/n)``, a copy of old head ``h // (H/Hkv)``. The pools then hold ``n`` KV heads, one
  per device (:func:`kv_heads`); the K/V memory per device is that of one head, the same as a
  model with ``Hkv = n``.
- The tied-embedding case gets its own column-split ``lm_head`` (``embed.T``) so the logits GEMM
  is split like the others (``V * D / n`` more bytes per device).

**The step** (:func:`forward_step`, :func:`decode_step`, same arguments as the model's, plus the
mesh) runs the whole decoder inside one ``jax.shard_map`` over the mesh: each device runs the
model's own layer code (``model._decoder``) on its local shard with a per-shard config
(:func:`local_config`), calling the plain ``write_kv`` / attention custom calls on its local pool
shard (the index buffers are replicated: a page id is the same page on every device). The O and
down projections give partial sums; the collectives are explicit, placed by hand rather than
left to GSPMD: one ``psum`` (all-reduce) after each of them, i.e. one per attention block and one
per MLP block (``2 L`` per step), and one ``all_gather`` of the column-split logits at the end.
``tests/runner/tp_worker.py`` checks the compiled HLO has exactly these collectives.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import model as llama

__all__ = ["AXIS", "make_mesh", "check_config", "kv_heads", "local_config", "shard_params",
           "param_specs", "forward_step", "decode_step", "collective_counts"]

AXIS = "tp"


def make_mesh(n: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh of the first ``n`` of ``devices`` (default ``jax.devices()``, every process's
    devices under ``jax.distributed``) with axis :data:`AXIS`."""
    devices = list(jax.devices() if devices is None else devices)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"tensor_parallel must be an integer >= 1, got {n!r}")
    if n > len(devices):
        raise ValueError(f"tensor_parallel {n} needs {n} devices; {len(devices)} visible "
                         f"({devices[0].platform})")
    return Mesh(np.asarray(devices[:n]), (AXIS,))


def check_config(config: llama.LlamaConfig, n: int) -> None:
    """Raises ``ValueError`` (naming the field) when ``config`` cannot be split over ``n``
    devices: ``H``, ``I`` divisible by ``n``; ``Hkv`` divisible by ``n`` or dividing it."""
    H, Hkv, I = (config.num_attention_heads, config.num_key_value_heads,
                 config.intermediate_size)
    if H % n:
        raise ValueError(f"num_attention_heads {H} must be divisible by tensor_parallel {n}")
    if I % n:
        raise ValueError(f"intermediate_size {I} must be divisible by tensor_parallel {n}")
    if Hkv % n and n % Hkv:
        raise ValueError(f"num_key_value_heads {Hkv} must be a multiple or a divisor of "
                         f"tensor_parallel {n}")


def kv_heads(config: llama.LlamaConfig, n: int) -> int:
    """KV heads the pools hold under ``n``-way TP: ``Hkv``, or ``n`` when ``Hkv < n`` (each head
    replicated ``n / Hkv`` times, see the module doc)."""
    check_config(config, n)
    return max(config.num_key_value_heads, n)


def local_config(config: llama.LlamaConfig, n: int) -> llama.LlamaConfig:
    """The config one shard's layer code runs with: ``H/n`` query heads, ``kv_heads/n`` KV
    heads, ``I/n`` MLP columns (the rest unchanged)."""
    return dataclasses.replace(config, num_attention_heads=config.num_attention_heads // n,
                               num_key_value_heads=kv_heads(config, n) // n,
                               intermediate_size=config.intermediate_size // n)


def _split_vocab(config: llama.LlamaConfig, n: int) -> bool:
    return config.vocab_size % n == 0


def param_specs(params: dict[str, Any], config: llama.LlamaConfig, n: int) -> dict[str, Any]:
    """The ``PartitionSpec`` of every leaf of :func:`shard_params`' output (same structure)."""
    col, row, rep = P(None, AXIS), P(AXIS, None), P()
    per_layer = {"attn_norm": rep, "mlp_norm": rep, "wqkv": col, "bqkv": P(AXIS), "wo": row,
                 "w_gate_up": col, "w_down": row, "q_norm": rep, "k_norm": rep}
    specs: dict[str, Any] = {
        "embed": rep, "norm": rep,
        "layers": [{name: per_layer[name] for name in lp} for lp in params["layers"]],
        "lm_head": col if _split_vocab(config, n) else rep,
    }
    if "kv_scales" in params:
        specs["kv_scales"] = {"k": col, "v": col}
    return specs


def _reorder_qkv(w: jax.Array, config: llama.LlamaConfig, n: int) -> jax.Array:
    """Fused q/k/v columns (last axis) ``[q | k | v]`` -> ``[q_0 | k_0 | v_0 | q_1 | ...]``, KV
    heads replicated up to :func:`kv_heads` first."""
    H, Hkv, Dh = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    lead = w.shape[:-1]
    q, k, v = jnp.split(w, [H * Dh, (H + Hkv) * Dh], axis=-1)
    rep = kv_heads(config, n) // Hkv
    if rep > 1:   # new KV head j is a copy of old head j // rep
        k, v = (jnp.repeat(x.reshape(*lead, Hkv, Dh), rep, axis=-2).reshape(*lead, -1)
                for x in (k, v))
    parts = [x.reshape(*lead, n, x.shape[-1] // n) for x in (q, k, v)]
    return jnp.concatenate(parts, axis=-1).reshape(*lead, -1)


def _reorder_gate_up(w: jax.Array, n: int) -> jax.Array:
    """``[gate | up]`` (last axis) -> ``[gate_0 | up_0 | gate_1 | up_1 | ...]``."""
    lead = w.shape[:-1]
    gate, up = jnp.split(w, 2, axis=-1)
    parts = [x.reshape(*lead, n, x.shape[-1] // n) for x in (gate, up)]
    return jnp.concatenate(parts, axis=-1).reshape(*lead, -1)


def shard_params(params: dict[str, Any], config: llama.LlamaConfig, mesh: Mesh) -> dict[str, Any]:
    """The model's params (``model.py``'s pytree, one dict per layer) reordered for TP and
    placed on ``mesh`` (see the module doc): fused columns reordered per shard, KV heads
    replicated when ``Hkv < n``, ``lm_head`` present (``embed.T`` for tied embeddings).
    Layer by layer, so at most one layer's reordered copy exists besides the input. Params
    that already came from this function for ``mesh`` (their ``wqkv`` split by columns on it)
    are returned as they are: reordering twice would scramble the heads."""
    n = int(mesh.shape[AXIS])
    check_config(config, n)
    if isinstance(params["layers"], dict):
        raise ValueError("params: stacked layers (stack_layers) are not supported with TP")
    specs = param_specs(params, config, n)
    wqkv = params["layers"][0]["wqkv"]
    if (isinstance(getattr(wqkv, "sharding", None), NamedSharding) and n > 1
            and wqkv.sharding.mesh == mesh
            and wqkv.sharding.is_equivalent_to(NamedSharding(mesh, P(None, AXIS)), 2)):
        return params

    def put(x, spec):
        return jax.device_put(x, NamedSharding(mesh, spec))

    layers = []
    for lp, sp in zip(params["layers"], specs["layers"]):
        out = {}
        for name, x in lp.items():
            if name in ("wqkv", "bqkv"):
                x = _reorder_qkv(x, config, n)
            elif name == "w_gate_up":
                x = _reorder_gate_up(x, n)
            out[name] = put(x, sp[name])
        layers.append(out)
    lm_head = params["embed"].T if config.tie_word_embeddings else params["lm_head"]
    out = {"embed": put(params["embed"], specs["embed"]), "norm": put(params["norm"], P()),
           "layers": layers, "lm_head": put(lm_head, specs["lm_head"])}
    if "kv_scales" in params:
        rep = kv_heads(config, n) // config.num_key_value_heads
        out["kv_scales"] = {name: put(jnp.repeat(a, rep, axis=1), specs["kv_scales"][name])
                            for name, a in params["kv_scales"].items()}
    return out


def _pool_spec() -> P:
    return P(None, None, None, AXIS, None)


def _run(params, k_cache, v_cache, tokens, positions, slot_mapping, page_table, rows, attend,
         *, config, rings, mesh, extra=()):
    """The decoder under one ``shard_map``: ``attend(*extra_local)`` builds the local
    ``attend`` of ``model._paged`` from the replicated ``extra`` operands; ``rows`` selects the
    hidden rows to produce logits for (replicated, or None for all). Returns ``(logits [N, V]
    float32 replicated, k_cache, v_cache)``."""
    n = int(mesh.shape[AXIS])
    local = local_config(config, n)
    split_vocab = _split_vocab(config, n)
    pspecs = param_specs(params, config, n)
    cache_specs = jax.tree_util.tree_map(lambda _: _pool_spec(), (k_cache, v_cache))

    with_rows = rows is not None

    def body(params, caches, tokens, positions, slot_mapping, page_table, *extra_):
        kc, vc = caches
        rows, extra_ = (extra_[0], extra_[1:]) if with_rows else (None, extra_)
        kv_attend = llama._paged(local, slot_mapping, page_table, rings, attend(*extra_),
                                 llama.kv_scales(params, local, kc))
        h, kc, vc = llama._decoder(params, local, kc, vc, tokens, positions, kv_attend,
                                   reduce=functools.partial(jax.lax.psum, axis_name=AXIS))
        if rows is not None:
            h = h[rows]
        x = llama.rms_norm(h, params["norm"], config.rms_norm_eps)
        logits = llama._mm(x, params["lm_head"]).astype(jnp.float32)
        if split_vocab:
            logits = jax.lax.all_gather(logits, AXIS, axis=1, tiled=True)
        return logits, (kc, vc)

    rep = P()
    extra = ((rows,) if with_rows else ()) + tuple(extra)
    in_specs = (pspecs, cache_specs, rep, rep, rep, rep, *(rep for _ in extra))
    # NOTE: check_vma=False: the custom calls have no varying-manual-axes rule; the specs are
    # exact (pools split over heads in and out; logits replicated after the all-gather, or
    # computed whole on every device when the vocabulary is not split).
    fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(rep, cache_specs),
                       check_vma=False)
    logits, (k_cache, v_cache) = fn(params, (k_cache, v_cache), tokens, positions, slot_mapping,
                                    page_table, *extra)
    return logits, k_cache, v_cache


@functools.partial(jax.jit, static_argnames=("config", "rings", "mesh"),
                   donate_argnames=("k_cache", "v_cache"))
def forward_step(params, k_cache, v_cache, tokens, positions, slot_mapping, page_table, seq_lens,
                 query_start, logits_index=None, *, config: llama.LlamaConfig,
                 rings: tuple[int, ...] | None = None, mesh: Mesh):
    """:func:`model.forward_step` over ``mesh``: ``params`` from :func:`shard_params`, pools
    ``[L, pages, page_size, kv_heads(config, n), Dh]`` split over heads (the manager's pools
    with ``KVCacheConfig(mesh=mesh)``), ``config`` the model's own (global) config; the other
    arguments and the result as there (logits replicated)."""
    if logits_index is None:
        logits_index = jnp.maximum(query_start[1:] - 1, 0)
    return _run(params, k_cache, v_cache, tokens, positions, slot_mapping, page_table,
                logits_index, llama.ragged_attend, config=config, rings=rings, mesh=mesh,
                extra=(seq_lens, query_start))


@functools.partial(jax.jit, static_argnames=("config", "rings", "mesh"),
                   donate_argnames=("k_cache", "v_cache"))
def decode_step(params, k_cache, v_cache, tokens, positions, slot_mapping, page_table, seq_lens,
                *, config: llama.LlamaConfig, rings: tuple[int, ...] | None = None, mesh: Mesh):
    """:func:`model.decode_step` over ``mesh`` (arguments as :func:`forward_step`)."""
    return _run(params, k_cache, v_cache, tokens, positions, slot_mapping, page_table, None,
                llama.decode_attend, config=config, rings=rings, mesh=mesh, extra=(seq_lens,))


def collective_counts(hlo_text: str) -> dict[str, int]:
    """Collective ops in a compiled HLO module's text (``jitted.lower(...).compile().as_text()``):
    ``{"all-reduce": k, "all-gather": k, ...}`` counting each op once (an async pair
    ``*-start``/``*-done`` counts as one)."""
    counts: dict[str, int] = {}
    for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
               "collective-permute"):
        plain = hlo_text.count(f" {op}(")
        started = hlo_text.count(f" {op}-start(")
        counts[op] = plain + started
    return counts
