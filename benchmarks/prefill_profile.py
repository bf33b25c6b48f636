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

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling, also under python -m
import decode_profile  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = decode_profile.shape_parser(batch=8, context=2048)
    p.description = __doc__.splitlines()[0]
    args = p.parse_args(argv)
    B, S, H, HKV, D, P = (args.batch, args.context, args.heads, args.kv_heads, args.head_dim,
                          args.page)
    import jax
    import jax.numpy as jnp

    import jax_kvcm

    rng = np.random.default_rng(0)
    k, v, table = decode_profile.random_paged_kv(args, rng)
    k, v = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
    table = jnp.asarray(table)
    q = jnp.asarray(rng.standard_normal((B * S, H, D), np.float32), jnp.bfloat16)
    seq_lens = jnp.full((B,), S, jnp.int32)
    query_start = jnp.arange(B + 1, dtype=jnp.int32) * S
    f = jax.jit(jax_kvcm.ragged_paged_attention)
    f(q, k, v, table, seq_lens, query_start).block_until_ready()  # compiled, warm
    outs = [f(q, k, v, table, seq_lens, query_start) for _ in range(args.calls - 1)]
    jax.block_until_ready(outs)  # back to back, as a serving step's layers run (nsys: the gaps)
    print(f"ours: {args.calls} prefill calls at B={B} S={S} H={H} Hkv={HKV} D={D} page={P}")


if __name__ == "__main__":
    main()
