"""The paged-KV ops sharded over KV heads (tensor parallelism), one custom call per shard.

Layout: the pools ``[L, num_pages, page_size, Hkv, D]`` (or without the layer axis) are split
over their KV-head axis on one mesh axis (default ``"tp"``), and so are the heads of ``q``
(``[B or T, H, D]``) and of the new ``k``/``v`` rows (``[T, Hkv, D]``) and the fp8 scales
(``[Hkv]`` or ``[L, Hkv]``). The index buffers (``page_table``, ``slot_mapping``, ``seq_lens``,
``query_start``) and ``layer`` are replicated: a page id is the same page on every device, so
one host-side :class:`~jax_kvcm.KVCacheManager` drives every shard. Each device runs the plain
custom call on its ``Hkv / tp`` KV heads and its ``H / tp`` query heads; GQA groups never span
devices because query head ``h`` reads KV head ``h // (H // Hkv)`` and both are split in the same
contiguous blocks. No collective is needed: the attention output stays sharded over heads (the
model's O projection, split by rows, does the one all-reduce).

``Hkv`` must be divisible by the axis size; ``Hkv < tp`` is refused (the caller replicates KV
heads up to ``tp`` before building the pools, as Megatron-style runners do).

Why wrappers and not ``jax.experimental.custom_partitioning`` on the plain ops: a prototype of
custom partitioning rules (Shardy rule ``"b (k g) d, n p k d, ... -> b (k g) d"``) partitions
correctly under this jax's Shardy partitioner, but it references a Python callback from the
compiled module (the persistent compilation cache keys on its pointer unless a global flag is
set, and ``jax.export`` cannot serialize it) and it would change the lowering of every existing
single-device caller. The wrappers here are explicit (``jax.shard_map`` with the mesh given),
leave the plain ops untouched, and compose with a GSPMD model: call them inside ``jax.jit`` with
arrays sharded as :func:`cache_sharding` / :func:`head_sharding` say.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_kvcm import ops as _ops
from jax_kvcm.ops import _checks

__all__ = ["cache_sharding", "head_sharding", "paged_attention", "ragged_paged_attention",
           "write_kv"]

DEFAULT_AXIS = "tp"


def cache_sharding(mesh: Mesh, axis: str = DEFAULT_AXIS, *, ndim: int = 5) -> NamedSharding:
    """The sharding of a pool (``ndim`` 5: ``[L, num_pages, page_size, Hkv, D]``, or 4 without
    the layer axis): KV heads (axis ``ndim - 2``) split over mesh axis ``axis``."""
    if ndim not in (4, 5):
        raise ValueError(f"ndim must be 4 or 5 (pool rank), got {ndim!r}")
    return NamedSharding(mesh, _head_spec(ndim, axis))


def head_sharding(mesh: Mesh, axis: str = DEFAULT_AXIS) -> NamedSharding:
    """The sharding of ``q [B or T, H, D]`` and of new ``k``/``v`` rows ``[T, Hkv, D]``: heads
    split over mesh axis ``axis``."""
    return NamedSharding(mesh, _head_spec(3, axis))


def write_kv(k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array, *, mesh: Mesh, axis: str = DEFAULT_AXIS,
             layer: Any = None, k_scale: jax.Array | None = None,
             v_scale: jax.Array | None = None,
             check_indices: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """:func:`jax_kvcm.write_kv` per KV-head shard. Shapes, dtypes and semantics as there
    (global shapes); ``slot_mapping`` and ``layer`` replicated. Returns the caches sharded as
    :func:`cache_sharding`; each shard is written in place when the caller donates the caches."""
    cache_shape = _checks.check_write(k_cache, v_cache, k, v, slot_mapping)
    _checks.layer_operand(layer, cache_shape)
    _checks.scale_operands(k_scale, v_scale, cache_shape, k_cache.dtype)
    _check_heads(mesh, axis, cache_shape[-2])
    cache_spec = _head_spec(len(cache_shape), axis)
    row_spec = _head_spec(3, axis)

    def per_shard(kc, vc, k_, v_, sm, layer_, ks, vs):  # noqa: ANN001, ANN202
        return _ops.write_kv(kc, vc, k_, v_, sm, layer=layer_, k_scale=ks, v_scale=vs,
                             check_indices=check_indices)

    return _run(per_shard, mesh, (cache_spec, cache_spec),
                [(k_cache, cache_spec), (v_cache, cache_spec), (k, row_spec), (v, row_spec),
                 (slot_mapping, P())], layer, k_scale, v_scale, axis)


def paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, page_table: jax.Array,
                    seq_lens: jax.Array, *, mesh: Mesh, axis: str = DEFAULT_AXIS,
                    layer: Any = None, scale: float | None = None,
                    sliding_window: int | None = None, soft_cap: float | None = None,
                    k_scale: jax.Array | None = None, v_scale: jax.Array | None = None,
                    ring_table: bool = False, check_indices: bool | None = None) -> jax.Array:
    """:func:`jax_kvcm.paged_attention` per KV-head shard (decode, ``q [B, H, D]``). Arguments
    as there (global shapes); ``page_table``, ``seq_lens`` and ``layer`` replicated. Returns
    ``[B, H, D]`` sharded over heads (:func:`head_sharding`)."""
    cache_shape = _checks.check_attention(q, k_cache, v_cache, page_table, seq_lens, None)
    kwargs = _attention_kwargs(mesh, axis, cache_shape, k_cache.dtype, layer, scale,
                               sliding_window, soft_cap, k_scale, v_scale, ring_table,
                               check_indices)

    def per_shard(q_, kc, vc, pt, sl, layer_, ks, vs):  # noqa: ANN001, ANN202
        return _ops.paged_attention(q_, kc, vc, pt, sl, layer=layer_, k_scale=ks, v_scale=vs,
                                    **kwargs)

    cache_spec = _head_spec(len(cache_shape), axis)
    return _run(per_shard, mesh, _head_spec(3, axis),
                [(q, _head_spec(3, axis)), (k_cache, cache_spec), (v_cache, cache_spec),
                 (page_table, P()), (seq_lens, P())], layer, k_scale, v_scale, axis)


def ragged_paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                           page_table: jax.Array, seq_lens: jax.Array, query_start: jax.Array, *,
                           mesh: Mesh, axis: str = DEFAULT_AXIS, layer: Any = None,
                           scale: float | None = None, sliding_window: int | None = None,
                           soft_cap: float | None = None, k_scale: jax.Array | None = None,
                           v_scale: jax.Array | None = None, ring_table: bool = False,
                           check_indices: bool | None = None) -> jax.Array:
    """:func:`jax_kvcm.ragged_paged_attention` per KV-head shard (prefill / mixed,
    ``q [T, H, D]``). Arguments as there (global shapes); ``page_table``, ``seq_lens``,
    ``query_start`` and ``layer`` replicated. Returns ``[T, H, D]`` sharded over heads."""
    cache_shape = _checks.check_attention(q, k_cache, v_cache, page_table, seq_lens, query_start)
    kwargs = _attention_kwargs(mesh, axis, cache_shape, k_cache.dtype, layer, scale,
                               sliding_window, soft_cap, k_scale, v_scale, ring_table,
                               check_indices)

    def per_shard(q_, kc, vc, pt, sl, qs, layer_, ks, vs):  # noqa: ANN001, ANN202
        return _ops.ragged_paged_attention(q_, kc, vc, pt, sl, qs, layer=layer_, k_scale=ks,
                                           v_scale=vs, **kwargs)

    cache_spec = _head_spec(len(cache_shape), axis)
    return _run(per_shard, mesh, _head_spec(3, axis),
                [(q, _head_spec(3, axis)), (k_cache, cache_spec), (v_cache, cache_spec),
                 (page_table, P()), (seq_lens, P()), (query_start, P())],
                layer, k_scale, v_scale, axis)


def _head_spec(ndim: int, axis: str) -> P:
    """Heads sit second to last in pools, q, k and v (before head_dim)."""
    return P(*([None] * (ndim - 2)), axis, None)


def _scale_spec(ndim: int, axis: str) -> P:
    """Heads are the last axis of the fp8 scales (``[Hkv]`` or ``[L, Hkv]``)."""
    return P(*([None] * (ndim - 1)), axis)


def _check_heads(mesh: Any, axis: Any, num_kv_heads: int) -> int:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(f"axis {axis!r} is not an axis of the mesh (axes {mesh.axis_names})")
    tp = int(mesh.shape[axis])
    if num_kv_heads % tp:
        hint = (" (fewer KV heads than shards: replicate each KV head up to the axis size "
                "before building the pools)" if num_kv_heads < tp else "")
        raise ValueError(f"num_kv_heads {num_kv_heads} must be divisible by the size {tp} of "
                         f"mesh axis {axis!r}{hint}")
    return tp


def _attention_kwargs(mesh: Any, axis: Any, cache_shape: tuple[int, ...], cache_dtype: Any,
                      layer: Any, scale: Any, sliding_window: Any, soft_cap: Any, k_scale: Any,
                      v_scale: Any, ring_table: Any, check_indices: Any) -> dict[str, Any]:
    """Validates the global arguments (errors name them with their global shapes) and returns
    the static keyword arguments every shard's call gets."""
    _checks.layer_operand(layer, cache_shape)
    _checks.scale_operands(k_scale, v_scale, cache_shape, cache_dtype)
    _checks.attention_attrs(scale, sliding_window, soft_cap, cache_shape[-1])
    _checks.check_flag(ring_table, "ring_table")
    _check_heads(mesh, axis, cache_shape[-2])
    # NOTE: the default scale is 1/sqrt(D), and D is not split, so each shard's default is the
    # global one.
    return dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
                ring_table=ring_table, check_indices=check_indices)


