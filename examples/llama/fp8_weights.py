"""FP8 (``float8_e4m3fn``) weights for the example Llama model: quantize, dequantize, the FP8
matmul and the checkpoint's scale tensors.

**What is quantized.** The four linear weights of every layer (``wqkv``, ``wo``, ``w_gate_up``,
``w_down``: ~97% of an 8B model's layer bytes). The embedding, ``lm_head`` and the norms stay in
the model dtype (as ModelOpt and llm-compressor exports leave them). A quantized weight is a
:class:`Fp8Weight` in the same slot of the params pytree, so ``model.stack_layers``, ``jax.jit``
and ``jax.device_put`` see an ordinary pytree; ``model._mm`` dispatches on it.

**Layout.** ``values`` is ``[out, in]`` (HF's layout, the transpose of the bf16 params' ``[in,
out]``). cuBLASLt's FP8 GEMMs take only the "TN" layout (both operands K-major), so XLA's GEMM
rewriter transposes a ``[in, out]`` FP8 right operand before the call: a copy of every weight in
every step. Stored ``[out, in]`` and contracted on its last axis (``dot_general`` with
``rhs_contracting_dims=(1,)``) it goes to the GEMM as it is.

**Scales** (float32, ``x_real = float32(x_fp8) * scale``):

- weights: one per output channel, ``scale [out]``. A per-tensor scale (a ModelOpt export, or
  ``--quantize fp8-tensor``) is that vector with one value; fused q/k/v (gate/up) with one scale
  each become a vector with three (two) values, exactly, with no requantization.
- activations: with the checkpoint's static ``input_scale`` (a scalar per linear; for fused
  q/k/v the largest of the three, as vLLM does), ``x / input_scale``; without one, dynamically
  per token (row): ``scale[t] = max|x[t]| / 448``. Per token rather than per tensor keeps a
  request's logits independent of what else is in its batch (the runner's sampling promises
  that). :func:`calibrate_input_scales` makes static scales for a model quantized at load: the
  per-token max before every GEMM goes, which on an H100 took the 8B decode step at 864 rows
  from 27.3 to 25.0 ms.

**The GEMM** (:func:`fp8_matmul`): ``dot_general(x_fp8, w_fp8, preferred_element_type=the
compute dtype)``, then ``out * x_scale[:, None] * w_scale[None, :]`` in float32, cast back. XLA's
GPU compiler (``gemm_rewriter``, Ada/Hopper, CUDA >= 12) can rewrite a ``dot`` of two FP8
operands into the cuBLASLt custom call ``__cublas$lt$matmul$f8`` (FP8 tensor cores, 1 byte per
weight read), but not always: on an H100 (jax 0.11.2) 4-6 of the 8B decode step's 8 linear
GEMMs were, by autotuning (docs/fp8.md). The scale multiply is an elementwise op that XLA fuses
with the GEMM's consumer. On the CPU the same program runs with FP8 values upcast (exact
products, float32 sums): the reference.

**Which weight scale by default.** ``--quantize fp8`` is per channel: each output channel gets its
own range (an outlier channel does not coarsen the others' rounding), and since the scales are
applied outside the GEMM a vector costs the same as a scalar. ``fp8-tensor`` (one scale per
weight) is there for comparison with per-tensor exports.

``python -m examples.llama.fp8_weights`` reports per-layer output errors of an 8B-shaped random
model (see :func:`main`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Fp8Weight", "FP8", "FP8_MAX", "QUANTIZE_CHOICES", "QUANTIZED_WEIGHTS", "SCALES_SCOPE",
           "quantize_weight", "quantize_params", "quantize_on_device", "compact_on_device",
           "dequantize", "fp8_matmul",
           "quantize_activation", "from_checkpoint_parts", "has_fp8_weights", "layer_errors",
           "calibrate_input_scales"]

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0          # float8_e4m3fn's largest finite value
# --quantize value -> weight scale granularity.
QUANTIZE_CHOICES = {"fp8": "channel", "fp8-tensor": "tensor"}
# The params' per-layer weights that are quantized (the linear layers).
QUANTIZED_WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down")
_TINY = float(np.finfo(np.float32).tiny)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """One FP8 linear weight: ``values [out, in]`` float8_e4m3fn, ``scale [out]`` float32,
    ``input_scale`` float32 ``[]`` (a static activation scale) or None (dynamic per token).
    Stacked by ``model.stack_layers``, each field gains a leading ``[L]`` axis."""

    values: jax.Array
    scale: jax.Array
    input_scale: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the weight it replaces (``[in, out]``, leading axes kept)."""
        *lead, out, inp = self.values.shape
        return (*lead, inp, out)


