#!/usr/bin/env python
"""Shared-prefix (cascade) decode attention against plain paged decode, on the seed workload's
decode layout (issue 38).

    python -m benchmarks.bench_cascade [--batch 256] [--kv-dtype bf16 fp8] [--json PATH]
    JAX_PLATFORMS=cpu python -m benchmarks.bench_cascade --tiny        # CPU smoke run

The layout of a decode step of ``serve.py --workload trtllm`` at concurrency ``--batch``: 15
system prompts of ``--prefix-tokens`` (shared pages, as the prefix cache leaves them), each row
one of them plus its own pages, at a length drawn from ``[--min-len, --max-len)`` (1,024-token
prompts part-way through 1,024 new tokens). Page ids are a random permutation of the pool.

For each K/V dtype:
- **op**: one layer's ``paged_attention`` over the full tables against
  ``cascade_paged_attention`` with the step's ``plan_cascade`` (planned once on the host; its host
  time is reported), after checking that the two agree (max abs difference printed);
- **model** (unless ``--no-model``): ``examples/llama/model.decode_step`` of the 8B-shaped model
  (random bf16 weights) with ``cascade=None`` and with the plan.
K/V bytes per step: every row's tokens (plain) against each group's prefix once plus every row's
own tokens (cascade), over all layers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_kvcm
from benchmarks.harness.serve_setup import LLAMA_31_8B, TINY
from benchmarks.harness.timing import time_jax
from examples.llama import model as llama

FP8 = jnp.float8_e4m3fn


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_cascade",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prefixes", type=int, default=15)
    ap.add_argument("--prefix-tokens", type=int, default=512)
    ap.add_argument("--min-len", type=int, default=1024)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--kv-dtype", nargs="+", choices=["bf16", "fp8"], default=["bf16", "fp8"])
    ap.add_argument("--members", type=int, nargs="+", default=None,
                    help="rows a group at most, one run each (default: cascade_group_size)")
    ap.add_argument("--no-model", action="store_true", help="the op only, not the model step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="the tiny float32 model (CPU)")
    ap.add_argument("--json", default=None)
    return ap


def layout(args, rng):
    """(page_table [B, P], seq_lens [B], num_pages): shared prefix pages, then own pages."""
    ps, B = args.page_size, args.batch
    pre_pages = args.prefix_tokens // ps
    lens = rng.integers(args.min_len, args.max_len, B).astype(np.int32)
    own = [-(-(int(n) - pre_pages * ps) // ps) for n in lens]
    num_pages = 1 + args.prefixes * pre_pages + sum(own)
    ids = 1 + rng.permutation(num_pages - 1).astype(np.int32)
    prefixes = ids[:args.prefixes * pre_pages].reshape(args.prefixes, pre_pages)
    width = pre_pages + max(own)
    table = np.zeros((B, width), np.int32)
    at = args.prefixes * pre_pages
    for b in range(B):
        table[b, :pre_pages] = prefixes[b % args.prefixes]
        table[b, pre_pages:pre_pages + own[b]] = ids[at:at + own[b]]
        at += own[b]
    return table, lens, num_pages


def random_caches(key, shape, dtype):
    k1, k2 = jax.random.split(key)
    f = jax.jit(lambda k: jax.random.normal(k, shape, jnp.bfloat16).astype(dtype))
    return f(k1), f(k2)


def filled_caches(shape, dtype):
    """The model step's caches: a constant (no random temporaries the size of 32 layers; the
    step's time does not depend on the values)."""
    f = jax.jit(lambda: jnp.full(shape, 0.01, dtype))
    return f(), f()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    c = TINY if args.tiny else LLAMA_31_8B
    if args.tiny:
        args.batch, args.prefixes, args.prefix_tokens = 8, 2, 32
        args.min_len, args.max_len, args.page_size = 40, 80, 8
    if jax.default_backend() == "cpu" and not args.tiny:
        print("the 8B-shaped run needs a GPU (use --tiny on CPU)", file=sys.stderr)
        return 2
    rng = np.random.default_rng(args.seed)
    table, lens, num_pages = layout(args, rng)
    Hkv, H, D, L = c.num_key_value_heads, c.num_attention_heads, c.head_dim, c.num_hidden_layers
    dev = jax.devices()[0]
    print(f"{dev.device_kind}, B {args.batch}, {args.prefixes} prefixes of {args.prefix_tokens}, "
          f"lengths [{args.min_len}, {args.max_len}), page {args.page_size}")
    plain_tokens = int(lens.sum())
    params = None if args.no_model else llama.init_params(
        c, on_device=jax.default_backend() != "cpu")
    model_dtype = jnp.dtype(c.jnp_dtype)
    rows = []
    for kv, members in [(kv, m) for kv in args.kv_dtype
                        for m in (args.members or [jax_kvcm.cascade_group_size(
                            H, Hkv, kv_dtype=FP8 if kv == "fp8" else None)])]:
        t0 = time.perf_counter()
        for _ in range(20):
            plan = jax_kvcm.plan_cascade(table, lens, page_size=args.page_size,
                                         max_members=members)
        plan_ms = (time.perf_counter() - t0) / 20 * 1e3
        cascade_tokens = int(plan.prefix_lens.sum() + plan.suffix_lens.sum())
        dtype = FP8 if kv == "fp8" else model_dtype
        itemsize = jnp.dtype(dtype).itemsize
        per_token = 2 * Hkv * D * itemsize
        scales = ({"k_scale": jnp.ones((1, Hkv), jnp.float32),
                   "v_scale": jnp.ones((1, Hkv), jnp.float32)} if kv == "fp8" else {})
        kc, vc = random_caches(jax.random.key(1), (1, num_pages, args.page_size, Hkv, D), dtype)
        q = jax.random.normal(jax.random.key(2), (args.batch, H, D), jnp.float32).astype(
            model_dtype)
        plain = jax.jit(lambda q, k, v, t, n: jax_kvcm.paged_attention(q, k, v, t, n, layer=0,
                                                                       **scales))
        casc = jax.jit(lambda q, k, v, p: jax_kvcm.cascade_paged_attention(q, k, v, p, layer=0,
                                                                           **scales))
        t_dev, n_dev, p_dev = jnp.asarray(table), jnp.asarray(lens), jax.device_put(plan)
        diff = float(jnp.abs(plain(q, kc, vc, t_dev, n_dev).astype(jnp.float32)
                             - casc(q, kc, vc, p_dev).astype(jnp.float32)).max())
        op_plain = time_jax(plain, [(q, kc, vc, t_dev, n_dev)])["ms"]
        op_casc = time_jax(casc, [(q, kc, vc, p_dev)])["ms"]
        # The cascade's two kernel calls alone: the groups' prefixes (packed heads) and the
        # rows' own pages; the rest of op_ms_cascade is packing, unpacking and the merge.
        packed = jnp.zeros((plan.members.shape[0], H * plan.members.shape[1], D), model_dtype)
        op_prefix = time_jax(plain, [(packed, kc, vc, jnp.asarray(plan.prefix_table),
                                      jnp.asarray(plan.prefix_lens))])["ms"]
        op_suffix = time_jax(plain, [(q, kc, vc, jnp.asarray(plan.suffix_table),
                                      jnp.asarray(plan.suffix_lens))])["ms"]
        row = {"kv_dtype": kv, "batch": args.batch, "members": members,
               "groups": int((plan.prefix_lens > 0).sum()),
               "max_abs_diff": diff, "plan_host_ms": plan_ms,
               "kv_gb_per_step_plain": plain_tokens * per_token * L / 1e9,
               "kv_gb_per_step_cascade": cascade_tokens * per_token * L / 1e9,
               "op_ms_plain": op_plain, "op_ms_cascade": op_casc,
               "op_ms_prefix_kernel": op_prefix, "op_ms_suffix_kernel": op_suffix,
               "op_speedup": op_plain / op_casc}
        del kc, vc
        if params is not None:
            kc, vc = filled_caches((L, num_pages, args.page_size, Hkv, D), dtype)
            if kv == "fp8":
                params = {**params, "kv_scales": {"k": jnp.ones((L, Hkv), jnp.float32),
                                                  "v": jnp.ones((L, Hkv), jnp.float32)}}
            state = {"k": kc, "v": vc}
            del kc, vc
            tokens = jnp.asarray(rng.integers(0, c.vocab_size, args.batch), jnp.int32)
            positions = jnp.asarray(lens - 1)
            slots = jnp.asarray(table[np.arange(args.batch), (lens - 1) // args.page_size]
                                * args.page_size + (lens - 1) % args.page_size)
            base = (tokens, positions, slots, t_dev, n_dev)

            def step(cascade):
                logits, state["k"], state["v"] = llama.decode_step(
                    params, state["k"], state["v"], *base, cascade, config=c)
                return logits

            row["step_ms_plain"] = time_jax(step, [(None,)], repeats=5)["ms"]
            row["step_ms_cascade"] = time_jax(step, [(p_dev,)], repeats=5)["ms"]
            row["step_speedup"] = row["step_ms_plain"] / row["step_ms_cascade"]
            state.clear()
        rows.append(row)
        print(json.dumps(row))
    print("| K/V | members (groups) | K/V GB/step plain | cascade | op ms plain | cascade (prefix "
          "+ suffix kernels) | op x | step ms plain | cascade | step x | max abs diff |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        step = (f"{r['step_ms_plain']:.2f} | {r['step_ms_cascade']:.2f} | "
                f"{r['step_speedup']:.3f}x" if "step_ms_plain" in r else "- | - | -")
        print(f"| {r['kv_dtype']} | {r['members']} ({r['groups']}) | "
              f"{r['kv_gb_per_step_plain']:.1f} | "
              f"{r['kv_gb_per_step_cascade']:.1f} | {r['op_ms_plain']:.3f} | "
              f"{r['op_ms_cascade']:.3f} ({r['op_ms_prefix_kernel']:.3f} + "
              f"{r['op_ms_suffix_kernel']:.3f}) | {r['op_speedup']:.3f}x | {step} | "
              f"{r['max_abs_diff']:.3g} |")
    if args.json:
        # NOTE: no `git rev-parse` here: the GPU runs use a snapshot without history, inside a
        # copy whose history is stale (it recorded the wrong commit); the filed result names it.
        with open(args.json, "w") as f:
            json.dump({"benchmark": "cascade", "date": time.strftime("%Y-%m-%d"),
                       "device": dev.device_kind, "platform": dev.platform,
                       "jax": jax.__version__,
                       "command": "python -m benchmarks.bench_cascade " + " ".join(
                           sys.argv[1:] if argv is None else argv),
                       "args": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
