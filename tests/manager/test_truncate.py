"""truncate(seq, n): rolling back the K/V of a sequence's last tokens (issue 37, item 1).

Oracle: the fake model and value checker of ``test_manager.py`` (every cached K/V value of every
active sequence, read back through its page table, from the arena's reservation on the arena)
and the manager's invariants, after every operation. The test's shadow of a truncated
sequence's tokens is cut too, and the tokens written after the cut differ from the dropped
ones, so a page past the cut that was not freed, or a shared page written through, shows up as
a wrong value in this sequence or in a sharer.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from test_arena_hot import arena_config
from test_manager import make, tiny_config

from jax_kvcm._types import CacheLevel
from jax_kvcm.manager import OutOfPagesError, SequenceState, StepInFlightError, SuspendResult

D, H = CacheLevel.DEVICE, CacheLevel.HOST


def config(hot: str, **kw):
    if hot == "paged":
        return tiny_config(device_pages=kw.pop("device_pages", 40), max_seq_len=64, **kw)
    return arena_config(device_pages=kw.pop("device_pages", 40), head_dim=128, max_seq_len=64,
                        max_sequences=8, **kw)


def cut(h, seq, n, *, may_refuse=False) -> bool:
    """truncate and the test's shadow of the sequence's tokens; a refusal (``may_refuse``)
    must change nothing."""
    before = (seq.num_tokens, seq.num_known_tokens, seq.page_ids(0).copy())
    if not h.mgr.truncate(seq, n):
        assert may_refuse, (seq, n)
        after = (seq.num_tokens, seq.num_known_tokens, seq.page_ids(0))
        assert after[:2] == before[:2] and (after[2] == before[2]).all(), (before, after)
        return False
    del h.tokens[seq.seq_id][n:]
    assert seq.num_tokens == n and seq.num_known_tokens <= n
    return True


def resume_and_write_past_the_cut(h, a, b) -> None:
    """``a``, cut to 6 tokens while suspended, resumes and writes other tokens from position 6
    on; ``b``, which shares a's first pages, decodes on: the values of both read back right."""
    assert h.mgr.resume(a)
    h.check()
    h.run([(a, 9)], as_ids=[True])
    h.run([(b, 2)], as_ids=[True])
    h.check()


@pytest.mark.parametrize("hot", ["paged", "arena"])
def test_a_shared_prefix_survives_a_truncation_of_one_sharer(hot):
    """a and b share three committed pages; b is cut inside the second: b gets a private copy
    of that page (a shared page is never written again), writes different tokens after the cut,
    and a's values, and a newcomer's reuse of the shared pages, stay right."""
    h = make(config(hot))
    prompt = list(range(1, 14))                  # 3 full pages of 4 + 1 token
    a = h.add(prompt)
    h.run([(a, 13)], as_ids=[True])
    b = h.add(prompt + [50])
    assert b.num_reused_tokens == 12
    h.run([(b, 2)], as_ids=[True])
    shared = b.page_ids(0)[:3].copy()
    committed = h.mgr.stats()["num_committed_pages"]
    if hot == "arena":
        # b's range starts at its first own page (3): a cut before it cannot be written
        # again where the layout puts page j; refused, nothing changed.
        assert not cut(h, b, 6, may_refuse=True)
        h.check()
        return
    cut(h, b, 6)                                 # inside page 1 (tokens 4..7)
    assert b.page_ids(0)[0] == shared[0] and b.page_ids(0)[1] != shared[1]
    assert (a.page_ids(0)[:3] == shared).all()
    h.check()
    h.run([(b, 9)], as_ids=[True])               # different tokens from position 6 on
    h.check()
    c = h.add(prompt + [60])
    assert c.num_reused_tokens == 12 and (c.page_ids(0)[:3] == shared).all()
    h.run([(c, 2)], as_ids=[True])
    h.check()
    assert h.mgr.stats()["num_committed_pages"] > committed   # b's new pages commit again
    assert h.mgr.stats()["num_truncated_tokens"] == 14 - 6


