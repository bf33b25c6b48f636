"""Suspend / resume of arena sequences through the storage manager's migration transaction.

The arena's pages are not storage slots (a sequence's range is the arena's, mapped on demand),
so the storage manager sees the arena's device tier through a *staging pool*: one hot pool group
of ``max_pages_per_sequence`` slots (plus the null slot), an ordinary device array pair. A suspend
copies the sequence's pages from the arena into staging slots on the device (one gather that
reads the arena in place, ordered after the last step on XLA's stream), then moves those slots to
host -- else disk -- with :meth:`StorageManager.migrate_many`: the cold tier's bytes and slots
are reserved before anything is submitted, so a cold tier that cannot take them (host
exhaustion, the seed's fourth bug) refuses with nothing changed; the sequence is untouched
either way until the transaction succeeded. A resume moves the cold slots back into staging
slots (one transaction; a corrupt disk page raises with nothing changed) and copies them into
the sequence's fresh range (GPU: a scatter that donates the arena pools, in place; CPU: host
writes, since XLA's CPU client would copy a donated imported pool, see ``_arena_ops.py``).

Cold pages use the storage manager's codec (the default lossless concatenating codec, or the one
given to the manager), its governor, host pool and disk pool, exactly as the paged backend's.
The staging pool is device memory outside ``ArenaConfig.budget_bytes``: ``2 * num_layers *
(max_pages_per_sequence + 1)`` slots.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jax_kvcm._arena import Arena, ArenaSequence
from jax_kvcm._storage import LayerGroupSpec, StorageConfig, StorageManager
from jax_kvcm._types import CacheLevel

__all__ = ["ArenaColdStore"]

_D = CacheLevel.DEVICE


def _gather(stage_k: jax.Array, stage_v: jax.Array, k: jax.Array, v: jax.Array,
            dst: jax.Array, src: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Arena slots ``src`` -> staging slots ``dst`` (reads only ``src`` of the arena)."""
    return stage_k.at[:, dst].set(k[:, src]), stage_v.at[:, dst].set(v[:, src])


def _scatter(k: jax.Array, v: jax.Array, stage_k: jax.Array, stage_v: jax.Array,
             dst: jax.Array, src: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Staging slots ``src`` -> arena slots ``dst`` (writes only ``dst`` of the arena)."""
    return k.at[:, dst].set(stage_k[:, src]), v.at[:, dst].set(stage_v[:, src])


class ArenaColdStore:
    """The cold tiers of an arena manager (see the module docstring).

    ``spec``: the arena's hot layout; ``host_bytes`` / ``disk_dir`` / ``disk_bytes`` as in
    :class:`~jax_kvcm._storage.StorageConfig`; ``codec`` is consumed as there.
    """

    def __init__(self, arena: Arena, spec: LayerGroupSpec, *, host_bytes: int,
                 disk_dir: str | None, disk_bytes: int, codec: Any = None,
                 device: jax.Device | None = None) -> None:
        self.arena = arena
        self.storage = StorageManager(
            StorageConfig(layer_groups=(spec,),
                          device_slots=(arena.config.max_pages_per_sequence,),
                          host_bytes=host_bytes, disk_dir=disk_dir, disk_bytes=disk_bytes),
            codec, device=device)
        self.levels = [lv for lv in (CacheLevel.HOST, CacheLevel.DISK)
                       if self.storage.has_level(lv)]
        self._gather = jax.jit(_gather, donate_argnums=(0, 1))
        self._scatter = jax.jit(_scatter, donate_argnums=(0, 1))

    def suspend(self, seq: ArenaSequence, pools: tuple[jax.Array, jax.Array]
                ) -> tuple[CacheLevel, np.ndarray] | None:
        """Saves ``seq``'s pages ``[0, num_pages)`` (read from ``pools``, the arena's current
        arrays) to host, else disk: ``(level, cold slots)``, or None when no cold tier can take
        them (nothing changed anywhere). Does not release the sequence's range."""
        n = seq.num_pages
        stage = self.storage.allocate(_D, 0, n)
        assert stage is not None, "the staging pool holds a whole sequence"
        try:
            k, v = self.storage.pools[0]
            self.storage.pools[0] = self._gather(
                k, v, *pools, jax.device_put(stage, k.device),
                jax.device_put(seq.slots(0, n).astype(np.int32), k.device))
            for level in self.levels:
                out = self.storage.migrate_many([(0, _D, stage, level)])
                if out is not None:  # NOTE: the staging slots were released by the move
                    return level, out[0]
        except BaseException:
            self.storage.free(_D, 0, stage)
            raise
        self.storage.free(_D, 0, stage)
        return None

    def resume(self, seq: ArenaSequence, level: CacheLevel, slots: np.ndarray,
               pools: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array] | None:
        """Restores the cold ``slots`` (from :meth:`suspend`) into ``seq``'s pages
        ``[0, len(slots))`` (its range mapped for them). Returns the arena's pools to use from
        now on (``pools`` themselves on CPU; the scatter's donated outputs on the GPU), or None
        when the staging pool cannot take them (nothing changed). On success the cold slots are
        released; a failure (a corrupt disk page) raises with nothing changed."""
        out = self.storage.migrate_many([(0, level, slots, _D)])
        if out is None:
            return None
        stage = out[0]
        try:
            k, v = self.storage.pools[0]
            idx = jax.device_put(stage.astype(np.int32), k.device)
            if self.arena.backend == "cpu":
                # NOTE: the staging pages, then host writes into the arena.
                ks, vs = (np.asarray(a[:, idx]) for a in (k, v))
                self.arena.write_pages(seq, 0, ks, vs)
            else:
                pools = self._scatter(*pools, k, v,
                                      jax.device_put(seq.slots(0, stage.size).astype(np.int32),
                                                     k.device), idx)
        finally:
            self.storage.free(_D, 0, stage)
        return pools

    def release(self, level: CacheLevel, slots: np.ndarray) -> None:
        """Frees the cold slots of a suspended sequence that is closed instead."""
        self.storage.free(level, 0, slots)

    def used_bytes(self) -> int:
        """Host bytes held by suspended sequences (governor's committed HOST bytes)."""
        st = self.storage.stats()
        return int(st["host"]["current"]) if "host" in st else 0

    def close(self) -> None:
        self.storage.close()
