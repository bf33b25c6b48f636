"""KVCacheManager under failure and misuse: a step that fails (before running, or after consuming
its donated pools), observers that raise, unreadable and full disks, bad token ids and bad
arguments. Every test checks the manager's invariants and the cached K/V values (the fake model of
test_manager) afterwards. Faults come from the test seams in ``faults.py`` (wrappers around a
disk pool, a step that fails inside XLA), not from hooks in the production classes. CPU only.
"""

from __future__ import annotations

import tempfile

import numpy as np
import pytest

from faults import FOREVER, failing_step, install_faulty_disks
from jax_kvcm.manager import SequenceState, SuspendResult
from jax_kvcm.manager import ManagerEvent
from jax_kvcm._storage import CorruptPageError, StorageEvent, UnreadablePageError
from jax_kvcm._types import CacheLevel
from test_manager import make, on_disk_prefix, stepped, tiny_config

D, H, K = CacheLevel.DEVICE, CacheLevel.HOST, CacheLevel.DISK


@pytest.fixture
def diskdir():
    with tempfile.TemporaryDirectory() as d:
        yield d


def where(h):
    """Page counts per tier and where every committed page is: what abort_step restores."""
    st = h.mgr.stats()
    nodes = sorted((n.key, n.level, n.slots.tolist(), n.refcount)
                   for n in h.mgr.tree.nodes.values())
    return repr((st["pages_per_pool"], nodes, st["num_committed_pages"]))


# -- a step that fails ------------------------------------------------------------------------


def test_abort_before_the_step_ran_restores_and_commits_nothing():
    """The step raised before running: abort_step puts every sequence back (lengths, pages,
    known tokens), frees the pages prepare_step took, commits nothing; complete_step refuses the
    pools it handed out (that "recovery" used to commit never-written pages, which a later
    request with the same prompt then reused)."""
    h = make(tiny_config(device_pages=12))
    b = h.add(list(range(30, 35)))
    h.run([(b, 5)])
    a = h.add(list(range(9)))
    before = where(h), a.num_tokens, a.page_ids().tolist(), b.num_tokens, b.page_ids().tolist()
    h.mgr.prepare_step([(a, np.arange(9, dtype=np.int32)), (b, 1)])
    with pytest.raises(ValueError, match=r"caches\[0\]\[0\].*handed out"):
        h.mgr.complete_step(h.mgr.caches)
    assert h.mgr.abort_step() == []
    after = where(h), a.num_tokens, a.page_ids().tolist(), b.num_tokens, b.page_ids().tolist()
    assert after == before
    h.check()
    c = h.add(list(range(9)))
    assert c.num_reused_tokens == 0  # nothing was committed
    h.run([(a, 9), (c, 9), (b, 2)], as_ids=[True, True, False])
    h.check()
    d = h.add(list(range(9)))
    assert d.num_reused_tokens == 8
    h.run([(d, 1)])
    h.check()


def test_abort_with_a_sequence_closed_and_its_row_reused_during_the_step():
    h = make(tiny_config(device_pages=12, windows=(None, 6)))
    a, b = h.add(list(range(10))), h.add(list(range(20, 30)))
    h.run([(a, 10), (b, 10)])
    h.mgr.prepare_step([(a, 3), (b, 3)])
    h.mgr.close(a)
    c = h.add(list(range(40, 45)))
    assert h.mgr.abort_step() == []
    h.check()
    assert c.num_tokens == 0 and b.num_tokens == 10
    h.run([(b, 3), (c, 5)])
    h.check()
    with pytest.raises(RuntimeError, match="abort_step without"):
        h.mgr.abort_step()


