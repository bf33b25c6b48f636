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
  when it is short, empty chunks are unmapped first, then chunks holding only cached or
  pending pages (the pages evicted, the frees waited for), parked ranges (least recently
  parked first) before bound ones. An unmap waits for the device (cuMemUnmap racing kernels
  in flight faults), so one such wait takes back a 32nd of the budget, not one step's need.
  A plan (:meth:`ArenaRoom.plan`) is made before anything is evicted.
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
        self._first: dict[int, int] = {}  # seq id -> its logical page at its range's base
        self._node_at: dict[int, BlockNode] = {}   # slot -> committed device node there
        self._g0 = int(self.groups[0])
        # NOTE: unmapping waits for the device (the seed's driver fault: cuMemUnmap racing
        # kernels in flight), so one quiesce takes a 32nd of the budget, not one step's need.
        self._harvest = max(1, self._geo.budget_chunks // 32)
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

    def _origin(self, seq_id: int) -> int:
        """Slot of logical page 0 of holder ``seq_id`` (its range's base less its ``first``)."""
        return self._base(self._book.range_of(seq_id)) - self._first[seq_id]

    def rewritable_from(self, seq: Sequence, j: int) -> list[BlockNode] | None:
        """For a truncation: the committed device pages at ``seq``'s own slots of pages ``j``
        onward (where it writes again as it grows back), or None when page ``j`` lies before
        its range (the range holds its chain in place from a later page)."""
        if j < self._first[seq.seq_id]:
            return None
        slots = self._origin(seq.seq_id) + np.arange(j, self._geo.pages_per_seq)
        return [self._node_at[s] for s in slots.tolist() if s in self._node_at]

    def place(self, seq: Sequence, j: np.ndarray) -> dict[int, np.ndarray]:
        """``{arena group: slots}`` of pages ``j`` of ``seq`` (bound)."""
        slots = (self._origin(seq.seq_id) + np.asarray(j)).astype(np.int32)
        return {int(g): slots for g in self.groups}

    def place_rows(self, rows: np.ndarray, j: np.ndarray) -> dict[int, np.ndarray]:
        """``{arena group: slots}`` of pages ``j[i]`` of the sequences at ``rows[i]``."""
        ids = self._rows.seq_ids[rows]
        origin = np.fromiter((self._origin(int(s)) for s in ids), np.int64, ids.size)
        slots = (origin + j).astype(np.int32)
        return {int(g): slots for g in self.groups}

    def _writes(self, nodes: list[BlockNode]) -> np.ndarray:
        """Page indices a holder of the chain ``nodes`` writes in its range: the chain's pages
        not on the device (onboarded there) and every page after the chain."""
        c = len(nodes)
        cold = [j for j, n in enumerate(nodes) if n.level is not D]
        return np.concatenate([np.asarray(cold, np.int64),
                               np.arange(c, self._geo.pages_per_seq, dtype=np.int64)])

    def _in_place(self, r: int, nodes: list[BlockNode]) -> tuple[int, int]:
        """``(first, pages)``: the run of the chain's device pages that range ``r`` holds in
        place (page ``j`` at ``base + j - first``), as the previous holder left them."""
        base, first, n_in = self._base(r), None, 0
        for j, n in enumerate(nodes):
            if n.level is not D:
                continue
            s = int(n.slots[self._g0])
            if self._geo.range_of_slot(s) != r:
                continue
            f = j - (s - base)
            if first is None:
                first = f
            n_in += f == first
        return (first, n_in) if first is not None and first >= 0 else (0, 0)

    def _fit(self, r: int, nodes: list[BlockNode], writes: np.ndarray
             ) -> tuple[int, list[BlockNode], int] | None:
        """``(affine pages, cached nodes to evict, first)`` when range ``r`` can take the chain,
        else None (a slot it writes holds a referenced page or one of the chain's own).
        ``first``: the logical page at the range's base: the prefix run in place keeps its
        place; otherwise the holder's first written page starts the range."""
        base = self._base(r)
        first, affine = self._in_place(r, nodes)
        if not affine:
            # NOTE: past the pages other sequences read at the range's start (another prefix's
            # canonical pages, likely), as far as the holder's first write allows; cached pages
            # there are evicted like any in the way. Skipping those too kept a predecessor's
            # layout but shifted every later holder by its prompt: a range needed one chunk
            # more than its pages, and at full budget each such chunk was mapped again.
            low = int(writes.min()) if writes.size else len(nodes)
            lead = 0
            while lead < low and (n := self._node_at.get(base + lead)) is not None \
                    and n.refcount > 0:
                lead += 1
            first = low - lead
        if writes.size and (writes.min() < first
                            or writes.max() - first >= self._geo.chunks_per_range
                            * self._geo.pages_per_chunk):
            return None
        chain = {id(n) for n in nodes}
        evict = []
        for s in (base + writes - first).tolist():
            n = self._node_at.get(s)
            if n is None:
                continue
            if n.refcount > 0 or id(n) in chain:
                return None
            evict.append(n)
        return affine, evict, first

    def _mapped_writes(self, r: int, slots: np.ndarray) -> int:
        """Chunks of range ``r`` mapped where a holder writes ``slots``."""
        mem = self._tiers[0].memory
        chunks = np.unique(slots // self._geo.pages_per_chunk)
        return sum(mem.is_mapped(c) for c in chunks.tolist())

    def _candidates(self, nodes: list[BlockNode]) -> list[int]:
        """Parked ranges worth examining: those holding the chain's pages first, then the
        others, oldest first."""
        book, out = self._book, []
        for n in nodes:
            if n.level is D:
                r = self._geo.range_of_slot(int(n.slots[self._g0]))
                if r >= 0 and book.is_parked(r) and r not in out:
                    out.append(r)
        out.extend(r for r in book.parked() if r not in out)
        return out

    def _choose(self, nodes: list[BlockNode]
                ) -> tuple[int, list[BlockNode], int, int] | None:
        """``(range, cached pages to evict there, pages in place, first)`` for ``nodes``."""
        writes = self._writes(nodes)
        fits, found = [], {}
        for r in self._candidates(nodes):
            if len(fits) >= _SCAN_PARKED:  # NOTE: enough fitting ones (oldest first) examined
                break
            fit = self._fit(r, nodes, writes)
            if fit is not None:
                slots = self._base(r) + writes - fit[2]
                fits.append((r, fit[0], len(fit[1]), self._mapped_writes(r, slots)))
                found[r] = fit
        r = self._book.choose(fits, self._tight(nodes))
        if r is None:
            return None
        affine, evict, first = found.get(r) or self._fit(r, nodes, writes) or (0, [], 0)
        return r, evict, affine, first

    def _tight(self, nodes: list[BlockNode]) -> bool:
        """Whether the budget could not map a fresh range for this holder and still let every
        bound range grow to its full length (then a parked range, mapped already, is adopted:
        no map call now, no unmap later; else a fresh one keeps the parked ranges' cached pages
        for later hits)."""
        C = self._geo.chunks_per_range
        bound = np.asarray(self._book.bound_ranges(), np.int64)
        for t in self._tiers:
            growth = C * bound.size - int(t.memory.mapped_per_range[bound].sum())
            if t.free_budget_chunks() < C + growth:
                return True
        return False

    def bind(self, seq: Sequence, nodes: list[BlockNode],
             deferred: list[BlockNode] | None = None) -> bool:
        """Gives ``seq`` (holding or about to hold the chain ``nodes``) a range; False when no
        range can take it (nothing changed). Cached pages in the way are evicted, or, with
        ``deferred``, appended to it for the caller to evict (:meth:`evict_in_the_way`) once
        its room is planned."""
        if self._book.range_of(seq.seq_id) is not None:
            return True
        choice = self._choose(nodes)
        if choice is None:
            return False
        r, evict, affine, first = choice
        if evict:
            if deferred is not None:
                deferred.extend(evict)
            else:
                self.evict_in_the_way(evict, nodes)
        self._book.bind(seq.seq_id, r)
        self._first[seq.seq_id] = first
        self.counts["affine_pages"] += affine
        self.counts["shared_pages"] += sum(1 for n in nodes if n.level is D) - affine
        return True

    def evict_in_the_way(self, evict: list[BlockNode], chain: list[BlockNode] = ()) -> None:
        """Evicts the cached pages ``evict`` a binding found where its holder writes."""
        self._ledger.need_pools("arena range adoption")
        # NOTE: an admission's chain is not referenced yet: making room down the tiers for the
        # pages evicted here must not drop its own lower-tier hits (the random run's seed
        # 3402: add_sequence then onboarded dead nodes, KeyError)
        held = [n for n in chain if n.alive]
        for n in held:
            self._tree.incref(n)
        try:
            self._planner.evict([n for n in evict if n.alive and n.level is D], D)
        finally:
            for n in held:
                self._tree.decref(n)
        self.counts["evicted_on_bind"] += len(evict)

    def bind_all(self, seqs: list[Sequence], deferred: list[BlockNode] | None = None) -> bool:
        """Binds every unbound sequence of ``seqs`` to a range (their chains on the device);
        False when there are not enough ranges (then :meth:`restore` the :meth:`snapshot`
        taken before). ``deferred``: as for :meth:`bind`."""
        unbound = [s for s in seqs if self._book.range_of(s.seq_id) is None]
        if not unbound:
            return True
        if len(unbound) > self._book.num_unbound:
            return False
        return all(self.bind(s, s._nodes, deferred) for s in unbound)

    def snapshot(self) -> Any:
        """The bindings (ranges, their order, counters), for :meth:`restore`."""
        return self._book.snapshot(), dict(self._first), dict(self.counts)

    def restore(self, snap: Any, counts: bool = True) -> None:
        """Puts back the bindings of :meth:`snapshot` (after a refused step: the sequences it
        bound hold no page yet), and the counters unless ``counts`` is False."""
        book, first, old = snap
        self._book.restore(book)
        self._first = dict(first)
        if counts:
            self.counts = dict(old)

    def unbind(self, seq: Sequence) -> None:
        """``seq`` leaves its range (close, suspend): the range is parked, still mapped."""
        self._book.unbind(seq.seq_id)
        self._first.pop(seq.seq_id, None)

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

    def _victims(self, need: int, keep: set[int], want: int = 0
                 ) -> tuple[list[int], list[BlockNode]] | None:
        """Chunks to unmap for ``need`` budget chunks (``want`` when more can go: the harvest
        of one quiesce), and the cached pages in them to evict; None when not even every
        reclaimable chunk would do. Empty chunks go first, then chunks holding only cached
        unreferenced pages; parked ranges (least recently parked first) before bound ones."""
        tier, mem, ppc, C = self._tiers[0], self._tiers[0].memory, self._geo.pages_per_chunk, \
            self._geo.chunks_per_range
        want = max(need, want)
        order = np.asarray([*self._book.parked(), *self._book.bound_ranges()], np.int64)
        chunks = (1 + order[:, None] * C + np.arange(C)).reshape(-1)  # in preference order
        free = mem.mapped.copy()
        free[0] = False
        if keep:
            free[np.fromiter(keep, np.int64, len(keep))] = False
        empty = free & (tier.used_in_chunk == 0)
        picked = chunks[empty[chunks]][:want]
        if picked.size >= want:
            return picked.tolist(), []
        # NOTE: a pass over the device's committed pages: only when empty chunks fall short
        pinned = tier.used.copy()            # allocated slots that cannot be evicted
        for s, n in self._node_at.items():
            if n.refcount == 0:
                pinned[s] = False
        for entry in self._ledger.pending:   # freed, read by a step in flight: waited for
            sl = entry.slots[self._g0]
            pinned[sl[sl >= 0]] = False
        cached = free & ~empty & ~pinned.reshape(-1, ppc).any(1)
        more = chunks[cached[chunks]][:want - picked.size]
        if picked.size + more.size < need:
            return None
        evict = [self._node_at[s] for c in more.tolist()
                 for s in range(c * ppc, (c + 1) * ppc) if s in self._node_at]
        return [*picked.tolist(), *more.tolist()], evict

    def plan_bind(self, seq: Sequence, nodes: list[BlockNode], pages: np.ndarray) -> bool:
        """The dry run of :meth:`bind` then :meth:`plan` (nothing changes): whether ``seq``
        (holding the chain ``nodes``) could get a range and its pages ``pages`` (logical
        indices) their slots there, once the cached pages in the way are evicted. A resume
        asks first, so that a refusal evicts nothing."""
        if self._book.range_of(seq.seq_id) is not None:
            return self.plan(self.place(seq, pages))
        choice = self._choose(nodes)
        if choice is None:
            return False
        r, evict, _, first = choice
        slots = (self._base(r) - first + np.asarray(pages, np.int64)).astype(np.int32)
        return self.plan({int(g): slots for g in self.groups},
                         {int(n.slots[self._g0]) for n in evict})

    def plan(self, at: dict[int, np.ndarray], evicted: set[int] | None = None) -> bool:
        """Whether the slots ``at`` can be allocated once pending frees are waited for and
        cached pages evicted (nothing changes). ``evicted``: slots whose cached pages a
        binding evicts first."""
        if not at:
            return True
        _, lack, busy = self._short(at)
        for s in busy.tolist():
            if evicted and s in evicted:
                continue
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
        found = self._victims(lack, keep, self._harvest)
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
        for k in ("num_map_calls", "num_unmap_calls", "num_create_calls", "num_release_calls",
                  "mapped_bytes", "physical_bytes", "peak_physical_bytes", "mapped_chunks",
                  "num_quiesces"):
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
                want = self._origin(seq.seq_id) + np.arange(k, npages)
                assert (mine == want).all(), (seq, mine, want)
