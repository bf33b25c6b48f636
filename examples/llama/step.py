"""The device side of one serving step: :func:`model_step` (input tokens, the model, sampling,
in one jitted program per shape) and :func:`step_inputs`, the host arrays it takes for the
requests a step serves."""

from __future__ import annotations

import bisect
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_kvcm

from . import fp8_weights
from . import model as llama
from . import tp as tensor_parallel
from .serve_types import RequestState, StepRecord

# Sampling on the device (examples/llama/model.py), re-exported here.
sample_tokens = llama.sample_tokens
greedy_tokens = llama.greedy_tokens


def _fit(x, n: int, fill: int):
    """``x[:n]``, padded with ``fill`` to ``n`` entries (static shapes)."""
    if x.shape[0] >= n:
        return x[:n]
    return jnp.concatenate([x, jnp.full((n - x.shape[0],), fill, x.dtype)])


_STEP_STATIC = ("config", "rings", "decode", "greedy", "with_logits", "mesh")
_STEP_DONATED = ("k_cache", "v_cache")   # the pools, updated in place


@functools.partial(jax.jit, static_argnames=_STEP_STATIC, donate_argnames=_STEP_DONATED)
def model_step(params, k_cache, v_cache, prev_tokens, gather, host_tokens, batch, sampling,
               cascade=None, *,
               config: llama.LlamaConfig, rings: tuple[int, ...] | None = None, decode: bool,
               greedy: bool, with_logits: bool, mesh: jax.sharding.Mesh | None = None):
    """One serving step on the device: input tokens, the model, sampling.

    Args:
      prev_tokens: int32 ``[M]``: the previous step's sampled tokens (its output).
      gather, host_tokens: int32 ``[T]`` (``T`` the token bucket): token ``t`` is
        ``prev_tokens[gather[t]]`` where ``gather[t] >= 0`` (a token sampled by the previous step
        and not read by the host yet), else ``host_tokens[t]``.
      batch: the manager's :class:`StepBatch` (``[B]`` rows, ``[T]`` tokens).
      sampling: ``(temperature, top_p, seed, stream, counter)`` ``[B]`` each (see
        :func:`model.sample_tokens`); ignored when ``greedy``.
      cascade: None, or (decode steps, one device) the step's :class:`jax_kvcm.CascadeBatch`:
        shared prefixes read once per group (``ServeConfig.cascade``).
      decode: one token per row (``T`` new tokens = the ``B`` rows): ``decode_step``
        (``paged_attention``); else ``forward_step`` (``ragged_paged_attention``).
      k_cache, v_cache, rings: the model's pools (tuples with several KV groups) and ring widths
        (see examples/llama/model.py).
      mesh: None, or the tensor-parallel mesh (``tp.forward_step`` / ``tp.decode_step``; params
        from ``tp.shard_params``, pools split over KV heads).

    Returns:
      ``(tokens [M] int32, logits [B, V] float32 or None, k_cache, v_cache)``: row ``b``'s next
      token (from the logits of its last new token) at ``tokens[b]``, zeros past ``B``; the
      caches donated.
    """
    tokens = jnp.where(gather >= 0, prev_tokens[jnp.maximum(gather, 0)], host_tokens)
    B = batch.seq_lens.shape[0]
    step_fns = llama if mesh is None else tensor_parallel
    on_mesh = {} if mesh is None else {"mesh": mesh}
    if cascade is not None and (mesh is not None or not decode):
        raise ValueError("cascade attention is for decode steps on one device")
    if decode:
        slots = batch.slot_mapping  # [T], or [G, T] with several KV groups
        slots = (_fit(slots, B, -1) if slots.ndim == 1
                 else jax.vmap(lambda s: _fit(s, B, -1))(slots))
        logits, k_cache, v_cache = step_fns.decode_step(
            params, k_cache, v_cache, _fit(tokens, B, 0), _fit(batch.positions, B, 0),
            slots, batch.page_table, batch.seq_lens,
            **({} if cascade is None else {"cascade": cascade}), config=config, rings=rings,
            **on_mesh)
    else:
        logits, k_cache, v_cache = step_fns.forward_step(
            params, k_cache, v_cache, tokens, batch.positions, batch.slot_mapping,
            batch.page_table, batch.seq_lens, batch.query_start, config=config, rings=rings,
            **on_mesh)
    with jax.named_scope("sampling"):   # a name for profiles (benchmarks/harness/device_profile)
        nxt = (llama.greedy_tokens(logits) if greedy
               else llama.sample_tokens(logits, *sampling))
        out = jax.lax.dynamic_update_slice(jnp.zeros_like(prev_tokens), nxt, (0,))
    return out, (logits if with_logits else None), k_cache, v_cache


# With FP8 weights the step is compiled without XLA's Triton GEMM fusions (its GEMMs go to
# cuBLAS/cuBLASLt): 1.04x output tok/s in `benchmarks/serve.py --workload trtllm-bench --quick` on
# an H100, equal in bench_decode_step at batch 256 (benchmarks/RESULTS.md, 2026-12-07).
FP8_WEIGHTS_XLA_OPTIONS = (("xla_gpu_enable_triton_gemm", False),)


