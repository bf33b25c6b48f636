#!/usr/bin/env python
"""Does the page layout cost decode bandwidth? ``paged_attention`` over the same bytes per row in
two layouts (GPU machine):

    python -m tools.decode_layout [--json out.json]
    JAX_PLATFORMS=cpu python -m tools.decode_layout --quick    # CPU smoke test

- ``interleaved``: the package's layout, ``[pages, 16, Hkv=8, D=128]``, H=32 (G=4). A (batch,
  kv head) row reads, per 16-token tile, 16 runs of D elements (256 bytes in bf16, 128 in fp8)
  ``Hkv * D`` elements apart.
- ``contiguous``: ``Hkv=1``, H=4 (G=4), B x 8 sequences. The same rows (B * 8), the same tiles per
  row and the same bytes, but a tile is one contiguous run (4 KiB bf16, 2 KiB fp8), as in a
  ``[pages, Hkv, 16, D]`` (head-major) page.

Both in bf16 and in float8_e4m3fn (benchmarks/harness/attention_cases.py's fp8_caches: one
power-of-two scale, the same for every kv head). Every output is checked against the float32
reference (also bench_attention.py's) before it is timed. The ratio ``contiguous / interleaved`` < 1
says the interleaved layout's strided runs cost DRAM bandwidth.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import json  # noqa: E402

import numpy as np  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.harness.attention_cases import check, fp8_caches, reference_decode  # noqa: E402
from benchmarks.harness import timing as _timing  # noqa: E402

import jax_kvcm  # noqa: E402

PAGE, D, G, HKV = 16, 128, 4, 8
SHAPES = [(64, 4096), (256, 1024), (8, 32768)]


def one(b: int, s: int, hkv: int, fp8: bool, seed: int, repeats: int) -> dict:
    """Time ``paged_attention`` at b sequences of length s, hkv kv heads, G query heads each."""
    keys = jax.random.split(jax.random.key(seed), 4)
    pages = b * s // PAGE + 1
    k = jax.random.normal(keys[0], (pages, PAGE, hkv, D), jnp.bfloat16)
    v = jax.random.normal(keys[1], (pages, PAGE, hkv, D), jnp.bfloat16)
    rng = np.random.default_rng(seed)
    table = jnp.asarray((1 + rng.permutation(pages - 1)).reshape(b, s // PAGE).astype(np.int32))
    lens = jnp.full((b,), s, jnp.int32)
    q_check = jax.random.normal(keys[2], (b, hkv * G, D), jnp.bfloat16)
    q_time = jax.random.normal(keys[3], (b, hkv * G, D), jnp.bfloat16)
    k_ref, v_ref = k, v
    if fp8:
        k, v, scale, k_ref, v_ref = fp8_caches(k, v)
        sc = jnp.full((hkv,), scale, jnp.float32)
        fn = jax.jit(lambda q, k, v, t, l: jax_kvcm.paged_attention(q, k, v, t, l, k_scale=sc,
                                                                    v_scale=sc))
    else:
        fn = jax.jit(jax_kvcm.paged_attention)
    ref = reference_decode(q_check, k_ref, v_ref, table, lens)
    del k_ref, v_ref
    c = check(fn(q_check, k, v, table, lens), ref)
    t = _timing.time_jax(fn, [(q_time, k, v, table, lens), (q_check, k, v, table, lens)],
                         repeats=repeats)
    kv_bytes = 2 * b * s * hkv * D * (1 if fp8 else 2)
    return {"ms": t["ms"], "samples_ms": t["samples_ms"], "check": c["text"], "ok": c["ok"],
            "tb_s": kv_bytes / (t["ms"] * 1e-3) / 1e12}


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m tools.decode_layout``."""
    p = argparse.ArgumentParser(
        prog="python -m tools.decode_layout", description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    print(f"seed {args.seed}; {jax.devices()[0].device_kind}")
    results = []
    for b, s in [(2, 256)] if args.quick else SHAPES:
        for fp8 in (False, True):
            inter = one(b, s, HKV, fp8, args.seed, args.repeats)
            contig = one(b * HKV, s, 1, fp8, args.seed, args.repeats)
            results.append({"shape": f"B={b} S={s}", "dtype": "fp8" if fp8 else "bf16",
                            "interleaved": inter, "contiguous": contig})
            print(f"B={b} S={s} {'fp8 ' if fp8 else 'bf16'}: interleaved {inter['ms']:.4f} ms "
                  f"({inter['tb_s']:.2f} TB/s, {inter['check']}), contiguous {contig['ms']:.4f} "
                  f"ms ({contig['tb_s']:.2f} TB/s, {contig['check']}), contiguous / interleaved "
                  f"{contig['ms'] / inter['ms']:.3f}", flush=True)
    print("\n| shape | K/V | interleaved ms | TB/s | contiguous ms | TB/s | contiguous / inter |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in results:
        i, c = r["interleaved"], r["contiguous"]
        print(f"| {r['shape']} | {r['dtype']} | {i['ms']:.4f} | {i['tb_s']:.2f} | {c['ms']:.4f} "
              f"| {c['tb_s']:.2f} | {c['ms'] / i['ms']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r[k]["ok"] for r in results for k in ("interleaved", "contiguous")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
