"""Argument checks run in Python before tracing: errors name the argument."""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jax_kvcm import _env

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
FP8 = jnp.dtype(jnp.float8_e4m3fn)
CACHE_DTYPES = FLOAT_DTYPES + (FP8,)
# Largest finite float8_e4m3fn: write_kv saturates quantized values to +-FP8_MAX.
FP8_MAX = 448.0
# Largest fp8 scale: the attention ops read float32(stored) * scale with |stored| <= 448, and
# 448 * 2**119 = 1.75 * 2**127 is a finite float32 (float32 max / 448 is about 1.14 * 2**119).
FP8_SCALE_MAX = 2.0 ** 119
# Empty placeholder passed as the scale operands of a cache that is not fp8.
_NO_SCALE_SHAPE = (0,)

def resolve_check_indices(check_indices: Any) -> bool:
    """``check_indices`` keyword of the ops and codecs: a bool, or None for the environment
    default (``jax_kvcm._env``)."""
    if check_indices is None:
        return _env.check_indices_default()
    if not isinstance(check_indices, (bool, np.bool_)):
        raise TypeError(f"check_indices must be a bool or None, got {check_indices!r}")
    return bool(check_indices)


def check_flag(value: Any, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def _shape(x: Any, name: str) -> tuple[int, ...]:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    return tuple(x.shape)


def check_int32(x: Any, name: str, rank: int) -> tuple[int, ...]:
    shape = _shape(x, name)
    if jnp.dtype(x.dtype) != jnp.int32:
        raise TypeError(f"{name} must be int32, got {x.dtype}")
    if len(shape) != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {shape}")
    return shape


def check_caches(k_cache: Any, v_cache: Any) -> tuple[int, ...]:
    """Returns the cache shape ([L,] num_pages, page_size, num_kv_heads, head_dim)."""
    shape = _shape(k_cache, "k_cache")
    if len(shape) not in (4, 5):
        raise ValueError(
            "k_cache must have rank 4 [num_pages, page_size, num_kv_heads, head_dim] or 5 "
            f"[num_layers, num_pages, page_size, num_kv_heads, head_dim], got shape {shape}"
        )
    if jnp.dtype(k_cache.dtype) not in CACHE_DTYPES:
        raise TypeError("k_cache dtype must be float32, bfloat16, float16 or float8_e4m3fn, got "
                        f"{k_cache.dtype}")
    if _shape(v_cache, "v_cache") != shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape {shape}")
    if jnp.dtype(v_cache.dtype) != jnp.dtype(k_cache.dtype):
        raise TypeError(f"v_cache dtype {v_cache.dtype} must equal k_cache dtype {k_cache.dtype}")
    if min(shape) < 1:
        raise ValueError(f"k_cache has an empty dimension: {shape}")
    return shape


def layer_operand(layer: Any, cache_shape: tuple[int, ...]) -> jax.Array:
    """The int32 scalar operand for `layer` (0 when the cache has no layer axis)."""
    if len(cache_shape) == 4:
        if layer is not None:
            raise ValueError("layer must be None when k_cache has no layer axis (rank 4)")
        return jnp.zeros((), jnp.int32)
    if layer is None:
        raise ValueError(f"layer is required when k_cache has a layer axis (shape {cache_shape})")
    if isinstance(layer, (bool, np.bool_)) or (
            hasattr(layer, "dtype") and jnp.dtype(layer.dtype) == jnp.bool_):
        raise TypeError(f"layer must be an integer, not a boolean ({layer!r})")
    if isinstance(layer, (int, np.integer)):
        if not 0 <= int(layer) < cache_shape[0]:
            raise ValueError(f"layer {int(layer)} is outside [0, {cache_shape[0]})")
        return jnp.asarray(layer, jnp.int32)
    shape = _shape(layer, "layer")
    if shape != () or not jnp.issubdtype(layer.dtype, jnp.integer):
        raise TypeError(f"layer must be an integer scalar, got {layer.dtype}{list(shape)}")
    return jnp.asarray(layer, jnp.int32)


def _as_float(x: Any, name: str) -> float:
    """A concrete real scalar (Python, numpy or 0-d array) as a float, else ValueError."""
    numeric = isinstance(x, (int, float, np.integer, np.floating)) or (
        hasattr(x, "dtype") and (jnp.issubdtype(x.dtype, jnp.floating)
                                 or jnp.issubdtype(x.dtype, jnp.integer)))
    if isinstance(x, (bool, np.bool_)) or not numeric:
        raise ValueError(f"{name} must be a float, got {x!r}")
    try:
        value = float(x)
    except (TypeError, ValueError, jax.errors.ConcretizationTypeError):
        raise ValueError(f"{name} must be a concrete float (not traced), got {x!r}") from None
    if np.ndim(x) != 0:
        raise ValueError(f"{name} must be a scalar, got shape {np.shape(x)}")
    return value


def attention_attrs(scale: Any, sliding_window: Any, soft_cap: Any,
                    head_dim: int) -> dict[str, Any]:
    """FFI attributes: scale (default 1/sqrt(head_dim)), window (0 = none), soft cap (0 = none)."""
    scale = 1.0 / math.sqrt(head_dim) if scale is None else _as_float(scale, "scale")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, got {scale!r}")
    window = 0
    if sliding_window is not None:
        if isinstance(sliding_window, (bool, np.bool_)) or not isinstance(
                sliding_window, (int, np.integer)):
            raise ValueError(f"sliding_window must be None or a positive int, got {sliding_window!r}")
        if not 1 <= int(sliding_window) <= np.iinfo(np.int32).max:
            raise ValueError(
                f"sliding_window must be in [1, 2**31 - 1], got {int(sliding_window)}")
        window = int(sliding_window)
    cap = 0.0
    if soft_cap is not None:
        cap = _as_float(soft_cap, "soft_cap")
        if not (cap > 0 and math.isfinite(cap)):
            raise ValueError(f"soft_cap must be None or a positive finite float, got {soft_cap!r}")
    return dict(scale=np.float32(scale), sliding_window=np.int32(window), soft_cap=np.float32(cap))


def check_attention(q: Any, k_cache: Any, v_cache: Any, page_table: Any, seq_lens: Any,
                    query_start: Any | None) -> tuple[int, ...]:
    """Checks the attention operands; returns the cache shape."""
    cache_shape = check_caches(k_cache, v_cache)
    num_kv_heads, head_dim = cache_shape[-2], cache_shape[-1]
    q_shape = _shape(q, "q")
    what = "[T, num_heads, head_dim]" if query_start is not None else "[batch, num_heads, head_dim]"
    if len(q_shape) != 3:
        raise ValueError(f"q must have rank 3 {what}, got shape {q_shape}")
    if jnp.dtype(q.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"q dtype must be float32, bfloat16 or float16, got {q.dtype}")
    if jnp.dtype(k_cache.dtype) != FP8 and jnp.dtype(q.dtype) != jnp.dtype(k_cache.dtype):
        raise TypeError(f"q dtype {q.dtype} must equal the cache dtype {k_cache.dtype}")
    if q_shape[2] != head_dim:
        raise ValueError(f"q head_dim {q_shape[2]} must equal the cache head_dim {head_dim}")
    if q_shape[1] < 1 or q_shape[1] % num_kv_heads:
        raise ValueError(
            f"q num_heads {q_shape[1]} must be a positive multiple of num_kv_heads {num_kv_heads}")
    batch, _ = check_int32(page_table, "page_table", 2)
    (n,) = check_int32(seq_lens, "seq_lens", 1)
    if n != batch:
        raise ValueError(f"seq_lens shape {tuple(seq_lens.shape)} must be [batch] = [{batch}]")
    if query_start is None:
        if q_shape[0] != batch:
            raise ValueError(f"q batch {q_shape[0]} must equal page_table batch {batch}")
    else:
        (m,) = check_int32(query_start, "query_start", 1)
        if m != batch + 1:
            raise ValueError(
                f"query_start shape {tuple(query_start.shape)} must be [batch + 1] = [{batch + 1}]")
    return cache_shape


def check_write(k_cache: Any, v_cache: Any, k: Any, v: Any, slot_mapping: Any) -> tuple[int, ...]:
    cache_shape = check_caches(k_cache, v_cache)
    want = ("T",) + tuple(cache_shape[-2:])
    k_shape = _shape(k, "k")
    if len(k_shape) != 3 or k_shape[1:] != cache_shape[-2:]:
        raise ValueError(f"k must have shape [T, num_kv_heads, head_dim] = {list(want)}, got {k_shape}")
    if _shape(v, "v") != k_shape:
        raise ValueError(f"v shape {tuple(v.shape)} must equal k shape {k_shape}")
    for name, x in (("k", k), ("v", v)):
        if jnp.dtype(k_cache.dtype) == FP8:
            if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
                raise TypeError(f"{name} dtype must be float32, bfloat16 or float16 (quantized "
                                f"into the float8_e4m3fn cache), got {x.dtype}")
            if jnp.dtype(x.dtype) != jnp.dtype(k.dtype):
                raise TypeError(f"v dtype {v.dtype} must equal k dtype {k.dtype}")
        elif jnp.dtype(x.dtype) != jnp.dtype(k_cache.dtype):
            raise TypeError(f"{name} dtype {x.dtype} must equal the cache dtype {k_cache.dtype}")
    (t,) = check_int32(slot_mapping, "slot_mapping", 1)
    if t != k_shape[0]:
        raise ValueError(f"slot_mapping shape {tuple(slot_mapping.shape)} must be [T] = [{k_shape[0]}]")
    return cache_shape


def scale_operands(k_scale: Any, v_scale: Any, cache_shape: tuple[int, ...],
                   cache_dtype: Any) -> tuple[jax.Array, jax.Array]:
    """The float32 ``[num_layers or 1, num_kv_heads]`` scale operands of an fp8 cache (empty
    placeholders for other caches). Scales are required with fp8 and refused otherwise."""
    fp8 = jnp.dtype(cache_dtype) == FP8
    if not fp8:
        for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
            if x is not None:
                raise ValueError(f"{name} is only for float8_e4m3fn caches; this cache is "
                                 f"{jnp.dtype(cache_dtype)} (pass None)")
        empty = jnp.zeros(_NO_SCALE_SHAPE, jnp.float32)
        return empty, empty
    num_kv_heads = cache_shape[-2]
    want = (num_kv_heads,) if len(cache_shape) == 4 else (cache_shape[0], num_kv_heads)
    out = []
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if x is None:
            raise ValueError(f"{name} is required with a float8_e4m3fn cache: float32 "
                             f"{list(want)} (per {'layer and ' if len(want) == 2 else ''}kv head)")
        shape = _shape(x, name)
        if jnp.dtype(x.dtype) != jnp.float32:
            raise TypeError(f"{name} must be float32, got {x.dtype}")
        if shape != want:
            raise ValueError(f"{name} must have shape {list(want)} "
                             f"([{'num_layers, ' if len(want) == 2 else ''}num_kv_heads]), "
                             f"got {list(shape)}")
        check_scale_values(x, name)
        out.append(jnp.asarray(x).reshape((-1, num_kv_heads)))
    return out[0], out[1]


# NOTE: set while jax_kvcm.sharded traces its per-shard calls: their scales are slices of the
# global ones, already checked outside the shard_map (a check per shard would be batched over
# the mesh axis, which checkify cannot report on a mesh with Explicit axes).
_SCALES_CHECKED_OUTSIDE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "kvcm_scales_checked_outside", default=False)