def has_fp8_weights(params: Any) -> bool:
    """Whether any leaf of ``params`` is an :class:`Fp8Weight`."""
    return any(isinstance(x, Fp8Weight) for x in jax.tree_util.tree_leaves(
        params, is_leaf=lambda x: isinstance(x, Fp8Weight)))


def _saturate(x: jax.Array) -> jax.Array:
    """float32 -> float8_e4m3fn, clamped to +-448 (a plain cast makes out-of-range values NaN)."""
    return jnp.clip(x, -FP8_MAX, FP8_MAX).astype(FP8)


@functools.partial(jax.jit, static_argnames="scaling")
def quantize_weight(w: jax.Array, scaling: str = "channel") -> Fp8Weight:
    """``w [in, out]`` (the model's layout) -> :class:`Fp8Weight` with ``values [out, in]``;
    ``scaling``: ``"channel"`` (one scale per output channel, the default) or ``"tensor"``."""
    if scaling not in ("channel", "tensor"):
        raise ValueError(f"scaling must be 'channel' or 'tensor', got {scaling!r}")
    if w.ndim != 2:
        raise ValueError(f"quantize_weight takes one [in, out] weight, got shape {w.shape}")
    wt = jnp.asarray(w).T.astype(jnp.float32)                          # [out, in]
    amax = jnp.max(jnp.abs(wt), axis=1)                                 # [out]
    if scaling == "tensor":
        amax = jnp.broadcast_to(jnp.max(amax), amax.shape)
    scale = jnp.maximum(amax / FP8_MAX, _TINY)   # (tiny / 448 is subnormal: flushed to 0)
    return Fp8Weight(_saturate(wt / scale[:, None]), scale)


def dequantize(w: Fp8Weight) -> jax.Array:
    """The float32 ``[in, out]`` weight ``w`` stands for (the reference of its GEMM)."""
    return (w.values.astype(jnp.float32) * w.scale[..., :, None]).swapaxes(-1, -2)


def quantize_params(params: dict[str, Any], scaling: str = "channel", *,
                    free_source: bool = False) -> dict[str, Any]:
    """``params`` (``model.py``'s pytree, one dict per layer) with each layer's
    :data:`QUANTIZED_WEIGHTS` as :class:`Fp8Weight` (weights already in FP8 kept as they are);
    embeddings, ``lm_head`` and norms unchanged. ``free_source``: the caller gives ``params``
    up, and each bf16 weight is deleted as soon as its FP8 copy is made (the device's peak stays
    near the bf16 size instead of bf16 + FP8)."""
    layers = params["layers"]
    if not isinstance(layers, list):
        raise ValueError("quantize_params takes one dict per layer (quantize before "
                         "model.stack_layers)")
    out = []
    for lp in layers:
        lp = dict(lp)
        for name in QUANTIZED_WEIGHTS:
            if not isinstance(lp[name], Fp8Weight):
                source = lp[name]
                lp[name] = jax.block_until_ready(quantize_weight(source, scaling))
                if free_source and isinstance(source, jax.Array):
                    source.delete()
        out.append(lp)
    return {**params, "layers": out}