@pytest.mark.parametrize("how", ["abort", "recover"])
def test_failed_step_that_consumed_the_pools_is_recovered(diskdir, how):
    """The step donated the pools and failed inside XLA: the pools are deleted. complete_step
    refuses them; abort_step (or recover_from_failed_step) rebuilds the pools and reports every
    sequence that held device pages (closed, to recompute); a sequence suspended to the host
    keeps its pages; the manager serves again, and re-adding a lost prompt reuses what the host
    tier still holds."""
    h = make(tiny_config(device_pages=10, host_pages=8))
    old = h.add(list(range(100, 109)))
    old2 = h.add(list(range(300, 309)))
    h.run([(old, 9), (old2, 9)], as_ids=[True, True])
    h.mgr.close(old)
    h.mgr.close(old2)
    filler = h.add(list(range(200, 228)))
    h.run([(filler, 28)])            # pushes old's two cached pages to the host
    h.mgr.close(filler)
    s = h.add(list(range(50, 57)))
    h.run([(s, 7)])
    assert h.mgr.suspend(s) is SuspendResult.SUSPENDED
    a = h.add(list(range(100, 109)) + [7, 7])
    assert a.num_reused_tokens == 8
    h.run([(a, 3)])
    b = h.add(list(range(9)))
    h.run([(b, 9)])
    batch = h.mgr.prepare_step([(a, 1), (b, 1)])
    handed = h.mgr.caches
    with pytest.raises(Exception):
        failing_step(handed)
    assert handed[0][0].is_deleted()
    with pytest.raises(ValueError, match="deleted"):
        h.mgr.complete_step(handed)
    if how == "abort":
        lost = h.mgr.abort_step()
    else:
        lost = h.mgr.recover_from_failed_step()
    assert {x.seq_id for x in lost} == {a.seq_id, b.seq_id}
    assert all(x.state is SequenceState.CLOSED for x in lost)
    assert s.state is SequenceState.SUSPENDED
    assert not h.mgr.caches[0][0].is_deleted()
    assert h.mgr.stats()["num_lost_sequences"] == 2
    h.check()
    assert h.mgr.resume(s)
    h.check()
    a2 = h.add(h.tokens[a.seq_id][:11])  # a's prompt pages had been onboarded: lost
    assert a2.num_reused_tokens == 0
    e = h.add(list(range(300, 309)))
    assert e.num_reused_tokens == 8  # the host tier still has these
    h.run([(a2, 11), (s, 2), (e, 1)])
    h.check()
    del batch


def test_recover_outside_a_step():
    """An error found only after complete_step took the step's outputs: recover anyway."""
    h = make(tiny_config(device_pages=8))
    a = h.add(list(range(9)))
    h.run([(a, 9)], as_ids=[True])
    assert [x.seq_id for x in h.mgr.recover_from_failed_step()] == [a.seq_id]
    h.check()
    assert len(h.mgr.tree) == 0
    b = h.add(list(range(9)))
    assert b.num_reused_tokens == 0
    h.run([(b, 9)])
    h.check()


# -- observers --------------------------------------------------------------------------------


def test_observer_that_raises_during_suspend_corrupts_nothing():
    """The reported bug: an observer raising on "removed" in the middle of suspend's page move
    freed a device page still in a live page table. Now events arrive after the call (the
    sequence already SUSPENDED), the error is collected and warned about, nothing breaks."""
    h = make(tiny_config(device_pages=8, host_pages=8))
    a = h.add(list(range(10)))
    b = h.add(list(range(20, 27)))
    h.run([(a, 10), (b, 7)])
    seen = []

    def observer(event):
        if isinstance(event, StorageEvent) and event.kind == "removed":
            seen.append(a.state)
            raise RuntimeError("observer bug")
    h.mgr.add_observer(observer)
    with pytest.warns(RuntimeWarning, match="observer bug"):
        assert h.mgr.suspend(a) is SuspendResult.SUSPENDED
    assert seen and all(st is SequenceState.SUSPENDED for st in seen)
    assert h.mgr.stats()["num_observer_errors"] == len(seen)
    assert isinstance(h.mgr.observer_errors[-1][2], RuntimeError)
    h.check()
    c = h.add(list(range(60, 75)))
    h.run([(c, 15), (b, 1)])  # takes the freed pages; must not touch a's
    h.check()
    h.mgr.close(c)
    with pytest.warns(RuntimeWarning):
        assert h.mgr.resume(a)
    h.check()


