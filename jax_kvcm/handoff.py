"""Moving a :class:`~jax_kvcm.SequenceExport` between processes (disaggregated prefill).

The page bytes travel through JAX's own transfer server (``jax.experimental.transfer``: a
PJRT-level server that serves ``jax.Array`` buffers to a peer process's pull, over sockets);
the header (token ids, layout, checksums: a small JSON object) travels on any channel the caller
has, e.g. the HTTP request that hands the sequence over. The pages are staged as arrays on
``device`` (default: the CPU device, as the host tier staged them); the importer checks every
page's CRC-32, so bytes damaged in transit are refused.

    sender = KVSender()                                  # prefill process
    ticket = sender.offer(mgr.export_sequence(seq, "llama"))   # JSON-able
    ...                                                  # ticket -> the decode process
    receiver = KVReceiver()
    seq = mgr.import_sequence(receiver.fetch(ticket), "llama")

Addresses are ``host:port`` (default ``127.0.0.1:0``: loopback, a free port). An offer is
served once: ``fetch`` pulls it, and the sender then drops it (:meth:`KVSender.forget`). The
sender must stay up until the pull is done: a pull from a sender that went away does not return
(the transfer server has no timeout): ``fetch(ticket, timeout=...)`` gives up with TimeoutError,
and nothing was imported.
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import Any

import jax
import numpy as np

from jax_kvcm.manager.handoff import SequenceExport

__all__ = ["KVReceiver", "KVSender"]

_ids = itertools.count(1)


def _server(address: str, device: Any) -> tuple[Any, Any]:
    from jax.experimental import transfer
    device = device if device is not None else jax.devices("cpu")[0]
    return transfer.start_transfer_server(device.client, address, [address]), device


class KVSender:
    """Serves exported pages to one pull each (see the module docstring)."""

    def __init__(self, address: str = "127.0.0.1:0", device: Any = None) -> None:
        self._server, self._device = _server(address, device)
        self._offered: dict[int, list[jax.Array]] = {}

    @property
    def address(self) -> str:
        return self._server.address()

    def offer(self, export: SequenceExport) -> dict[str, Any]:
        """Stages ``export``'s pages for one pull; returns the ticket (JSON-able: the export's
        header, this server's address and the transfer id)."""
        uuid = (os.getpid() << 24) + next(_ids)
        arrays = [jax.device_put(np.ascontiguousarray(p), self._device) for p in export.pages]
        self._server.await_pull(uuid, arrays)
        self._offered[uuid] = arrays   # NOTE: alive until pulled; dropped by forget()
        return {**export.header(), "address": self.address, "transfer_id": uuid}

    def forget(self, ticket: dict[str, Any]) -> None:
        """Drops an offer's staged pages (after the receiver confirmed its fetch)."""
        self._offered.pop(int(ticket["transfer_id"]), None)


class KVReceiver:
    """Pulls offered pages from senders (see the module docstring)."""

    def __init__(self, address: str = "127.0.0.1:0", device: Any = None) -> None:
        self._server, self._device = _server(address, device)
        self._conns: dict[str, Any] = {}

    def fetch(self, ticket: dict[str, Any], timeout: float | None = None) -> SequenceExport:
        """The export a :meth:`KVSender.offer` ticket names (its pages pulled here).
        ``timeout`` (seconds): TimeoutError when the pages have not all arrived by then (a
        sender that went away); nothing is imported, so the importing manager is untouched
        (the abandoned pull's thread stays blocked, and its connection is not reused)."""
        addr = str(ticket["address"])
        conn = self._conns.get(addr)
        if conn is None:
            conn = self._conns[addr] = self._server.connect(addr)
        sharding = jax.sharding.SingleDeviceSharding(self._device)
        specs = [jax.ShapeDtypeStruct(tuple(s), np.uint8, sharding=sharding)
                 for s in ticket["page_shapes"]]
        box: list[Any] = []

        def pull() -> None:
            try:
                box.append([np.asarray(a) for a in conn.pull(int(ticket["transfer_id"]),
                                                               specs)])
            except BaseException as e:  # noqa: BLE001  (re-raised in the caller)
                box.append(e)

        worker = threading.Thread(target=pull, daemon=True, name="kv-fetch")
        worker.start()
        worker.join(timeout)
        if not box:
            self._conns.pop(addr, None)
            raise TimeoutError(f"fetch: the pages of transfer {ticket['transfer_id']} from "
                               f"{addr} did not arrive in {timeout} s (is the sender up?)")
        if isinstance(box[0], BaseException):
            raise box[0]
        return SequenceExport.from_parts(ticket, box[0])
