"""Test seams for fault injection, kept out of the production classes.

- :class:`FaultyDisk` wraps a :class:`~jax_kvcm._disk_tier.DiskPool` in place of the storage
  manager's (``install_faulty_disks``): its reads fail with ``EIO`` and its writes with ``ENOSPC``
  while the test says so (a number of calls, or for good), its close may fail like an unlink
  that is refused; else it delegates.
- :func:`failing_step` is a user's step that donates the pools and fails inside XLA (an
  out-of-range ``write_kv`` slot refused by the CPU handler): the pools come back deleted.
- :func:`fail_at` raises :class:`InjectedFault` at one of the storage manager's fault points
  (e.g. ``"shard_pairs:1"``: while shard 1's part of a codec call is prepared, after shard 0's).
- :func:`bad_shard_pairs` makes one shard's codec index pairs point past the cold region, so the
  codec call fails at run time on that shard only (pools split over a mesh).
- :class:`GatedOffloads` (``install_gated_offloads``) holds the copies of write-back-ahead
  offloads "in flight" until the test opens them (or makes them fail): each offload's fence
  is wrapped in a :class:`GateFence`, an off-stream fence like the CUDA side-stream mover's.
- :class:`GatedSteps` (``install_gated_steps``) holds completed steps "running on the device"
  until the test finishes them: each step's fence is wrapped in a :class:`StepGate`.
"""

from __future__ import annotations

import contextlib
import errno
import functools

import jax
import jax.numpy as jnp

import jax_kvcm
from jax_kvcm._disk_tier import DiskFullError, DiskIOError
from jax_kvcm._fence import wait_quietly

FOREVER = -1


class FaultyDisk:
    """A disk pool whose next ``fail_reads`` reads / ``fail_writes`` writes fail (``FOREVER``:
    every one); counts the failures it injected."""

    def __init__(self, pool) -> None:
        self.__dict__.update(_pool=pool, fail_reads=0, fail_writes=0, num_failed_reads=0,
                             num_failed_writes=0, fail_close=False)

    def __getattr__(self, name):
        return getattr(self.__dict__["_pool"], name)

    def read(self, slots, dst_address, dst_pages=None):
        if self.fail_reads:
            self.fail_reads -= self.fail_reads > 0
            self.num_failed_reads += 1
            raise DiskIOError(errno.EIO, "injected read error", self._pool.path)
        return self._pool.read(slots, dst_address, dst_pages)

    def close(self):
        """Closes the pool; with ``fail_close`` then raises as a failed unlink of its name
        would."""
        self._pool.close()
        if self.fail_close:
            raise DiskIOError(errno.EACCES, "injected: cannot unlink", self._pool.path)

    def write(self, slots, src_address, src_pages=None):
        if self.fail_writes:
            self.fail_writes -= self.fail_writes > 0
            self.num_failed_writes += 1
            raise DiskFullError(errno.ENOSPC, "injected: no space left on device",
                                self._pool.path)
        return self._pool.write(slots, src_address, src_pages)


def install_faulty_disks(mgr) -> list[FaultyDisk]:
    """Wraps every disk pool of ``mgr``'s storage manager (idempotent); returns the wrappers."""
    st = mgr.storage
    st.disk_pools = [p if isinstance(p, FaultyDisk) else FaultyDisk(p) for p in st.disk_pools]
    return st.disk_pools


@functools.partial(jax.jit, donate_argnums=(0,))
def _bad_write(pools, slots):
    out = []
    for k, v in pools:
        z = jnp.zeros((1,) + k.shape[3:], k.dtype)
        out.append(jax_kvcm.write_kv(k, v, z, z, slots, layer=0))
    return out


def failing_step(pools):
    """Donates ``pools`` to a step that fails at run time; raises (the pools are deleted)."""
    return _bad_write(list(pools), jnp.array([1 << 30], jnp.int32))


class InjectedFault(RuntimeError):
    """Raised by :func:`fail_at`."""


@contextlib.contextmanager
def fail_at(storage, point: str):
    """While open, ``storage`` raises :class:`InjectedFault` at fault point ``point``."""
    def hook(p):
        if p == point:
            raise InjectedFault(point)
    storage._fault_hook = hook
    try:
        yield
    finally:
        storage._fault_hook = None


@contextlib.contextmanager
def bad_shard_pairs(storage, shard: int):
    """While open, the pairs of every sharded codec call of ``storage`` name, on ``shard``
    only, a cold piece far past the region (the other shards' pairs are untouched)."""
    import numpy as np

    from jax_kvcm._codec import PageIndexLocation
    put = storage._put_pairs

    def bad(lg, chunk, cold=0):
        arr = put(lg, chunk, cold)
        host = np.asarray(arr).copy()
        storage._unregister_pairs(arr)
        rows = slice(shard * len(chunk), (shard + 1) * len(chunk))
        host[rows, cold] = (1 << 30) + host[rows, cold]
        out = jax.device_put(host, arr.sharding)
        if storage.index_location[lg] == PageIndexLocation.HOST:   # each shard's host copy
            for s in out.addressable_shards:
                storage.codec.register_host_index_pairs(s.data, host[s.index[0]])
        return out

    storage._put_pairs = bad
    try:
        yield
    finally:
        del storage._put_pairs


