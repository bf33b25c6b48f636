"""Handing a sequence's K/V between managers: export, transport, import (disaggregated prefill).

    python -m benchmarks.bench_handoff [--tokens 1024 4096] [--repeats 3] [--json out.json]

For each sequence length, on JAX's default device (the GPU when there is one), at the 8B shape
(32 layers, 8 KV heads of 128, bfloat16, 16 tokens a page: 2 MiB a page): a prefill manager
holds one sequence; the median of ``--repeats`` rounds of

- export: ``export_sequence`` (the device pages encoded through the host tier, CRC-32 per page);
- transport: ``KVSender.offer`` + ``KVReceiver.fetch`` in one process over loopback (JAX's
  transfer server; the pages staged on the CPU device as the host tier gave them);
- import: ``import_sequence`` into a second manager (checksums, device pages, decode, commit).

Prints a table (GB/s of page bytes) and writes the rows as JSON. Mooncake's transfer engine, the
other candidate, is not measured here (see docs/manager.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvcm import KVCacheConfig, KVCacheManager, LayerGroupConfig, write_kv
from jax_kvcm.handoff import KVReceiver, KVSender

PAGE, LAYERS, KV_HEADS, HEAD_DIM = 16, 32, 8, 128


def manager(tokens: int, layers: int) -> KVCacheManager:
    pages = tokens // PAGE + 2
    page_bytes = 2 * layers * PAGE * KV_HEADS * HEAD_DIM * 2
    cfg = KVCacheConfig(
        tokens_per_page=PAGE,
        layer_groups=(LayerGroupConfig(layers, KV_HEADS, HEAD_DIM, jnp.bfloat16),),
        device_pages=2 * pages, host_bytes=int(2.5 * pages * page_bytes), max_batch=4,
        max_tokens_per_step=tokens, max_seq_len=tokens + PAGE)
    return KVCacheManager(cfg)


def one_length(tokens: int, repeats: int, layers: int) -> dict[str, Any]:
    src, dst = manager(tokens, layers), manager(tokens, layers)
    ids = np.random.default_rng(0).integers(0, 30000, tokens, dtype=np.int32)
    seq = src.add_sequence(ids)
    batch = src.prepare_step([(seq, ids)])
    (k, v), = src.caches
    new = jnp.ones((batch.slot_mapping.shape[0], KV_HEADS, HEAD_DIM), jnp.bfloat16)
    src.complete_step([write_kv(k, v, new, new, batch.slot_mapping, layer=0)])
    sender, receiver = KVSender(), KVReceiver()
    times: dict[str, list[float]] = {"export": [], "transport": [], "import": []}
    nbytes = 0
    for r in range(repeats + 1):           # round 0 compiles
        t0 = time.perf_counter()
        exp = src.export_sequence(seq, "bench")
        t1 = time.perf_counter()
        ticket = sender.offer(exp)
        got = receiver.fetch(ticket)
        sender.forget(ticket)
        t2 = time.perf_counter()
        moved = dst.import_sequence(got, "bench")
        jax.block_until_ready(dst.caches)
        t3 = time.perf_counter()
        assert moved is not None
        dst.close(moved)
        nbytes = sum(p.nbytes for p in exp.pages)
        if r:
            for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[k].append(dt)
    src.shutdown()
    dst.shutdown()
    row: dict[str, Any] = {"tokens": tokens, "pages": -(-tokens // PAGE), "bytes": nbytes,
                           "layers": layers}
    for k, v in times.items():
        ms = statistics.median(v) * 1e3
        row[f"{k}_ms"] = round(ms, 2)
        row[f"{k}_gb_per_s"] = round(nbytes / ms / 1e6, 2)
    return row


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_handoff",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=LAYERS, help="(fewer for a quick run)")
    ap.add_argument("--json", default=None)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows = [one_length(t, args.repeats, args.layers) for t in args.tokens]
    dev = jax.devices()[0]
    print(f"handoff on {dev.device_kind} ({dev.platform}), {args.layers} layers x {KV_HEADS} KV "
          f"heads x {HEAD_DIM}, bf16, page {PAGE}; median of {args.repeats}")
    print("| tokens | MiB | export ms (GB/s) | transport ms (GB/s) | import ms (GB/s) |")
    print("|---:|---:|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['bytes'] / 2**20:.0f} | "
              + " | ".join(f"{r[k + '_ms']} ({r[k + '_gb_per_s']})"
                           for k in ("export", "transport", "import")) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
                       "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
