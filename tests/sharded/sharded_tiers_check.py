"""Cold tiers with pools split over KV heads (run by ``sharded_worker.py --tiers`` in a process
with several devices).

- Storage round trips: random pools on the mesh; device -> host -> disk -> device, device -> disk
  -> host -> device and host -> device, byte-exact. The host tier's bytes are checked against the
  concatenating codec's documented layout computed in numpy from the pools: shard ``s``'s piece of
  a page (``np.stack([k[:, slot, :, heads_s], v[:, slot, :, heads_s]], 1)`` as raw bytes) sits at
  ``s * piece`` in the page's cold slot.
- One transaction across shards: a fault raised while shard 1's part of a migration is prepared
  (after shard 0's), and a codec call that fails at run time on shard 1 only (its piece index out
  of range), each leave everything as before the call (slots, free counts, governor ledger,
  stats, the source bytes); the same migration then succeeds. A device -> host encode that
  fails at run time on one shard (not waited for) leaves host pages every read refuses.
- The int8 codec (per-head scales, DEVICE-location pairs): a sharded device -> host -> device
  round trip decodes to the same bits as the same round trip on one device (its scales are per
  KV head, so splitting heads must change nothing).
- Through the manager: the sharded steps of ``sharded_manager_check`` with a host and a disk
  tier: a sequence suspended (its pages leave the device) and resumed, a prefix onboarded from
  the host tier, attention outputs against the closed-form oracle after each.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_kvcm import CacheLevel, Int8Codec
from jax_kvcm._storage import LayerGroupSpec, StorageConfig, StorageManager

D, H, K = CacheLevel.DEVICE, CacheLevel.HOST, CacheLevel.DISK
LAYERS, PAGE, HEAD_DIM = 2, 4, 8


def check_tiers(mesh, seed: int, diskdir: str) -> int:
    n = int(mesh.shape["tp"])
    hkv = 2 * n
    rng = np.random.default_rng(seed)
    sharding = NamedSharding(mesh, P(None, None, None, "tp", None))
    spec = LayerGroupSpec(LAYERS, PAGE, hkv, HEAD_DIM, jnp.float32)
    st = StorageManager(StorageConfig((spec,), device_slots=(16,), host_bytes=1 << 20,
                                      disk_dir=diskdir, disk_bytes=1 << 20), device=sharding)
    checks = 0
    try:
        assert st.num_shards == n, st.num_shards
        piece = 2 * LAYERS * PAGE * (hkv // n) * HEAD_DIM * 4
        assert st.cold_page_bytes == [n * piece], (st.cold_page_bytes, piece)
        shape = (LAYERS, 17, PAGE, hkv, HEAD_DIM)
        k = rng.standard_normal(shape).astype(np.float32)
        v = rng.standard_normal(shape).astype(np.float32)
        st.pools[0] = (jax.device_put(k, sharding), jax.device_put(v, sharding))

        def hot(slots):
            kk, vv = (np.asarray(a) for a in st.pools[0])
            return kk[:, slots], vv[:, slots]

        def expected_cold(slot):
            hl = hkv // n
            return b"".join(np.stack([k[:, slot, :, s * hl:(s + 1) * hl],
                                      v[:, slot, :, s * hl:(s + 1) * hl]], axis=1).tobytes()
                            for s in range(n))

        # device -> host: per-shard pieces in the documented place.
        src = st.allocate(D, 0, 5)
        want_k, want_v = k[:, src], v[:, src]
        host = st.migrate(0, D, src, H)
        assert host is not None
        view = st.host_pools[0].view()
        for i, c in enumerate(host):
            st._wait_fences(0, np.asarray([c]))
            assert view[c].tobytes() == expected_cold(int(src[i])), f"host slot {c} (seed={seed})"
        checks += 1
        # host -> disk -> device
        disk = st.migrate(0, H, host, K)
        back = st.migrate(0, K, disk, D)
        got_k, got_v = hot(back)
        assert np.array_equal(got_k, want_k) and np.array_equal(got_v, want_v), "H->K->D"
        checks += 1
        # device -> disk -> host -> device
        disk = st.migrate(0, D, back, K)
        host = st.migrate(0, K, disk, H)
        back = st.migrate(0, H, host, D)
        got_k, got_v = hot(back)
        assert np.array_equal(got_k, want_k) and np.array_equal(got_v, want_v), "D->K->H->D"
        checks += 1
        checks += check_rollback(st, back, want_k, want_v, hot, seed)
    finally:
        st.close()
    return checks + check_int8(mesh, k, v, seed)


def check_int8(mesh, k: np.ndarray, v: np.ndarray, seed: int) -> int:
    """Sharded int8 round trip == the one-device round trip, bit for bit."""
    sharding = NamedSharding(mesh, P(None, None, None, "tp", None))
    spec = LayerGroupSpec(LAYERS, PAGE, k.shape[3], HEAD_DIM, jnp.float32)
    out = []
    for device in (sharding, jax.devices()[0]):
        st = StorageManager(StorageConfig((spec,), device_slots=(16,), host_bytes=1 << 20),
                            Int8Codec(), device=device)
        try:
            st.pools[0] = (jax.device_put(k, device), jax.device_put(v, device))
            src = st.allocate(D, 0, 6)
            back = st.migrate(0, H, st.migrate(0, D, src, H), D)
            out.append([np.asarray(a)[:, back] for a in st.pools[0]] + [src])
        finally:
            st.close()
    (ks, vs, src), (k1, v1, _) = out
    assert np.array_equal(ks, k1) and np.array_equal(vs, v1), f"int8 sharded != one device ({seed})"
    err = float(np.abs(ks - k[:, src]).max())
    assert 0 < err < 0.05, f"int8 round trip error {err}: not the int8 codec's (seed={seed})"
    return 1


def _snapshot(st):
    return (st.stats(), [st.num_free(lv, 0) for lv in (D, H, K)],
            {lv: st.governor.usage(lv).current for lv in (D, H, K)})


def check_rollback(st, src, want_k, want_v, hot, seed: int) -> int:
    """A failure on shard 1 of a migration, before and at submission: nothing changes."""
    import faults
    n = st.num_shards
    checks = 0
    for dst_level in (H, K):
        before = _snapshot(st)
        with faults.fail_at(st, "shard_pairs:1"):
            try:
                st.migrate(0, D, src, dst_level)
            except faults.InjectedFault:
                pass
            else:
                raise AssertionError("the fault at shard 1 did not fail the migration")
        assert _snapshot(st) == before, (dst_level, _snapshot(st), before)
        got_k, got_v = hot(src)
        assert np.array_equal(got_k, want_k) and np.array_equal(got_v, want_v)
        checks += 1
    # A codec call that fails at run time on shard 1 only (device -> disk waits for the encode
    # before it writes, inside the transaction).
    before = _snapshot(st)
    with faults.bad_shard_pairs(st, shard=1 % n):
        try:
            st.migrate(0, D, src, K)
        except Exception as e:  # noqa: BLE001  (the codec's runtime error, whatever its type)
            assert "outside the cold tier" in str(e), e
        else:
            raise AssertionError("a codec call failing on shard 1 did not fail the migration")
    after = _snapshot(st)
    assert after == before, (after, before)
    got_k, got_v = hot(src)
    assert np.array_equal(got_k, want_k) and np.array_equal(got_v, want_v)
    checks += 1
    # The same migrations succeed afterwards.
    disk = st.migrate(0, D, src, K)
    back = st.migrate(0, K, disk, D)
    got_k, got_v = hot(back)
    assert np.array_equal(got_k, want_k) and np.array_equal(got_v, want_v), f"retry (seed={seed})"
    return checks + 1 + check_unwritten_host(st, back, seed)


def check_unwritten_host(st, src, seed: int) -> int:
    """A device -> host encode that fails at run time on the last shard only: the transaction
    does not wait for it (its device source is released), so every later read of those host
    pages refuses them (CorruptPageError, level HOST, naming each) before anything moves, and
    never serves the failed shard's piece; freed and reused, the slots work again."""
    from jax_kvcm import CorruptPageError
    import faults
    with faults.bad_shard_pairs(st, shard=st.num_shards - 1):
        host = st.migrate(0, D, src, H)
    assert host is not None
    for dst_level in (D, K, D):
        before = _snapshot(st)
        try:
            st.migrate(0, H, host, dst_level)
        except CorruptPageError as e:
            assert e.level == "HOST" and sorted(e.slots.tolist()) == sorted(host.tolist()), e
            assert "never written" in str(e), e
        else:
            raise AssertionError(f"host pages of a failed copy were read (-> {dst_level.name}, "
                                 f"seed={seed})")
        assert _snapshot(st) == before, (dst_level, _snapshot(st), before)
    st.free(H, 0, host)
    src = st.allocate(D, 0, host.size)
    again = st.migrate(0, D, src, H)               # the same host slots, written this time
    back = st.migrate(0, H, again, D)
    assert back is not None and sorted(again.tolist()) == sorted(host.tolist()), (again, host)
    st.free(D, 0, back)
    return 1