def compact_on_device(params: Any) -> Any:
    """``params`` moved to the host and back, so that their device memory is one run at the
    bottom of the allocator's region. Quantizing on the device frees each bf16 weight between
    the FP8 ones it made; the holes add up to gigabytes that a K/V pool (one contiguous
    allocation) cannot use. On an H100 an 8B model quantized this way left its 32 GiB free in two
    pieces of 12 and 20 GiB, and the 28 GiB FP8 pool of a run sized to the free bytes failed
    (RESOURCE_EXHAUSTED). Takes ownership: the given arrays are deleted. Each leaf keeps its
    sharding."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    shardings = [x.sharding for x in leaves]
    host = jax.device_get(leaves)
    for x in leaves:
        x.delete()
    return jax.tree_util.tree_unflatten(
        treedef, [jax.device_put(h, s) for h, s in zip(host, shardings)])


def quantize_on_device(params: dict[str, Any], scaling: str = "channel") -> dict[str, Any]:
    """:func:`quantize_params` for a serving process: takes ownership of ``params`` (each bf16
    weight freed as its FP8 copy is made), then :func:`compact_on_device`, so that the K/V
    pools allocated next find the free memory in one piece. Without both, an 8B model quantized
    on an H100 left 62.7 GiB free with a largest block of 48.7 GiB (the bf16 weights, still
    referenced by the caller while the FP8 copies were compacted, were freed above them), and
    the second 28.18 GiB pool of a run sized to the free bytes failed."""
    return compact_on_device(quantize_params(params, scaling, free_source=True))


# The name scope of the activation quantization and the scale multiplies, so that a profile can
# tell their time from the GEMMs' (benchmarks/harness/device_profile.py: "FP8 scales").
SCALES_SCOPE = "fp8_scales"


def quantize_activation(x: jax.Array, input_scale: jax.Array | None):
    """``(x_fp8 [T, K], scale)``: ``scale`` is ``input_scale`` (static) or ``[T, 1]``
    ``max|x[t]| / 448`` (dynamic per token); both float32, ``x = x_fp8 * scale``."""
    with jax.named_scope(SCALES_SCOPE):
        xf = x.astype(jnp.float32)
        if input_scale is None:
            scale = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / FP8_MAX, _TINY)
        else:
            scale = input_scale.astype(jnp.float32)
        return _saturate(xf / scale), scale


def fp8_matmul(x: jax.Array, w: Fp8Weight) -> jax.Array:
    """``x [T, in] @ w`` -> ``[T, out]`` in ``x``'s dtype: both operands in FP8, the GEMM
    accumulating in float32 and writing the compute dtype, the scales applied after (see the
    module doc for the pattern XLA rewrites to cuBLASLt)."""
    if _observed is not None:    # calibrate_input_scales: eager, so x is concrete here
        _observed[id(w)] = max(_observed.get(id(w), 0.0), float(jnp.max(jnp.abs(x))))
    xq, x_scale = quantize_activation(x, w.input_scale)
    out = jax.lax.dot_general(xq, w.values, (((x.ndim - 1,), (1,)), ((), ())),
                              preferred_element_type=x.dtype)
    with jax.named_scope(SCALES_SCOPE):
        return (out.astype(jnp.float32) * x_scale * w.scale).astype(x.dtype)


# ---------------------------------------------------------------------------------------------
# Static activation scales from a calibration prompt.

# id(Fp8Weight) -> the largest |input| its GEMM saw, while calibrate_input_scales runs.
_observed: dict[int, float] | None = None


@contextlib.contextmanager
def _observing():
    global _observed
    if _observed is not None:
        raise RuntimeError("calibrate_input_scales does not nest")
    _observed = {}
    try:
        yield _observed
    finally:
        _observed = None


def calibrate_input_scales(quantized: dict[str, Any], config: Any,
                           tokens: Sequence[int]) -> dict[str, Any]:
    """``quantized`` (one dict per layer, :class:`Fp8Weight` linears) with a static
    ``input_scale = max|x| / 448`` on every linear, ``x`` its inputs over one causal prefill of
    ``tokens`` through the quantized model with dynamic scales (max calibration, as ModelOpt's
    default). A static scale makes the activation quantization elementwise, so XLA can fuse it
    into the op that produces ``x`` (no per-token max reduction per GEMM); inputs beyond the
    calibrated range saturate at +-448. Runs eagerly, one layer at a time; existing static
    scales are replaced."""
    from . import model as llama   # (model imports this module)

    if not isinstance(quantized.get("layers"), list):
        raise ValueError("calibrate_input_scales takes one dict per layer (calibrate before "
                         "model.stack_layers)")
    if len(tokens) == 0:
        raise ValueError("tokens: calibration needs at least one token")
    positions = jnp.arange(len(tokens), dtype=jnp.int32)
    cos, sin = llama.rope_tables(positions, llama.rope_inv_freq(config))
    h = quantized["embed"][jnp.asarray(tokens)]
    layers = []
    for lp in quantized["layers"]:
        dynamic = {k: dataclasses.replace(v, input_scale=None) if isinstance(v, Fp8Weight)
                   else v for k, v in lp.items()}
        with _observing() as seen:
            h = llama._layer(dynamic, config, h, cos, sin, None, None, 0, _causal_attend)[0]
        layers.append({k: dataclasses.replace(v, input_scale=jnp.float32(
            max(seen[id(dynamic[k])], _TINY * FP8_MAX) / FP8_MAX))
            if isinstance(v, Fp8Weight) else v for k, v in lp.items()})
    return {**quantized, "layers": layers}


# ---------------------------------------------------------------------------------------------
# Checkpoints.


def _channel_scales(name: str, scale: np.ndarray, rows: int) -> np.ndarray:
    """A checkpoint's ``weight_scale`` (scalar / ``[1]``: per tensor; ``[rows]`` / ``[rows,
    1]``: per channel) as float32 ``[rows]``; ValueError naming the tensor otherwise."""
    a = np.asarray(scale, np.float32)
    if a.size == 1:
        a = np.full((rows,), a.reshape(()), np.float32)
    elif a.shape in ((rows,), (rows, 1)):
        a = a.reshape(rows)
    else:
        raise ValueError(f"tensor {name!r} has shape {a.shape}; an FP8 weight scale is a scalar "
                         f"(per tensor) or [{rows}] / [{rows}, 1] (per output channel)")
    if not (np.all(np.isfinite(a)) and np.all(a > 0)):
        raise ValueError(f"tensor {name!r}: FP8 weight scales must be finite and > 0")
    return a


def from_checkpoint_parts(parts: Sequence[tuple[str, np.ndarray, np.ndarray,
                                                np.ndarray | None]]) -> Fp8Weight:
    """One fused :class:`Fp8Weight` from a checkpoint's FP8 linears, concatenated along the
    output axis (q/k/v or gate/up): ``parts`` = ``(weight name, values [out_i, in] fp8,
    weight_scale, input_scale or None)``. The input scales are all present or all absent; the
    fused one is the largest (one activation feeds every part)."""
    values = np.concatenate([np.asarray(v) for _, v, _, _ in parts], axis=0)
    scale = np.concatenate([_channel_scales(n.removesuffix("weight") + "weight_scale", s,
                                            v.shape[0]) for n, v, s, _ in parts])
    given = [i is not None for *_, i in parts]
    if any(given) and not all(given):
        missing = parts[given.index(False)][0].removesuffix("weight") + "input_scale"
        raise ValueError(f"checkpoint is missing tensor {missing!r} (the other parts of this "
                         "fused weight have static input scales)")
    input_scale = None
    if all(given):
        names = [n.removesuffix("weight") + "input_scale" for n, *_ in parts]
        inputs = [np.asarray(i, np.float32).reshape(-1) for *_, i in parts]
        for n, i in zip(names, inputs):
            if i.size != 1 or not (np.isfinite(i[0]) and i[0] > 0):
                raise ValueError(f"tensor {n!r}: an FP8 input scale is one finite value > 0, "
                                 f"got {i.tolist()}")
        input_scale = jnp.asarray(max(float(i[0]) for i in inputs), jnp.float32)
    return Fp8Weight(jnp.asarray(values.astype(FP8)), jnp.asarray(scale), input_scale)


# ---------------------------------------------------------------------------------------------
# Per-layer error against the unquantized model.


def _causal_attend(q, k, v, kc, vc, layer):
    """``kv_attend`` of ``model._decoder`` for one sequence with no cache: causal attention of
    ``q [T, H, Dh]`` over ``k, v [T, Hkv, Dh]`` (GQA), float32 softmax."""
    T, H, Dh = q.shape
    rep = H // k.shape[1]
    k, v = jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)
    s = jnp.einsum("thd,shd->hts", q.astype(jnp.float32), k.astype(jnp.float32)) * Dh ** -0.5
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool))[None], s, -jnp.inf)
    o = jnp.einsum("hts,shd->thd", jax.nn.softmax(s, axis=-1), v.astype(jnp.float32))
    return o.astype(q.dtype), kc, vc


def _rel_l2(a: jax.Array, b: jax.Array) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def layer_errors(params: dict[str, Any], quantized: dict[str, Any], config: Any,
                 tokens: Sequence[int]) -> list[dict[str, float]]:
    """Per layer ``l``, relative L2 errors of its output hidden state ``[T, D]`` (one causal
    prefill over ``tokens``): ``layer`` = the quantized layer on the reference input (its own
    error), ``stack`` = the quantized model's hidden state against the reference's after layers
    ``0..l`` (the accumulated error); ``params`` is the reference, ``quantized`` the same model
    with :class:`Fp8Weight` layers."""
    from . import model as llama   # (model imports this module)

    positions = jnp.arange(len(tokens), dtype=jnp.int32)
    cos, sin = llama.rope_tables(positions, llama.rope_inv_freq(config))
    layer_fn = jax.jit(lambda lp, h: llama._layer(lp, config, h, cos, sin, None, None, 0,
                                                  _causal_attend)[0])
    ref = quant = params["embed"][jnp.asarray(tokens)]
    rows = []
    for i, (lp, lq) in enumerate(zip(params["layers"], quantized["layers"])):
        alone = layer_fn(lq, ref)
        ref_next = layer_fn(lp, ref)
        quant = layer_fn(lq, quant)
        # NOTE: the residual stream carries the layer's input; the error of what the layer adds
        # is the sharper number (a small update on a large residual hides its error).
        delta = _rel_l2(alone - ref, ref_next - ref)
        rows.append({"layer": i, "layer_rel_l2": _rel_l2(alone, ref_next),
                     "layer_update_rel_l2": delta, "stack_rel_l2": _rel_l2(quant, ref_next)})
        ref = ref_next
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict[str, float]]:
    """``python -m examples.llama.fp8_weights [--layers N] [--tokens T] [--quantize fp8]``:
    per-layer output errors of a random Llama-3.1-8B-shaped bf16 model (``--layers`` of its 32;
    vocabulary 1,024: it does not change a layer) quantized to FP8, against itself in bf16.
    Random Gaussian weights have no outlier channels, so real checkpoints can err more."""
    from . import model as llama

    p = argparse.ArgumentParser(prog="python -m examples.llama.fp8_weights",
                                description=main.__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4, help="layers of the 8B shape (default 4)")
    p.add_argument("--tokens", type=int, default=64, help="prompt tokens (default 64)")
    p.add_argument("--quantize", choices=sorted(QUANTIZE_CHOICES), default="fp8",
                   help="fp8: per-channel weight scales; fp8-tensor: per tensor")
    p.add_argument("--static-input-scales", type=int, metavar="TOKENS",
                   help="static activation scales calibrated over TOKENS other random tokens "
                   "(calibrate_input_scales) instead of per-token scales")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 1 <= args.layers <= 32 or args.tokens < 1:
        p.error(f"argument --layers: must be in [1, 32] (got {args.layers}); --tokens >= 1")
    if args.static_input_scales is not None and args.static_input_scales < 1:
        p.error(f"argument --static-input-scales: must be >= 1, got {args.static_input_scales}")
    config = llama.LlamaConfig(
        vocab_size=1024, hidden_size=4096, intermediate_size=14336, num_hidden_layers=args.layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500000.0, dtype="bfloat16")
    params = llama.init_params(config, seed=args.seed, on_device=True)
    quantized = quantize_params(params, QUANTIZE_CHOICES[args.quantize])
    rng = np.random.default_rng(args.seed)
    tokens = rng.integers(0, config.vocab_size, args.tokens)
    activations = "dynamic per-token activations"
    if args.static_input_scales:
        calibration = rng.integers(0, config.vocab_size, args.static_input_scales).tolist()
        quantized = calibrate_input_scales(quantized, config, calibration)
        activations = (f"static activation scales calibrated over {args.static_input_scales} "
                       "other tokens")
    rows = layer_errors(params, quantized, config, tokens.tolist())
    print(f"8B-shaped random model, {args.layers} layers, {args.tokens} tokens, seed "
          f"{args.seed}, {args.quantize} ({QUANTIZE_CHOICES[args.quantize]} weight scales, "
          f"{activations}) against bf16, on {jax.devices()[0].device_kind}")
    print("layer  output rel-L2  update rel-L2  stack rel-L2")
    for r in rows:
        print(f"{r['layer']:5d}  {r['layer_rel_l2']:13.2e}  {r['layer_update_rel_l2']:13.2e}  "
              f"{r['stack_rel_l2']:12.2e}")
    return rows


if __name__ == "__main__":
    # NOTE: python -m runs this file as __main__, a second copy of the module whose Fp8Weight
    # model._mm does not know: run the package's copy.
    from examples.llama import fp8_weights
    fp8_weights.main()