def _run(per_shard: Any, mesh: Mesh, out_specs: Any, operands: list[tuple[Any, P]],
         layer: Any, k_scale: Any, v_scale: Any, axis: str) -> Any:
    """Runs ``per_shard(*operands, layer, k_scale, v_scale)`` under ``jax.shard_map``. A Python
    int ``layer`` and absent scales stay static (closed over); a traced ``layer`` and the scales
    travel as operands (layer replicated, scales split over heads)."""
    args = [x for x, _ in operands]
    specs = [s for _, s in operands]
    extra: list[str] = []
    for name, x in (("layer", layer), ("k_scale", k_scale), ("v_scale", v_scale)):
        if x is None or (name == "layer" and isinstance(x, int)):
            continue
        extra.append(name)
        args.append(x)
        specs.append(P() if name == "layer" else _scale_spec(jax.numpy.ndim(x), axis))
    num_plain = len(operands)

    def body(*xs):  # noqa: ANN002, ANN202
        given = dict(zip(extra, xs[num_plain:]))
        return per_shard(*xs[:num_plain], given.get("layer", layer),
                         given.get("k_scale"), given.get("v_scale"))

    # NOTE: on a mesh with Explicit axes (jax.make_mesh's default) shard_map refuses operands
    # whose sharding type differs from in_specs; reshard them (replicated -> split is a local
    # slice, no communication; operands already placed as specified are untouched). Auto axes
    # let shard_map insert the same resharding itself.
    if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        args = [jax.sharding.reshard(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
    # NOTE: check_vma=False: the custom calls have no varying-manual-axes rule; the out_specs
    # above are exact (outputs split over heads like their inputs).
    fn = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=out_specs,
                       check_vma=False)
    with _checks.scales_checked_outside():  # NOTE: the global scales were checked by the caller
        return fn(*args)
