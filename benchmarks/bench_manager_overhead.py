"""Host overhead of KVCacheManager per decode step: prepare_step + complete_step.

N active sequences with 1,024-token contexts (prefilled through the manager, caches passed straight
back: no device step), then decode steps of one new token id per sequence. Per step, the time of
``prepare_step(work)`` + ``complete_step(caches)`` (no model runs: the caches handed back are a
second set of arrays of the pools' shapes, swapped with the manager's each step, since
``complete_step`` refuses the very arrays it handed out; this measures bookkeeping). Median over many steps; prefix reuse on (every
``tokens_per_page``-th step commits one page per sequence, which is included).

The third row per size adds a second layer group with a 512-token sliding window: pages leave
its window as the sequences decode and are released (one page per sequence every
``tokens_per_page`` steps, as commits are).

Two more tables (issue 12): host time per step of a full group plus a window group (ring
tables) against the full group alone, the two managers stepped alternately (target: <= 1.2x at
256 sequences); and capacity, ``max_num_sequences`` at 32k-token contexts in the same device
bytes for all-full layers vs 3 of 4 layers windowed with W = 4,096 (target: >= 3x; the bound is
``4 * 32768 / (32768 + 3 * peak)`` with ``peak`` the window's peak in tokens, 2.9x at best).

Usage: ``JAX_PLATFORMS=cpu python -m benchmarks.bench_manager_overhead [--steps 400] [--sizes 64
256 1024] [--only rows|pair|capacity]``. Target (issue 4): <= 300 us per step at 256 sequences.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvcm import KVCacheConfig, KVCacheManager, LayerGroupConfig

TPP = 16
CONTEXT = 1024


def run(num_seqs: int, steps: int, *, ids: bool = True, prefix: bool = True,
        window: int | None = None) -> dict:
    max_len = CONTEXT + steps + TPP
    pages = num_seqs * (-(-max_len // TPP)) + 16
    groups = (LayerGroupConfig(1, 1, 8, jnp.float32),)
    if window:
        groups += (LayerGroupConfig(1, 1, 8, jnp.float32, sliding_window=window),)
    cfg = KVCacheConfig(tokens_per_page=TPP, layer_groups=groups,
                        device_pages=pages, enable_prefix_reuse=prefix, max_batch=num_seqs,
                        max_tokens_per_step=max(num_seqs, 4096), max_seq_len=2048)
    mgr = KVCacheManager(cfg, device=jax.devices("cpu")[0])
    rng = np.random.default_rng(0)
    seqs = [mgr.add_sequence(rng.integers(0, 32000, CONTEXT)) for _ in range(num_seqs)]
    chunk = 4096 // CONTEXT
    spare = [(k + 0, v + 0) for k, v in mgr.caches]  # stands for the step's outputs
    for i in range(0, num_seqs, chunk):  # prefill
        handed = mgr.caches
        mgr.prepare_step([(s, CONTEXT) for s in seqs[i:i + chunk]])
        mgr.complete_step(spare)
        spare = handed
    times = []
    for step in range(steps):
        toks = rng.integers(0, 32000, num_seqs)
        work = ([(s, toks[i:i + 1]) for i, s in enumerate(seqs)] if ids
                else [(s, 1) for s in seqs])
        handed = mgr.storage.pools
        t0 = time.perf_counter()
        mgr.prepare_step(work)
        mgr.complete_step(spare)
        spare = handed
        times.append(time.perf_counter() - t0)
    mgr.storage.close()
    t = np.asarray(times[steps // 10:]) * 1e6
    return dict(num_seqs=num_seqs, median_us=float(statistics.median(t)),
                p90_us=float(np.percentile(t, 90)), mean_us=float(t.mean()),
                committed=mgr.stats()["num_committed_pages"])


def _setup(num_seqs: int, steps: int, window: int | None, rng: np.random.Generator):
    """A manager with ``num_seqs`` prefilled sequences (a full group; with ``window``, a second
    group with that window as a ring) and the state one decode step needs."""
    max_len = CONTEXT + steps + TPP
    pages = num_seqs * (-(-max_len // TPP)) + 16
    groups = (LayerGroupConfig(1, 1, 8, jnp.float32),)
    if window:
        groups += (LayerGroupConfig(1, 1, 8, jnp.float32, sliding_window=window),)
    cfg = KVCacheConfig(tokens_per_page=TPP, layer_groups=groups, device_pages=pages,
                        max_batch=num_seqs, max_tokens_per_step=max(num_seqs, 4096),
                        max_seq_len=2048, ring_tables=True, max_window_chunk=CONTEXT)
    mgr = KVCacheManager(cfg, device=jax.devices("cpu")[0])
    seqs = [mgr.add_sequence(rng.integers(0, 32000, CONTEXT)) for _ in range(num_seqs)]
    state = {"mgr": mgr, "seqs": seqs, "spare": [(k + 0, v + 0) for k, v in mgr.caches]}
    for i in range(0, num_seqs, 4096 // CONTEXT):  # prefill
        handed = mgr.caches
        mgr.prepare_step([(s, CONTEXT) for s in seqs[i:i + 4096 // CONTEXT]])
        mgr.complete_step(state["spare"])
        state["spare"] = handed
    return state


def _step(state: dict, toks: np.ndarray) -> float:
    mgr = state["mgr"]
    work = [(s, toks[i:i + 1]) for i, s in enumerate(state["seqs"])]
    handed = mgr.storage.pools
    t0 = time.perf_counter()
    mgr.prepare_step(work)
    mgr.complete_step(state["spare"])
    dt = time.perf_counter() - t0
    state["spare"] = handed
    return dt


def two_group_overhead(num_seqs: int, steps: int, window: int = 512) -> dict:
    """Host time per decode step of one full group vs a full group plus a window group (ring
    tables), the two managers stepped alternately so machine noise hits both alike; prefix
    reuse on, token ids. Target (issue 12): ratio <= 1.2 at 256 sequences."""
    rng = np.random.default_rng(0)
    one, two = _setup(num_seqs, steps, None, rng), _setup(num_seqs, steps, window, rng)
    t1, t2 = [], []
    for step in range(steps):
        toks = rng.integers(0, 32000, num_seqs)
        if step % 2:
            t1.append(_step(one, toks))
            t2.append(_step(two, toks))
        else:
            t2.append(_step(two, toks))
            t1.append(_step(one, toks))
    for st in (one, two):
        st["mgr"].shutdown()
    a = statistics.median(t1[steps // 10:]) * 1e6
    b = statistics.median(t2[steps // 10:]) * 1e6
    ma, mb = (statistics.fmean(t[steps // 10:]) * 1e6 for t in (t1, t2))
    return dict(num_seqs=num_seqs, one_us=a, two_us=b, ratio=b / a, one_mean_us=ma,
                two_mean_us=mb, mean_ratio=mb / ma)


def capacity(context: int = 32768, window: int = 4096, budget: int = 60 * 2 ** 30,
             chunk: int = 512) -> dict:
    """``max_num_sequences(context)`` in the same device bytes for an 8B-shaped model (32
    layers, 8 kv heads of 128, bf16, 16 tokens a page) with every layer full vs 3 of 4 layers
    windowed (``window``), the latter's bytes split by ``typical_batch`` (sequences of
    ``context`` tokens) and also equally; prefill chunks of at most ``chunk`` tokens a
    sequence (``max_window_chunk``). Planning only (``KVCacheConfig.max_num_sequences``, the
    manager's call): no pools are allocated. Target (issue 12): >= 3x."""
    lg = dict(num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16)
    base = dict(tokens_per_page=16, max_seq_len=context, max_tokens_per_step=2048,
                device_bytes=budget, max_window_chunk=chunk)
    full = KVCacheConfig(layer_groups=(LayerGroupConfig(32, **lg),), **base)
    mixed = (LayerGroupConfig(8, **lg), LayerGroupConfig(24, sliding_window=window, **lg))
    equal = KVCacheConfig(layer_groups=mixed, **base)
    sized = KVCacheConfig(layer_groups=mixed, typical_batch=(context,), **base)
    n = {k: c.max_num_sequences(context) for k, c in
         (("full", full), ("equal", equal), ("sized", sized))}
    peak = int(sized.peak_pages(context)[1]) * 16
    bound = 4 * context / (context + 3 * peak)  # exact when bytes split without rounding
    return dict(n, ratio=n["sized"] / n["full"], bound=bound, window_peak_tokens=peak,
                pages=sized.device_pages)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.bench_manager_overhead``."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_manager_overhead")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--only", choices=["rows", "pair", "capacity"], default=None,
                    help="run one table only")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    if args.only in (None, "capacity"):
        print("\ncapacity: 8B-shaped, 60 GiB, 32k-token contexts, W = 4,096 on 24 of 32 layers")
        print("| max_window_chunk | all full | 3/4 windowed, equal split | 3/4 windowed, "
              "typical_batch split | ratio | bound |")
        print("|---:|---:|---:|---:|---:|---:|")
        for chunk in (2048, 512, 1):
            r = capacity(chunk=chunk)
            print(f"| {chunk} | {r['full']} | {r['equal']} | {r['sized']} | {r['ratio']:.2f}x | "
                  f"{r['bound']:.2f}x |", flush=True)
    if args.only in (None, "pair"):
        print("\ntwo groups vs one, stepped alternately (median us per step)")
        print("| sequences | one full group | + a window-512 group (ring) | ratio | "
              "means (us) | mean ratio |")
        print("|---:|---:|---:|---:|---:|---:|")
        for n in args.sizes:
            r = two_group_overhead(n, args.steps)
            print(f"| {n} | {r['one_us']:.0f} | {r['two_us']:.0f} | {r['ratio']:.2f} | "
                  f"{r['one_mean_us']:.0f} / {r['two_mean_us']:.0f} | {r['mean_ratio']:.2f} |",
                  flush=True)
    if args.only not in (None, "rows"):
        return
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, tokens_per_page {TPP}, "
          f"context {CONTEXT}, {args.steps} decode steps (first 10% dropped)")
    print("| sequences | work | median us | p90 us | mean us |")
    print("|---:|---|---:|---:|---:|")
    for n in args.sizes:
        for ids, prefix, window, label in (
                (True, True, None, "token ids, prefix reuse on"),
                (False, False, None, "counts, prefix reuse off"),
                (True, True, 512, "token ids, prefix reuse on, + a window-512 group")):
            r = run(n, args.steps, ids=ids, prefix=prefix, window=window)
            print(f"| {n} | {label} | {r['median_us']:.0f} | {r['p90_us']:.0f} | "
                  f"{r['mean_us']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