# NOTE: off by default. A checkify.debug_check puts an ErrorEffect on the traced function, and
# jax.jit dispatches a function with effects through its Python path, not the C++ one: on the
# H100 the 8B FP8 serving step (about 650 argument leaves) took ~11 ms of host time per decode
# step, most of it in that path (a CPU microbenchmark, 300 arguments: 3.7 against 0.68 ms).
_CHECK_TRACED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "kvcm_check_traced_scales", default=False)


@contextlib.contextmanager
def _set(flag: contextvars.ContextVar[bool]) -> Iterator[None]:
    token = flag.set(True)
    try:
        yield
    finally:
        flag.reset(token)


def check_traced_scales() -> contextlib.AbstractContextManager[None]:
    """Within it, the ops traced add a ``checkify.debug_check`` on traced fp8 scales, so that
    ``checkify.checkify(step)`` reports a bad one by name. Trace the step inside (call it there
    first; a ``jax.jit`` traced before reuses its cached trace, without the check)."""
    return _set(_CHECK_TRACED)


def scales_checked_outside() -> contextlib.AbstractContextManager[None]:
    return _set(_SCALES_CHECKED_OUTSIDE)


def check_scale_values(x: Any, name: str) -> None:
    """Refuses fp8 scales that are zero, negative, NaN, inf or above :data:`FP8_SCALE_MAX`
    (``x / scale`` would store NaN, +-448 or sign-flipped bytes, and ``stored * scale`` would
    read NaN or inf): ValueError naming the
    argument and the bad entries when ``x`` is concrete (numpy, an eager ``jax.Array``, a
    constant closed over by a traced function). A traced ``x`` (an argument of a jitted
    function) has no value here: such scales are checked where they are produced; within
    :func:`check_traced_scales` it gets a ``checkify.debug_check``, which raises under
    ``jax.experimental.checkify.checkify`` (docs/fp8.md, "Scale values")."""
    if isinstance(x, jax.core.Tracer) or (isinstance(x, jax.Array)
                                          and not x.is_fully_addressable):
        if _SCALES_CHECKED_OUTSIDE.get() or not _CHECK_TRACED.get():
            return
        ok = jnp.all(jnp.isfinite(x) & (x > 0) & (x <= FP8_SCALE_MAX))
        checkify.debug_check(ok, f"{name} must be finite and > 0, at most {FP8_SCALE_MAX:.4g} "
                             "(fp8 K/V scale), got {x}", x=x)
        return
    a = np.asarray(x, np.float32)
    bad = ~(np.isfinite(a) & (a > 0) & (a <= FP8_SCALE_MAX))
    if bad.any():
        where = np.argwhere(bad)[:4]
        got = ", ".join(f"{float(a[tuple(i)])} at {list(map(int, i))}" for i in where)
        more = f" (and {int(bad.sum()) - len(where)} more)" if bad.sum() > len(where) else ""
        raise ValueError(f"{name} must be finite and > 0, at most {FP8_SCALE_MAX:.4g} (fp8 "
                         f"K/V scale: the cache stores x / {name}, attention reads stored * "
                         f"{name}), got {got}{more}")
