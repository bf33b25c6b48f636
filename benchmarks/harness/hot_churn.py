"""Shared-prefix churn through the manager alone: host time per step, paged vs arena, same bytes.

The serving loop of ``examples/llama`` without the model: requests (a system prompt drawn from
``prefixes``, a unique part, ``output_tokens`` to generate) are admitted while pages are
obtainable, decoded one token a step beside chunked prefills, preempted (closed, requeued for
recompute) on :class:`~jax_kvcm.OutOfPagesError`, and closed when done. The step itself is one
``write_kv`` per pool (real slot mapping, zeros written), so the manager sees real returned
pools; only the manager's calls are timed: ``add_sequence`` (admission), ``prepare_step``,
``complete_step``, ``close``.

The pool geometry is the 8B shape on the H200 scaled down: two pages per arena chunk (the
memfd super-page is 4 KiB; a page of one pool is 2 KiB).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvcm import (ArenaHot, CacheLevel, KVCacheConfig, KVCacheManager, LayerGroupConfig,
                      OutOfPagesError, PagedHot, write_kv)

HEAD_DIM = 32          # one layer, one KV head, float32: a pool page is 16 x 32 x 4 = 2 KiB
SUPER_PAGE = 4096      # the memfd super-page: two pages per chunk, as the 8B shape on the H200


@dataclasses.dataclass(frozen=True)
class ChurnSpec:
    """The workload: ``requests`` requests, ``concurrency`` at a time, in ``device_pages``."""

    concurrency: int = 256
    requests: int = 768
    prefixes: int = 15
    prefix_tokens: int = 512
    unique_tokens: tuple[int, int] = (64, 512)
    output_tokens: tuple[int, int] = (64, 256)
    tokens_per_page: int = 16
    device_pages: int = 0           # 0: 3/4 of what every running sequence needs at its longest
    max_tokens_per_step: int = 2048
    seed: int = 0

    def max_seq_len(self) -> int:
        return self.prefix_tokens + self.unique_tokens[1] + self.output_tokens[1]

    def pages(self) -> int:
        if self.device_pages:
            return self.device_pages
        return int(0.75 * self.concurrency * -(-self.max_seq_len() // self.tokens_per_page))


def _config(spec: ChurnSpec, hot: str) -> KVCacheConfig:
    lg = LayerGroupConfig(num_layers=1, num_kv_heads=1, head_dim=HEAD_DIM, dtype=jnp.float32)
    hot_tier = (PagedHot() if hot == "paged" else
                ArenaHot(max_sequences=2 * spec.concurrency, super_page_bytes=SUPER_PAGE,
                         backend="cpu"))
    return KVCacheConfig(tokens_per_page=spec.tokens_per_page, layer_groups=(lg,),
                         device_pages=spec.pages(), max_batch=spec.concurrency,
                         max_tokens_per_step=spec.max_tokens_per_step,
                         max_seq_len=spec.max_seq_len(), hot=hot_tier)


def _requests(spec: ChurnSpec) -> list[tuple[np.ndarray, int]]:
    rng = np.random.default_rng(spec.seed)
    systems = [rng.integers(0, 32000, spec.prefix_tokens, dtype=np.int32)
               for _ in range(spec.prefixes)]
    out = []
    for _ in range(spec.requests):
        unique = rng.integers(0, 32000, int(rng.integers(*spec.unique_tokens)), dtype=np.int32)
        prompt = np.concatenate([systems[int(rng.integers(spec.prefixes))], unique])
        out.append((prompt, int(rng.integers(*spec.output_tokens))))
    return out


@jax.jit
def _write(k, v, slot_mapping):
    zeros = jnp.zeros((slot_mapping.shape[0],) + k.shape[-2:], k.dtype)
    return write_kv(k, v, zeros, zeros, slot_mapping, layer=0)


def churn(spec: ChurnSpec, hot: str) -> dict:
    """Runs the workload on ``hot`` ("paged" or "arena"); per-step manager host times (us) and
    counters."""
    mgr = KVCacheManager(_config(spec, hot), device=jax.devices("cpu")[0])
    tpp = spec.tokens_per_page
    waiting = deque([{"prompt": p, "out": n, "tokens": list(p), "seq": None}
                     for p, n in _requests(spec)])
    running: list[dict] = []
    rng = np.random.default_rng(spec.seed + 1)
    times: list[float] = []
    parts = {"admit": 0.0, "prepare": 0.0, "complete": 0.0, "close": 0.0}
    preemptions = steps = generated = peak_used = peak_mapped = 0
    calls: list[tuple[int, int]] = []   # arena: (map, unmap) calls so far, after each step
    while waiting or running:
        t_step = 0.0
        t0 = time.perf_counter()
        while waiting and len(running) < spec.concurrency:
            r = waiting[0]
            room = mgr.num_obtainable_pages(CacheLevel.DEVICE) - len(running)
            if running and -(-(len(r["tokens"]) + 1) // tpp) > room:
                break
            waiting.popleft()
            r["seq"] = mgr.add_sequence(np.asarray(r["tokens"], np.int32))
            running.append(r)
        dt = time.perf_counter() - t0
        parts["admit"] += dt
        t_step += dt
        while True:
            budget = spec.max_tokens_per_step
            work = []
            for r in running:
                left = len(r["tokens"]) - r["seq"].num_tokens
                if left == 0:
                    work.append((r, 1))
                    budget -= 1
            for r in running:
                left = len(r["tokens"]) - r["seq"].num_tokens
                if left > 0 and budget > 0:
                    work.append((r, min(left, budget)))
                    budget -= min(left, budget)
            items, decoding = [], []
            for r, n in work:
                nt = r["seq"].num_tokens
                if nt == len(r["tokens"]):   # decoding: the token it generated last step
                    r["tokens"].append(int(rng.integers(0, 32000)))
                    decoding.append(r)
                items.append((r["seq"], np.asarray(r["tokens"][nt:nt + n], np.int32)))
            t0 = time.perf_counter()
            try:
                batch = mgr.prepare_step(items)
            except OutOfPagesError:
                for r in decoding:           # the ids not consumed: drawn again next try
                    r["tokens"].pop()
                victim = running.pop()       # the newest: recomputed from its tokens later
                mgr.close(victim["seq"])
                waiting.appendleft(victim)
                preemptions += 1
                t_step += time.perf_counter() - t0
                continue
            dt = time.perf_counter() - t0
            parts["prepare"] += dt
            t_step += dt
            generated += len(decoding)
            break
        caches = [_write(k, v, batch.slot_mapping) for k, v in mgr.caches]
        t0 = time.perf_counter()
        mgr.complete_step(caches)
        dt = time.perf_counter() - t0
        parts["complete"] += dt
        t_step += dt
        t0 = time.perf_counter()
        still = []
        for r in running:
            done = len(r["tokens"]) - len(r["prompt"])
            if done >= r["out"] and r["seq"].num_tokens == len(r["tokens"]):
                mgr.close(r["seq"])
            else:
                still.append(r)
        running = still
        dt = time.perf_counter() - t0
        parts["close"] += dt
        t_step += dt
        times.append(t_step)
        steps += 1
        # NOTE: outside the timed calls: pages holding data (referenced, cached, pending), and
        # on the arena the pages its mapped chunks hold (what it keeps physical)
        pages = mgr.stats()["pages"]["device"]
        peak_used = max(peak_used, pages["capacity"] - pages["free"])
        if hot == "arena":
            a = mgr.stats()["arena"]
            peak_mapped = max(peak_mapped, a["mapped_chunks"] * a["pages_per_chunk"])
            calls.append((a["num_map_calls"], a["num_unmap_calls"]))
    stats = mgr.stats()
    mgr.shutdown()
    t = np.asarray(times) * 1e6
    out = dict(hot=hot, steps=steps, preemptions=preemptions, generated=int(generated),
               median_us=float(statistics.median(t)), p90_us=float(np.percentile(t, 90)),
               p99_us=float(np.percentile(t, 99)), mean_us=float(t.mean()),
               max_us=float(t.max()), device_pages=spec.pages(),
               **{f"{k}_us_per_step": v * 1e6 / steps for k, v in parts.items()},
               prefix_hit_tokens=int(stats["num_prefix_hit_tokens"]),
               peak_used_pages=peak_used,
               peak_physical_pages=peak_mapped if hot == "arena" else spec.pages())
    if calls:
        # Map / unmap calls in each quarter of the run's steps: a budget still filling maps in
        # the early quarters; churn maps (and unmaps) in the late ones too.
        totals = np.asarray([(0, 0)] + calls)   # [steps + 1, 2]: calls so far
        marks = totals[np.linspace(0, len(calls), 5).astype(int)]
        out["arena_map_calls_by_quarter"] = np.diff(marks[:, 0]).tolist()
        out["arena_unmap_calls_by_quarter"] = np.diff(marks[:, 1]).tolist()
        # Map calls per step (each a native map of one super-page: its host cost on the GPU is
        # the bench's map_us): a step's burst is host time before that step can be dispatched.
        per_step = np.diff(totals[:, 0])
        out["arena_map_calls_per_step_p50"] = float(np.percentile(per_step, 50))
        out["arena_map_calls_per_step_p90"] = float(np.percentile(per_step, 90))
        out["arena_map_calls_per_step_max"] = int(per_step.max())
        out["arena_steps_with_map_calls"] = int(np.count_nonzero(per_step))
    if "arena" in stats:
        a = stats["arena"]
        out.update({f"arena_{k}": a[k] for k in ("num_map_calls", "num_unmap_calls",
                                                 "adoptions", "fresh_ranges",
                                                 "blocking_reclaims", "evicted_on_bind",
                                                 "affine_pages", "peak_physical_bytes",
                                                 "num_quiesces", "reclaimed_chunks")})
    return out
