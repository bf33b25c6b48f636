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

Usage: ``JAX_PLATFORMS=cpu python benchmarks/manager_overhead.py [--steps 400] [--sizes 64 256 1024]``
Target (issue 4): <= 300 us per step at 256 sequences.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvcm._manager import KVCacheConfig, KVCacheManager, LayerGroupConfig

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    args = ap.parse_args()
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