def step_xla_options(chosen: tuple | None, params: Any) -> tuple:
    """The device step's XLA options: ``chosen`` (``ServeConfig.xla_options``) unless None, else
    the defaults for ``params``: :data:`FP8_WEIGHTS_XLA_OPTIONS` with FP8 weights, else ()."""
    if chosen is not None:
        return chosen
    return FP8_WEIGHTS_XLA_OPTIONS if fp8_weights.has_fp8_weights(params) else ()


# Inside a compiled step XLA lowers an FP8 dot whose row count is not a multiple of 16 to
# something other than cuBLASLt's FP8 GEMM: on an H100 the 8B decode step at 858 rows compiled
# none of its 128 linear GEMMs to cuBLASLt FP8 calls, at 864 all of them (weight GEMMs 10.55 vs
# 9.50 ms); trtllm-bench's mixed steps got 8% faster with the rounding (benchmarks/RESULTS.md,
# 2026-12-07). So with FP8 weights the step's row buckets are rounded up to this multiple;
# padding rows are inert (no slot, no logits). Not for bf16, whose step at 864 rows took 1.03x
# its time at 858.
FP8_GEMM_ROWS = 16


def step_kv_config(kv_config: jax_kvcm.KVCacheConfig, params: Any) -> jax_kvcm.KVCacheConfig:
    """``kv_config`` with, for FP8 ``params``, every batch and token bucket (the rows of the
    step's GEMMs) rounded up to a multiple of :data:`FP8_GEMM_ROWS`; else ``kv_config``."""
    if not fp8_weights.has_fp8_weights(params):
        return kv_config

    def up(buckets: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(sorted({-(-b // FP8_GEMM_ROWS) * FP8_GEMM_ROWS for b in buckets}))
    return dataclasses.replace(kv_config, batch_buckets=up(kv_config.batch_buckets),
                               token_buckets=up(kv_config.token_buckets))


@functools.cache
def model_step_with(xla_options: tuple[tuple[str, bool | int | str], ...] = ()):
    """:func:`model_step`, or (``xla_options`` not empty) the same function jitted with these
    XLA compiler options (``ServeConfig.xla_options``; e.g.
    ``(("xla_gpu_enable_triton_gemm", False),)``). One jitted function per option set."""
    if not xla_options:
        return model_step
    return jax.jit(model_step.__wrapped__, static_argnames=_STEP_STATIC,
                   donate_argnames=_STEP_DONATED, compiler_options=dict(xla_options))


def step_shapes(kv_config: jax_kvcm.KVCacheConfig,
                paged_decode: bool) -> list[tuple[bool, int, int]]:
    """Every ``(decode, batch bucket, token bucket)`` a serving step can take: ``B`` rows
    (``1 <= B <= max_batch``) and ``T <= max_tokens_per_step`` tokens, ``T = B`` in a decode step
    (``paged_decode``), ``T >= B`` in any other (``T > B`` with ``paged_decode``)."""
    bb, tb = kv_config.batch_buckets, kv_config.token_buckets
    max_b, max_t = kv_config.max_batch, kv_config.max_tokens_per_step
    shapes = set()
    if paged_decode:
        shapes |= {(True, bb[bisect.bisect_left(bb, n)], tb[bisect.bisect_left(tb, n)])
                   for n in range(1, min(max_b, max_t) + 1)}
    for i, b in enumerate(bb):
        least_rows = (bb[i - 1] if i else 0) + 1       # the bucket's fewest rows
        for j, t in enumerate(tb):
            most_tokens = min(t, max_t)                 # and the token bucket's most tokens
            if (least_rows <= max_b and most_tokens > (tb[j - 1] if j else 0)
                    and most_tokens >= least_rows + paged_decode):
                shapes.add((False, b, t))
    return sorted(shapes)


def program_key(decode: bool, batch_bucket: int, token_bucket: int, greedy: bool) -> tuple:
    """The compiled step program a step runs: ``(kind, batch bucket, token bucket, greedy)``,
    kind "decode" or "forward" (``Server.report``'s ``compiled_shapes``)."""
    return ("decode" if decode else "forward", batch_bucket, token_bucket, greedy)


def compile_steps(step_fn: Any, statics: dict[str, Any], params: Any, caches: Any,
                  prev_tokens: jax.Array, kv_config: jax_kvcm.KVCacheConfig,
                  shapes: list[tuple[bool, int, int]], *, greedy: bool, with_logits: bool,
                  cascade: tuple[int, int] | None, progress: bool = False) -> None:
    """Compiles ``step_fn`` (:func:`model_step_with`'s jitted step; ``statics``: its ``config``,
    ``rings`` and ``mesh``) for each ``(decode, batch bucket, token bucket)`` of ``shapes``, on
    all-padding inputs (``KVCacheConfig.padding_batch``) with the avals, shardings and static
    arguments a serving step passes, so jit's cache holds the program when such a step comes.
    Nothing runs; the pools are not touched. ``cascade``: as :func:`step_inputs`'."""
    if progress:
        from tqdm import tqdm   # the llama extra
        shapes = tqdm(shapes, desc="compiling step programs", unit="program")
    for decode, Bb, Tb in shapes:
        batch = kv_config.padding_batch(Bb, Tb)
        sampling = None if greedy else padding_sampling(Bb)
        plan = {}
        if decode and cascade is not None:
            plan["cascade"] = jax_kvcm.plan_cascade(batch.page_table, batch.seq_lens,
                                                    page_size=cascade[0],
                                                    max_members=cascade[1])
        step_fn.lower(params, *caches, prev_tokens, np.full(Tb, -1, np.int32),
                      np.zeros(Tb, np.int32), batch, sampling, decode=decode, greedy=greedy,
                      with_logits=with_logits, **plan, **statics).compile()


def model_caches(caches):
    """The manager's pools (one ``(k, v)`` per layer group) as the model takes them: one
    ``(k, v)`` pair for one group, else a tuple of ``k`` pools and one of ``v`` pools."""
    if len(caches) == 1:
        return caches[0]
    k, v = zip(*caches)
    return tuple(k), tuple(v)


@dataclasses.dataclass
class Dispatched:
    """A dispatched step whose sampled tokens the host has not read yet."""

    index: int
    tokens: jax.Array                  # [max_batch] on the device
    logits: jax.Array | None
    rows: list[tuple[RequestState, int]]   # (request, row) of every token due
    record: StepRecord | None = None   # ServeConfig.record_steps


@dataclasses.dataclass
class StepInputs:
    """The host side of one step's device inputs (see :func:`model_step`)."""

    decode: bool                       # one token per row: decode_step (paged_attention)
    host_tokens: np.ndarray            # int32 [T bucket]
    gather: np.ndarray                 # int32 [T bucket]: rows of the previous step's tokens
    due: list[int]                     # the rows whose last new token samples a token
    rows: list[RequestState]           # their requests
    greedy: bool                       # every due row greedy: no sampling inputs
    sampling: tuple | None             # (temperature, top_p, seed, stream, counter) [B bucket]
    cascade: Any = None                # decode steps with ServeConfig.cascade: the CascadeBatch


def padding_sampling(batch_bucket: int) -> tuple[np.ndarray, ...]:
    """A step's sampling inputs with no row sampling: ``(temperature 0, top_p 1, seed, stream,
    counter 0)``, ``[batch_bucket]`` each (float32, float32, int32 x 3)."""
    return (np.zeros(batch_bucket, np.float32), np.ones(batch_bucket, np.float32),
            *(np.zeros(batch_bucket, np.int32) for _ in range(3)))


def step_inputs(work: list[tuple[RequestState, int]], batch: Any,
                paged_decode: bool, cascade: tuple[int, int] | None = None) -> StepInputs:
    """What :func:`model_step` takes for ``work`` (``(request, new tokens)`` per row, in the
    order given to ``prepare_step``) and the manager's ``batch``: each row's new tokens (an
    unread token is gathered from the previous step's output on the device), the rows whose last
    token is due a sample, and the sampling parameters of those rows. ``cascade``: ``(page_size,
    max_members)`` to plan a decode step's shared-prefix groups (``jax_kvcm.plan_cascade``)."""
    counts = [n for _, n in work]
    B, T = len(work), sum(counts)
    Bb, Tb = batch.seq_lens.shape[0], batch.positions.shape[0]
    host_tokens = np.zeros(Tb, np.int32)
    gather = np.full(Tb, -1, np.int32)
    off = 0
    for r, n in work:
        if r.unread:
            gather[off] = r.last_row
        else:
            end = r.seq.num_tokens
            host_tokens[off:off + n] = r.tokens[end - n:end]
        off += n
    lens = np.asarray(batch.seq_lens)[:B].tolist()
    due = [b for b, ((r, _), n) in enumerate(zip(work, lens))
           if n == len(r.tokens) + r.unread]
    rows = [work[b][0] for b in due]
    sampling = padding_sampling(Bb)
    temp, top_p, seed, stream, counter = sampling
    temp[due] = [r.req.temperature for r in rows]
    greedy = not temp.any()
    if greedy:
        sampling = None
    else:
        top_p[due] = [r.req.top_p for r in rows]
        seed[due] = [r.req.seed for r in rows]
        stream[due] = [r.rid for r in rows]
        counter[due] = [r.num_generated for r in rows]
    decode = paged_decode and T == B
    plan = None
    if decode and cascade is not None:
        page_size, members = cascade
        plan = jax_kvcm.plan_cascade(batch.page_table, batch.seq_lens, page_size=page_size,
                                     max_members=members)
    return StepInputs(decode, host_tokens, gather, due, rows, greedy, sampling, plan)