class FailedCopyFence:
    """The fence of a device copy on XLA's stream that failed at run time: ready, and ``wait``
    raises (as a ``jax.Array`` in an error state does on ``block_until_ready``)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def is_ready(self) -> bool:
        return self.inner.is_ready()

    def wait(self) -> None:
        self.inner.wait()
        raise InjectedFault("device copy failed at run time")


@contextlib.contextmanager
def failed_encodes(storage):
    """While open, every device -> cold encode of ``storage`` "fails at run time": its bytes
    are written (the real call runs) but its fence fails, as when a codec call fails on the
    device after submission (tests/sharded makes a real one fail on one shard of a mesh; on one
    CPU device such a call fails at dispatch instead, which rolls back at submission)."""
    encode = storage._encode

    def failing(*args, **kwargs):
        return FailedCopyFence(encode(*args, **kwargs))

    storage._encode = failing
    try:
        yield
    finally:
        del storage._encode


class GateFence:
    """Wraps an offload's fence: not ready until :meth:`open`, or failed after :meth:`fail`
    (either waits for the wrapped copy first). ``wait`` on a closed gate counts the wait, then opens it (the
    copy "finishes" while the host waits), unless ``block_forever`` (then it raises
    AssertionError: the test said nobody may wait)."""

    off_stream = True  # like SideStreamFence: device-side readers wait on the host too

    def __init__(self, inner, gates) -> None:
        self.inner, self.gates = inner, gates
        self.state = "closed"  # closed / open / failed

    def open(self) -> None:
        if self.state == "closed":
            wait_quietly(self.inner)
            self.state = "open"

    def fail(self) -> None:
        wait_quietly(self.inner)
        self.state = "failed"

    def is_ready(self) -> bool:
        # The copy underneath finished when the gate opened or failed, so readiness is the
        # gate's alone, not how fast the CPU ran the copy (a replayed hypothesis example must
        # see the same; the manager's own polls of real step fences still vary with timing).
        return self.state != "closed"

    def wait(self) -> None:
        if self.state == "closed":
            if self.gates.block_forever:
                raise AssertionError("waited on an offload the test holds in flight")
            self.gates.num_waits += 1
            self.state = "open"
        self.inner.wait()
        if self.state == "failed":
            raise InjectedFault("offload copy")


class GatedOffloads:
    """Every write-back-ahead offload of one storage manager gets a :class:`GateFence`
    (``fences``, in order); ``num_waits``: waits on closed gates."""

    def __init__(self) -> None:
        self.fences: list[GateFence] = []
        self.num_waits = 0
        self.block_forever = False

    def __call__(self, fence):
        gate = GateFence(fence, self)
        self.fences.append(gate)
        return gate

    def open_all(self) -> None:
        for f in self.fences:
            f.open()


def install_gated_offloads(mgr) -> GatedOffloads:
    """Gates the offloads of ``mgr`` (a KVCacheManager) from now on."""
    gates = GatedOffloads()
    mgr.storage._fence_hook = gates
    return gates


class StepGate:
    """Wraps a step's fence (the array :func:`jax_kvcm._fence.step_fence` slices): the step
    "runs" until :meth:`finish` or until the manager blocks on it, either of which waits for
    the real step first. Readiness is the gate's alone, so a replayed hypothesis example sees
    the same answers, whatever the speed of the CPU under it."""

    def __init__(self, inner) -> None:
        self.inner, self.ready = inner, False

    def is_deleted(self) -> bool:
        return self.inner.is_deleted()

    def is_ready(self) -> bool:
        return self.ready

    def block_until_ready(self) -> None:
        self.finish()

    def finish(self) -> None:
        if not self.ready:
            self.inner.block_until_ready()
            self.ready = True


class GatedSteps:
    """The :class:`StepGate` of every step completed since ``install_gated_steps``, oldest
    first; :meth:`finish` finishes the oldest ``n`` still running (steps end in order)."""

    def __init__(self) -> None:
        self.gates: list[StepGate] = []

    def running(self) -> list[StepGate]:
        return [g for g in self.gates if not g.ready]

    def finish(self, n: int) -> None:
        for g in self.running()[:max(n, 0)]:
            g.finish()


def install_gated_steps(mgr) -> GatedSteps:
    """From now on, the fence that ``mgr`` (a KVCacheManager) keeps of each completed step is a
    :class:`StepGate`."""
    steps, ledger = GatedSteps(), mgr._ledger
    complete = ledger.complete

    def gated_complete(pool):
        record = complete(pool)
        ledger._fence = StepGate(ledger._fence)
        steps.gates.append(ledger._fence)
        return record

    ledger.complete = gated_complete
    return steps