@pytest.mark.parametrize("hot", ["paged", "arena"])
def test_a_page_only_it_holds_is_uncommitted_in_place(hot):
    """a alone: cut inside its last committed page, that page becomes private where it is (no
    copy), leaves the prefix tree (a newcomer no longer reuses it), and what a writes next is
    read back right."""
    h = make(config(hot))
    a = h.add(list(range(1, 10)))
    h.run([(a, 9)], as_ids=[True])
    h.run([(a, 4)], as_ids=[True])               # 13 tokens: pages 0-2 committed
    pages = a.page_ids(0).copy()
    cut(h, a, 10)
    assert (a.page_ids(0)[:3] == pages[:3]).all() and a.num_pages == 3
    h.check()
    b = h.add(h.tokens[a.seq_id][:12] + [99])
    assert b.num_reused_tokens == 8              # pages 0 and 1; page 2 is a's own now
    h.run([(a, 5), (b, 5)], as_ids=[True, True])
    h.check()


def test_truncate_refusals_change_nothing(tmp_path):
    """Out-of-range counts, a step in flight, a suspended sequence: errors naming the cause,
    and the sequence as it was."""
    h = make(config("paged", host_pages=16))
    a = h.add(list(range(1, 10)))
    h.run([(a, 9)], as_ids=[True])
    before = (a.num_tokens, a.page_ids(0).copy())
    for bad, err in ((10, ValueError), (-1, ValueError), (2.0, TypeError)):
        with pytest.raises(err, match="num_tokens"):
            h.mgr.truncate(a, bad)
    assert a.num_tokens == before[0] and (a.page_ids(0) == before[1]).all()
    batch, spans = h.prepare([(a, 1)], [True])
    with pytest.raises(StepInFlightError, match="truncate"):
        h.mgr.truncate(a, 3)
    h.mgr.complete_step(h.write(batch, spans))
    assert h.mgr.suspend(a) is SuspendResult.SUSPENDED
    h.mgr.close(a)
    with pytest.raises(ValueError, match="closed"):
        h.mgr.truncate(a, 3)
    h.check()


@pytest.mark.parametrize("hot", ["paged", "arena"])
def test_a_suspended_sequence_is_truncated_where_it_is_parked(hot, tmp_path):
    """Suspended to the host (and to disk): a cut inside its parked pages frees the rest there;
    a cut inside a committed page only it holds makes that page parked; resumed, its values are
    right and it decodes on. A cut into a page another sequence shares gets a private copy at
    the parked level: the sharer's values stay, and the cut sequence writes other tokens after
    the cut once resumed."""
    h = make(config(hot, host_pages=24, disk_dir=str(tmp_path), disk_pages=24))
    a = h.add(list(range(1, 14)))
    h.run([(a, 13)], as_ids=[True])
    h.run([(a, 6)], as_ids=[True])              # 19 tokens: pages 0-3 committed, 4 private
    assert h.mgr.suspend(a) is SuspendResult.SUSPENDED
    host_used = h.mgr.stats()["pages_per_pool"]["host"][0]["referenced"]
    assert cut(h, a, 17)                         # inside page 4 (parked): page 4 kept
    assert cut(h, a, 14)                         # inside page 3 (committed, only a): parked
    assert h.mgr.stats()["pages_per_pool"]["host"][0]["referenced"] <= host_used
    h.check()
    assert h.mgr.resume(a)
    h.check()
    h.run([(a, 7)], as_ids=[True])
    h.check()
    b = h.add(h.tokens[a.seq_id][:9] + [77])     # shares a's pages 0 and 1
    h.run([(b, 10 - b.num_reused_tokens)], as_ids=[True])
    assert h.mgr.suspend(a) is SuspendResult.SUSPENDED
    copies = h.mgr.stats()["num_truncated_tokens"]
    assert cut(h, a, 6)                          # page 1 is shared (on the device): copied
    assert h.mgr.stats()["num_truncated_tokens"] > copies
    h.check()
    resume_and_write_past_the_cut(h, a, b)
    c = h.add(h.tokens[b.seq_id][:9] + [55])     # the shared pages are still b's prefix
    assert c.num_reused_tokens == 8
    h.run([(c, 2)], as_ids=[True])
    h.check()


