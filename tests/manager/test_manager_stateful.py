"""Randomized state machine over add / step / suspend / resume / close (hypothesis; the failing
example and its seed are printed by hypothesis). After every rule: the manager's invariants (page
accounting per tier, refcounts == holders, no page in two places, governor ledger == recomputation)
and every cached K/V value of every active sequence, read back through its page table.

Tiny tiers so every path runs: device 12 pages, host ~4, disk ~6 (some machines without one tier).
Layer groups: one or two full-attention groups, sliding-window groups (windows 1 to 17 tokens, 2,
4 or 8 tokens per page) alone or beside a full one, with distinct or shared cold pools; window
groups with absolute rows or rings (``ring_tables``, chunks of at most ``max_window_chunk``
tokens per sequence), read back through the ring of every step's ``StepBatch``; batch
compaction moves sequences between rows.
``KVCM_STATEFUL_EXAMPLES`` raises the number of examples (default 200, up to 50 steps each).

Write-back ahead (``offload_ahead_pages``, with a host tier): its copies are held in flight by the
gate seam of ``faults.py`` until a rule finishes one or makes it fail (rolled back, nothing lost).

Steps (the gate seam of ``faults.py``): the newest one or two completed steps may still "run
on the device" (the machine draws it after each step) until a later step finishes them or the
manager waits for them, so what the manager's polls see is the machine's choice, not the CPU's
speed (hypothesis replays an example exactly), and pages freed behind a running step stay
pending.

Faults (seams from ``faults.py``): disk reads that fail (EIO) and disk writes that fail (ENOSPC),
once, twice or for good; a step that raises before running (``abort_step``) or that consumes its
donated pools and fails inside XLA (``abort_step`` then reports the lost sequences, which the
machine forgets); an observer that raises on some event kind. The K/V content oracle and the
invariants are checked after every rule all the same.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from faults import (FOREVER, failing_step, install_faulty_disks, install_gated_offloads,
                    install_gated_steps)
from jax_kvcm import ArenaHot
from jax_kvcm.manager import OutOfPagesError, SequenceState, SuspendResult
from jax_kvcm._storage import CorruptPageError
from test_manager import Harness, _state, make, tiny_config
from test_window_ring import read_back

pytestmark = [pytest.mark.slow,  # raising observers, bad disks
              pytest.mark.filterwarnings("ignore:KVCacheManager")]

EXAMPLES = int(os.environ.get("KVCM_STATEFUL_EXAMPLES", "200"))
_COUNT_KEYS = {"examples": 0, "rules": 0, "steps": 0, "oop": 0, "suspended": 0, "recompute": 0,
          "resumed": 0, "refused_resume": 0, "reused": 0, "windowed": 0, "window_released": 0,
          "aborted": 0, "lost": 0, "observer_errors": 0, "disk_read_errors": 0,
          "disk_write_errors": 0, "unreadable_resume": 0, "ring": 0, "compacted": 0,
          "ring_checked": 0, "offloaded_ahead": 0, "ahead_done": 0, "ahead_failed": 0,
          "steps_running": 0}
COUNTS_BY_HOT = {"paged": dict(_COUNT_KEYS), "arena": dict(_COUNT_KEYS)}
PREFIXES = ([], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9])


class ManagerMachine(RuleBasedStateMachine):
    """Over the paged hot tier; :class:`ArenaManagerMachine` runs the same rules over the
    arena."""

    HOT = "paged"

    @property
    def counts(self) -> dict:
        return COUNTS_BY_HOT[self.HOT]

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp()
        self.h: Harness | None = None
        self.disks: list = []
        self.observer = None
        self.gates = None
        self.steps = None
        self.settled = {"done": 0, "failed": 0}   # this example's write-back-ahead copies
        self.arena = False

    @initialize(tiers=st.sampled_from(["none", "host", "disk", "host+disk"]),
                groups=st.sampled_from(["1", "1", "2", "w", "1+w", "1+w shared", "w+w"]),
                window=st.sampled_from([1, 3, 4, 6, 9, 13, 17]),
                hash_kind=st.sampled_from(["sha", "const"]),
                faults=st.sampled_from([(0, 0), (1, 1), (FOREVER, 0), (1, 0), (0, FOREVER)]),
                tpp=st.sampled_from([4, 4, 2, 8]),
                ring=st.booleans(), chunk=st.sampled_from([None, 1, 3, 6]),
                ahead=st.sampled_from([0, 5, 12]))
    def setup(self, tiers, groups, window, hash_kind, faults, tpp, ring, chunk, ahead):
        hot = self.HOT
        # "w": a sliding-window group; "shared": same layouts, so one cold pool for both.
        windows = {"1": (None,), "2": (None, None), "w": (window,), "1+w": (None, window),
                   "1+w shared": (None, window), "w+w": (window, window + 2)}[groups]
        arena = {}
        if hot == "arena":
            # NOTE: full-attention groups in an arena (2 KiB pages of one pool: 2 per 4 KiB
            # memfd chunk; groups of one layout), window groups paged; no write-back ahead.
            arena = dict(hot=ArenaHot(super_page_bytes=4096, backend="cpu"),
                         head_dim=2048 // (4 * tpp))
            ahead = 0
        cfg = tiny_config(device_pages=12, host_pages=4 if "host" in tiers else 0,
                          disk_dir=self.dir if "disk" in tiers else None,
                          disk_pages=6 if "disk" in tiers else 0, windows=windows,
                          same_layout="shared" in groups or hot == "arena", max_batch=4,
                          max_tokens=32, max_seq_len=48, tpp=tpp, ring_tables=ring,
                          max_window_chunk=chunk,
                          offload_ahead_pages=ahead if "host" in tiers else 0, **arena)
        # NOTE: only full-attention groups live in an arena (window groups stay paged); a failed
        # step loses nothing only when every group is in one.
        self.arena = len(cfg.arena_geometries()) == len(cfg.layer_groups)
        self.counts["windowed"] += "w" in groups
        self.counts["ring"] += ring and "w" in groups
        kw = {"_hash_fn": (lambda b: b"k")} if hash_kind == "const" else {}
        self.h = make(cfg, **kw)
        self.disks = install_faulty_disks(self.h.mgr)
        self.steps = install_gated_steps(self.h.mgr)
        if self.h.mgr.config.offload_ahead_pages:
            self.gates = install_gated_offloads(self.h.mgr)
        self.disk_faults(*faults)
        self.counts["examples"] += 1

    def seqs(self, state):
        return [s for s in self.h.mgr._rows.seqs.values() if s.state is state]

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 3), min_size=1,
                                                             max_size=10),
          salt=st.sampled_from([None, None, "a"]))
    def add(self, prefix, suffix, salt):
        if len(self.h.mgr._rows.seqs) >= 8:
            return
        s = self.h.add(prefix + suffix, salt=salt)
        toks = self.h.tokens[s.seq_id]
        self.counts["reused"] += s.num_reused_tokens > 0
        tpp = self.h.mgr.config.tokens_per_page
        assert s.num_reused_tokens % tpp == 0 and s.num_reused_tokens < len(toks)

    def pick_work(self, data):
        """Up to 4 ACTIVE sequences and their new token counts (adds one when none is active)."""
        active = self.seqs(SequenceState.ACTIVE)
        if not active:
            if len(self.h.mgr._rows.seqs) >= 8:
                return
            self.add(data.draw(st.sampled_from(PREFIXES)),
                     data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=10)), None)
            active = self.seqs(SequenceState.ACTIVE)
        chosen = data.draw(st.lists(st.sampled_from(active), min_size=1, max_size=4,
                                    unique_by=lambda s: s.seq_id))
        work, ids, total = [], [], 0
        cfg = self.h.mgr.config
        most = min(12, cfg.max_window_chunk) if any(
            g.sliding_window for g in cfg.layer_groups) else 12
        for s in chosen:
            left = len(self.h.tokens[s.seq_id]) - s.num_tokens
            n = data.draw(st.integers(1, max(1, min(left, most)))) if left > 0 else 1
            if total + n > 32 or s.num_tokens + n > 48:
                continue
            work.append((s, n))
            ids.append(data.draw(st.booleans()))
            total += n
        return work, ids

    @precondition(lambda self: self.h is not None)
    @rule(data=st.data())
    def step(self, data):
        work, ids = self.pick_work(data) or ([], [])
        if not work:
            return
        before = {s.seq_id: (s.num_tokens, s.page_ids()) for s, _ in work}
        state = _state(self.h)
        try:
            batch, spans = self.h.prepare(work, as_ids=ids)
            self.h.mgr.complete_step(self.h.write(batch, spans))
            # The device is mostly done by the next call (as a CPU is); now and then the
            # newest one or two steps still run, the pages freed behind them pending.
            behind = data.draw(st.sampled_from([0, 0, 0, 1, 2]))
            self.steps.finish(len(self.steps.running()) - behind)
            self.counts["steps_running"] += behind > 0
            self.counts["ring_checked"] += read_back(self.h, batch, spans)
            self.counts["steps"] += 1
        except OutOfPagesError:
            self.counts["oop"] += 1
            for s, _ in work:  # refused: nothing scheduled, nothing evicted
                n, pages = before[s.seq_id]
                assert s.num_tokens == n and np.array_equal(s.page_ids(), pages)
            assert _state(self.h) == state

    @precondition(lambda self: self.h is not None)
    @rule(data=st.data())
    def step_again(self, data):  # steps three times as likely as other rules
        self.step(data)

    @precondition(lambda self: self.h is not None)
    @rule(data=st.data())
    def step_thrice(self, data):  # NOTE: more rules (faults, compaction) dilute the steps
        self.step(data)

    @precondition(lambda self: self.h is not None)
    @rule(data=st.data())
    def suspend(self, data):
        active = self.seqs(SequenceState.ACTIVE)
        if not active:
            return
        s = data.draw(st.sampled_from(active))
        n, pages = s.num_tokens, s.page_ids()
        state = _state(self.h)
        write_errors = self.h.mgr.stats()["num_disk_write_errors"]
        res = self.h.mgr.suspend(s)
        self.counts["suspended" if res is SuspendResult.SUSPENDED else "recompute"] += 1
        if res is SuspendResult.MUST_RECOMPUTE:  # the sequence unchanged
            assert s.state is SequenceState.ACTIVE and s.num_tokens == n
            assert np.array_equal(s.page_ids(), pages)
            if self.h.mgr.stats()["num_disk_write_errors"] == write_errors:
                assert _state(self.h) == state  # a refusal: nothing evicted either

    @precondition(lambda self: self.h is not None)
    @rule(data=st.data())
    def resume(self, data):
        sus = self.seqs(SequenceState.SUSPENDED)
        if not sus:
            return
        s = data.draw(st.sampled_from(sus))
        state = _state(self.h)
        try:
            ok = self.h.mgr.resume(s)
        except CorruptPageError:  # an unreadable disk page: still suspended; close, recompute
            assert s.state is SequenceState.SUSPENDED
            self.h.check()
            self.h.mgr.close(s)
            self.counts["unreadable_resume"] += 1
            return
        if ok:
            self.counts["resumed"] += 1
        else:  # refused: nothing changed, nothing evicted
            assert s.state is SequenceState.SUSPENDED
            assert _state(self.h) == state
            self.counts["refused_resume"] += 1

    @precondition(lambda self: self.h is not None)
    @rule(data=st.data())
    def suspend_and_resume(self, data):  # NOTE: more resumes, so more (faulty) disk reads
        self.suspend(data)
        self.resume(data)

    @precondition(lambda self: self.h is not None)
    @rule(data=st.data())
    def compact(self, data):
        """Moves every sequence to a new row (a random arrangement of rows 0..n-1, or spread
        over up to twice as many); their pages, rings and what later steps read must follow."""
        mgr = self.h.mgr
        seqs = list(mgr._rows.seqs.values())
        if not seqs:
            return
        rows = [s.row for s in seqs]
        spread = data.draw(st.sampled_from([1, 2]))
        targets = data.draw(st.permutations(range(len(seqs) * spread)))
        old_to_new = np.full(max(rows) + 1, -1)
        old_to_new[rows] = targets[:len(seqs)]
        before = {s.seq_id: (s.num_tokens, [s.page_ids(g) for g in range(len(
            mgr.config.layer_groups))]) for s in seqs if s.state is SequenceState.ACTIVE}
        new_to_old = mgr.compact(old_to_new)
        for s, r in zip(seqs, rows):
            assert s.row == old_to_new[r] and new_to_old[s.row] == r
        for s in seqs:
            if s.seq_id in before:
                n, pages = before[s.seq_id]
                assert s.num_tokens == n
                assert all(np.array_equal(s.page_ids(g), p) for g, p in enumerate(pages))
        self.counts["compacted"] += 1

    @precondition(lambda self: self.h is not None)
    @rule(data=st.data())
    def close(self, data):
        seqs = list(self.h.mgr._rows.seqs.values())
        if not seqs:
            return
        self.h.mgr.close(data.draw(st.sampled_from(seqs)))

    @precondition(lambda self: self.h is not None and self.disks)
    @rule(reads=st.sampled_from([0, 1, 2, FOREVER]), writes=st.sampled_from([0, 1, 2, FOREVER]))
    def disk_faults(self, reads, writes):
        """The next ``reads`` reads and ``writes`` writes of every disk pool fail."""
        for d in self.disks:
            d.fail_reads, d.fail_writes = reads, writes

    @precondition(lambda self: self.h is not None)
    @rule(data=st.data(), consumed=st.sampled_from([False, False, True]))
    def failed_step(self, data, consumed):
        """A step that raises before running (abort_step restores everything), or that consumed
        its donated pools and failed in XLA (abort_step loses every sequence with device
        pages: they are closed and the caller recomputes them)."""
        work, ids = self.pick_work(data) or ([], [])
        if not work:
            return
        mgr = self.h.mgr
        before = {s.seq_id: (s.num_tokens, s.page_ids()) for s, _ in work}
        try:
            self.h.prepare(work, ids)
        except OutOfPagesError:
            return
        if consumed:
            with pytest.raises(Exception):
                failing_step(mgr.caches)
        lost = mgr.abort_step()
        self.counts["aborted"] += 1
        self.counts["lost"] += len(lost)
        if not consumed or self.arena:  # NOTE: an arena's memory outlives its arrays
            assert lost == []
            for s, _ in work:
                n, pages = before[s.seq_id]
                assert s.num_tokens == n and np.array_equal(s.page_ids(), pages)
        else:
            assert all(s.state is SequenceState.CLOSED for s in lost)
            assert not any(s.state is SequenceState.ACTIVE and s.num_pages
                           for s in mgr._rows.seqs.values())

    @precondition(lambda self: self.h is not None and self.gates is not None)
    @rule(data=st.data())
    def close_then_step(self, data):  # NOTE: cached pages for write-back ahead to move
        self.close(data)
        self.step(data)
        # NOTE: and one copy it started settles now, done and failed in turns, so coverage
        # does not wait for the offload_copies rule. The turns are this example's: taken from
        # the module's running counts they differed when hypothesis replayed an example
        # (FlakyStrategyDefinition at >= ~1,000 examples).
        self._settle(data, ok=self.settled["done"] <= 2 * self.settled["failed"])

    @precondition(lambda self: self.h is not None and self.gates is not None)
    @rule(data=st.data())
    def offload_copies(self, data):
        """A write-back-ahead copy in flight finishes, or fails: rolled back when the manager
        sees it (here: free_page_count), its pages back on the device, nothing lost."""
        self._settle(data, ok=data.draw(st.sampled_from([True, True, True, False])))

    def _settle(self, data, ok: bool) -> None:
        closed = [f for f in self.gates.fences if f.state == "closed"]
        if not closed:
            return
        gate = data.draw(st.sampled_from(closed))
        if ok:
            gate.open()
            self.counts["ahead_done"] += 1
        else:
            gate.fail()
            self.counts["ahead_failed"] += 1
        self.settled["done" if ok else "failed"] += 1
        self.h.mgr.free_page_count()

    @precondition(lambda self: self.h is not None and not self.observer)
    @rule(kind=st.sampled_from(["removed", "stored", "migrated", "committed", "evicted",
                                "dropped", "suspended"]))
    def raising_observer(self, kind):
        """An observer that raises on every event of ``kind`` (counted, never corrupting)."""
        def observer(event):
            if event.kind == kind:
                raise RuntimeError(f"observer fails on {kind}")
        self.observer = observer
        self.h.mgr.add_observer(observer)

    @invariant()
    def consistent(self):
        self.counts["rules"] += 1
        if self.h is not None:
            self.h.check()

    def teardown_counts(self):
        st = self.h.mgr.stats()
        self.counts["window_released"] += st["num_window_released_pages"]
        self.counts["observer_errors"] += st["num_observer_errors"]
        self.counts["disk_read_errors"] += st["num_disk_read_errors"]
        self.counts["disk_write_errors"] += st["num_disk_write_errors"]
        self.counts["offloaded_ahead"] += st["num_offloaded_ahead_pages"]

    def teardown(self):
        if self.h is not None:
            self.teardown_counts()
            self.h.mgr.shutdown()
        shutil.rmtree(self.dir, ignore_errors=True)


# NOTE: derandomize: test_machine_covered_every_path asserts that every rule did real work, and
# with a fresh random seed per run a rare path (a disk write error) went unvisited now and then,
# failing CI by chance; the derived seed visits all of them, every run.
ManagerMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=50, deadline=None, print_blob=True,
    derandomize=True, suppress_health_check=list(HealthCheck))
TestManagerMachine = ManagerMachine.TestCase


class ArenaManagerMachine(ManagerMachine):
    """The same rules with the arena as the hot tier: full-attention groups in memfd arenas
    (2 KiB pages of one pool, two per 4 KiB chunk), window groups paged, no write-back ahead;
    a failed step that consumed the pools loses nothing when every group is in the arena."""

    HOT = "arena"


ArenaManagerMachine.TestCase.settings = settings(
    max_examples=EXAMPLES // 2, stateful_step_count=50, deadline=None, print_blob=True,
    derandomize=True, suppress_health_check=list(HealthCheck))
TestArenaManagerMachine = ArenaManagerMachine.TestCase

# Paths each machine must have visited (the arena has no write-back ahead).
_AHEAD = ("offloaded_ahead", "ahead_done", "ahead_failed")
_MUST = ("steps", "oop", "suspended", "recompute", "resumed", "reused", "windowed",
         "window_released", "aborted", "lost", "observer_errors", "disk_read_errors",
         "disk_write_errors", "ring", "compacted", "ring_checked", "steps_running")


@pytest.mark.parametrize("hot", ["paged", "arena"])
def test_machine_covered_every_path(hot):
    """Runs after the machines (same module, file order): every rule did real work."""
    counts = COUNTS_BY_HOT[hot]
    print(hot, counts)
    if counts["examples"] == 0:
        pytest.skip("the machine did not run in this session")
    for key in _MUST + (_AHEAD if hot == "paged" else ()):
        assert counts[key] > 0, (key, dict(counts))
    assert counts["rules"] >= 20 * counts["examples"], counts
    assert counts["steps"] >= 5 * counts["examples"], counts
