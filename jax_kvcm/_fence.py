"""Fences: the completion of asynchronous work that last touched some bytes (one module).

- :class:`Fence`: the protocol (``is_ready()``, ``wait()``); every fence here implements it.
- :class:`ArrayFence`: ready when a ``jax.Array`` (never donated) is; the fence of a migration
  or of a step (:func:`step_fence`).
- :class:`SideStreamFence`: encode calls issued on the CUDA side stream (write-back ahead).
- :class:`AllFences`: ready when every one of several fences is.

A step's fence is a few bytes sliced from its output pool (:func:`step_fence`), which the next
step does not donate. Steps run in order on XLA's stream, so a ready fence covers every step
before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import jax

from jax_kvcm import _ffi

__all__ = ["AllFences", "ArrayFence", "Fence", "SideStreamFence", "step_fence", "wait_quietly"]


@runtime_checkable
class Fence(Protocol):
    """Completion of the asynchronous work that last touched some bytes."""

    def is_ready(self) -> bool: ...

    def wait(self) -> None: ...


class ArrayFence:
    """A :class:`Fence` over a ``jax.Array``: ready when the array is (its producer finished).

    NOTE: the array must never be donated. A donated (deleted) array cannot be queried, so use a
    small output of the migration's jitted function that nothing consumes with donation (e.g. a
    scalar token), not the hot pools it writes in place. Querying a deleted array raises
    ``RuntimeError``.
    """

    __slots__ = ("array",)

    def __init__(self, array: Any) -> None:
        self.array = array

    def _check_alive(self) -> None:
        if self.array.is_deleted():
            raise RuntimeError("the fence's jax.Array was deleted (donated?); fence on an output "
                               "that is never donated")

    def is_ready(self) -> bool:
        self._check_alive()
        return bool(self.array.is_ready())

    def wait(self) -> None:
        self._check_alive()
        self.array.block_until_ready()

    def __repr__(self) -> str:
        return f"ArrayFence({type(self.array).__name__} at {id(self.array):#x})"


class SideStreamFence:
    """Completion of encode calls made with ``side_stream=True`` (CUDA): ready when the last
    call's token is (every call was issued) and every ticket's copies are done. The side stream
    runs its copies in order, but every ticket is checked and released.

    ``off_stream`` is True: XLA's stream is not ordered after these copies, so device-side
    readers of the bytes they write wait on the host (see the module docstring, (b)). ``arrays``
    (the pools the calls read) are kept alive until the fence is ready. A failure (the call's
    error, a failed copy) is raised by :meth:`wait`, every time; :meth:`is_ready` is then True.
    """

    __slots__ = ("_token", "_tickets", "_arrays", "_error", "_done")
    off_stream = True

    def __init__(self, token: jax.Array, tickets: Sequence[int], arrays: tuple = ()) -> None:
        self._token, self._tickets, self._arrays = token, list(tickets), arrays
        self._error: BaseException | None = None
        self._done = False

    def _finish(self, error: BaseException | None) -> None:
        for t in self._tickets:
            _ffi._kvcm_cuda.ticket_release(t)
        self._tickets, self._arrays, self._token = [], (), None
        self._error, self._done = error, True

    def is_ready(self) -> bool:
        if self._done:
            return True
        try:
            if not self._token.is_ready():
                return False
            for t in self._tickets:
                state = _ffi._kvcm_cuda.ticket_query(t)
                if state == 1:  # copies in flight
                    return False
                if state != 2:  # never submitted although the call ran: the call failed
                    self.wait()
                    return True
        except Exception as e:  # noqa: BLE001 - reported by wait()
            self._finish(e)
            return True
        self._finish(None)
        return True

    def wait(self) -> None:
        if not self._done:
            try:
                self._token.block_until_ready()
                for t in self._tickets:
                    if not _ffi._kvcm_cuda.ticket_wait(t):
                        raise RuntimeError(f"side-stream offload: ticket {t} was never submitted "
                                           "(its encode call failed)")
            except Exception as e:  # noqa: BLE001 - kept and raised on every wait
                self._finish(e)
            else:
                self._finish(None)
        if self._error is not None:
            raise self._error

    def __repr__(self) -> str:
        state = "failed" if self._error else ("done" if self._done else "pending")
        return f"SideStreamFence({state}, {len(self._tickets)} tickets)"


class AllFences:
    """Ready when every fence is; ``off_stream`` when any is."""

    __slots__ = ("fences", "off_stream")

    def __init__(self, fences: Sequence[Any]) -> None:
        self.fences = list(fences)
        self.off_stream = any(getattr(f, "off_stream", False) for f in fences)

    def is_ready(self) -> bool:
        return all(f.is_ready() for f in self.fences)

    def wait(self) -> None:
        errors = []
        for f in self.fences:
            try:
                f.wait()
            except Exception as e:  # noqa: BLE001 - every fence is waited on
                errors.append(e)
        if errors:
            raise errors[0]


def wait_quietly(fence: Any) -> None:
    """Waits for ``fence``; its failure is its owner's to report."""
    try:
        fence.wait()
    except Exception:  # noqa: BLE001, S110 - see the docstring
        pass


@jax.jit
def _slice_fence(pool: jax.Array) -> jax.Array:
    return pool[(slice(0, 1),) * (pool.ndim - 2)] if pool.ndim > 2 else pool.reshape(-1)[:1]


def step_fence(pool: Any) -> jax.Array:
    """A few bytes computed from a step's output pool (a ``[..., Hkv, D]`` array: the leading
    axes cut to 1, the KV-head axis kept, so a pool sharded over KV heads stays sharded, no
    collective; an arena pool's leaf likewise, or its ordering token): ready once the step is
    complete, and never donated, unlike the pool the next step takes. One small dispatch."""
    return _slice_fence(getattr(pool, "data", pool))