def test_a_window_refuses_a_cut_before_its_retained_pages():
    """A sliding-window group released the pages before its window: a cut that needs them
    again is refused (ValueError naming the first retained token), nothing changed; a cut
    inside the window works."""
    h = make(tiny_config(device_pages=40, max_seq_len=64, windows=(None, 8)))
    a = h.add(list(range(1, 30)))
    h.run([(a, 29)], as_ids=[True])
    before = [a.page_ids(g).copy() for g in (0, 1)]
    with pytest.raises(ValueError, match="sliding window of layer group 1"):
        h.mgr.truncate(a, 10)
    assert a.num_tokens == 29 and all((a.page_ids(g) == before[g]).all() for g in (0, 1))
    h.check()
    cut(h, a, 27)                                # the window still holds page 5
    h.check()
    h.run([(a, 6)], as_ids=[True])
    h.check()
    # rollback_tokens: the window keeps 8 tokens more, so a cut of 8 is served
    h = make(tiny_config(device_pages=40, max_seq_len=64, windows=(None, 8), rollback_tokens=8))
    a = h.add(list(range(1, 30)))
    h.run([(a, 29)], as_ids=[True])
    h.check()
    cut(h, a, 21)
    h.check()
    h.run([(a, 9)], as_ids=[True])
    h.check()
    with pytest.raises(ValueError, match="sliding window"):
        h.mgr.truncate(a, 10)


def test_a_suspended_sequence_with_a_window_group_is_cut_where_it_is_parked():
    """A full-attention group and a window of 8 with 8 tokens of rollback slack, suspended to
    the host: a cut the window still serves frees the parked pages past it in both groups;
    resumed, every value is right and the sequence decodes on; a cut before the window's
    retained pages raises ValueError for the parked sequence too, nothing changed."""
    h = make(tiny_config(device_pages=40, max_seq_len=64, windows=(None, 8), rollback_tokens=8,
                         host_pages=32))
    a = h.add(list(range(1, 30)))
    h.run([(a, 29)], as_ids=[True])
    h.run([(a, 3)], as_ids=[True])              # 32 tokens
    assert h.mgr.suspend(a) is SuspendResult.SUSPENDED
    host = h.mgr.stats()["pages"]["host"]["referenced"]
    with pytest.raises(ValueError, match="sliding window"):
        h.mgr.truncate(a, 10)
    assert cut(h, a, 23)                         # inside page 5, within the slack
    assert h.mgr.stats()["pages"]["host"]["referenced"] < host
    h.check()
    assert h.mgr.resume(a)
    h.check()
    h.run([(a, 9)], as_ids=[True])               # other tokens from position 23 on
    h.check()


