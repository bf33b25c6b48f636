#!/usr/bin/env python
"""One decode shape, a few calls: the program to run under Nsight Compute (GPU machine).

Calls ``paged_attention`` (``--method ours``) or FlashInfer's tensor-core paged decode (``--method
flashinfer``, from ``--anchors DIR`` as in benchmarks/bench_attention.py) ``--calls`` times on one
random paged cache (K and V in separate buffers, a random page permutation, every row at length S),
so that ``ncu`` can profile one warm launch:

    ncu --clock-control none -k regex:PagedDecode --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python3 -m tools.decode_profile --batch 256 --context 1024
    ncu --clock-control none -k regex:BatchPrefill --launch-skip 2 --launch-count 1 ... \\
        python3 -m tools.decode_profile --method flashinfer --anchors /tmp/anchors

Shapes: ``[pages, page, Hkv, D]`` caches, ``q [B, H, D]``; bf16 unless ``--fp8`` (float8_e4m3fn
K/V, scale 1/128 per kv head). It checks nothing and times nothing: benchmarks/bench_attention.py
does both.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch may share the device

import argparse  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402


def shape_parser(batch: int, context: int) -> argparse.ArgumentParser:
    """The shape options shared with tools/prefill_profile.py (defaults: batch, context)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--context", type=int, default=context)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--calls", type=int, default=3)
    return p


def random_paged_kv(args: argparse.Namespace, rng: np.random.Generator
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 K and V ``[pages, page, Hkv, D]`` (page 0 the null page, never in the table) and
    the page table ``[B, S / page]``: every row at length S, over a random page permutation."""
    B, S, HKV, D, P = args.batch, args.context, args.kv_heads, args.head_dim, args.page
    if S % P:
        sys.exit("--context must be a multiple of --page")
    pages = B * S // P + 1
    k = rng.standard_normal((pages, P, HKV, D), np.float32)
    v = rng.standard_normal((pages, P, HKV, D), np.float32)
    table = (1 + rng.permutation(pages - 1)).reshape(B, S // P).astype(np.int32)
    return k, v, table


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m tools.decode_profile``."""
    p = shape_parser(batch=256, context=1024)
    p.prog = "python -m tools.decode_profile"
    p.add_argument("--method", choices=("ours", "flashinfer"), default="ours")
    p.add_argument("--fp8", action="store_true", help="float8_e4m3fn K/V")
    p.add_argument("--anchors", default=None, help="FlashInfer's install folder")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    B, S, H, HKV, D, P = (args.batch, args.context, args.heads, args.kv_heads, args.head_dim,
                          args.page)
    rng = np.random.default_rng(0)
    k, v, table = random_paged_kv(args, rng)
    q = rng.standard_normal((B, H, D), np.float32)
    scale = 1.0 / 128.0

    if args.method == "ours":
        import jax
        import jax.numpy as jnp

        from jax_kvcm import ops

        kv_dtype = jnp.float8_e4m3fn if args.fp8 else jnp.bfloat16
        kw = {}
        if args.fp8:
            k, v = k / scale, v / scale
            kw = {"k_scale": jnp.full((HKV,), scale, jnp.float32),
                  "v_scale": jnp.full((HKV,), scale, jnp.float32)}
        kc, vc = jnp.asarray(k, kv_dtype), jnp.asarray(v, kv_dtype)
        args_ = (jnp.asarray(q, jnp.bfloat16), kc, vc, jnp.asarray(table),
                 jnp.full((B,), S, jnp.int32))
        f = jax.jit(lambda *a: ops.paged_attention(*a, **kw))
        for _ in range(args.calls):
            f(*args_).block_until_ready()
    else:
        from benchmarks.harness import anchors as _anchors
        _anchors.prepare(args.anchors)
        import torch

        kv_dtype = torch.float8_e4m3fn if args.fp8 else torch.bfloat16
        kc = torch.from_numpy(k).to("cuda").to(kv_dtype)
        vc = torch.from_numpy(v).to("cuda").to(kv_dtype)
        qt = torch.from_numpy(q).to("cuda").to(torch.bfloat16)
        pt = torch.from_numpy(table).to("cuda")
        fn = _anchors.flashinfer_decode(torch, qt, kc, vc, pt, [S] * B, tensor_cores=True,
                                        sm_scale=D ** -0.5,
                                        kv_scale=1.0 if args.fp8 else None)
        for _ in range(args.calls):
            fn()
        torch.cuda.synchronize()
    print(f"{args.method}: {args.calls} decode calls at B={B} S={S} H={H} Hkv={HKV} D={D} "
          f"page={P}{' fp8' if args.fp8 else ''}")


if __name__ == "__main__":
    main()
