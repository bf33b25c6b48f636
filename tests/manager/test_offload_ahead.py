"""Write-back ahead (``KVCacheConfig.offload_ahead_pages``) on CPU, its copies held "in flight"
by the gate seam of ``faults.py`` (``install_gated_offloads``): the CPU codec is synchronous, so
the gate stands for the CUDA side-stream mover's ticket, an off-stream fence that is not ready
until the test opens it.

Checked against the fake model's exact K/V values (``test_manager.Harness``) and the manager's
invariants: the device slots of an offload in flight are never handed out; the reserve of free +
pending device pages is kept; prefix hits on pages offloaded ahead (in flight or done) onboard
byte-exactly; suspend / resume, eviction to disk, close and shutdown with an offload in flight;
a failed copy (at submission or later) loses nothing.
"""

from __future__ import annotations

import numpy as np
import pytest

from faults import GatedOffloads, InjectedFault, fail_at, install_gated_offloads
from jax_kvcm.manager import SuspendResult
from jax_kvcm._storage import SideStreamFence
from test_manager import Harness, make, tiny_config
from jax_kvcm._types import CacheLevel

D, H, K = CacheLevel.DEVICE, CacheLevel.HOST, CacheLevel.DISK
RESERVE = 3


def ahead(*, device_pages=8, host_pages=12, reserve=RESERVE, **kw) -> Harness:
    return make(tiny_config(device_pages=device_pages, host_pages=host_pages,
                            offload_ahead_pages=reserve, **kw))


def fill(h: Harness, n: int, base: int = 0) -> list[list[int]]:
    """``n`` prompts of 9 tokens, each run and closed: 2 committed pages cached each."""
    prompts = [[base + p * 10 + i + 1 for i in range(9)] for p in range(n)]
    for p in prompts:
        s = h.add(p)
        h.run([(s, 9)], as_ids=[True])
        h.check()
        h.mgr.close(s)
    return prompts


def in_flight_slots(mgr) -> np.ndarray:
    """Device slots of every offload in flight."""
    if not mgr._ahead.offloads:
        return np.zeros(0, np.int32)
    s = np.concatenate([r.src.reshape(-1) for r in mgr._ahead.offloads])
    return s[s >= 0]


def device_room(mgr) -> int:
    c = mgr.stats()["pages"]["device"]
    return c["free"] + c["pending"]


def test_config_field_is_validated():
    with pytest.raises(ValueError, match="offload_ahead_pages"):
        tiny_config(offload_ahead_pages=-1)
    with pytest.raises(ValueError, match="offload_ahead_pages needs a host tier"):
        tiny_config(offload_ahead_pages=2)
    assert tiny_config(host_pages=2).offload_ahead_pages == 0  # off by default


def test_off_by_default_changes_nothing():
    h = make(tiny_config(device_pages=10, host_pages=12))
    fill(h, 4)
    st = h.mgr.stats()
    assert st["num_offloads_ahead"] == 0 and st["num_evicted_pages"][H] == 0


def test_reserve_is_kept_and_in_flight_slots_are_never_handed_out():
    h = ahead()
    gates = install_gated_offloads(h.mgr)
    gates.block_forever = True  # nobody may wait for the copies in this test
    fill(h, 3)  # 6 cached + pages in use: the reserve is short after some steps
    mgr = h.mgr
    assert mgr.stats()["num_offloads_ahead"] >= 1 and gates.fences
    assert device_room(mgr) >= RESERVE
    held = in_flight_slots(mgr)
    assert held.size and all(mgr.storage.allocator(D, 0).is_allocated(int(s)) for s in held)
    # New sequences while the copies are in flight: never given those slots.
    for p in range(3):
        s = h.add([90 + p] * 5)
        h.run([(s, 5)])
        h.check()
        assert not np.isin(s.page_ids(0), held).any()
        assert device_room(mgr) >= RESERVE or mgr.stats()["pages"]["device"]["cached"] == 0
        mgr.close(s)
    assert gates.num_waits == 0
    # Copies done: the slots come back.
    gates.open_all()
    free_before = mgr.stats()["pages"]["device"]["free"]
    mgr.free_page_count()
    assert not mgr._ahead.offloads and mgr.stats()["pages"]["device"]["free"] > free_before
    h.check()


def test_allocation_that_needs_the_slots_waits_for_the_copy():
    h = ahead(device_pages=6, host_pages=12, reserve=4)
    gates = install_gated_offloads(h.mgr)
    fill(h, 2)
    mgr = h.mgr
    held = in_flight_slots(mgr)
    assert held.size
    # A sequence that needs every device page: the in-flight slots are needed, after the copy.
    s = h.add(list(range(100, 124)))
    h.run([(s, 24)], as_ids=[True])
    h.check()
    assert gates.num_waits >= 1 and mgr.stats()["num_offload_ahead_waits"] >= 1
    assert all(f.state != "closed" for f in gates.fences[:1])