def test_observer_may_call_the_manager():
    h = make(tiny_config(device_pages=8))
    calls = []
    h.mgr.add_observer(lambda ev: calls.append(h.mgr.stats()["num_steps"]))
    a = h.add(list(range(9)))
    h.run([(a, 9)], as_ids=[True])
    assert calls and calls[-1] == 1
    with pytest.raises(TypeError, match="callable"):
        h.mgr.add_observer(None)


# -- unreadable and full disks ----------------------------------------------------------------


@pytest.mark.parametrize("fault", ["eio_forever", "short_read_native"])
def test_unreadable_disk_hit_is_a_miss_and_is_dropped(diskdir, fault):
    """A read error (EIO, or a real short read in the native file) on a prefix hit used to
    raise from every add_sequence with that prefix, forever. Now it is a miss, like a checksum
    failure: the unreadable nodes are dropped and the next request does not touch the disk."""
    h, hit = on_disk_prefix(diskdir)
    if fault == "eio_forever":
        disk = install_faulty_disks(h.mgr)[0]
        disk.fail_reads = FOREVER
    else:
        h.mgr.storage.disk_pools[0]._inject_fault("short_read")
    c = h.add(list(range(9)))
    assert c.num_reused_tokens == 0 and not any(n.alive for n in hit)
    assert h.mgr.stats()["num_disk_read_errors"] == 1
    h.check()
    d = h.add(list(range(9)))
    assert d.num_reused_tokens == 0
    h.mgr.close(d)
    h.run([(c, 9)], as_ids=[True])
    h.check()
    if fault == "eio_forever":
        assert disk.num_failed_reads == 1


def test_unreadable_parked_pages_allow_close_and_recompute(diskdir):
    h = make(tiny_config(device_pages=8, disk_dir=diskdir, disk_pages=10))
    a = h.add(list(range(10)))
    h.run([(a, 10)], as_ids=[True])
    assert h.mgr.suspend(a) is SuspendResult.SUSPENDED and a._parked[0] is K
    disk = install_faulty_disks(h.mgr)[0]
    disk.fail_reads = FOREVER
    with pytest.raises(UnreadablePageError) as e:
        h.mgr.resume(a)
    assert isinstance(e.value, CorruptPageError) and isinstance(e.value, OSError)
    assert a.state is SequenceState.SUSPENDED
    h.check()
    h.mgr.close(a)  # and recompute
    h.check()
    b = h.add(list(range(10)))
    assert b.num_reused_tokens == 0  # the unreadable pages were a miss, then dropped
    h.run([(b, 10)])
    h.check()


def fill_and_evict(h, base, n=3):
    """Closes ``n`` one-page-plus prompts so their committed pages are cached on the device,
    then runs a prompt that needs the room: cached pages must be evicted."""
    for i in range(n):
        s = h.add(list(range(base + 10 * i, base + 10 * i + 5)))
        h.run([(s, 5)], as_ids=[True])
        h.mgr.close(s)


def test_full_disk_never_blocks_device_allocation(diskdir):
    """Writes fail with ENOSPC: eviction used to raise DiskFullError from every prepare_step.
    Now the cached pages are dropped (counted), after three failures in a row the disk tier is
    degraded (an event, a warning, no more writes) and serving goes on."""
    h = make(tiny_config(device_pages=4, disk_dir=diskdir, disk_pages=10))
    disk = install_faulty_disks(h.mgr)[0]
    disk.fail_writes = FOREVER
    with pytest.warns(RuntimeWarning, match="disk writes failed"):
        for i in range(5):
            fill_and_evict(h, 100 * i, n=2)
            h.check()
    st = h.mgr.stats()
    assert st["num_dropped_on_disk_error"] >= 3 and st["num_disk_write_errors"] == 3
    assert st["disk_degraded"] and disk.num_failed_writes == 3
    assert any(isinstance(e, ManagerEvent) and e.kind == "disk_degraded" for e in h.mgr.events)
    assert st["pages"]["disk"]["free"] == st["pages"]["disk"]["capacity"]
    a = h.add(list(range(13)))
    h.run([(a, 13)])
    h.check()


