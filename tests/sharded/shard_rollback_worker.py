"""A fault in one shard's part of a migration rolls back every shard, byte-exact (run by
``test_shard_rollback.py`` in a process with several CPU devices: the device count is fixed when
jax starts).

Usage: ``python shard_rollback_worker.py --devices N --seed S --disk DIR [--manager]
[--platform cpu|gpu]``. Exits 0 when every check passes; prints each case with the seed. On GPUs
the concat codec's pairs are HOST-location (each shard's host copy registered per call), the
host tier is pinned and the disk hops go through the pinned staging ring.

Pools split over KV heads on an N-device mesh; a host and a disk tier. For every path that runs
a per-shard codec call (device -> host, write-back ahead, host -> device, device -> disk, disk ->
device) the fault is raised while the LAST shard's part is prepared (after every other shard's
was: ``shard_pairs:<N-1>``), also as the second move of a two-move transaction whose first move
was already submitted. Host <-> disk copies are one raw copy of whole pages (the disk file's I/O
never splits a page, so every shard's piece of a page is in one syscall): there the last page's
syscall fails (ENOSPC, a short write, EIO, a short read) after the others went through.
After each fault:

- every shard of every pool holds the bytes it held before (each addressable shard compared
  with a snapshot), and so do the host tier and the disk file, except bytes of slots that are
  free both before and after (a rolled-back transaction may have written into the destination
  slots it then released: no one reads a free slot). Where nothing was submitted before the
  fault, the whole host tier and pools are compared, free slots included;
- the allocated slots of every tier, free counts, governor usage (current and peak) and stats
  are as before;
- the same migration then succeeds, and the moved pages hold the oracle's bytes: the pool
  contents written at the start (numpy), in the documented cold layout (shard ``s``'s piece of
  a page at ``s * piece`` of its cold slot).

With ``--manager``, the same through a :class:`KVCacheManager` on the mesh (suspend, resume,
prefix onboarding from the host tier and eviction to it under page pressure): the call raises,
the manager's invariants hold, the sequence's state and every tier's bytes are as before, and a
retry succeeds with the attention output of the closed-form oracle of sharded_manager_check.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

# NOTE: run as a script: the tests' folders on sys.path as under pytest (faults.py is in manager/)
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import group_paths  # noqa: E402

group_paths.add_to_sys_path()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--disk", required=True)
    ap.add_argument("--manager", action="store_true")
    ap.add_argument("--platform", default="cpu", choices=["cpu", "gpu"])
    args = ap.parse_args()
    if args.platform == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.devices}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import jax
    assert len(jax.devices()) >= args.devices, jax.devices()
    mesh = jax.make_mesh((args.devices,), ("tp",), devices=jax.devices()[:args.devices])
    if args.manager:
        n = check_manager(mesh, args.seed, args.disk)
    else:
        n = check_storage(mesh, args.seed, args.disk)
    print(f"OK {'manager' if args.manager else 'storage'} devices={args.devices} "
          f"seed={args.seed} cases={n}")


# -- snapshots ---------------------------------------------------------------------------------


def _wait_host(st) -> None:
    """Waits for the device work that last touched host slots (failed work included: a
    rolled-back copy's fence stays on the slots it freed, for their next writer)."""
    from jax_kvcm._fence import wait_quietly
    for fences in st._host_fences:
        for f in {id(f): f for f in fences if f is not None}.values():
            wait_quietly(f)


def _allocated(alloc, num_slots: int):
    import numpy as np
    return frozenset(int(s) for s in np.arange(num_slots) if alloc.is_allocated(int(s)))


def snapshot(st) -> dict:
    """Everything a rolled-back transaction must leave as it was."""
    from jax_kvcm import CacheLevel
    _wait_host(st)
    for k, v in st.pools:
        k.block_until_ready()
        v.block_until_ready()
    shards = [[(s.device.id, s.index, bytes(memoryview(s.data.__array__()).cast("B")))
               for x in pair for s in sorted(x.addressable_shards, key=lambda s: s.device.id)]
              for pair in st.pools]
    hp, dp = st.host_pools[0], (st.disk_pools or [None])[0]
    disk = b"" if dp is None else os.pread(dp.fileno, dp.num_slots * dp.slot_bytes, 0)
    dev_alloc = st.device_allocators[0]
    return dict(
        shards=shards,
        host=bytes(hp.view().tobytes()),
        disk=disk,
        allocated={CacheLevel.DEVICE: _allocated(dev_alloc, dev_alloc.num_slots),
                   CacheLevel.HOST: _allocated(hp, hp.num_slots),
                   CacheLevel.DISK: frozenset() if dp is None else _allocated(dp, dp.num_slots)},
        free=[st.num_free(lv, 0) for lv in CacheLevel if st.has_level(lv)],
        usage=st.governor.ledger(),   # every level: pending, committed, transient, peaks
        stats=st.stats())


def assert_same(st, before: dict, after: dict, what: str, *, free_too: bool) -> None:
    """``after == before``; with ``free_too`` False, bytes of slots free in both are skipped."""
    import numpy as np

    from jax_kvcm import CacheLevel
    for key in ("allocated", "free", "usage", "stats"):
        assert after[key] == before[key], f"{what}: {key} changed:\n{before[key]}\n{after[key]}"
    live = before["allocated"]
    for h, (b_pair, a_pair) in enumerate(zip(before["shards"], after["shards"])):
        for (dev, index, b), (dev2, index2, a) in zip(b_pair, a_pair):
            assert (dev, index) == (dev2, index2), what
            if free_too:
                assert a == b, f"{what}: device {dev}'s shard {index} of the pools changed"
                continue
            shape = st.pools[h][0].addressable_shards[0].data.shape
            dtype = st.pools[h][0].dtype
            ab = np.frombuffer(a, dtype).reshape(shape)
            bb = np.frombuffer(b, dtype).reshape(shape)
            slots = sorted(live[CacheLevel.DEVICE] | {0})
            assert np.array_equal(ab[:, slots], bb[:, slots]), (
                f"{what}: a live slot of device {dev}'s shard {index} changed")
    for level, key, slot_bytes in ((CacheLevel.HOST, "host", st.host_pools[0].slot_bytes),
                                   (CacheLevel.DISK, "disk", st.disk_pools[0].slot_bytes)):
        if free_too and key == "host":
            assert after[key] == before[key], f"{what}: the host tier's bytes changed"
            continue
        for s in sorted(live[level]):
            sl = slice(s * slot_bytes, (s + 1) * slot_bytes)
            assert after[key][sl] == before[key][sl], f"{what}: live {key} slot {s} changed"


@contextlib.contextmanager
def fail_on(st, point: str, occurrence: int = 1):
    """Raises InjectedFault at the ``occurrence``-th time ``point`` is reached."""
    import faults
    seen = [0]

    def hook(p):
        if p == point:
            seen[0] += 1
            if seen[0] == occurrence:
                raise faults.InjectedFault(p)
    st._fault_hook = hook
    try:
        yield seen
    finally:
        st._fault_hook = None


# -- the storage manager -------------------------------------------------------------------------


def check_storage(mesh, seed: int, diskdir: str) -> int:
    import faults
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_kvcm import CacheLevel
    from jax_kvcm._storage import LayerGroupSpec, StorageConfig, StorageManager
    D, H, K = CacheLevel.DEVICE, CacheLevel.HOST, CacheLevel.DISK
    n = int(mesh.shape["tp"])
    layers, page, hkv, hd = 2, 4, 2 * n, 8
    rng = np.random.default_rng(seed)
    sharding = NamedSharding(mesh, P(None, None, None, "tp", None))
    spec = LayerGroupSpec(layers, page, hkv, hd, jnp.float32)
    st = StorageManager(StorageConfig((spec,), device_slots=(24,), host_bytes=1 << 20,
                                      disk_dir=diskdir, disk_bytes=1 << 20), device=sharding)
    cases = 0
    try:
        shape = (layers, 25, page, hkv, hd)
        k = rng.standard_normal(shape).astype(np.float32)
        v = rng.standard_normal(shape).astype(np.float32)
        st.pools[0] = (jax.device_put(k, sharding), jax.device_put(v, sharding))
        piece = 2 * layers * page * (hkv // n) * hd * 4
        last = n - 1

        # page id -> its (k, v) content; where each page lives: (level, slot)
        content: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        where: dict[int, tuple[CacheLevel, int]] = {}
        for pid, slot in enumerate(st.allocate(D, 0, 18)):
            content[pid] = (k[:, slot].copy(), v[:, slot].copy())
            where[pid] = (D, int(slot))

        def cold_bytes(pid):
            ck, cv = content[pid]
            hl = hkv // n
            return b"".join(np.stack([ck[:, :, s * hl:(s + 1) * hl], cv[:, :, s * hl:(s + 1) * hl]],
                                     axis=1).tobytes() for s in range(n))

        def verify(pids, what):
            snap = snapshot(st)
            kk, vv = (np.asarray(a) for a in st.pools[0])
            for pid in pids:
                level, slot = where[pid]
                if level is D:
                    ok = (np.array_equal(kk[:, slot], content[pid][0])
                          and np.array_equal(vv[:, slot], content[pid][1]))
                else:
                    sb = (st.host_pools[0] if level is H else st.disk_pools[0]).slot_bytes
                    raw = snap["host" if level is H else "disk"][slot * sb:slot * sb + n * piece]
                    ok = raw == cold_bytes(pid)
                assert ok, f"{what}: page {pid} at {level.name} slot {slot} (seed={seed})"

        def pick(level, count):
            out = [pid for pid, (lv, _) in sorted(where.items()) if lv is level][:count]
            assert len(out) == count, (level, count, where)
            return out

        def move(pids, dst_level):
            src_level = where[pids[0]][0]
            dst = st.migrate(0, src_level, np.array([where[p][1] for p in pids], np.int32),
                             dst_level)
            assert dst is not None
            for p, s in zip(pids, dst):
                where[p] = (dst_level, int(s))

        # Every tier holds live pages before the faults.
        move(pick(D, 5), H)
        move(pick(D, 4), K)
        verify(list(where), "setup")

        def expect_rollback(what, run, *, free_too):
            before = snapshot(st)
            try:
                run()
            except (faults.InjectedFault, OSError) as e:
                print(f"  {what}: {type(e).__name__}: {e}")
            else:
                raise AssertionError(f"{what}: the injected fault did not fail the migration")
            assert_same(st, before, snapshot(st), f"{what} (seed={seed})", free_too=free_too)
            verify(list(where), f"{what}: after the rollback")

        single = {"device -> host": (D, H), "device -> disk": (D, K), "host -> device": (H, D),
                  "disk -> device": (K, D)}
        for what, (src_level, dst_level) in single.items():
            pids = pick(src_level, 3)
            src = np.array([where[p][1] for p in pids], np.int32)
            with fail_on(st, f"shard_pairs:{last}"):
                expect_rollback(what, lambda: st.migrate(0, src_level, src, dst_level),
                                free_too=True)
            move(pids, dst_level)                              # the retry
            verify(list(where), f"{what}: retry")
            cases += 1

        # Write-back ahead (device -> host, the source slots stay allocated on success).
        pids = pick(D, 2)
        src = np.array([where[p][1] for p in pids], np.int32)
        with fail_on(st, f"shard_pairs:{last}"):
            expect_rollback("offload_ahead", lambda: st.offload_ahead([(0, src)]),
                            free_too=True)
        dsts, fence = st.offload_ahead([(0, src)])
        fence.wait()
        st.free(D, 0, src)
        for p, s in zip(pids, dsts[0]):
            where[p] = (H, int(s))
        verify(list(where), "offload_ahead: retry")
        cases += 1

        # Two moves in one transaction; the second fails on the last shard after the first
        # was submitted (its copies went into destination slots that the rollback frees).
        for first, second in (((H, D), (D, H)), ((D, H), (H, D)), ((K, D), (D, K))):
            a = pick(first[0], 2)
            b = [p for p in pick(second[0], 4) if p not in a][:2]
            moves = [(0, first[0], np.array([where[p][1] for p in a], np.int32), first[1]),
                     (0, second[0], np.array([where[p][1] for p in b], np.int32), second[1])]
            what = (f"{first[0].name}->{first[1].name} + {second[0].name}->{second[1].name}, "
                    "the second failing")
            with fail_on(st, f"shard_pairs:{last}", occurrence=2) as seen:
                expect_rollback(what, lambda: st.migrate_many(moves), free_too=False)
                assert seen[0] == 2, seen
            out = st.migrate_many(moves)
            assert out is not None
            for pids, dst, (_, _, _, level) in zip((a, b), out, moves):
                for p, s in zip(pids, dst):
                    where[p] = (level, int(s))
            verify(list(where), f"{what}: retry")
            cases += 1

        # host <-> disk: one raw copy of whole pages (every shard's piece of a page is in the
        # same syscall: the file's I/O is never split inside a page); one syscall per page, and
        # the last page's fails after the others went through.
        dpool = st.disk_pools[0]
        dpool._set_io_tuning(piece_bytes=dpool.slot_bytes, min_thread_bytes=1 << 30)
        for what, (src_level, dst_level), kind in (("host -> disk", (H, K), "enospc"),
                                                    ("host -> disk", (H, K), "short_write"),
                                                    ("disk -> host", (K, H), "eio_read"),
                                                    ("disk -> host", (K, H), "short_read")):
            what = f"{what} ({kind})"
            pids = pick(src_level, 3)
            src = np.array([where[p][1] for p in pids], np.int32)
            dpool._inject_fault(kind, after_ios=2)
            try:
                expect_rollback(what, lambda: st.migrate(0, src_level, src, dst_level),
                                free_too=False)
            finally:
                dpool._clear_faults()
            move(pids, dst_level)
            verify(list(where), f"{what}: retry")
            cases += 1
    finally:
        st.close()
    return cases


# -- the KV-cache manager ----------------------------------------------------------------------


def _stepping(mgr, mesh, hkv: int, tokens: dict[int, list[int]], seed: int):
    """``(run, add, pages_hold_oracle)`` over ``mgr``: ``run([(seq, ids)])`` one sharded step
    writing ``kv_of`` of the ids at their positions; ``add(ids)`` a sequence whose ids
    ``tokens`` records; ``pages_hold_oracle(seq, what)`` the pages hold ``kv_of`` of them."""
    import jax.numpy as jnp
    import numpy as np
    from sharded_manager_check import HEAD_DIM, NUM_LAYERS, assert_pages_hold, kv_of
    from sharded_manager_check import sharded_step as step

    def run(work):
        batch = mgr.prepare_step([(s, np.asarray(t, np.int32)) for s, t in work])
        T = batch.slot_mapping.shape[0]
        kv_new = np.zeros((NUM_LAYERS, 2, T, hkv, HEAD_DIM), np.float32)
        qs, pos = np.asarray(batch.query_start), np.asarray(batch.positions)
        for b, (seq, toks) in enumerate(work):
            rows = np.arange(qs[b], qs[b + 1])
            for layer in range(NUM_LAYERS):
                kv_new[layer, :, rows] = kv_of(np.asarray(toks), pos[rows], layer,
                                               hkv).transpose(1, 0, 2, 3)
        q = np.zeros((NUM_LAYERS, T, 2 * hkv, HEAD_DIM), np.float32)
        caches, _ = step(mgr.caches, batch, jnp.asarray(kv_new), jnp.asarray(q), mesh=mesh)
        mgr.complete_step(caches)

    def add(toks):
        seq = mgr.add_sequence(toks)
        tokens[seq.seq_id] = list(toks)
        return seq

    def pages_hold_oracle(seq, what):
        assert_pages_hold(mgr, seq, tokens[seq.seq_id], hkv, f"{what} (seed={seed})")

    return run, add, pages_hold_oracle


def check_manager(mesh, seed: int, diskdir: str) -> int:
    import faults
    import jax.numpy as jnp
    import numpy as np
    from sharded_manager_check import HEAD_DIM, NUM_LAYERS, PAGE

    from jax_kvcm import KVCacheConfig, KVCacheManager, LayerGroupConfig, SuspendResult
    n = int(mesh.shape["tp"])
    hkv = 2 * n
    last = n - 1
    rng = np.random.default_rng(seed)
    cfg = KVCacheConfig(tokens_per_page=PAGE,
                        layer_groups=(LayerGroupConfig(NUM_LAYERS, hkv, HEAD_DIM, jnp.float32),),
                        device_pages=12, max_batch=4, max_tokens_per_step=32, max_seq_len=48,
                        mesh=mesh, host_bytes=1 << 20, disk_dir=diskdir, disk_bytes=1 << 20)
    mgr = KVCacheManager(cfg)
    st = mgr.storage
    tokens: dict[int, list[int]] = {}

    run, add, pages_hold_oracle = _stepping(mgr, mesh, hkv, tokens, seed)

    def faulted(what, call, *, free_too=True):
        mgr.check_invariants()
        before, stats = snapshot(st), mgr.stats()
        with fail_on(st, f"shard_pairs:{last}") as seen:
            try:
                out = call()
            except faults.InjectedFault as e:
                print(f"  {what}: {type(e).__name__}: {e}")
            else:
                raise AssertionError(f"{what}: returned {out!r} through the fault "
                                     f"(reached {seen[0]}x)")
        mgr.check_invariants()
        assert_same(st, before, snapshot(st), f"{what} (seed={seed})", free_too=free_too)
        after = mgr.stats()
        # NOTE: the prefix lookup of a failed add_sequence ran and is counted (query counters,
        # not state); every other counter is as before.
        diff = {k: (stats.get(k), after.get(k)) for k in set(stats) | set(after)
                if stats.get(k) != after.get(k)
                and k not in ("num_prefix_queries", "num_prefix_query_tokens")}
        assert not diff, f"{what}: the manager's stats changed: {diff} (seed={seed})"

    cases = 0
    a = add([int(t) for t in rng.integers(0, 100, size=14)])
    run([(a, tokens[a.seq_id])])
    # suspend: a's pages leave the device
    view = mgr.state(a)
    faulted("suspend", lambda: mgr.suspend(a))
    assert mgr.state(a) == view and view.state.name == "ACTIVE", (mgr.state(a), view)
    pages_hold_oracle(a, "suspend rolled back")
    assert mgr.suspend(a) is SuspendResult.SUSPENDED
    cases += 1
    # prefix onboarding from the host tier
    faulted("onboarding", lambda: add(tokens[a.seq_id][:9]))
    b = add(tokens[a.seq_id][:9])
    assert b.num_reused_tokens == 8, b.num_reused_tokens
    pages_hold_oracle(b, "onboarded after a rolled-back onboarding")
    cases += 1
    # resume
    view = mgr.state(a)
    faulted("resume", lambda: mgr.resume(a))
    assert mgr.state(a) == view and view.state.name == "SUSPENDED", (mgr.state(a), view)
    assert mgr.resume(a)
    pages_hold_oracle(a, "resumed after a rolled-back resume")
    cases += 1
    # eviction to the host under page pressure: d's committed pages stay cached on the device
    # after it closes; a step that needs more pages than are free evicts them to the host.
    mgr.close(b)
    d = add([int(t) for t in rng.integers(100, 200, size=16)])
    run([(d, tokens[d.seq_id])])
    mgr.close(d)
    c = add([int(t) for t in rng.integers(200, 300, size=24)])
    new = [int(rng.integers(0, 100))]
    work = [(a, new), (c, tokens[c.seq_id])]
    free_before = mgr.free_page_count()
    faulted("eviction", lambda: mgr.prepare_step([(s, np.asarray(t, np.int32))
                                                  for s, t in work]))
    assert mgr.free_page_count() == free_before, (mgr.free_page_count(), free_before)
    tokens[a.seq_id].extend(new)
    run(work)
    for seq in (a, c):
        pages_hold_oracle(seq, "after the retried eviction")
    mgr.close(c)
    onboarded = mgr.stats()["num_onboarded_pages"]
    e = add(tokens[d.seq_id][:13])             # d's pages, evicted to the host by the retry
    assert e.num_reused_tokens == 12, e.num_reused_tokens
    assert mgr.stats()["num_onboarded_pages"] > onboarded, "nothing came back from the host"
    run([(e, tokens[e.seq_id][12:])])
    pages_hold_oracle(e, "the evicted pages, onboarded")
    mgr.check_invariants()
    cases += 1
    mgr.shutdown()
    return cases + check_ahead(mesh, seed)


def check_ahead(mesh, seed: int) -> int:
    """Write-back ahead on a mesh (the encode on XLA's stream, its token the fence): one shard's
    codec call fails at run time (its pairs point past the host tier), so the failure is seen
    only when the fence is; the manager rolls the offload back then (the pages stay on the
    device, their host slots are freed), and the next offload of the same pages succeeds."""
    import warnings

    import faults
    import jax.numpy as jnp
    import numpy as np
    from sharded_manager_check import HEAD_DIM, NUM_LAYERS, PAGE

    from jax_kvcm import CacheLevel, KVCacheConfig, KVCacheManager, LayerGroupConfig
    n = int(mesh.shape["tp"])
    hkv = 2 * n
    rng = np.random.default_rng(seed + 1)
    cfg = KVCacheConfig(tokens_per_page=PAGE,
                        layer_groups=(LayerGroupConfig(NUM_LAYERS, hkv, HEAD_DIM, jnp.float32),),
                        device_pages=8, max_batch=4, max_tokens_per_step=32, max_seq_len=48,
                        mesh=mesh, host_bytes=1 << 20, offload_ahead_pages=6)
    mgr = KVCacheManager(cfg)
    st = mgr.storage
    tokens: dict[int, list[int]] = {}

    run, add, pages_hold_oracle = _stepping(mgr, mesh, hkv, tokens, seed)

    a = add([int(t) for t in rng.integers(0, 100, size=9)])
    d = add([int(t) for t in rng.integers(100, 200, size=12)])
    run([(a, tokens[a.seq_id]), (d, tokens[d.seq_id])])
    mgr.close(d)                    # d's 3 full pages: cached on the device, offloaded next
    before = snapshot(st)
    new = [int(rng.integers(0, 100))]
    with faults.bad_shard_pairs(st, shard=n - 1):
        run([(a, new)])             # complete_step offloads d's pages; shard n-1's copy fails
    tokens[a.seq_id].extend(new)
    assert mgr.stats()["num_offloaded_ahead_pages"] >= 3, mgr.stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        e = add(tokens[d.seq_id][:12] + [7])   # reads d's pages: settles the failed copy first
    assert e.num_reused_tokens == 12, e.num_reused_tokens
    stats = mgr.stats()
    assert stats["num_offload_ahead_failures"] == 1, stats
    assert stats["num_offload_ahead_restored_pages"] >= 3, stats
    assert any("failed" in str(w.message) for w in caught), [str(w.message) for w in caught]
    mgr.check_invariants()
    after = snapshot(st)
    H = CacheLevel.HOST
    assert after["allocated"][H] == before["allocated"][H] == frozenset(), after["allocated"]
    assert after["usage"][H].current == before["usage"][H].current, (after["usage"][H],
                                                                      before["usage"][H])
    run([(e, [7])])
    pages_hold_oracle(e, "rolled-back offload ahead")
    # The retry: e closes, its pages (d's) are offloaded again after the next step, and a new
    # sequence onboards them from the host with the oracle's bytes.
    mgr.close(e)
    new = [int(rng.integers(0, 100))]
    run([(a, new)])
    tokens[a.seq_id].extend(new)
    failures = mgr.stats()["num_offload_ahead_failures"]
    assert mgr.stats()["num_offloaded_ahead_pages"] >= 6, mgr.stats()   # offloaded again
    f = add(tokens[d.seq_id][:12] + [9])
    assert f.num_reused_tokens == 12, f.num_reused_tokens
    run([(f, [9])])
    assert mgr.stats()["num_offload_ahead_failures"] == failures == 1, mgr.stats()
    pages_hold_oracle(f, "onboarded after the retried offload ahead")
    pages_hold_oracle(a, "a, untouched")
    mgr.check_invariants()
    mgr.shutdown()
    return 1


if __name__ == "__main__":
    main()
