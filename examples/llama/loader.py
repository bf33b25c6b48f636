"""Loads a HF Llama/Mistral/Qwen2/Qwen3 checkpoint directory into :mod:`model`'s params pytree, and
writes deterministic random-weight checkpoints in the same HF format.

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` /
any ``*.safetensors`` files, or a sharded set listed by ``model.safetensors.index.json``; read with
the ``safetensors`` package (numpy framework; bfloat16 comes back as ``ml_dtypes.bfloat16``).
``tokenizer.json``, when present, is loaded with ``tokenizers``.

FP8 K/V scales: when the checkpoint carries per-layer K/V cache scales (a model quantized with an
FP8 KV cache), they become ``params["kv_scales"] = {"k": [L, Hkv], "v": [L, Hkv]}`` (float32),
which the model passes to the ops when its caches are ``float8_e4m3fn`` (the cache stores
``k / k_scale``). Recognized names, per layer ``i``, first match wins (the names vLLM loads):

- ``model.layers.{i}.self_attn.k_scale`` / ``.v_scale`` (llm-compressor / compressed-tensors);
- ``model.layers.{i}.self_attn.k_proj.output_scale`` / ``.v_proj.output_scale`` (ModelOpt,
  AutoFP8);
- ``model.layers.{i}.self_attn.kv_scale`` (one scale for K and V; older exports).

FP8 weights (``fp8_weights.py``): a layer's q/k/v/o and gate/up/down ``.weight`` tensors in
``float8_e4m3fn`` (``[out, in]``) with ``.weight_scale`` beside each (float32; a scalar or
``[1]`` per tensor as ModelOpt writes it, ``[out]`` / ``[out, 1]`` per channel as
compressed-tensors writes it) and optionally ``.input_scale`` (a static activation scale; absent:
dynamic per token), ``x = float32(x_fp8) * scale``, load as ``fp8_weights.Fp8Weight``; any other
FP8 tensor is an error. ``load_checkpoint(quantize="fp8")`` quantizes a float checkpoint instead.

Each K/V scale is a scalar (one scale for every KV head, the usual per-tensor scale) or ``[Hkv]``; finite
and > 0 (at most 2**119: 448 * scale stays a finite float32) in float32, else CheckpointError
naming the tensor. Either every layer has them or none does (a partial set is an error). A
checkpoint without them gets no ``kv_scales`` and FP8 K/V then uses 1.0 (fine for the activations of most
models, whose K/V stay well inside fp8's +-448; an outlier saturates there).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Iterator

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from . import fp8_weights
from .model import LlamaConfig, init_scales, param_shapes

__all__ = ["load_checkpoint", "load_config", "load_tokenizer", "write_random_checkpoint",
           "hf_to_params", "kv_scales_from_tensors", "CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded (the message names the file/tensor)."""


# Our per-layer name -> the HF tensors under model.layers.{i}. it is made of (concatenated along
# the output axis after transposing HF's [out, in] to [in, out]), and whether to transpose.
_LAYER_NAMES = {
    "attn_norm": (("input_layernorm.weight",), False),
    "wqkv": (("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
             True),
    "wo": (("self_attn.o_proj.weight",), True),
    "mlp_norm": (("post_attention_layernorm.weight",), False),
    "w_gate_up": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), True),
    "w_down": (("mlp.down_proj.weight",), True),
    # Qwen2 (config.qkv_bias) and Qwen3 (config.qk_norm) only.
    "bqkv": (("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), False),
    "q_norm": (("self_attn.q_norm.weight",), False),
    "k_norm": (("self_attn.k_norm.weight",), False),
}

# Largest FP8 K/V scale (jax_kvcm.ops._checks.FP8_SCALE_MAX): 448 (fp8's largest value) times
# it is a finite float32.
_FP8_SCALE_MAX = 2.0 ** 119
# Per-layer (K name, V name) pairs under model.layers.{i}. for FP8 K/V scales, tried in order.
_KV_SCALE_NAMES = (("self_attn.k_scale", "self_attn.v_scale"),
                   ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
                   ("self_attn.kv_scale", "self_attn.kv_scale"))

_RAW_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
               "F64": np.float64, "F8_E4M3": ml_dtypes.float8_e4m3fn}