def test_transient_disk_write_error_drops_once(diskdir):
    h = make(tiny_config(device_pages=4, disk_dir=diskdir, disk_pages=10))
    disk = install_faulty_disks(h.mgr)[0]
    disk.fail_writes = 1
    fill_and_evict(h, 0, n=8)
    h.check()
    st = h.mgr.stats()
    assert st["num_disk_write_errors"] == 1 and st["num_dropped_on_disk_error"] >= 1
    assert not st["disk_degraded"]
    assert st["pages"]["disk"]["cached"] >= 1  # later evictions went to disk again
    assert h.add(list(range(0, 5))).num_reused_tokens in (0, 4)
    h.check()


def test_suspend_to_a_failing_disk_must_recompute(diskdir):
    h = make(tiny_config(device_pages=8, disk_dir=diskdir, disk_pages=10))
    a = h.add(list(range(10)))
    h.run([(a, 10)])
    install_faulty_disks(h.mgr)[0].fail_writes = 1
    pages = a.page_ids().tolist()
    assert h.mgr.suspend(a) is SuspendResult.MUST_RECOMPUTE
    assert a.state is SequenceState.ACTIVE and a.page_ids().tolist() == pages
    h.check()
    assert h.mgr.suspend(a) is SuspendResult.SUSPENDED  # the disk works again
    assert h.mgr.resume(a)
    h.check()


def test_storage_close_frees_every_tier_when_a_disk_close_fails(diskdir):
    h = make(tiny_config(device_pages=8, host_pages=4, disk_dir=diskdir, disk_pages=4,
                         groups=2))
    st = h.mgr.storage
    disks = install_faulty_disks(h.mgr)
    assert len(disks) == 2 and len(st.host_pools) == 2
    disks[0].fail_close = True
    with pytest.raises(OSError, match="unlink"):
        st.close()
    assert all(d.closed for d in disks) and all(p.closed for p in st.host_pools)
    st.close()  # idempotent


# -- misuse -----------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [[1, 2**32 + 1], [-1, 3], np.array([2**64 - 1], np.uint64),
                                    [2**31], [2**70]])
def test_token_ids_outside_int32_are_refused(tokens):
    """2**32 + 1 used to wrap to 1 and reuse the pages of a prompt starting with 1."""
    h = make(tiny_config())
    with pytest.raises(ValueError, match="token"):
        h.mgr.add_sequence(tokens)
    a = h.add([5, 6, 7])
    with pytest.raises(ValueError, match=r"work\[0\]\[1\]"):
        h.mgr.prepare_step([(a, np.asarray(tokens) if not isinstance(tokens, list)
                             or max(tokens) < 2**63 else np.array([2**31], np.int64))])
    assert a.num_tokens == 0
    h.check()


def test_wrapped_ids_do_not_alias_another_prompt():
    h = make(tiny_config())
    a = h.add([1] + list(range(2, 10)))
    h.run([(a, 9)], as_ids=[True])
    with pytest.raises(ValueError):
        h.mgr.add_sequence([2**32 + 1] + list(range(2, 10)))


def test_bad_arguments_are_type_errors_naming_them():
    h = make(tiny_config())
    a = h.add([1, 2, 3])
    with pytest.raises(TypeError, match=r"work\[0\]\[0\]"):
        h.mgr.prepare_step([(None, 1)])
    with pytest.raises(TypeError, match=r"work\[1\]"):
        h.mgr.prepare_step([(a, 1), 7])
    with pytest.raises(TypeError, match=r"work\[0\]\[1\]"):
        h.mgr.prepare_step([(a, None)])
    h.mgr.prepare_step([(a, 3)])
    numpy_pools = [(np.asarray(k), np.asarray(v)) for k, v in h.mgr.caches]
    with pytest.raises(TypeError, match=r"caches\[0\]\[0\]"):
        h.mgr.complete_step(numpy_pools)
    with pytest.raises(TypeError, match=r"caches"):
        h.mgr.complete_step(h.mgr.caches[0][0])
    h.mgr.complete_step(stepped(h.mgr.caches))
    h.mgr.check_invariants()