@pytest.mark.parametrize("done", [False, True])
def test_prefix_hit_on_pages_offloaded_ahead_is_byte_exact(done):
    h = ahead()
    gates = install_gated_offloads(h.mgr)
    prompts = fill(h, 4)
    mgr = h.mgr
    on_host = [p for p in prompts
               if any(n.level is H for n in mgr.tree.match(np.asarray(p, np.int32), b"", 4, 2))]
    assert on_host, "nothing was offloaded ahead"
    if done:
        gates.open_all()
    waits = gates.num_waits
    onboarded = mgr.stats()["num_onboarded_pages"]
    s = h.add(on_host[0])
    assert s.num_reused_tokens == 8
    assert mgr.stats()["num_onboarded_pages"] > onboarded
    # A hit on a page whose copy is in flight waits for it (the gate) before reading the host.
    assert gates.num_waits == waits + (0 if done else 1)
    h.run([(s, 1)], as_ids=[True])
    h.check()  # every value of the sequence, read back from the pools
    assert h.check_values() >= 9


def test_suspend_resume_with_an_offload_in_flight():
    h = ahead(device_pages=12, host_pages=16)
    gates = install_gated_offloads(h.mgr)
    gates.block_forever = True
    a = h.add(list(range(1, 14)))
    h.run([(a, 13)], as_ids=[True])
    fill(h, 3, base=200)
    assert h.mgr._ahead.offloads
    assert h.mgr.suspend(a) is SuspendResult.SUSPENDED
    h.check()
    assert h.mgr.resume(a)
    h.run([(a, 1)])
    h.check()
    assert h.check_values() >= 14
    gates.open_all()
    h.mgr.free_page_count()
    h.check()


def test_eviction_to_disk_of_pages_in_flight_waits_then_onboards(tmp_path):
    h = ahead(device_pages=8, host_pages=4, disk_dir=str(tmp_path), disk_pages=24)
    gates = install_gated_offloads(h.mgr)
    prompts = fill(h, 6)  # the small host tier pushes offloaded pages on to disk
    st = h.mgr.stats()
    assert st["num_evicted_pages"][K] > 0 and st["num_offloads_ahead"] > 0
    h.check()
    hits = 0
    for p in reversed(prompts):
        s = h.add(p)
        hits += s.num_reused_tokens
        h.run([(s, 9 - s.num_reused_tokens)], as_ids=[True])
        h.check()
        h.mgr.close(s)
    assert hits > 0
    gates.open_all()
    h.mgr.free_page_count()
    h.check()


def test_close_and_shutdown_with_an_offload_in_flight():
    h = ahead()
    gates = install_gated_offloads(h.mgr)
    fill(h, 3)
    s = h.add([7] * 6)
    h.run([(s, 6)])
    assert h.mgr._ahead.offloads
    h.mgr.close(s)
    h.check()
    h.mgr.shutdown()  # waits for the copies (the gates), then frees everything
    assert all(f.state == "open" for f in gates.fences) and gates.num_waits >= 1
    assert not h.mgr._ahead.offloads and not h.mgr.storage._ahead_fences


def test_a_failed_copy_loses_nothing():
    h = ahead()
    gates = install_gated_offloads(h.mgr)
    prompts = fill(h, 3)
    mgr = h.mgr
    rec = mgr._ahead.offloads[0]
    nodes, src, dst = list(rec.nodes), rec.src.copy(), rec.dst.copy()
    before = mgr.stats()
    gates.fences[0].fail()
    with pytest.warns(RuntimeWarning, match="write-back-ahead copy .* failed"):
        mgr.free_page_count()  # the failure is seen: rolled back
    st = mgr.stats()
    assert st["num_offload_ahead_failures"] == 1
    assert st["num_offload_ahead_restored_pages"] == len(nodes)
    for i, n in enumerate(nodes):  # back in their device slots, never freed meanwhile
        assert n.level is D and np.array_equal(n.slots, src[:, i])
    host = mgr.storage.allocator(H, 0)
    assert not any(host.is_allocated(int(x)) for x in dst[dst >= 0])
    assert st["pages"]["host"]["cached"] == before["pages"]["host"]["cached"] - len(nodes)
    h.check()
    # Their prefix hits are device hits again, byte-exact.
    onboarded = st["num_onboarded_pages"]
    for p in prompts:
        m = mgr.tree.match(np.asarray(p, np.int32), b"", 4, 2)
        if m and m[0] in nodes:
            s = h.add(p)
            assert s.num_reused_tokens == 8
            h.run([(s, 1)], as_ids=[True])
            h.check()
            mgr.close(s)
    assert mgr.stats()["num_onboarded_pages"] == onboarded


def test_a_failed_submission_changes_nothing():
    h = ahead()
    fill(h, 2)
    mgr = h.mgr
    offloads = mgr.stats()["num_offloads_ahead"]
    with fail_at(mgr.storage, "offload_ahead"):
        with pytest.warns(RuntimeWarning, match="failed at submission"):
            fill(h, 2, base=500)
        st = mgr.stats()
    assert st["num_offloads_ahead"] == offloads and st["num_offload_ahead_failures"] >= 1
    assert st["storage"]["num_offloads_ahead"] == offloads and not mgr._ahead.offloads
    h.check()  # ledgers == recomputation from the allocators, every value in place
    fill(h, 1, base=800)  # and it works again afterwards
    assert mgr.stats()["num_offloads_ahead"] > offloads
    h.check()