_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def load_config(path: str | Path, *, dtype: str | None = None) -> LlamaConfig:
    path = Path(path)
    cfg = path / "config.json"
    if not cfg.is_file():
        raise CheckpointError(f"{path}: no config.json (not a HF checkpoint directory)")
    return LlamaConfig.from_json(cfg, dtype=dtype)


def load_tokenizer(path: str | Path):
    """``tokenizers.Tokenizer`` from ``path/tokenizer.json``, or None when there is none."""
    tok = Path(path) / "tokenizer.json"
    if not tok.is_file():
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(tok))


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        files = sorted({_shard_path(path, index, name, f) for name, f in weight_map.items()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shard(s) that do not exist: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files and no model.safetensors.index.json")
    return files


def _shard_path(path: Path, index: Path, tensor: str, shard: Any) -> Path:
    """``path / shard`` for a ``weight_map`` entry, which must name a file directly inside the
    model directory (no directories, no ``..``, not absolute, no symlink leading out of it): an
    index must not make the loader read files elsewhere."""
    if (not isinstance(shard, str) or not shard or shard in (".", "..") or "/" in shard
            or "\\" in shard or "\0" in shard):
        raise CheckpointError(f"{index}: weight_map[{tensor!r}] = {shard!r} is not a file name "
                              "inside the model directory")
    file = path / shard
    root = path.resolve()
    if file.exists() and file.resolve().parent != root:
        raise CheckpointError(f"{index}: weight_map[{tensor!r}] = {shard!r} leads out of the "
                              f"model directory (to {file.resolve()})")
    return file


def _read_raw(file: Path, name: str) -> np.ndarray:
    """Fallback reader (a safetensors/numpy without bfloat16): header offsets + raw bytes."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        info = header[name]
        if info["dtype"] not in _RAW_DTYPES:
            raise CheckpointError(f"{file}: tensor {name!r} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        f.seek(8 + n + start)
        buf = f.read(end - start)
    return np.frombuffer(buf, _RAW_DTYPES[info["dtype"]]).reshape(info["shape"])


def _iter_tensors(files: list[Path], progress: bool) -> Iterator[tuple[str, np.ndarray]]:
    from safetensors import safe_open
    from tqdm import tqdm

    names: list[tuple[str, Any, Path]] = []
    for file in files:
        try:
            h = safe_open(str(file), framework="numpy")
        except Exception as e:  # noqa: BLE001  (safetensors raises its own error types)
            raise CheckpointError(f"{file}: not a readable safetensors file: {e}") from e
        names.extend((k, h, file) for k in h.keys())
    with tqdm(total=len(names), desc="loading tensors", unit="tensor",
              disable=not progress) as bar:
        for name, h, file in names:
            try:
                arr = h.get_tensor(name)
            except (TypeError, ValueError, AttributeError):  # a dtype numpy cannot map (FP8)
                arr = _read_raw(file, name)
            bar.update(1)
            yield name, arr


def hf_to_params(tensors: dict[str, np.ndarray], config: LlamaConfig) -> dict[str, Any]:
    """Maps HF tensor names to the params pytree (one dict per layer, q/k/v and gate/up fused;
    cast to config.dtype), checking shapes."""
    dtype = config.jnp_dtype
    shapes = param_shapes(config)
    c = config
    q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    out_dims = {"self_attn.q_proj.weight": q_dim, "self_attn.k_proj.weight": kv_dim,
                "self_attn.v_proj.weight": kv_dim, "mlp.gate_proj.weight": c.intermediate_size,
                "mlp.up_proj.weight": c.intermediate_size, "self_attn.q_proj.bias": q_dim,
                "self_attn.k_proj.bias": kv_dim, "self_attn.v_proj.bias": kv_dim}

    def get(name: str, want: tuple[int, ...], transpose: bool) -> np.ndarray:
        if name not in tensors:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}")
        arr = tensors[name]
        hf_shape = tuple(reversed(want)) if transpose else want
        if tuple(arr.shape) != hf_shape:
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(arr.shape)}, expected {hf_shape} from config")
        return arr.T if transpose else arr

    def cast(a: np.ndarray):
        return jnp.asarray(np.ascontiguousarray(a), dtype)

    def fp8_linear(i: int, parts: tuple[str, ...], want: tuple[int, ...]):
        names = [f"model.layers.{i}.{hf}" for hf in parts]
        if not any(n in tensors and tensors[n].dtype == _FP8 for n in names):
            return None
        rows = [out_dims.get(hf, want[1]) for hf in parts]
        found = []
        for n, r in zip(names, rows):
            values = get(n, (want[0], r), True).T                    # HF's [out, in]
            if values.dtype != _FP8:
                raise CheckpointError(f"tensor {n!r} is {values.dtype}, but the other parts of "
                                      "its fused weight are float8_e4m3fn")
            stem = n.removesuffix("weight")
            if stem + "weight_scale" not in tensors:
                raise CheckpointError(f"checkpoint is missing tensor {stem + 'weight_scale'!r} "
                                      f"(the scale of the FP8 weight {n!r})")
            found.append((n, values, tensors[stem + "weight_scale"],
                          tensors.get(stem + "input_scale")))
        try:
            return fp8_weights.from_checkpoint_parts(found)
        except ValueError as e:
            raise CheckpointError(str(e)) from None

    def layer(i: int) -> dict[str, Any]:
        out = {}
        for ours, want in shapes["layers"][i].items():
            parts, transpose = _LAYER_NAMES[ours]
            if ours in fp8_weights.QUANTIZED_WEIGHTS:
                quantized = fp8_linear(i, parts, want)
                if quantized is not None:
                    out[ours] = quantized
                    continue
            if len(parts) == 1:
                out[ours] = cast(get(f"model.layers.{i}.{parts[0]}", want, transpose))
            elif len(want) == 1:  # fused biases
                out[ours] = cast(np.concatenate(
                    [get(f"model.layers.{i}.{hf}", (out_dims[hf],), False) for hf in parts]))
            else:
                out[ours] = cast(np.concatenate(
                    [get(f"model.layers.{i}.{hf}", (want[0], out_dims[hf]), transpose)
                     for hf in parts], axis=1))
        return out

    params: dict[str, Any] = {
        "embed": cast(get("model.embed_tokens.weight", shapes["embed"], False)),
        "norm": cast(get("model.norm.weight", shapes["norm"], False)),
        "layers": [layer(i) for i in range(config.num_hidden_layers)],
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = cast(get("lm_head.weight", shapes["lm_head"], True))
    stray = next((k for k, a in tensors.items() if a.dtype == _FP8 and not _in_fp8_linear(k)),
                 None)
    if stray is not None:
        raise CheckpointError(f"tensor {stray!r} is float8_e4m3fn; FP8 is read for the layers' "
                              "q/k/v/o and gate/up/down projection weights only")
    scales = kv_scales_from_tensors(tensors, config)
    if scales is not None:
        params["kv_scales"] = scales
    extra = [k for k in tensors if k.startswith(f"model.layers.{config.num_hidden_layers}.")]
    if extra:
        raise CheckpointError(f"checkpoint has more layers than config.num_hidden_layers="
                              f"{config.num_hidden_layers} (e.g. {extra[0]!r})")
    return params


def _in_fp8_linear(name: str) -> bool:
    """Whether ``name`` is a weight :func:`hf_to_params` may read in FP8 (a layer's linear)."""
    linears = [hf for ours in fp8_weights.QUANTIZED_WEIGHTS for hf in _LAYER_NAMES[ours][0]]
    return name.startswith("model.layers.") and any(name.endswith("." + hf) for hf in linears)


def kv_scales_from_tensors(tensors: dict[str, np.ndarray],
                           config: LlamaConfig) -> dict[str, Any] | None:
    """``{"k": [L, Hkv], "v": [L, Hkv]}`` float32 FP8 K/V scales from the checkpoint's tensors
    (names in the module doc), or None when it has none."""
    L, Hkv = config.num_hidden_layers, config.num_key_value_heads
    found: list[tuple[str, np.ndarray, np.ndarray] | None] = []
    for i in range(L):
        pair = next(((f"model.layers.{i}.{k}", f"model.layers.{i}.{v}")
                     for k, v in _KV_SCALE_NAMES if f"model.layers.{i}.{k}" in tensors), None)
        if pair is None:
            found.append(None)
            continue
        if pair[1] not in tensors:
            raise CheckpointError(f"checkpoint has {pair[0]!r} but not {pair[1]!r}")
        k, v = (_head_scales(n, tensors[n], Hkv) for n in pair)
        found.append((pair[0], k, v))
    if all(f is None for f in found):
        return None
    if any(f is None for f in found):
        have = next(f[0] for f in found if f is not None)
        missing = found.index(None)
        raise CheckpointError(f"checkpoint has FP8 K/V scales for some layers (e.g. {have!r}) "
                              f"but none for layer {missing}")
    k = np.stack([f[1] for f in found])  # type: ignore[index]
    v = np.stack([f[2] for f in found])  # type: ignore[index]
    return {"k": jnp.asarray(k, jnp.float32), "v": jnp.asarray(v, jnp.float32)}


def _head_scales(name: str, arr: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """One layer's scale tensor (scalar, ``[1]`` or ``[Hkv]``) as float32 ``[Hkv]``."""
    with np.errstate(over="ignore"):  # NOTE: a value past float32's range becomes inf: refused
        a = np.asarray(arr, np.float32).reshape(-1)
    if a.size not in (1, num_kv_heads):
        raise CheckpointError(f"tensor {name!r} has shape {tuple(np.shape(arr))}; an FP8 K/V "
                              f"scale is a scalar or [{num_kv_heads}] (one per KV head)")
    # NOTE: as the ops' check (jax_kvcm.ops._checks.check_scale_values), in float32: the
    # runner's scales are traced in its step, so this is where their values are checked.
    if not (np.all(np.isfinite(a)) and np.all(a > 0) and np.all(a <= _FP8_SCALE_MAX)):
        raise CheckpointError(f"tensor {name!r}: FP8 K/V scales must be finite and > 0, at "
                              f"most {_FP8_SCALE_MAX:.4g} (in float32), got {a.tolist()}")
    return np.broadcast_to(a, (num_kv_heads,)).copy()


def load_checkpoint(path: str | Path, *, dtype: str | None = None, progress: bool = True,
                    quantize: str | None = None) -> tuple[LlamaConfig, dict[str, Any], Any]:
    """Reads a HF checkpoint directory: ``(config, params, tokenizer_or_None)``.

    ``dtype`` ("float32", "bfloat16", "float16") overrides the checkpoint's ``torch_dtype``.
    ``quantize`` ("fp8": per-channel weight scales, "fp8-tensor": per tensor; None: as stored)
    quantizes the layers' linear weights at load time (``fp8_weights.quantize_params``); an
    FP8 checkpoint's weights load as FP8 either way.
    """
    if quantize is not None and quantize not in fp8_weights.QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be one of {sorted(fp8_weights.QUANTIZE_CHOICES)} or "
                         f"None, got {quantize!r}")
    path = Path(path)
    config = load_config(path, dtype=dtype)
    files = _safetensors_files(path)
    tensors = dict(_iter_tensors(files, progress))
    params = hf_to_params(tensors, config)
    del tensors
    if quantize is not None:
        params = fp8_weights.quantize_on_device(params, fp8_weights.QUANTIZE_CHOICES[quantize])
    return config, params, load_tokenizer(path)


def write_random_checkpoint(path: str | Path, config: LlamaConfig, seed: int = 0,
                            dtype: str | None = None, *, shards: int = 1,
                            kv_scales: tuple[Any, Any] | None = None) -> Path:
    """Writes a deterministic random-weight HF-format checkpoint (config.json + safetensors).

    ``kv_scales=(k, v)`` (float32, ``[L]`` or ``[L, Hkv]``) also writes FP8 K/V scales as
    ``model.layers.{i}.self_attn.k_scale`` / ``.v_scale`` (the llm-compressor layout).
    ``shards=2`` splits the tensors over ``model-0000{1,2}-of-00002.safetensors`` with a
    ``model.safetensors.index.json`` (the sharded path). Same (config, seed, dtype) -> same bytes.
    Weight scales from :func:`model.init_scales` (varied greedy generations, unlike HF's 0.02).
    """
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = dtype or config.dtype
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16,
                "float16": np.float16}[dtype]
    rng = np.random.default_rng(seed)
    c = config
    D, I, V = c.hidden_size, c.intermediate_size, c.vocab_size
    q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim

    embed_std, gain = init_scales(config)

    # NOTE: every value is rounded to float32 first, then to the checkpoint's dtype, so a bf16
    # checkpoint holds exactly the f32 one's values rounded (a float64 product cast straight to
    # bfloat16 can round the other way at a tie of the f32 value).
    def cast(x):
        return np.asarray(x, np.float32).astype(np_dtype)

    def dense(*shape):  # HF layout [out, in]: fan-in is the last axis
        std = gain / np.sqrt(shape[-1])
        return cast(std * rng.standard_normal(shape, dtype=np.float32))

    def norm(n):
        return cast(1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32))

    tensors: dict[str, np.ndarray] = {"model.embed_tokens.weight": cast(
        embed_std * rng.standard_normal((V, D), dtype=np.float32))}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = norm(D)
        tensors[p + "self_attn.q_proj.weight"] = dense(q_dim, D)
        tensors[p + "self_attn.k_proj.weight"] = dense(kv_dim, D)
        tensors[p + "self_attn.v_proj.weight"] = dense(kv_dim, D)
        if c.qkv_bias:
            for name, n in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
                tensors[p + f"self_attn.{name}_proj.bias"] = cast(
                    gain / np.sqrt(D) * rng.standard_normal(n, dtype=np.float32))
        if c.qk_norm:
            tensors[p + "self_attn.q_norm.weight"] = norm(c.head_dim)
            tensors[p + "self_attn.k_norm.weight"] = norm(c.head_dim)
        tensors[p + "self_attn.o_proj.weight"] = dense(D, q_dim)
        tensors[p + "post_attention_layernorm.weight"] = norm(D)
        tensors[p + "mlp.gate_proj.weight"] = dense(I, D)
        tensors[p + "mlp.up_proj.weight"] = dense(I, D)
        tensors[p + "mlp.down_proj.weight"] = dense(D, I)
        if kv_scales is not None:
            tensors[p + "self_attn.k_scale"] = np.asarray(kv_scales[0][i], np.float32)
            tensors[p + "self_attn.v_scale"] = np.asarray(kv_scales[1][i], np.float32)
    tensors["model.norm.weight"] = norm(D)
    if not c.tie_word_embeddings:
        tensors["lm_head.weight"] = dense(V, D)  # fan-in D

    hf = c.to_hf_dict()
    hf["torch_dtype"] = dtype
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    meta = {"format": "pt"}
    if shards <= 1:
        save_file(tensors, str(path / "model.safetensors"), metadata=meta)
        return path
    names = list(tensors)
    per = -(-len(names) // shards)
    weight_map, total = {}, 0
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s * per:(s + 1) * per]}
        save_file(part, str(path / fname), metadata=meta)
        for n, a in part.items():
            weight_map[n] = fname
            total += a.nbytes
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return path