@pytest.mark.parametrize("hot", ["paged", "arena"])
def test_random_truncations_keep_every_value(hot, tmp_path):
    """Random steps, truncations, closes, suspends and resumes over prompts with shared
    prefixes, on a host and a disk tier; every value and the invariants after each operation.
    Prints its seed (TRUNCATE_SEED=N repeats a run)."""
    seed = int(os.environ.get("TRUNCATE_SEED", np.random.default_rng().integers(1 << 30)))
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    h = make(config(hot, device_pages=48, host_pages=24, disk_dir=str(tmp_path),
                    disk_pages=48))
    prefixes = [list(rng.integers(0, 40, size=int(rng.integers(4, 14)))) for _ in range(3)]
    live = []
    ops = {"add": 0, "step": 0, "truncate": 0, "close": 0, "suspend": 0, "resume": 0,
           "refused": 0, "out_of_pages": 0}
    for i in range(400):
        op = rng.choice(["add", "step", "step", "truncate", "truncate", "close", "suspend",
                         "resume"])
        active = [s for s in live if s.state is SequenceState.ACTIVE]
        try:
            if op == "add" and len(live) < 5:
                p = prefixes[int(rng.integers(3))]
                s = h.add([int(t) for t in p] + [int(t) for t in rng.integers(0, 40, size=2)])
                try:
                    h.run([(s, len(h.tokens[s.seq_id]) - s.num_tokens)], as_ids=[True])
                    live.append(s)
                except OutOfPagesError:   # the device is full of live pages: a refusal
                    ops["out_of_pages"] += 1
                    h.mgr.close(s)
            elif op == "step" and active:
                pick = [s for s in active if s.num_tokens < 56][:3]
                if pick:
                    try:
                        h.run([(s, int(rng.integers(1, 7))) for s in pick],
                              as_ids=[bool(rng.integers(0, 4)) for _ in pick])
                    except OutOfPagesError:   # a refusal: nothing scheduled, nothing changed
                        ops["out_of_pages"] += 1
            elif op == "truncate" and live:
                s = live[int(rng.integers(len(live)))]
                n = int(rng.integers(max(0, s.num_tokens - 12), s.num_tokens + 1))
                refusable = hot == "arena" or s.state is SequenceState.SUSPENDED
                if not cut(h, s, n, may_refuse=refusable):
                    ops["refused"] += 1
            elif op == "close" and live:
                s = live.pop(int(rng.integers(len(live))))
                h.mgr.close(s)
            elif op == "suspend" and active:
                h.mgr.suspend(active[int(rng.integers(len(active)))])
            elif op == "resume":
                sus = [s for s in live if s.state is SequenceState.SUSPENDED]
                if sus:
                    h.mgr.resume(sus[0])
            else:
                continue
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"seed={seed} operation {i} ({op}) failed: {e!r}") from e
        ops[op] += 1
        try:
            h.check()
        except AssertionError as e:
            raise AssertionError(f"seed={seed} after operation {i} ({op}): {e}") from e
    print(ops)
    assert ops["truncate"] - ops["refused"] > 20 and ops["step"] > 30, ops


@pytest.mark.parametrize("hot", ["paged", "arena"])
def test_a_cut_inside_an_adopted_page_copies_it(hot):
    """a and b run the same prompt in one step: b adopts a's committed pages (its own copies
    are freed). Cut inside one of them, b gets a private copy in its own slot (on an arena at
    ``base + j``, through the codec and a device scratch region); a's page is never written."""
    h = make(config(hot))
    prompt = list(range(1, 14))
    a, b = h.add(prompt), h.add(prompt)
    h.run([(a, 13), (b, 13)], as_ids=[True, True])
    assert (b.page_ids(0)[:3] == a.page_ids(0)[:3]).all()   # adopted
    h.check()
    assert cut(h, b, 6)
    assert b.page_ids(0)[1] != a.page_ids(0)[1] and b.page_ids(0)[0] == a.page_ids(0)[0]
    h.check()                                    # b's copy holds tokens 4, 5 of the page
    h.run([(b, 10)], as_ids=[True])
    h.check()
    h.run([(a, 3)], as_ids=[True])
    h.check()


