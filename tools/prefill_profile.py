#!/usr/bin/env python
"""One causal prefill shape, a few calls: the program to run under Nsight Compute (GPU machine).

Calls ``ragged_paged_attention`` ``--calls`` times on one random paged cache (every sequence a
whole ``--context``-token prompt over its own pages, a random page permutation), so that ``ncu``
can profile one warm launch of the prefill kernel. ``--method flashinfer`` / ``cudnn`` run
FlashInfer's FA3 paged prefill over the same pages, or cuDNN on them made dense, so that ncu
times their kernels the same way:

    ncu --clock-control none -k regex:RaggedPrefill --launch-skip 2 --launch-count 1 --set full \\
        python3 -m tools.prefill_profile --batch 8 --context 2048

Shapes: ``q [B * S, H, D]``, ``[pages, page, Hkv, D]`` caches, bf16. It checks nothing and times
nothing: benchmarks/bench_attention.py does both. With ``--trace DIR`` the calls after the first run
under ``jax.profiler``, and it prints the device ops and the gaps between them (where a call's
wall time goes outside the prefill kernel; Nsight Systems is not on the GPU machine).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402

from tools import decode_profile  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m tools.prefill_profile``."""
    p = decode_profile.shape_parser(batch=8, context=2048)
    p.prog = "python -m tools.prefill_profile"
    p.description = __doc__.splitlines()[0]
    p.add_argument("--method", choices=("ours", "flashinfer", "cudnn"), default="ours",
                   help="ours, FlashInfer's FA3 paged prefill (--anchors) or cuDNN on dense K/V")
    p.add_argument("--anchors", default=None, help="FlashInfer's install folder")
    p.add_argument("--trace", metavar="DIR", default=None,
                   help="run the calls under jax.profiler into DIR and print the compiled "
                        "program's instructions and the device ops with the gaps between them "
                        "(ours and cudnn)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    B, S, H, HKV, D, P = (args.batch, args.context, args.heads, args.kv_heads, args.head_dim,
                          args.page)
    rng = np.random.default_rng(0)
    k, v, table = decode_profile.random_paged_kv(args, rng)
    q = rng.standard_normal((B * S, H, D), np.float32)
    if args.method == "flashinfer":
        if args.trace is not None:
            sys.exit("--trace is for the JAX methods (ours, cudnn)")
        run_flashinfer(args, q, k, v, table)
    else:
        run_jax(args, q, k, v, table)
    print(f"{args.method}: {args.calls} prefill calls at B={B} S={S} H={H} Hkv={HKV} D={D} "
          f"page={P}")


def run_jax(args, q, k, v, table) -> None:
    """Ours over the pages, or cuDNN's flash attention on the same K/V made dense (GQA)."""
    import jax
    import jax.numpy as jnp

    import jax_kvcm

    B, S, H, HKV, D = args.batch, args.context, args.heads, args.kv_heads, args.head_dim
    qj = jnp.asarray(q, jnp.bfloat16)
    if args.method == "ours":
        call_args = (qj, jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16),
                     jnp.asarray(table), jnp.full((B,), S, jnp.int32),
                     jnp.arange(B + 1, dtype=jnp.int32) * S)
        f = jax.jit(jax_kvcm.ragged_paged_attention)
    else:
        def dense(x):  # [pages, page, Hkv, D] -> [B, S, Hkv, D] in the table's order
            return jnp.asarray(x[table].reshape(B, S, HKV, D), jnp.bfloat16)
        call_args = (qj.reshape(B, S, H, D), dense(k), dense(v))
        f = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn"))
    f(*call_args).block_until_ready()  # compiled, warm

    def back_to_back():  # as a serving step's layers run
        outs = [f(*call_args) for _ in range(args.calls - 1)]
        jax.block_until_ready(outs)

    if args.trace is None:
        back_to_back()
    else:
        trace_gaps(f, call_args, back_to_back, args.trace)


def run_flashinfer(args, q, k, v, table) -> None:
    """FlashInfer's FA3 paged prefill over the same pages, calls back to back."""
    from benchmarks.harness import anchors as _anchors
    _anchors.prepare(args.anchors)
    import torch

    B, S, D = args.batch, args.context, args.head_dim
    cuda = lambda x, dt: torch.from_numpy(x).to("cuda").to(dt)  # noqa: E731
    fn = _anchors.flashinfer_prefill(
        torch, cuda(q, torch.bfloat16), cuda(k, torch.bfloat16), cuda(v, torch.bfloat16),
        torch.from_numpy(table).to("cuda"), [S] * B, [S] * B, backend="fa3", sm_scale=D ** -0.5)
    fn()
    torch.cuda.synchronize()
    for _ in range(args.calls - 1):
        fn()
    torch.cuda.synchronize()


def trace_gaps(f, call_args, run, trace_dir: str) -> None:
    """The compiled program's ENTRY instructions (a copy or transpose XLA put around the custom
    call would show here), then ``run()`` under jax.profiler and its device ops in time order
    with the idle gap before each (tools/kernel_gaps.py), the last two calls' worth."""
    import jax

    from benchmarks.harness import device_profile as _profile
    from tools import kernel_gaps

    hlo = f.lower(*call_args).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):].split("\n}")[0].splitlines()[1:]
    print("compiled ENTRY instructions:")
    for line in entry:
        print("  " + line.strip()[:160])
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        run()
    trace = _profile.load_trace(trace_dir, kernel_names=True)
    ops = [(o.ts, o.dur, o.name) for o in trace.ops]
    print(f"{len(trace.executions)} executions, {len(ops)} device ops")
    if ops:
        per_call = max(1, len(ops) // max(1, len(trace.executions)))
        print(kernel_gaps.report(ops, last=2 * per_call + 1))


if __name__ == "__main__":
    main()
