"""The Mooncake transfer engine as a transport for :class:`~jax_kvcm.SequenceExport` pages (the
other candidate of issue 37; measured against :mod:`jax_kvcm.handoff` by
``benchmarks/bench_handoff.py --transport jax mooncake``). Optional: ``mooncake`` is imported
when an engine starts, and its absence is an ImportError that says what to install.

The same staging as :mod:`jax_kvcm.handoff`: the export's host-side pages (``uint8 [n, bytes]``
per layer group, the host tier's format). The sender registers those arrays with its engine (no
copy) and hands out a ticket (the export's header, its engine's session ``host:rpc_port`` and the
arrays' addresses); the receiver registers arrays of the header's page shapes and reads the
bytes into them (``batch_transfer_sync_read``). The metadata travels by Mooncake's peer-to-peer
handshake (``P2PHANDSHAKE``: no etcd or HTTP metadata server), the bytes over its ``tcp``
protocol by default (``rdma`` where there are RDMA devices). The importer checks every page's
CRC-32, and :func:`check_pages` does here.

    sender = MooncakeSender()                        # prefill process
    ticket = sender.offer(mgr.export_sequence(seq, "llama"))      # JSON-able
    receiver = MooncakeReceiver()                    # decode process
    seq = mgr.import_sequence(receiver.fetch(ticket), "llama")
    sender.forget(ticket)                            # after the receiver confirmed
"""

from __future__ import annotations

import itertools
import os
import zlib
from typing import Any

import numpy as np

from jax_kvcm.manager.handoff import SequenceExport, page_checksums

__all__ = ["MooncakeReceiver", "MooncakeSender", "check_pages", "mooncake_available"]

INSTALL = ("the Mooncake transfer engine is not installed: pip install "
           "mooncake-transfer-engine-non-cuda (CPU; mooncake-transfer-engine or "
           "mooncake-transfer-engine-cuda13 on GPU hosts), which needs libibverbs.so.1 "
           "(Debian/Ubuntu: apt-get install libibverbs1) even for its TCP protocol")
_ids = itertools.count(1)


def mooncake_available() -> str | None:
    """None when ``mooncake.engine`` imports, else why not (for a skip reason)."""
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as e:
        return f"{INSTALL} ({e})"
    return None


def _engine(host: str, protocol: str, device_name: str) -> Any:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise ImportError(f"{INSTALL} ({e})") from e
    engine = TransferEngine()
    rc = engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
    if rc != 0:
        raise RuntimeError(f"Mooncake TransferEngine.initialize({host!r}, 'P2PHANDSHAKE', "
                           f"{protocol!r}, {device_name!r}) returned {rc}")
    return engine


def _register(engine: Any, arrays: list[np.ndarray]) -> None:
    rc = engine.batch_register_memory([a.ctypes.data for a in arrays],
                                      [a.nbytes for a in arrays])
    if rc != 0:
        raise RuntimeError(f"Mooncake batch_register_memory of {len(arrays)} buffers "
                           f"returned {rc}")


def check_pages(ticket: dict[str, Any], pages: list[np.ndarray]) -> None:
    """ValueError naming the first page whose CRC-32 differs from the ticket's."""
    for g, (p, crcs) in enumerate(zip(pages, ticket["checksums"])):
        got, want = page_checksums(p), np.asarray(crcs, np.uint32)
        for i in np.flatnonzero(got != want)[:1].tolist():
            raise ValueError(f"layer group {g} page {i}: CRC-32 {int(got[i]):#010x}, the "
                             f"sender had {int(want[i]):#010x}")


class _Peer:
    def __init__(self, host: str, protocol: str, device_name: str) -> None:
        self._host = host
        self._engine = _engine(host, protocol, device_name)

    @property
    def session(self) -> str:
        """This engine's Mooncake session name (``host:rpc_port``, the P2P handshake's)."""
        return f"{self._host}:{self._engine.get_rpc_port()}"


class MooncakeSender(_Peer):
    """Registers exported pages for the receivers' reads (see the module docstring)."""

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp",
                 device_name: str = "") -> None:
        super().__init__(host, protocol, device_name)
        self._offered: dict[int, list[np.ndarray]] = {}

    def offer(self, export: SequenceExport) -> dict[str, Any]:
        """Registers ``export``'s pages; the ticket (JSON-able): the header, this engine's
        session, the pages' addresses and an id for :meth:`forget`."""
        arrays = [np.ascontiguousarray(p, np.uint8) for p in export.pages]
        _register(self._engine, arrays)
        uuid = (os.getpid() << 24) + next(_ids)
        self._offered[uuid] = arrays   # alive (and registered) until forget()
        return {**export.header(), "session": self.session, "transfer_id": uuid,
                "addresses": [a.ctypes.data for a in arrays]}

    def forget(self, ticket: dict[str, Any]) -> None:
        """Unregisters and drops an offer's pages (after the receiver confirmed its read)."""
        arrays = self._offered.pop(int(ticket["transfer_id"]), None)
        if arrays:
            self._engine.batch_unregister_memory([a.ctypes.data for a in arrays])


