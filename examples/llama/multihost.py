"""The example server across processes joined by ``jax.distributed`` (one process per host):
tensor parallelism over every process's devices, one leader manager, followers that execute.

Every process builds the same :class:`serve.Server` (same params, same ``ServeConfig`` with
``tensor_parallel = jax.device_count()``, the global device count): the mesh spans every
process's devices, the weights and K/V pools are global ``jax.Array`` s of which each process
holds its devices' shards, and the constructor's device work (placing the params, creating the
pools) is the same SPMD program everywhere.

- **Leader** (process 0, :func:`lead`): the scheduler, the :class:`~jax_kvcm.KVCacheManager`
  and the request queue, as on one host. Before each device step it publishes the step's inputs
  (a small message: the ``StepBatch`` index buffers, the token gather/host token buffers, the
  sampling rows and the step's kind) through the coordination service's key-value store; then it
  runs the step.
- **Followers** (:func:`follow`): no scheduling and no manager decisions; for every message they
  build the same replicated arrays from it and run the same jitted step on their own shards of
  the pools, so the SPMD program (and its all-reduces, which run between processes) is identical
  everywhere. They keep their own pools and the previous step's token output (the same values as
  the leader's: the same program computed them).

Why one leader and not a manager replicated on every host: see docs/ARCHITECTURE.md (manager
decisions depend on fence readiness, local disk I/O outcomes, request arrival and wall clocks,
which differ between hosts). Why the key-value store and not a device broadcast: it is a
host-only channel, so publishing step n+1 never waits behind step n on the device (the
overlapped loop keeps its one-step lag).

Limits of this example (checked): no cold tiers (a migration would need its own message:
followers must run the same encode/decode program; designed in docs/ARCHITECTURE.md, not built),
and a failed step is not recovered across processes (a step that raises on one process fails
everywhere, as any collective does; the run ends).
"""

from __future__ import annotations

import io
from typing import Any

import jax
import numpy as np
from jax_kvcm import StepBatch

from . import serve

__all__ = ["StepChannel", "lead", "follow", "finish"]

_FIELDS = ("page_table", "seq_lens", "query_start", "slot_mapping", "positions")
_SAMPLING = ("temperature", "top_p", "seed", "stream", "counter")


class StepChannel:
    """Leader -> followers messages through the ``jax.distributed`` coordination service's
    key-value store (``<prefix>/<n>``, numbered from 0). A message is a dict of numpy arrays
    (``np.savez`` bytes, no pickle). Each follower bumps ``<prefix>/<n>/read`` after reading;
    the last reader deletes the message."""

    def __init__(self, prefix: str = "kvcm/step", timeout_s: float = 600.0) -> None:
        from jax._src import distributed   # NOTE: the coordination client has no public name
        client = distributed.global_state.client
        if client is None:
            raise RuntimeError("jax.distributed.initialize() has not been called")
        self._client, self._prefix, self._n = client, prefix, 0
        self._timeout_ms = int(timeout_s * 1000)
        self._followers = jax.process_count() - 1

    def send(self, **arrays: Any) -> None:
        buf = io.BytesIO()
        np.savez(buf, **{k: np.asarray(v) for k, v in arrays.items()})
        self._client.key_value_set_bytes(f"{self._prefix}/{self._n}", buf.getvalue())
        self._n += 1

    def recv(self) -> dict[str, np.ndarray]:
        key = f"{self._prefix}/{self._n}"
        data = self._client.blocking_key_value_get_bytes(key, self._timeout_ms)
        self._n += 1
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            msg = {k: z[k] for k in z.files}
        if self._client.key_value_increment(f"{key}/read", 1) >= self._followers:
            self._client.key_value_delete(key)
            self._client.key_value_delete(f"{key}/read")
        return msg


def _check(server: serve.Server) -> None:
    cfg = server.serve
    if cfg.tensor_parallel != jax.device_count():
        raise ValueError(f"ServeConfig.tensor_parallel must be jax.device_count() "
                         f"({jax.device_count()}: every process's devices), got "
                         f"{cfg.tensor_parallel}")
    if cfg.host_bytes or cfg.disk_bytes:
        raise ValueError("host_bytes and disk_bytes must be 0 across processes (migrations are "
                         "not published to the followers)")


def lead(server: serve.Server, channel: StepChannel) -> None:
    """Makes ``server`` (process 0's) publish every device step on ``channel`` before running
    it; then use it as on one host (``generate``, ``step``, ...) and call :func:`finish` at the
    end."""
    _check(server)
    step = server._model_step   # NOTE: the server's documented device-step seam

    def publishing(params, k, v, prev_tokens, gather, host_tokens, batch, sampling, *,
                   decode, greedy, with_logits):
        msg = {f: np.asarray(getattr(batch, f)) for f in _FIELDS}
        if sampling is not None:
            msg.update(zip(_SAMPLING, sampling))
        channel.send(op=np.asarray("step"), gather=gather, host_tokens=host_tokens,
                     flags=np.asarray([decode, greedy, with_logits]), **msg)
        return step(params, k, v, prev_tokens, gather, host_tokens, batch, sampling,
                    decode=decode, greedy=greedy, with_logits=with_logits)

    server._model_step = publishing


def finish(channel: StepChannel) -> None:
    """The leader's last message: the followers return."""
    channel.send(op=np.asarray("stop"))


def follow(server: serve.Server, channel: StepChannel) -> int:
    """A follower's loop: runs every step the leader publishes on this process's shards, until
    :func:`finish`. ``server`` is built exactly as the leader's (its manager is used only for
    the pools it created). Returns the number of steps run."""
    _check(server)
    k, v = serve.model_caches(server.manager.caches)
    prev = server._prev_tokens
    steps = 0
    while True:
        msg = channel.recv()
        if str(msg["op"]) == "stop":
            return steps
        # NOTE: numpy buffers, as the leader's manager hands them to its step (the same
        # argument types: the same compiled program on every process).
        batch = StepBatch(**{f: msg[f] for f in _FIELDS})
        sampling = (tuple(msg[f] for f in _SAMPLING) if _SAMPLING[0] in msg else None)
        decode, greedy, with_logits = (bool(x) for x in msg["flags"])
        prev, _, k, v = server._model_step(server.params, k, v, prev, msg["gather"],
                                           msg["host_tokens"], batch, sampling, decode=decode,
                                           greedy=greedy, with_logits=with_logits)
        steps += 1