def test_side_stream_fence_needs_the_cuda_extension_only_when_used():
    """The CPU build never creates a SideStreamFence (the codec runs synchronously), and the
    storage says so: ``side_stream`` is False on CPU."""
    h = ahead()
    assert h.mgr.storage.side_stream is False
    fill(h, 3)
    assert all(not isinstance(r.fence, SideStreamFence) for r in h.mgr._ahead.offloads)
    assert InjectedFault  # the seam's error type (used by the gates)


# -- the storage transaction -----------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_storage_offload_ahead_keeps_sources_and_fences_every_reader(tmp_path, seed):
    """``StorageManager.offload_ahead``: the device sources stay allocated (the caller frees
    them), the host pages are byte-exact, and every reader of them (a decode to the device on
    XLA's stream, a disk write) waits for the copy first; a refusal changes nothing."""
    from test_storage import fill_random, hot_pages, make_manager, snapshot
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    m = make_manager(tmp_path)
    gates = GatedOffloads()
    m._fence_hook = gates
    try:
        for lg in range(len(m.specs)):
            src = m.allocate(D, lg, 4)
            want = fill_random(m, lg, src, int(rng.integers(1 << 30)))
            free_before = m.num_free(D, lg)
            (dst,), fence = m.offload_ahead([(lg, src)])
            assert fence is gates.fences[-1] and not fence.is_ready()
            assert m.num_free(D, lg) == free_before  # sources not released
            assert all(m.allocator(D, lg).is_allocated(int(s)) for s in src)
            back = m.migrate(lg, H, dst, D)  # the decode reads the host pages: waits first
            assert gates.num_waits == 1 and fence.state == "open"
            assert np.array_equal(hot_pages(m, lg, back), want)
            m.free(D, lg, src)
            gates.num_waits = 0
            # A disk write of pages in flight waits too.
            src = m.allocate(D, lg, 2)
            want = fill_random(m, lg, src, int(rng.integers(1 << 30)))
            (dst,), _ = m.offload_ahead([(lg, src)])
            on_disk = m.migrate(lg, H, dst, K)
            assert gates.num_waits == 1
            m.free(D, lg, src)
            assert np.array_equal(hot_pages(m, lg, m.migrate(lg, K, on_disk, D)), want)
            gates.num_waits = 0
        # Refused (the host tier cannot take it): nothing changed.
        src = m.allocate(D, 2, 3)
        hold = m.governor.reserve(H, m.governor.available(H))
        before = snapshot(m)
        assert m.offload_ahead([(2, src)]) is None
        assert snapshot(m) == before and len(gates.fences) == 2 * len(m.specs)
        hold.release()
        m.free(D, 2, src)
    finally:
        m.close()


# -- the codec option ------------------------------------------------------------------------


def test_codec_side_stream_option():
    """Only the concat codec has the side-stream mover; on CPU its encode with
    ``side_stream=True`` writes exactly what the plain encode writes (the handler is
    synchronous). Bad tickets are refused naming the argument."""
    import jax
    import jax.numpy as jnp

    from jax_kvcm._codec import HotPoolGroupDesc, make_cold_page_codec
    desc = HotPoolGroupDesc(index=0, layer_groups=(0,), num_layers=2, num_slots=6, page_size=4,
                            num_kv_heads=2, head_dim=16, dtype=jnp.float32)
    rng = np.random.default_rng(3)
    print("seed=3")
    k = jnp.asarray(rng.standard_normal(desc.pool_shape).astype(np.float32))
    v = jnp.asarray(rng.standard_normal(desc.pool_shape).astype(np.float32))
    pairs = jnp.asarray(np.array([[0, 3], [1, 5], [2, 1]], np.int32))
    int8 = make_cold_page_codec("int8")
    assert int8.configure([desc]) and not int8.supports_side_stream
    with pytest.raises(ValueError, match="side_stream"):
        int8.encode(0, k, v, pairs, 1 << 12, side_stream=True)
    concat = make_cold_page_codec("concat")
    assert concat.configure([desc]) and concat.supports_side_stream
    with pytest.raises(ValueError, match="ticket"):
        concat.register_host_index_pairs(pairs, np.asarray(pairs), ticket=-1)
    outs = []
    for side in (False, True):
        buf = np.full((3, concat.cold_page_bytes(0)), 0xA5, np.uint8)
        token = jax.jit(lambda k, v, p, side=side: concat.encode(
            0, k, v, p, buf.ctypes.data, num_cold_slots=3, side_stream=side))(k, v, pairs)
        token.block_until_ready()
        outs.append(buf.copy())
    want = np.stack([np.asarray(k)[:, [3, 5, 1]], np.asarray(v)[:, [3, 5, 1]]], axis=2)
    want = np.ascontiguousarray(np.moveaxis(want, 1, 0)).view(np.uint8).reshape(3, -1)
    assert np.array_equal(outs[0], want) and np.array_equal(outs[1], want)
