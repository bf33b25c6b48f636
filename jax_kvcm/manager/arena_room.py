"""The arena's ranges and device room: which sequence holds which range, and where memory
comes back from under pressure.

Each sequence with device pages holds a *range* (:mod:`jax_kvcm.hot.arena.geometry`): its page
``j`` is written at ``base + j`` of every arena group (full attention; window groups stay paged).
Pages it reuses from the prefix tree are wherever they were committed: the page table points
there (page-granular, zero copy); the range's slots for them stay unused.

- **Binding** (admission, resume, or the first step that needs a page): a range none of whose
  slots the sequence will write holds a page someone else references. Preferred, in order: a
  parked range holding the longest run of the sequence's own prefix at ``base + j`` (prefix-
  affine adoption: nothing to move), a parked range (adoption: its chunks are mapped, so steady
  state makes no map/unmap call), a fresh range. A parked range's cached pages in the way are
  evicted first (down a tier, else dropped), as paged eviction would under pressure.
- **Room** (:meth:`ArenaRoom.make_room`): the chunks an allocation needs come from the budget;
  when it is short, empty chunks of parked ranges are unmapped first, then chunks holding only
  cached or pending pages (the pages evicted, the frees waited for), least recently parked
  first. A plan (:meth:`ArenaRoom.plan`) is made before anything is evicted.
- **Obtainable pages**, as admission control reads them, count cached and pending pages of the
  arena like paged ones, and its free budget.

Why no VA aliasing of shared prefixes (the seed design mapped another range's physical chunks
into a new range, whole chunks only, with a "partial alias" skip): our kernels read page
tables, so the prefix tree shares committed pages page by page by table entry, zero copy and
zero budget, with no map call and no chunk-alignment constraint; aliasing would only buy a
``base + arange`` table for kernels that address pages linearly, which we do not have.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jax_kvcm._prefix_tree import BlockNode, PrefixTree
from jax_kvcm._types import CacheLevel
from jax_kvcm.hot.arena.ranges import RangeBook
from jax_kvcm.hot.arena.tier import ArenaSpec
from jax_kvcm.manager.api import Sequence
from jax_kvcm.manager.config import KVCacheConfig
from jax_kvcm.manager.ledger import StepLedger
from jax_kvcm.manager.planner import TierPlanner
from jax_kvcm.manager.rows import RowTable

__all__ = ["ArenaRoom", "arena_specs"]

D = CacheLevel.DEVICE
_SCAN_PARKED = 16  # fitting parked ranges compared per binding, oldest first


def arena_specs(config: KVCacheConfig) -> tuple[ArenaSpec | None, ...] | None:
    """Per layer group (one hot pool group each), its arena or None (paged)."""
    geos = config.arena_geometries()
    if not geos:
        return None
    return tuple(ArenaSpec(geos[g], config.hot.backend) if g in geos else None
                 for g in range(len(config.layer_groups)))


class ArenaRoom:
    """See the module docstring."""

    def __init__(self, config: KVCacheConfig, storage: Any, tree: PrefixTree, rows: RowTable,
                 ledger: StepLedger, planner: TierPlanner) -> None:
        geos = config.arena_geometries()
        self.groups = np.asarray(sorted(geos), np.int64)
        self._geo = geos[int(self.groups[0])]
        self._tiers = [storage.hot_tier(int(g)) for g in self.groups]
        self._storage, self._tree, self._rows = storage, tree, rows
        self._ledger, self._planner = ledger, planner
        self._book = RangeBook(self._geo.max_sequences, config.hot.adoption)  # by seq id
        self._node_at: dict[int, BlockNode] = {}   # slot -> committed device node there
        self._g0 = int(self.groups[0])
        tree.watch = self._watch
        self._steps_checked = 0
        self.counts = dict.fromkeys(("affine_pages", "shared_pages", "evicted_on_bind",
                                     "reclaimed_chunks", "blocking_reclaims"), 0)

    # -- the slot index of committed pages -------------------------------------------------------

    def _watch(self, node: BlockNode, old_level: Any, old_slots: Any) -> None:
        ppc = self._geo.pages_per_chunk
        if old_level is D:
            s = int(old_slots[self._g0])
            if self._node_at.get(s) is node:
                del self._node_at[s]
        if node.alive and node.level is D:
            s = int(node.slots[self._g0])
            if s >= ppc:
                self._node_at[s] = node

    def on_commit(self, node: BlockNode) -> None:
        """Nothing beyond the tree's watch (kept for the committer's protocol)."""

    # -- ranges ----------------------------------------------------------------------------------

    def bound(self, seq: Sequence) -> bool:
        return self._book.range_of(seq.seq_id) is not None

    def _base(self, r: int) -> int:
        return self._geo.range_base(r)

    def place(self, seq: Sequence, j: np.ndarray) -> dict[int, np.ndarray]:
        """``{arena group: slots}`` of pages ``j`` of ``seq`` (bound)."""
        slots = (self._base(self._book.range_of(seq.seq_id)) + np.asarray(j)).astype(np.int32)
        return {int(g): slots for g in self.groups}

    def place_rows(self, rows: np.ndarray, j: np.ndarray) -> dict[int, np.ndarray]:
        """``{arena group: slots}`` of pages ``j[i]`` of the sequences at ``rows[i]``."""
        ids = self._rows.seq_ids[rows]
        base = np.fromiter((self._base(self._book.range_of(int(s))) for s in ids), np.int64,
                           ids.size)
        slots = (base + j).astype(np.int32)
        return {int(g): slots for g in self.groups}

    def _writes(self, nodes: list[BlockNode]) -> np.ndarray:
        """Page indices a holder of the chain ``nodes`` writes in its range: the chain's pages
        not on the device (onboarded there) and every page after the chain."""
        c = len(nodes)
        cold = [j for j, n in enumerate(nodes) if n.level is not D]
        return np.concatenate([np.asarray(cold, np.int64),
                               np.arange(c, self._geo.pages_per_seq, dtype=np.int64)])

    def _fit(self, r: int, nodes: list[BlockNode], writes: np.ndarray
             ) -> tuple[int, list[BlockNode]] | None:
        """``(affine pages, cached nodes to evict)`` when range ``r`` can take the chain, else
        None (a slot it writes holds a referenced page or one of the chain's own)."""
        base = self._base(r)
        chain = {id(n) for n in nodes}
        evict = []
        for s in (base + writes).tolist():
            n = self._node_at.get(s)
            if n is None:
                continue
            if n.refcount > 0 or id(n) in chain:
                return None
            evict.append(n)
        affine = sum(1 for j, n in enumerate(nodes)
                     if n.level is D and int(n.slots[self._g0]) == base + j)
        return affine, evict

    def _mapped_writes(self, r: int, writes: np.ndarray) -> int:
        """Chunks of range ``r`` mapped where a holder writing pages ``writes`` writes."""
        mem = self._tiers[0].memory
        chunks = np.unique((self._base(r) + writes) // self._geo.pages_per_chunk)
        return sum(mem.is_mapped(c) for c in chunks.tolist())

    def _candidates(self, nodes: list[BlockNode]) -> list[int]:
        """Parked ranges worth examining: those holding the chain's pages in place first, then
        the others, oldest first."""
        book, out = self._book, []
        for j, n in enumerate(nodes):
            if n.level is D:
                s = int(n.slots[self._g0])
                r = self._geo.range_of_slot(s)
                if r >= 0 and s == self._base(r) + j and book.is_parked(r) and r not in out:
                    out.append(r)
        out.extend(r for r in book.parked() if r not in out)
        return out

    def _choose(self, nodes: list[BlockNode]) -> tuple[int, list[BlockNode], int] | None:
        """``(range, cached pages to evict there, pages in place)`` for the chain ``nodes``."""
        writes = self._writes(nodes)
        fits, evictions = [], {}
        for r in self._candidates(nodes):
            if len(fits) >= _SCAN_PARKED:  # NOTE: enough fitting ones (oldest first) examined
                break
            fit = self._fit(r, nodes, writes)
            if fit is not None:
                fits.append((r, fit[0], len(fit[1]), self._mapped_writes(r, writes)))
                evictions[r] = fit
        r = self._book.choose(fits, self._tight(nodes))
        if r is None:
            return None
        affine, evict = evictions.get(r, (0, []))
        return r, evict, affine

    def _tight(self, nodes: list[BlockNode]) -> bool:
        """Whether the budget could not map a fresh range for this holder (then a parked
        range, mapped already, is adopted: no map call; else a fresh one keeps the parked
        ranges' cached pages for later hits)."""
        need = self._geo.chunks_per_range
        return any(t.free_budget_chunks() < need for t in self._tiers)

    def bind(self, seq: Sequence, nodes: list[BlockNode]) -> bool:
        """Gives ``seq`` (holding or about to hold the chain ``nodes``) a range; False when no
        range can take it (nothing changed). Cached pages in the way are evicted."""
        if self._book.range_of(seq.seq_id) is not None:
            return True
        choice = self._choose(nodes)
        if choice is None:
            return False
        r, evict, affine = choice
        if evict:
            self._ledger.need_pools("arena range adoption")
            self._planner.evict(evict, D)
            self.counts["evicted_on_bind"] += len(evict)
        self._book.bind(seq.seq_id, r)
        self.counts["affine_pages"] += affine
        self.counts["shared_pages"] += sum(1 for n in nodes if n.level is D) - affine
        return True

    def bind_all(self, seqs: list[Sequence]) -> bool:
        """Binds every unbound sequence of ``seqs`` to a range (their chains on the device);
        False, with nothing bound, when there are not enough ranges."""
        unbound = [s for s in seqs if self._book.range_of(s.seq_id) is None]
        if not unbound:
            return True
        if len(unbound) > self._book.num_unbound:
            return False
        return all(self.bind(s, s._nodes) for s in unbound)

    def unbind(self, seq: Sequence) -> None:
        """``seq`` leaves its range (close, suspend): the range is parked, still mapped."""
        self._book.unbind(seq.seq_id)

    def move_rows(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Ranges follow sequences, not rows: nothing to move on compaction."""

    # -- room ------------------------------------------------------------------------------------

    def _short(self, at: dict[int, np.ndarray]) -> tuple[list[int], int, np.ndarray]:
        """``(unmapped chunks the slots need, budget chunks lacking, slots allocated now)``
        (the arena groups move in lockstep: group 0 speaks for all)."""
        slots = at.get(self._g0, np.zeros(0, np.int32))
        tier, ppc = self._tiers[0], self._geo.pages_per_chunk
        chunks = np.unique(slots // ppc).tolist()
        missing = [c for c in chunks if not tier.memory.is_mapped(c)]
        lack = max(0, max(len(missing) - t.free_budget_chunks() for t in self._tiers))
        return missing, lack, slots[tier.used[slots]]

    def _victims(self, need: int, keep: set[int]) -> tuple[list[int], list[BlockNode]] | None:
        """Chunks to unmap for ``need`` budget chunks, and the cached pages in them to evict;
        None when not even every reclaimable chunk would do."""
        tier, ppc, geo = self._tiers[0], self._geo.pages_per_chunk, self._geo
        pending = np.zeros(tier.used.size, bool)
        for entry in self._ledger.pending:
            s = entry.slots[self._g0]
            pending[s[s >= 0]] = True
        order = [*self._book.parked(), *self._book.bound_ranges()]
        picked: list[int] = []
        evict: list[BlockNode] = []
        for r in order:
            first = self._base(r) // ppc
            for c in range(first, first + geo.chunks_per_range):
                if len(picked) >= need:
                    return picked, evict
                if c in keep or not tier.memory.is_mapped(c):
                    continue
                slots = np.arange(c * ppc, (c + 1) * ppc)
                nodes = []
                ok = True
                for s in slots[tier.used[slots] & ~pending[slots]].tolist():
                    n = self._node_at.get(s)
                    if n is None or n.refcount > 0:
                        ok = False
                        break
                    nodes.append(n)
                if ok:  # only cached pages, pending frees or nothing
                    picked.append(c)
                    evict.extend(nodes)
        return (picked, evict) if len(picked) >= need else None

    def plan(self, at: dict[int, np.ndarray]) -> bool:
        """Whether the slots ``at`` can be allocated once pending frees are waited for and
        cached pages evicted (nothing changes)."""
        if not at:
            return True
        _, lack, busy = self._short(at)
        for s in busy.tolist():
            if s in self._node_at:  # NOTE: a committed page where this range writes: a bug
                raise RuntimeError(f"arena slot {s} holds a committed page")
        if not lack:
            return True
        keep = set(np.unique(at[self._g0] // self._geo.pages_per_chunk).tolist())
        return self._victims(lack, keep) is not None

    def make_room(self, at: dict[int, np.ndarray]) -> bool:
        """Acts on :meth:`plan`: waits for pending frees at the slots, reclaims chunks."""
        if not at:
            return True
        _, lack, busy = self._short(at)
        if busy.size:
            self._planner.reclaim()
            _, lack, busy = self._short(at)
            if busy.size:
                self.counts["blocking_reclaims"] += 1
                self._planner.reclaim(block=True)
                _, lack, busy = self._short(at)
                if busy.size:  # pragma: no cover - pending frees always come back
                    raise RuntimeError(f"arena slots {busy.tolist()} stay allocated")
        if not lack:
            return True
        keep = set(np.unique(at[self._g0] // self._geo.pages_per_chunk).tolist())
        found = self._victims(lack, keep)
        if found is None:
            return False
        chunks, evict = found
        if evict:
            self._planner.evict([n for n in evict if n.alive and n.level is D], D)
        tier = self._tiers[0]
        if any(tier.chunk_used(c) for c in chunks):
            self._planner.reclaim()
            if any(tier.chunk_used(c) for c in chunks):
                self.counts["blocking_reclaims"] += 1
                self._planner.reclaim(block=True)
        empty = tier.empty_mapped_chunks(chunks)
        for t in self._tiers:
            t.unmap(empty)
        self.counts["reclaimed_chunks"] += len(empty)
        return len(empty) >= lack

    # -- steps -----------------------------------------------------------------------------------

    def after_step(self, seqs: list[Sequence]) -> None:
        """Nothing to do per step (kept for the step runner's protocol)."""

    def check_returned(self, pools: list[tuple[Any, Any]]) -> None:
        """ValueError when a step returned arena pools that are not the reservation (XLA
        copied them): checked on the first 16 steps and every 256th, as reading a pointer
        may wait for the step."""
        n = self._steps_checked
        self._steps_checked += 1
        if n >= 16 and n % 256:
            return
        for g, t in zip(self.groups.tolist(), self._tiers):
            t.memory.check_pools(pools[g], f"caches[{g}]")

    def recover_pools(self) -> bool:
        """After a failed step: the arenas' memory outlived the consumed arrays. True (nothing
        lost) when every tier kept its content."""
        self._ledger.need_pools("recovery")
        if not self._storage.rebuild_pools():
            return False
        self._ledger.forget_steps()
        self._planner.reclaim()
        return True

    # -- planning and checks ---------------------------------------------------------------------

    def max_num_sequences(self, seq_len: int) -> int:
        geo = self._geo
        pages = -(-min(seq_len, geo.pages_per_seq * geo.tokens_per_page) // geo.tokens_per_page)
        per = max(1, -(-pages // geo.pages_per_chunk))
        return min(geo.max_sequences, min(t.geometry.budget_chunks for t in self._tiers) // per)

    def max_seq_len_for(self, n: int) -> int:
        geo = self._geo
        if n > geo.max_sequences:
            return 0
        chunks = min(t.geometry.budget_chunks for t in self._tiers) // n
        return min(geo.pages_per_seq, chunks * geo.pages_per_chunk) * geo.tokens_per_page

    def stats(self) -> dict[str, Any]:
        book = self._book
        out: dict[str, Any] = dict(self.counts)
        out.update(num_ranges=self._geo.max_sequences, num_bound=book.num_bound,
                   num_parked=book.num_parked, adoptions=book.num_adoptions,
                   fresh_ranges=book.num_fresh)
        per = [t.stats() for t in self._tiers]
        for k in ("num_map_calls", "num_unmap_calls", "mapped_bytes", "physical_bytes",
                  "peak_physical_bytes", "mapped_chunks", "num_quiesces"):
            out[k] = sum(p[k] for p in per)
        out["pages_per_chunk"] = self._geo.pages_per_chunk
        out["chunk_bytes"] = self._geo.chunk_bytes
        return out

    def check(self) -> None:
        """Arena invariants: ranges, the slot index, and the lockstep of private pages."""
        self._book.check()
        ppc = self._geo.pages_per_chunk
        want = {int(n.slots[self._g0]): n for n in self._tree.nodes.values()
                if n.level is D and int(n.slots[self._g0]) >= ppc}
        assert want.keys() == self._node_at.keys() and all(
            self._node_at[s] is n for s, n in want.items()), "the arena's slot index is stale"
        rows = self._rows
        for seq in rows.active():
            r = self._book.range_of(seq.seq_id)
            k, npages = len(seq._nodes), rows.num_pages(seq._row)
            if npages > k:
                assert r is not None, f"{seq!r} holds private pages but no range"
                mine = rows.row_pages(seq._row, k, npages)[self.groups]
                assert (mine == self._base(r) + np.arange(k, npages)).all(), (seq, mine)
