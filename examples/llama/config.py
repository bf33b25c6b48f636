"""The model's configuration: :class:`LlamaConfig`, the HF ``config.json`` fields a
Llama/Mistral/Qwen2/Qwen3 decoder needs (re-exported by ``model``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

import jax.numpy as jnp

__all__ = ["LlamaConfig"]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_LAYER_TYPES = ("full_attention", "sliding_attention")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _check_layer_types(types: Any, num_layers: int) -> None:
    if (not isinstance(types, (list, tuple)) or len(types) != num_layers
            or not set(types) <= set(_LAYER_TYPES)):
        raise ValueError(f"layer_types must list {num_layers} entries out of {_LAYER_TYPES}, "
                         f"got {types!r}")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The HF ``config.json`` fields a Llama/Mistral/Qwen2/Qwen3 decoder needs (hashable: a static
    jit arg)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # RoPE scaling: "default" (none), "linear" or "llama3".
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    # Per layer "full_attention" or "sliding_attention" (HF layer_types); None: every layer
    # slides when sliding_window is set (Mistral), else every layer is full.
    layer_types: tuple[str, ...] | None = None
    qkv_bias: bool = False             # Qwen2: q/k/v projections have biases
    qk_norm: bool = False              # Qwen3: RMSNorm over each head's q and k before RoPE
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"
    model_type: str = "llama"

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def jnp_dtype(self):
        return _DTYPES[self.dtype]

    def __post_init__(self) -> None:
        types = self.layer_types
        if types is None:
            return
        _check_layer_types(types, self.num_hidden_layers)
        if "sliding_attention" in types and not self.sliding_window:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is "
                             "not set")
        object.__setattr__(self, "layer_types", tuple(types))

    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention)."""
        types = self.layer_types or (
            ("sliding_attention" if self.sliding_window else "full_attention",)
            * self.num_hidden_layers)
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in types)

    def kv_groups(self) -> tuple[tuple[int | None, tuple[int, ...]], ...]:
        """``((window, layers), ...)``: the layers of each attention kind, full layers first,
        one KV pool each (the order of the manager's layer groups)."""
        windows = self.layer_windows()
        kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))
        return tuple((w, tuple(i for i, x in enumerate(windows) if x == w)) for w in kinds)

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], *, dtype: str | None = None) -> "LlamaConfig":
        """Parses a HF ``config.json`` dict (transformers 4.x ``rope_scaling``/``rope_theta`` or
        5.x ``rope_parameters`` layouts). ``dtype`` overrides ``torch_dtype``/``dtype``."""
        model_type = d.get("model_type", "llama")
        if model_type not in _ARCHITECTURES:
            raise ValueError(f"unsupported model_type {model_type!r} "
                             f"({', '.join(_ARCHITECTURES)})")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if key not in d:
                raise ValueError(f"config.json is missing {key!r}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (silu)")
        # Llama/Mistral/Qwen3's attention_bias also biases o_proj: not supported. Qwen2 always
        # has q/k/v biases (and no o_proj bias).
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise ValueError("attention_bias / mlp_bias are not supported")
        heads = int(d["num_attention_heads"])
        head_dim = d.get("head_dim") or int(d["hidden_size"]) // heads
        # RoPE: transformers 5 writes rope_parameters (theta inside); 4.x wrote rope_theta plus an
        # optional rope_scaling dict.
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope type {rope_type!r} (default, linear, llama3)")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported")
        max_pos = int(d.get("max_position_embeddings", 4096))
        eos = d.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])
                        if e is not None)
        if dtype is None:
            dtype = d.get("torch_dtype") or d.get("dtype") or "float32"
        if dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r} ({', '.join(_DTYPES)})")
        window = d.get("sliding_window")
        qwen = model_type in ("qwen2", "qwen3")
        # Qwen2/3 slide only with use_sliding_window (false when absent, as in transformers).
        if d.get("use_sliding_window", not qwen) is False:
            window = None
        window = int(window) if window else None
        num_layers = int(d["num_hidden_layers"])
        layer_types = d.get("layer_types")
        if layer_types is None and qwen and window:
            # Older Qwen configs: the layers from max_window_layers on slide (as transformers
            # derives layer_types from them).
            first = int(d.get("max_window_layers", num_layers))
            layer_types = ["full_attention" if i < first else "sliding_attention"
                           for i in range(num_layers)]
        if layer_types is not None and window is None:
            _check_layer_types(layer_types, num_layers)
            layer_types = None         # transformers: no window, every layer attends fully
        return cls(
            vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=num_layers, num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim), rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta, rope_type=rope_type, rope_factor=float(rope.get("factor", 1.0)),
            rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            rope_original_max_position_embeddings=int(
                rope.get("original_max_position_embeddings",
                         max_pos if rope_type == "llama3" else 8192)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            sliding_window=window,
            layer_types=tuple(layer_types) if layer_types is not None else None,
            qkv_bias=model_type == "qwen2", qk_norm=model_type == "qwen3",
            max_position_embeddings=max_pos,
            bos_token_id=d.get("bos_token_id"), eos_token_ids=eos_ids, dtype=dtype,
            model_type=model_type)

    @classmethod
    def from_json(cls, path: str | Path, *, dtype: str | None = None) -> "LlamaConfig":
        return cls.from_hf_dict(json.loads(Path(path).read_text()), dtype=dtype)

    def to_hf_dict(self) -> dict[str, Any]:
        """A HF-style ``config.json`` dict (transformers 4.x layout, which 5.x also reads)."""
        rope_scaling = None
        if self.rope_type == "linear":
            rope_scaling = {"rope_type": "linear", "factor": self.rope_factor}
        elif self.rope_type == "llama3":
            rope_scaling = {
                "rope_type": "llama3", "factor": self.rope_factor,
                "low_freq_factor": self.rope_low_freq_factor,
                "high_freq_factor": self.rope_high_freq_factor,
                "original_max_position_embeddings": self.rope_original_max_position_embeddings}
        d = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_scaling": rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (list(self.eos_token_ids) if len(self.eos_token_ids) > 1
                             else self.eos_token_id),
            "torch_dtype": self.dtype, "attention_bias": False, "mlp_bias": False,
        }
        if self.model_type != "llama":
            d["sliding_window"] = self.sliding_window
        if self.model_type in ("qwen2", "qwen3"):
            d["use_sliding_window"] = self.sliding_window is not None
            d["layer_types"] = [("sliding_attention" if w else "full_attention")
                                for w in self.layer_windows()]
        return d

