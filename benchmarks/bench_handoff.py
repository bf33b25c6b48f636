"""Handing a sequence's K/V between managers: export, transport, import (disaggregated prefill).

    python -m benchmarks.bench_handoff [--tokens 1024 4096] [--repeats 3] [--json out.json]
        [--transport jax mooncake] [--processes 1|2] [--device-probe MIB]

For each sequence length, on JAX's default device (the GPU when there is one), at the 8B shape
(32 layers, 8 KV heads of 128, bfloat16, 16 tokens a page: 2 MiB a page): a prefill manager
holds one sequence; the median of ``--repeats`` rounds of

- export: ``export_sequence`` (the device pages encoded through the host tier, CRC-32 per page);
- transport, per ``--transport`` (each round moves the same export through each, in turn):
  ``jax``: ``KVSender.offer`` + ``KVReceiver.fetch`` over loopback (JAX's transfer server; the
  pages staged on the CPU device as the host tier gave them);
  ``mooncake``: ``MooncakeSender.offer`` + ``MooncakeReceiver.fetch``
  (``benchmarks/harness/mooncake_transport.py``: Mooncake transfer engines, TCP over loopback,
  P2P handshake; the receiver reads the sender's registered host pages).
  Sender and receiver in this process, or with ``--processes 2`` the sender in a second one
  (handed the export outside the timing; the ticket comes back over a pipe). Every fetched page
  is compared with the exported one (byte-exact, outside the timing);
- import: ``import_sequence`` into a second manager (checksums, device pages, decode, commit) of
  the first transport's pages.

``--device-probe MIB``: a device buffer moved between two transfer servers on the default device
(no host staging, no checksums), beside a device copy: what a device-to-device handoff could
reach (:func:`device_probe`).

Prints a table (GB/s of page bytes) and writes the rows as JSON: ``transport_ms`` and
``transport_gb_per_s`` are the first transport's (named by ``transport``), ``transport_<name>_ms``
and ``transport_<name>_gb_per_s`` each other one's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
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


TRANSPORTS = ("jax", "mooncake")


def _sender(transport: str) -> Any:
    if transport == "jax":
        return KVSender()
    from benchmarks.harness.mooncake_transport import MooncakeSender
    return MooncakeSender()


def _receiver(transport: str) -> Any:
    if transport == "jax":
        return KVReceiver()
    from benchmarks.harness.mooncake_transport import MooncakeReceiver
    return MooncakeReceiver()


def _serve(transport: str, conn: Any) -> None:
    """The sender process of ``--processes 2``: offers the export it was given (stage) when
    asked (offer), then drops it (forget)."""
    sender, staged, done = _sender(transport), None, False
    while not done:
        op, arg = conn.recv()
        if op == "stage":
            staged = arg
        elif op == "offer":
            conn.send(sender.offer(staged))
            continue
        elif op == "forget":
            sender.forget(arg)
        done = op == "stop"
        conn.send(None)


class RemoteSender:
    """A sender in a second process (spawned; JAX on CPU there, as the host tier staged the
    pages): :meth:`stage` hands it an export outside the timing, :meth:`offer` has it offer
    that export (the ticket comes back over a pipe, as over any channel)."""

    def __init__(self, transport: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        old = os.environ.get("JAX_PLATFORMS")
        os.environ["JAX_PLATFORMS"] = "cpu"
        try:
            self._proc = ctx.Process(target=_serve, args=(transport, child), daemon=True)
            self._proc.start()
        finally:
            if old is None:
                os.environ.pop("JAX_PLATFORMS")
            else:
                os.environ["JAX_PLATFORMS"] = old

    def _call(self, op: str, arg: Any = None) -> Any:
        self._conn.send((op, arg))
        return self._conn.recv()

    def stage(self, export: Any) -> None:
        self._call("stage", export)

    def offer(self, export: Any) -> dict[str, Any]:
        return self._call("offer")

    def forget(self, ticket: dict[str, Any]) -> None:
        self._call("forget", ticket)

    def close(self) -> None:
        self._call("stop")
        self._proc.join(30)


def endpoints(transport: str, processes: int = 1) -> tuple[Any, Any]:
    """A (sender, receiver) pair of ``transport`` over loopback: both in this process, or
    (``processes=2``) the sender in a second one."""
    return (_sender(transport) if processes == 1 else RemoteSender(transport),
            _receiver(transport))


def one_length(tokens: int, repeats: int, layers: int, transports: tuple[str, ...] = ("jax",),
               processes: int = 1) -> dict[str, Any]:
    src, dst = manager(tokens, layers), manager(tokens, layers)
    ids = np.random.default_rng(0).integers(0, 30000, tokens, dtype=np.int32)
    seq = src.add_sequence(ids)
    batch = src.prepare_step([(seq, ids)])
    (k, v), = src.caches
    new = jnp.ones((batch.slot_mapping.shape[0], KV_HEADS, HEAD_DIM), jnp.bfloat16)
    src.complete_step([write_kv(k, v, new, new, batch.slot_mapping, layer=0)])
    ends = {t: endpoints(t, processes) for t in transports}
    keys = ["transport"] + [f"transport_{t}" for t in transports[1:]]
    times: dict[str, list[float]] = {k: [] for k in ["export", *keys, "import"]}
    nbytes = 0
    for r in range(repeats + 1):           # round 0 compiles and warms the connections
        t0 = time.perf_counter()
        exp = src.export_sequence(seq, "bench")
        t1 = time.perf_counter()
        fetched = []
        for key, t in zip(keys, transports):
            sender, receiver = ends[t]
            if hasattr(sender, "stage"):
                sender.stage(exp)
            ta = time.perf_counter()
            ticket = sender.offer(exp)
            got = receiver.fetch(ticket)
            sender.forget(ticket)
            dt = time.perf_counter() - ta
            if not all(np.array_equal(a, b) for a, b in zip(got.pages, exp.pages)):
                raise AssertionError(f"{t}: the fetched pages differ from the exported ones")
            fetched.append(got)
            if r:
                times[key].append(dt)
        t2 = time.perf_counter()
        moved = dst.import_sequence(fetched[0], "bench")
        jax.block_until_ready(dst.caches)
        t3 = time.perf_counter()
        assert moved is not None
        dst.close(moved)
        nbytes = sum(p.nbytes for p in exp.pages)
        if r:
            times["export"].append(t1 - t0)
            times["import"].append(t3 - t2)
    for sender, _ in ends.values():
        if hasattr(sender, "close"):
            sender.close()
    src.shutdown()
    dst.shutdown()
    row: dict[str, Any] = {"tokens": tokens, "pages": -(-tokens // PAGE), "bytes": nbytes,
                           "layers": layers, "processes": processes,
                           "transport": transports[0]}
    for k, v in times.items():
        ms = statistics.median(v) * 1e3
        row[f"{k}_ms"] = round(ms, 2)
        row[f"{k}_gb_per_s"] = round(nbytes / ms / 1e6, 2)
    return row


def device_probe(mib: int, repeats: int) -> dict[str, Any]:
    """JAX's transfer server moving a device buffer between two servers on JAX's default device
    (one process): no host staging, no checksums; the bound a device-to-device handoff could
    reach, next to a copy of the same bytes on the device (read + write counted)."""
    from jax.experimental import transfer
    dev = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(dev)
    src = jax.device_put(np.random.default_rng(1).integers(0, 256, mib << 20, dtype=np.uint8),
                         dev)
    a = transfer.start_transfer_server(dev.client, "127.0.0.1:0", ["127.0.0.1:0"])
    b = transfer.start_transfer_server(dev.client, "127.0.0.1:0", ["127.0.0.1:0"])
    conn = b.connect(a.address())
    spec = [jax.ShapeDtypeStruct(src.shape, src.dtype, sharding=sharding)]
    copy = jax.jit(lambda x: x + np.uint8(0))
    moved, copied = [], []
    for r in range(repeats + 1):            # round 0 warms the connection and the copy
        a.await_pull(r + 1, [src])
        t0 = time.perf_counter()
        got, = conn.pull(r + 1, spec)
        got.block_until_ready()
        t1 = time.perf_counter()
        copy(src).block_until_ready()
        t2 = time.perf_counter()
        if not bool(jnp.array_equal(got, src)):
            raise AssertionError("device probe: the pulled buffer differs")
        if r:
            moved.append(t1 - t0)
            copied.append(t2 - t1)
    nbytes = src.nbytes
    return {"what": "device buffer, JAX transfer server, 1 process", "bytes": nbytes,
            "device": dev.device_kind,
            "transfer_gb_per_s": round(nbytes / statistics.median(moved) / 1e9, 2),
            "device_copy_gb_per_s": round(2 * nbytes / statistics.median(copied) / 1e9, 1)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_handoff",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=LAYERS, help="(fewer for a quick run)")
    ap.add_argument("--transport", nargs="+", choices=TRANSPORTS, default=["jax"],
                    help="the transports measured side by side (mooncake: needs "
                         "mooncake-transfer-engine, see benchmarks/harness/mooncake_transport.py)")
    ap.add_argument("--processes", type=int, choices=(1, 2), default=1,
                    help="2: each transport's sender in a second process (spawned, JAX on CPU)")
    ap.add_argument("--device-probe", type=int, default=0, metavar="MIB",
                    help="also move a MIB-MiB device buffer through JAX's transfer server "
                         "(no host staging) beside a device copy (default: off)")
    ap.add_argument("--json", default=None)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    transports = tuple(dict.fromkeys(args.transport))
    rows = [one_length(t, args.repeats, args.layers, transports, args.processes)
            for t in args.tokens]
    dev = jax.devices()[0]
    print(f"handoff on {dev.device_kind} ({dev.platform}), {args.layers} layers x {KV_HEADS} KV "
          f"heads x {HEAD_DIM}, bf16, page {PAGE}; {args.processes} process(es); median of "
          f"{args.repeats}")
    keys = ["export", "transport"] + [f"transport_{t}" for t in transports[1:]] + ["import"]
    names = ["export", f"{transports[0]} transport"] + [f"{t} transport"
                                                        for t in transports[1:]] + ["import"]
    print("| tokens | MiB | " + " | ".join(f"{n} ms (GB/s)" for n in names) + " |")
    print("|---:|---:|" + "---|" * len(keys))
    for r in rows:
        print(f"| {r['tokens']} | {r['bytes'] / 2**20:.0f} | "
              + " | ".join(f"{r[k + '_ms']} ({r[k + '_gb_per_s']})" for k in keys) + " |")
    probe = device_probe(args.device_probe, args.repeats) if args.device_probe else None
    if probe:
        print(f"device buffer of {probe['bytes'] >> 20} MiB through JAX's transfer server: "
              f"{probe['transfer_gb_per_s']} GB/s (device copy {probe['device_copy_gb_per_s']} "
              "GB/s, read + write)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
                       "rows": rows, "device_probe": probe}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