class MooncakeReceiver(_Peer):
    """Reads offered pages from senders' engines (see the module docstring)."""

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp",
                 device_name: str = "") -> None:
        super().__init__(host, protocol, device_name)

    def fetch(self, ticket: dict[str, Any]) -> SequenceExport:
        """The export a :meth:`MooncakeSender.offer` ticket names, its pages read here (new
        arrays, registered for the read only). RuntimeError when the engine reports a failed
        read (e.g. a sender that went away); nothing is imported then."""
        pages = [np.empty(tuple(s), np.uint8) for s in ticket["page_shapes"]]
        live = [p for p in pages if p.nbytes]
        _register(self._engine, live)
        try:
            remote = [a for a, p in zip(ticket["addresses"], pages) if p.nbytes]
            rc = self._engine.batch_transfer_sync_read(
                str(ticket["session"]), [p.ctypes.data for p in live], [int(a) for a in remote],
                [p.nbytes for p in live])
        finally:
            self._engine.batch_unregister_memory([p.ctypes.data for p in live])
        if rc != 0:
            raise RuntimeError(f"Mooncake read of transfer {ticket['transfer_id']} from "
                               f"{ticket['session']} failed ({rc}; is the sender up?)")
        return SequenceExport.from_parts(ticket, pages)


# --- device -> device (GPU hosts, the CUDA build; not run on CPU) --------------------------------

def _location(x: Any) -> str:
    d = x.devices().pop()
    return f"cuda:{d.local_hardware_id}" if d.platform == "gpu" else "*"


def _probe_sender(protocol: str, nbytes: int, conn: Any) -> None:
    import jax
    x = jax.device_put(np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8),
                       jax.devices()[0]).block_until_ready()
    engine = _engine("127.0.0.1", protocol, "")
    ptr = x.unsafe_buffer_pointer()
    if engine.register_memory(ptr, nbytes, _location(x)) != 0:
        raise RuntimeError("register_memory of the JAX device buffer failed")
    conn.send((f"127.0.0.1:{engine.get_rpc_port()}", ptr, zlib.crc32(np.asarray(x))))
    conn.recv()


def device_probe(protocol: str = "nvlink_intra", mib: int = 128, repeats: int = 3) -> dict:
    """GB/s of a Mooncake read between two processes' JAX device buffers on GPU 0 (the CUDA
    build; ``protocol`` ``nvlink_intra``: CUDA IPC on one host, or ``tcp``: staged through
    host memory inside Mooncake), byte-exact, next to an on-device copy of the same bytes
    (``device_copy_gb_per_s``: bytes read + written per second). On a CPU-only JAX the same
    runs over host buffers (a smoke test of this code)."""
    import multiprocessing
    import time

    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # two processes, one GPU
    import jax
    import jax.numpy as jnp
    nbytes = mib << 20
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_probe_sender, args=(protocol, nbytes, child), daemon=True)
    proc.start()
    if not conn.poll(300):
        raise RuntimeError(f"the sender process sent nothing (exit code {proc.exitcode})")
    session, remote, crc = conn.recv()
    engine = _engine("127.0.0.1", protocol, "")
    y = jnp.zeros(nbytes, jnp.uint8).block_until_ready()
    ptr = y.unsafe_buffer_pointer()
    if engine.register_memory(ptr, nbytes, _location(y)) != 0:
        raise RuntimeError("register_memory of the JAX device buffer failed")
    times = []
    for r in range(repeats + 1):
        t = time.perf_counter()
        rc = engine.transfer_sync_read(session, ptr, remote, nbytes)
        dt = time.perf_counter() - t
        if rc != 0:
            raise RuntimeError(f"transfer_sync_read over {protocol} returned {rc}")
        if r:
            times.append(dt)
    exact = zlib.crc32(np.asarray(y)) == crc
    copy = jax.jit(lambda a: a + jnp.uint8(1))
    copy(y).block_until_ready()
    ct = []
    for _ in range(repeats):
        t = time.perf_counter()
        copy(y).block_until_ready()
        ct.append(time.perf_counter() - t)
    conn.send("done")
    proc.join(30)
    med = sorted(times)[len(times) // 2]
    return {"protocol": protocol, "bytes": nbytes, "byte_exact": exact,
            "read_ms": round(med * 1e3, 3), "read_gb_per_s": round(nbytes / med / 1e9, 2),
            "device_copy_gb_per_s": round(2 * nbytes / sorted(ct)[len(ct) // 2] / 1e9, 1),
            "device": jax.devices()[0].device_kind}


if __name__ == "__main__":
    import argparse
    import json
    ap = argparse.ArgumentParser(prog="python -m benchmarks.harness.mooncake_transport",
                                 description="device_probe: a Mooncake read between two "
                                             "processes' JAX GPU buffers")
    ap.add_argument("--protocol", nargs="+", default=["nvlink_intra", "tcp"])
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    for p in a.protocol:
        try:
            print(json.dumps(device_probe(p, a.mib, a.repeats)), flush=True)
        except Exception as e:  # noqa: BLE001  (one protocol failing leaves the others)
            print(json.dumps({"protocol": p, "error": f"{type(e).__name__}: {e}"}), flush=True)