@pytest.mark.parametrize("hot", ["paged", "arena"])
def test_fp8_pools_copy_the_cut_page_byte_for_byte(hot):
    """float8_e4m3fn pools: a and b compute the same prompt in one step (b adopts a's pages);
    b is cut inside page 1: its private copy holds the very bytes of a's page at the kept
    positions, and a's pages are not touched (raw bytes before and after)."""
    import dataclasses

    import jax.numpy as jnp

    import jax_kvcm
    from test_manager import read_tokens
    base = config(hot)
    cfg = dataclasses.replace(base, layer_groups=tuple(
        dataclasses.replace(g, kv_dtype=jnp.float8_e4m3fn) for g in base.layer_groups))
    h = make(cfg)
    mgr, tpp = h.mgr, cfg.tokens_per_page
    prompt = np.arange(1, 14, dtype=np.int32)
    a, b = mgr.add_sequence(prompt), mgr.add_sequence(prompt)
    batch = mgr.prepare_step([(a, prompt), (b, prompt)])
    (k, v), = mgr.caches
    rng = np.random.default_rng(3)
    lg = cfg.layer_groups[0]
    T = batch.slot_mapping.shape[0]
    new = jnp.asarray(rng.standard_normal((T, lg.num_kv_heads, lg.head_dim)), jnp.float32)
    scale = jnp.full((lg.num_layers, lg.num_kv_heads), 0.5, jnp.float32)
    for layer in range(lg.num_layers):
        k, v = jax_kvcm.write_kv(k, v, new, -new, batch.slot_mapping, layer=layer,
                                 k_scale=scale, v_scale=scale)
    mgr.complete_step([(k, v)])
    assert (b.page_ids(0)[:3] == a.page_ids(0)[:3]).all()     # adopted

    def raw(seq, n):
        pages = seq.page_ids(0)
        slots = pages[np.arange(n) // tpp] * tpp + np.arange(n) % tpp
        return [np.asarray(x).view(np.uint8).copy() for x in read_tokens(mgr, 0, slots)]

    a_before = raw(a, 13)
    assert mgr.truncate(b, 6)
    assert b.page_ids(0)[1] != a.page_ids(0)[1]
    for x, y in zip(raw(b, 6), a_before):
        assert np.array_equal(x, y[:, :6])
    for x, y in zip(raw(a, 13), a_before):
        assert np.array_equal(x, y)
    mgr.check_invariants()


def test_a_cut_while_the_step_that_read_the_pages_still_runs():
    """The overlapped loop: the device still runs the step that read a's last pages when the
    host learns the drafts were rejected. The pages past the cut wait for that step (pending,
    never handed out before it completes); the next step then waits for it rather than write
    into a page it may still read, and every value is right."""
    from test_manager import NotReadyFence
    h = make(tiny_config(device_pages=6, prefix=False))
    mgr = h.mgr
    a = h.add(list(range(1, 9)))
    h.run([(a, 8)], as_ids=[True])
    h.run([(a, 12)], as_ids=[True])              # 20 tokens: 5 pages
    mgr._ledger._fence = NotReadyFence()         # that step has not finished on the device
    mgr._ledger._ready_upto = 0
    assert cut(h, a, 9)                          # pages 3, 4 past the cut: pending
    assert mgr.stats()["pages"]["device"]["pending"] == 2
    mgr._planner.reclaim()
    assert mgr.stats()["pages"]["device"]["pending"] == 2   # not before the step completes
    b = h.add(list(range(40, 44)))
    h.run([(b, 4), (a, 7)], as_ids=[True, True])  # needs them: waits for the step, reuses
    assert mgr._stats.num_fence_waits == 1
    h.check()


@pytest.mark.parametrize("hot", ["paged", "arena"])
def test_a_parked_cut_whose_disk_write_fails_is_refused(hot, tmp_path):
    """Suspended to the disk (no host tier), cut into a page another sequence shares: the
    private copy goes to the disk; when that write fails the truncation is refused (False,
    nothing changed) and counted as a disk write error, as the planner counts every other one
    (it raised DiskFullError out of truncate before, found by tools/random_run.py, seeds
    2670091267 and 1856074790); once the disk writes again the same cut works and the values
    read back right after the resume."""
    from faults import install_faulty_disks

    h = make(config(hot, disk_dir=str(tmp_path), disk_pages=24))
    a = h.add(list(range(1, 14)))
    h.run([(a, 13)], as_ids=[True])
    b = h.add(h.tokens[a.seq_id][:9] + [77])     # shares a's pages 0 and 1
    h.run([(b, 10 - b.num_reused_tokens)], as_ids=[True])
    assert h.mgr.suspend(a) is SuspendResult.SUSPENDED
    assert a._parked[0] is CacheLevel.DISK
    disk = install_faulty_disks(h.mgr)[0]
    disk.fail_writes = 1
    errors = h.mgr.stats()["num_disk_write_errors"]
    assert not cut(h, a, 6, may_refuse=True)     # page 1 is shared: its copy's write fails
    assert disk.num_failed_writes == 1
    assert h.mgr.stats()["num_disk_write_errors"] == errors + 1
    assert a.state is SequenceState.SUSPENDED
    h.check()
    assert cut(h, a, 6)                          # the disk writes again
    h.check()
    resume_and_write_past_the_cut(h, a, b)
