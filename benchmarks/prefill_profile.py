#!/usr/bin/env python
"""One causal prefill shape, a few calls: the program to run under Nsight Compute (GPU machine).

Calls ``ragged_paged_attention`` ``--calls`` times on one random paged cache (every sequence a
whole ``--context``-token prompt over its own pages, a random page permutation), so that ``ncu``
can profile one warm launch of the prefill kernel:

    ncu --clock-control none -k regex:RaggedPrefill --launch-skip 2 --launch-count 1 --set full \\
        python3 benchmarks/prefill_profile.py --batch 8 --context 2048

Shapes: ``q [B * S, H, D]``, ``[pages, page, Hkv, D]`` caches, bf16. It checks nothing and times
nothing: benchmarks/attention.py does both.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--calls", type=int, default=3)
    args = p.parse_args(argv)

    B, S, H, HKV, D, P = (args.batch, args.context, args.heads, args.kv_heads, args.head_dim,
                          args.page)
    if S % P:
        sys.exit("--context must be a multiple of --page")
    import jax
    import jax.numpy as jnp

    import jax_kvcm

    pages = B * S // P + 1  # page 0 is the null page
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((pages, P, HKV, D), np.float32), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((pages, P, HKV, D), np.float32), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((B * S, H, D), np.float32), jnp.bfloat16)
    table = jnp.asarray((1 + rng.permutation(pages - 1)).reshape(B, S // P).astype(np.int32))
    seq_lens = jnp.full((B,), S, jnp.int32)
    query_start = jnp.arange(B + 1, dtype=jnp.int32) * S
    f = jax.jit(jax_kvcm.ragged_paged_attention)
    for _ in range(args.calls):
        f(q, k, v, table, seq_lens, query_start).block_until_ready()
    print(f"ours: {args.calls} prefill calls at B={B} S={S} H={H} Hkv={HKV} D={D} page={P}")


if __name__ == "__main__":
    main()
