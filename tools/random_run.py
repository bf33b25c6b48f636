"""A long seeded random run of the KV-cache manager across all of its features, against a
content oracle.

Every operation is drawn from one ``numpy`` generator (``--seed``; the run prints it): add a
sequence (prompts over a few shared prefixes, so prefix reuse hits every tier; salts), steps
(prefill chunks and decode, token ids given or not), a step that fails before running
(``abort_step``) or after consuming its donated pools (``abort_step`` reports the lost
sequences, which the run forgets), a cancellation (``close`` of a sequence between
``prepare_step`` and ``complete_step``, and admissions while the step is in flight), suspend,
resume, close, compaction, disk read and write faults (EIO, ENOSPC), observers that raise or
call back into the manager. Managers are rebuilt every ``--episode-ops`` operations with a new
random configuration: the paged or the arena hot tier (``--hot``), full-attention and
sliding-window layer groups (absolute rows or ring tables), 2 to 8 tokens a page, tiny device,
host and disk tiers so that eviction, onboarding and suspension cross every tier all the time.

After every operation: ``manager.check_invariants()`` and the oracle of ``tests/manager/test_manager.py``
(``Harness.check_values``: every cached K/V value of every active sequence, in its window for
window groups, read back through its page table from the device pools or the arena's
reservation, must equal what the fake model wrote for that token and prefix); after every step,
``read_back`` of ``tests/windows/test_window_ring.py`` (each row read through the step's own page table,
as a ring where the group has one). Refusals (``OutOfPagesError``, ``MUST_RECOMPUTE``, a refused
resume) must change nothing. A failure prints the seed, the operation index and the last
operations, and exits 1.

    python -m tools.random_run --ops 100000 --seed 7 --hot both

The oracle and the fault seams live in ``tests/`` (``test_manager.py``, ``test_window_ring.py``,
``faults.py``), so this driver puts its folders on ``sys.path``: one oracle for the tests and
the long run. ``tests/manager/test_random_run.py`` runs a short version in CI.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter, deque
from pathlib import Path

import jax
import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))
import group_paths  # noqa: E402

group_paths.add_to_sys_path()

from faults import FOREVER, failing_step, install_faulty_disks
from test_manager import Harness, _state, make, tiny_config
from test_window_ring import read_back

from jax_kvcm import ArenaHot, CorruptPageError
from jax_kvcm.manager import OutOfPagesError, SequenceState, SuspendResult

__all__ = ["RandomRun", "RunFailure", "build_parser", "main"]

PREFIXES = ((), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7, 8), (9, 9, 9, 9), (1, 2, 3, 4, 9, 9, 9, 9),
            (5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8))
WINDOWS = (1, 3, 4, 6, 9, 13, 17)
OPS = {  # operation -> weight
    "add": 10, "step": 40, "failed_step": 4, "cancel": 5, "suspend": 6, "resume": 7,
    "close": 5, "compact": 2, "disk_faults": 2, "observer": 1, "truncate": 5,
}
MAX_OPEN = 8
MAX_SEQ_LEN = 48


class RunFailure(AssertionError):
    """A wrong value, a broken invariant or a refusal that changed something."""


class RandomRun:
    """One seeded run. :meth:`run` performs ``ops`` operations (or until ``deadline``, a
    ``time.monotonic()`` value) and returns the counters; raises :class:`RunFailure` (with the
    seed, the operation index and the recent operations) on the first wrong value."""

    def __init__(self, seed: int, hot: str = "both", episode_ops: int = 2000,
                 check_every: int = 1, progress: float = 0.0, log=print,
                 const_hash_p: float = 0.15) -> None:
        if hot not in ("paged", "arena", "both"):
            raise ValueError(f"hot must be paged, arena or both, got {hot!r}")
        self.seed, self.hot, self.episode_ops = seed, hot, episode_ops
        self.check_every, self.progress, self.log = check_every, progress, log
        self.const_hash_p = const_hash_p  # episodes whose prefix keys all collide
        self.rng = np.random.default_rng(seed)
        self.h: Harness | None = None
        self.dir: str | None = None
        self.disks: list = []
        self.all_arena = False
        self.episode = 0
        self.ops_done = 0
        self._episode_start = 0
        self.desc = ""
        self.counts: Counter = Counter()
        self.recent: deque = deque(maxlen=40)
        names = list(OPS)
        w = np.array([OPS[n] for n in names], np.float64)
        self._names, self._p = names, w / w.sum()

    # -- configuration ---------------------------------------------------------------------------

    def _hot_of_episode(self) -> str:
        if self.hot != "both":
            return self.hot
        return ("paged", "arena")[self.episode % 2]

    def new_episode(self) -> None:
        self.close_episode()
        rng = self.rng
        hot = self._hot_of_episode()
        self.dir = tempfile.mkdtemp(prefix="kvcm_random_run_")
        tpp = int(rng.choice([2, 4, 4, 8]))
        layout = str(rng.choice(["1", "1", "2", "w", "1+w", "1+w", "w+w", "1+w shared"]))
        w = int(rng.choice(WINDOWS))
        windows = {"1": (None,), "2": (None, None), "w": (w,), "1+w": (None, w),
                   "1+w shared": (None, w), "w+w": (w, w + 2)}[layout]
        ring = bool(rng.integers(0, 2))
        chunk = rng.choice([None, 1, 3, 6]) if ring else None
        tiers = str(rng.choice(["host+disk", "host+disk", "host+disk", "host", "disk"]))
        extra = {}
        if hot == "arena":
            # full-attention groups in memfd arenas of 2 KiB pages (two per 4 KiB chunk), one
            # page layout for all of them; window groups stay paged
            extra = {"hot": ArenaHot(super_page_bytes=4096, backend="cpu",
                                     adoption=bool(rng.integers(0, 4))),
                     "head_dim": 2048 // (4 * tpp)}
        else:
            extra = {"offload_ahead_pages": int(rng.choice([0, 0, 4])) if "host" in tiers
                     else 0}
        rollback = int(rng.choice([0, 0, 4]))   # window slack for truncations
        cfg = tiny_config(device_pages=int(rng.choice([12, 16, 24])),
                          host_pages=int(rng.choice([4, 8])) if "host" in tiers else 0,
                          disk_dir=self.dir if "disk" in tiers else None,
                          disk_pages=int(rng.choice([6, 12])) if "disk" in tiers else 0,
                          windows=windows, same_layout="shared" in layout or hot == "arena",
                          max_batch=4, max_tokens=32, max_seq_len=MAX_SEQ_LEN, tpp=tpp,
                          ring_tables=ring, max_window_chunk=None if chunk is None else int(chunk),
                          rollback_tokens=rollback, **extra)
        const_hash = rng.random() < self.const_hash_p
        kw = {"_hash_fn": (lambda b: b"k")} if const_hash else {}
        kw["record_events"] = False
        self.h = make(cfg, **kw)
        self.h.rng = rng
        self.disks = install_faulty_disks(self.h.mgr)
        self.all_arena = len(cfg.arena_geometries()) == len(cfg.layer_groups)
        self.desc = (f"episode {self.episode}: hot={hot} tpp={tpp} groups={layout} window={w} "
                     f"ring={ring} chunk={chunk} tiers={tiers} device_pages={cfg.device_pages} "
                     f"const_hash={const_hash} rollback={rollback}")
        self.counts[f"episodes_{hot}"] += 1
        self.counts["windowed_episodes"] += any(windows)
        self.counts["ring_episodes"] += ring and any(windows)
        self.episode += 1

    def close_episode(self) -> None:
        if self.h is not None:
            st = self.h.mgr.stats()
            for key in ("num_window_released_pages", "num_observer_errors",
                        "num_disk_read_errors", "num_disk_write_errors", "num_onboarded_pages",
                        "num_prefix_hit_tokens", "num_dropped_pages", "num_lost_sequences",
                        "num_offloaded_ahead_pages"):
                self.counts[key] += st[key]
            ev = st["num_evicted_pages"]
            self.counts["evicted_to_host"] += ev[1]
            self.counts["evicted_to_disk"] += ev[2]
            if "arena" in st:
                for key in ("num_map_calls", "num_unmap_calls", "adoptions", "reclaimed_chunks",
                            "evicted_on_bind", "affine_pages"):
                    self.counts["arena_" + key] += st["arena"][key]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.h.mgr.shutdown()
            self.h = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    # -- helpers ---------------------------------------------------------------------------------

    @property
    def mgr(self):
        return self.h.mgr

    def seqs(self, state=None) -> list:
        out = list(self.mgr._rows.seqs.values())
        return out if state is None else [s for s in out if s.state is state]

    def pick(self, items):
        return items[int(self.rng.integers(0, len(items)))]

    def prompt(self) -> list[int]:
        rng = self.rng
        prefix = list(PREFIXES[int(rng.integers(0, len(PREFIXES)))])
        seen = [t for t in self.h.tokens.values() if t]  # (truncations may empty one)
        if rng.random() < 0.25 and seen:  # a prompt that extends an earlier sequence's
            toks = self.pick(seen)
            prefix = list(toks[:int(rng.integers(1, len(toks) + 1))])[:MAX_SEQ_LEN - 12]
        alphabet = int(rng.choice([4, 50]))
        return prefix + rng.integers(0, alphabet, int(rng.integers(1, 12))).tolist()

    def work(self) -> tuple[list, list] | None:
        """Up to 4 ACTIVE sequences (a new one when none is), their token counts, ids or not."""
        rng, mgr = self.rng, self.mgr
        active = self.seqs(SequenceState.ACTIVE)
        if not active:
            if len(mgr._rows.seqs) >= MAX_OPEN:
                return None
            self.op_add()
            active = self.seqs(SequenceState.ACTIVE)
            if not active:
                return None
        k = int(rng.integers(1, min(4, len(active)) + 1))
        chosen = [active[i] for i in rng.choice(len(active), k, replace=False)]
        cfg = mgr.config
        most = min(12, cfg.max_window_chunk) if any(
            g.sliding_window for g in cfg.layer_groups) else 12
        work, ids, total = [], [], 0
        for s in chosen:
            if s.num_tokens >= MAX_SEQ_LEN:
                continue
            left = len(self.h.tokens[s.seq_id]) - s.num_tokens
            n = int(rng.integers(1, max(1, min(left, most)) + 1)) if left > 0 else \
                (1 if rng.random() < 0.8 else int(rng.integers(1, 4)))
            n = min(n, most, MAX_SEQ_LEN - s.num_tokens)
            if total + n > cfg.max_tokens_per_step:
                continue
            work.append((s, n))
            ids.append(bool(rng.integers(0, 2)))
            total += n
        return (work, ids) if work else None

    def finish_long(self) -> None:
        """Sequences at max_seq_len are done: closed (their committed pages stay cached)."""
        for s in self.seqs(SequenceState.ACTIVE):
            if s.num_tokens >= MAX_SEQ_LEN:
                self.mgr.close(s)
                self.counts["finished"] += 1

    def snapshot(self, seqs) -> dict:
        G = len(self.mgr.config.layer_groups)
        return {s.seq_id: (s.num_tokens, [s.page_ids(g).copy() for g in range(G)]) for s in seqs}

    def same(self, seqs, before: dict, what: str) -> None:
        G = len(self.mgr.config.layer_groups)
        for s in seqs:
            n, pages = before[s.seq_id]
            if s.num_tokens != n or not all(np.array_equal(s.page_ids(g), pages[g])
                                            for g in range(G)):
                raise RunFailure(f"{what} changed {s!r}: {n} -> {s.num_tokens} tokens")

    # -- operations ------------------------------------------------------------------------------

    def op_add(self) -> None:
        if len(self.mgr._rows.seqs) >= MAX_OPEN:
            return
        salt = None if self.rng.random() < 0.85 else "lora"
        s = self.h.add(self.prompt(), salt=salt)
        self.counts["added"] += 1
        self.counts["reused"] += s.num_reused_tokens > 0
        tpp = self.mgr.config.tokens_per_page
        if s.num_reused_tokens % tpp or s.num_reused_tokens >= len(self.h.tokens[s.seq_id]):
            raise RunFailure(f"{s!r} reuses {s.num_reused_tokens} tokens")

    def op_step(self) -> None:
        picked = self.work()
        if picked is None:
            return
        work, ids = picked
        before = self.snapshot([s for s, _ in work])
        state = _state(self.h)
        try:
            batch, spans = self.h.prepare(work, as_ids=ids)
        except OutOfPagesError:
            self.counts["oop"] += 1
            self.same([s for s, _ in work], before, "a refused step")
            if _state(self.h) != state:
                raise RunFailure("a refused step changed the manager's state") from None
            return
        self.mgr.complete_step(self.h.write(batch, spans))
        self.counts["steps"] += 1
        self.counts["ring_checked"] += read_back(self.h, batch, spans)
        self.finish_long()

    def op_failed_step(self) -> None:
        """A step that raises before running, or consumes its donated pools and fails in XLA;
        sometimes a sequence of it is cancelled before the abort."""
        picked = self.work()
        if picked is None:
            return
        work, ids = picked
        mgr, rng = self.mgr, self.rng
        before = self.snapshot([s for s, _ in work])
        try:
            self.h.prepare(work, ids)
        except OutOfPagesError:
            self.counts["oop"] += 1
            return
        consumed = rng.random() < 0.3
        if consumed:
            try:
                failing_step(mgr.caches)
            except jax.errors.JaxRuntimeError:  # the injected failure
                self.counts["consumed_pools"] += 1
            else:
                raise RunFailure("the failing step did not fail")
        else:
            try:  # the pools prepare_step handed out: never committed
                mgr.complete_step(mgr.caches)
            except ValueError:
                pass
            else:
                raise RunFailure("complete_step took the pools prepare_step handed out")
        cancelled = []
        if rng.random() < 0.25:
            s = work[int(rng.integers(0, len(work)))][0]
            mgr.close(s)
            cancelled.append(s.seq_id)
        lost = mgr.abort_step()
        self.counts["aborted"] += 1
        self.counts["aborted_consumed"] += consumed
        self.counts["lost"] += len(lost)
        kept = [s for s, _ in work if s.seq_id not in cancelled]
        if not consumed or self.all_arena:
            if lost:
                raise RunFailure(f"abort_step lost {lost} (consumed={consumed})")
            self.same(kept, before, "an aborted step")
        else:
            if not all(s.state is SequenceState.CLOSED for s in lost):
                raise RunFailure("a lost sequence is not closed")
            if any(s.state is SequenceState.ACTIVE and s.num_pages for s in self.seqs()):
                raise RunFailure("an active sequence kept device pages after the loss")

    def op_cancel(self) -> None:
        """Close mid-generation: a sequence of the step in flight is closed (its pages wait for
        the step's fence), sometimes a new one is admitted meanwhile; the step completes."""
        picked = self.work()
        if picked is None:
            return
        work, ids = picked
        mgr, rng = self.mgr, self.rng
        try:
            batch, spans = self.h.prepare(work, ids)
        except OutOfPagesError:
            self.counts["oop"] += 1
            return
        victims = [s for s, _ in work if rng.random() < 0.6] or [work[0][0]]
        for s in victims:
            mgr.close(s)
        self.counts["cancelled"] += len(victims)
        if rng.random() < 0.4 and len(mgr._rows.seqs) < MAX_OPEN:
            self.op_add()
            self.counts["added_mid_step"] += 1
        mgr.complete_step(self.h.write(batch, spans))
        self.counts["steps"] += 1

    def op_suspend(self) -> None:
        active = self.seqs(SequenceState.ACTIVE)
        if not active:
            return
        s = self.pick(active)
        before = self.snapshot([s])
        state = _state(self.h)
        werr = self.mgr.stats()["num_disk_write_errors"]
        res = self.mgr.suspend(s)
        if res is SuspendResult.SUSPENDED:
            self.counts["suspended"] += 1
            return
        self.counts["must_recompute"] += 1
        if s.state is not SequenceState.ACTIVE:
            raise RunFailure(f"MUST_RECOMPUTE left {s!r}")
        self.same([s], before, "a refused suspend")
        if self.mgr.stats()["num_disk_write_errors"] == werr and _state(self.h) != state:
            raise RunFailure("a refused suspend changed the manager's state")

    def op_resume(self) -> None:
        sus = self.seqs(SequenceState.SUSPENDED)
        if not sus:
            return
        s = self.pick(sus)
        state = _state(self.h)
        try:
            ok = self.mgr.resume(s)
        except CorruptPageError:
            if s.state is not SequenceState.SUSPENDED:
                raise RunFailure(f"an unreadable resume left {s!r}") from None
            self.check()
            self.mgr.close(s)
            self.counts["unreadable_resume"] += 1
            return
        if ok:
            self.counts["resumed"] += 1
        else:
            self.counts["refused_resume"] += 1
            if s.state is not SequenceState.SUSPENDED or _state(self.h) != state:
                raise RunFailure("a refused resume changed something")

    def op_close(self) -> None:
        seqs = self.seqs()
        if seqs:
            self.mgr.close(self.pick(seqs))
            self.counts["closed"] += 1

    def op_truncate(self) -> None:
        """Rolls back up to 8 tokens of an active or suspended sequence; a refusal (False, or
        ValueError for a cut a sliding window cannot serve) must change nothing; a suspended
        one whose cut page cannot be read (CorruptPageError) must be unchanged, then closed."""
        seqs = self.seqs(SequenceState.ACTIVE) + self.seqs(SequenceState.SUSPENDED)
        if not seqs:
            return
        s = self.pick(seqs)
        n = int(self.rng.integers(max(0, s.num_tokens - 8), s.num_tokens + 1))
        before = self.snapshot([s])
        state = _state(self.h)
        try:
            done = self.mgr.truncate(s, n)
        except ValueError as e:
            if "sliding window" not in str(e):
                raise
            done = False
        except CorruptPageError:   # a parked cut page the disk cannot read: as op_resume's
            if s.state is not SequenceState.SUSPENDED:
                raise RunFailure(f"an unreadable truncation left {s!r}") from None
            self.same([s], before, "an unreadable truncation")
            self.check()
            self.mgr.close(s)
            self.counts["unreadable_truncate"] += 1
            return
        if not done:
            self.counts["refused_truncate"] += 1
            self.same([s], before, "a refused truncation")
            if _state(self.h) != state:
                raise RunFailure("a refused truncation changed the manager's state")
            return
        del self.h.tokens[s.seq_id][n:]
        self.counts["truncated"] += 1
        if s.state is SequenceState.SUSPENDED:
            windowed = any(g.sliding_window for g in self.mgr.config.layer_groups)
            self.counts["truncated_parked_windowed" if windowed else "truncated_parked"] += 1

    def op_compact(self) -> None:
        seqs = self.seqs()
        if not seqs:
            return
        rows = [s.row for s in seqs]
        targets = self.rng.permutation(len(seqs) * int(self.rng.integers(1, 3)))
        old_to_new = np.full(max(rows) + 1, -1)
        old_to_new[rows] = targets[:len(seqs)]
        active = [s for s in seqs if s.state is SequenceState.ACTIVE]
        before = self.snapshot(active)
        self.mgr.compact(old_to_new)
        self.same(active, before, "compact")
        self.counts["compacted"] += 1

    def op_disk_faults(self) -> None:
        if not self.disks:
            return
        choice = [0, 0, 1, 2, FOREVER]
        reads = choice[int(self.rng.integers(0, 5))] if self.rng.random() < 0.5 else 0
        writes = choice[int(self.rng.integers(0, 4))]  # FOREVER writes degrade the disk: rarer
        if self.rng.random() < 0.05:
            writes = FOREVER
        for d in self.disks:
            d.fail_reads, d.fail_writes = reads, writes
        self.counts["disk_fault_rules"] += 1

    def op_observer(self) -> None:
        mgr = self.mgr
        kind = str(self.pick(["removed", "stored", "migrated", "committed", "evicted", "dropped",
                              "suspended", "resumed", "onboarded"]))
        if self.rng.random() < 0.5:
            def observer(event, kind=kind):
                if event.kind == kind:
                    raise RuntimeError(f"observer fails on {kind}")
        else:
            def observer(event, mgr=mgr):  # calls back into the manager, then raises
                mgr.stats()
                mgr.free_page_count()
                if event.kind == kind:
                    raise RuntimeError(f"observer fails on {kind} after calling the manager")
        mgr.add_observer(observer)
        self.counts["observers"] += 1

    # -- the loop --------------------------------------------------------------------------------

    def check(self) -> None:
        self.mgr.check_invariants()
        self.counts["values_checked"] += self.h.check_values()

    def run(self, ops: int, deadline: float | None = None) -> Counter:
        t0 = last = time.monotonic()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # raising observers and bad disks warn
            while self.ops_done < ops:
                if deadline is not None and time.monotonic() > deadline:
                    break
                if self.h is None or self.ops_done - self._episode_start >= self.episode_ops:
                    self.new_episode()
                    self._episode_start = self.ops_done
                    self.recent.append(("episode", self.desc))
                name = self._names[int(self.rng.choice(len(self._names), p=self._p))]
                self.recent.append((self.ops_done, name))
                try:
                    getattr(self, "op_" + name)()
                    if self.check_every and self.ops_done % self.check_every == 0:
                        self.check()
                except Exception as e:
                    raise RunFailure(self.report_failure(e)) from e
                self.ops_done += 1
                self.counts["op_" + name] += 1
                now = time.monotonic()
                if self.progress and now - last >= self.progress:
                    last = now
                    self.log(f"[seed {self.seed}] {self.ops_done}/{ops} ops, "
                             f"{self.ops_done / (now - t0):.0f} ops/s, episode {self.episode}, "
                             f"steps {self.counts['steps']}, values checked "
                             f"{self.counts['values_checked']}", flush=True)
            self.close_episode()
        self.counts["seconds"] = round(time.monotonic() - t0, 1)
        return self.counts

    def report_failure(self, e: BaseException) -> str:
        tail = "\n".join(f"  {r}" for r in self.recent)
        return (f"random run FAILED: seed {self.seed}, hot {self.hot}, operation "
                f"{self.ops_done} ({type(e).__name__}: {e})\n{self.desc}\nlast operations:\n"
                f"{tail}\n{traceback.format_exc()}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=None, help="default: drawn from the OS")
    p.add_argument("--hot", choices=["paged", "arena", "both"], default="both")
    p.add_argument("--episode-ops", type=int, default=2000,
                   help="operations per manager (a new random configuration each)")
    p.add_argument("--check-every", type=int, default=1,
                   help="content oracle every N operations (invariants too); 1: every one")
    p.add_argument("--progress", type=float, default=30.0, help="seconds between progress lines")
    p.add_argument("--minutes", type=float, default=None, help="stop after this long")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    seed = a.seed if a.seed is not None else int.from_bytes(os.urandom(4), "little")
    print(f"random run: seed {seed}, {a.ops} ops, hot {a.hot}", flush=True)
    run = RandomRun(seed, a.hot, a.episode_ops, a.check_every, a.progress)
    deadline = None if a.minutes is None else time.monotonic() + 60 * a.minutes
    try:
        counts = run.run(a.ops, deadline)
    except RunFailure as e:
        print(e, flush=True)
        return 1
    secs = counts["seconds"]
    print(f"random run OK: seed {seed}, hot {a.hot}, {run.ops_done} ops in {secs} s "
          f"({run.ops_done / max(secs, 1e-9):.0f} ops/s), 0 wrong values", flush=True)
    print(dict(sorted(counts.items())), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
