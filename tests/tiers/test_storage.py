"""StorageManager: byte-exact migrations over every path, transactions under fault injection.

CPU only (the CUDA codec paths are covered by tests/tiers/test_codec.py's gpu variants). Seeds are
printed; the oracle is the page bytes captured with numpy before the migrations.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kvcm._codec import create_default_cold_page_codec, make_cold_page_codec
from jax_kvcm._storage import (CorruptPageError, LayerGroupSpec, StorageConfig, StorageManager)
from jax_kvcm._types import CacheLevel

D, H, K = CacheLevel.DEVICE, CacheLevel.HOST, CacheLevel.DISK

# lg0 and lg1 have different hot layouts (2 layers x 2 heads vs 4 layers x 1 head) but equal
# encoded page sizes, so they share one cold pool group; lg2 has a larger cold page.
SPECS = (
    LayerGroupSpec(num_layers=2, page_size=8, num_kv_heads=2, head_dim=16, dtype=jnp.float32),
    LayerGroupSpec(num_layers=4, page_size=8, num_kv_heads=1, head_dim=16, dtype=jnp.float32),
    LayerGroupSpec(num_layers=2, page_size=32, num_kv_heads=2, head_dim=16, dtype=jnp.bfloat16),
)


def make_manager(tmp_path, *, host=True, disk=True, device_slots=(12, 12, 12), codec=None,
                 specs=SPECS, hot_pool_groups=None, disk_io_threads=None):
    config = StorageConfig(layer_groups=specs, device_slots=device_slots,
                           hot_pool_groups=hot_pool_groups,
                           host_bytes=(1 << 20) if host else 0,
                           disk_dir=str(tmp_path) if disk else None,
                           disk_bytes=(1 << 20) if disk else 0,
                           disk_io_threads=disk_io_threads)
    return StorageManager(config, codec, device=jax.devices("cpu")[0])


def fill_random(m: StorageManager, lg: int, slots: np.ndarray, seed: int) -> np.ndarray:
    """Writes random values into hot slots of lg; returns them as [n, 2, L, ...] float32."""
    rng = np.random.default_rng(seed)
    h = m.hot_group_of[lg]
    k, v = m.pools[h]
    vals = rng.standard_normal((len(slots), 2) + k.shape[:1] + k.shape[2:]).astype(np.float32)
    idx = jnp.asarray(slots)
    k = k.at[:, idx].set(jnp.asarray(np.moveaxis(vals[:, 0], 0, 1), k.dtype))
    v = v.at[:, idx].set(jnp.asarray(np.moveaxis(vals[:, 1], 0, 1), v.dtype))
    m.pools[h] = (k, v)
    return hot_pages(m, lg, slots)


def hot_pages(m: StorageManager, lg: int, slots: np.ndarray) -> np.ndarray:
    k, v = m.pools[m.hot_group_of[lg]]
    kk = np.asarray(k[:, jnp.asarray(slots)].astype(jnp.float32))
    vv = np.asarray(v[:, jnp.asarray(slots)].astype(jnp.float32))
    return np.moveaxis(np.stack([kk, vv], axis=1), 2, 0)  # [n, 2, L, ...]


def snapshot(m: StorageManager):
    frees = {(lvl, lg): m.num_free(lvl, lg) for lvl in CacheLevel for lg in range(len(m.specs))
             if m.has_level(lvl)}
    return m.governor.ledger(), frees, m.stats()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_round_trips_are_byte_exact(tmp_path, seed):
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    m = make_manager(tmp_path)
    try:
        for lg in range(len(SPECS)):
            n = int(rng.integers(1, 7))  # D -> D needs 2n of the 12 device slots
            slots = m.allocate(D, lg, n)
            want = fill_random(m, lg, slots, seed * 10 + lg)
            # hot -> host -> disk -> host -> hot
            h1 = m.migrate(lg, D, slots, H)
            k1 = m.migrate(lg, H, h1, K)
            h2 = m.migrate(lg, K, k1, H)
            d2 = m.migrate(lg, H, h2, D)
            np.testing.assert_array_equal(hot_pages(m, lg, d2), want, err_msg=f"seed={seed}")
            # hot -> disk -> hot
            k2 = m.migrate(lg, D, d2, K)
            d3 = m.migrate(lg, K, k2, D)
            np.testing.assert_array_equal(hot_pages(m, lg, d3), want, err_msg=f"seed={seed}")
            # cold -> cold and hot -> hot (defragmentation)
            h3 = m.migrate(lg, D, d3, H)
            h4 = m.migrate(lg, H, h3, H)
            k3 = m.migrate(lg, H, h4, K)
            k4 = m.migrate(lg, K, k3, K)
            d4 = m.migrate(lg, K, k4, D)
            d5 = m.migrate(lg, D, d4, D)
            np.testing.assert_array_equal(hot_pages(m, lg, d5), want, err_msg=f"seed={seed}")
    finally:
        m.close()


def test_groups_with_different_hot_layouts_share_a_cold_pool_group(tmp_path):
    m = make_manager(tmp_path)
    try:
        assert m.hot_group_of[0] != m.hot_group_of[1]
        assert m.cold_group_of[0] == m.cold_group_of[1] != m.cold_group_of[2]
        a = m.allocate(D, 0, 3)
        b = m.allocate(D, 1, 3)
        wa, wb = fill_random(m, 0, a, 1), fill_random(m, 1, b, 2)
        ha, hb = m.migrate(0, D, a, H), m.migrate(1, D, b, H)
        assert not set(ha.tolist()) & set(hb.tolist()), "one cold slot space for both"
        np.testing.assert_array_equal(hot_pages(m, 0, m.migrate(0, H, ha, D)), wa)
        np.testing.assert_array_equal(hot_pages(m, 1, m.migrate(1, H, hb, D)), wb)
    finally:
        m.close()


def test_layer_groups_sharing_a_hot_pool_group_share_slots(tmp_path):
    specs = (SPECS[0], SPECS[0])
    m = make_manager(tmp_path, specs=specs, device_slots=(10,), hot_pool_groups=((0, 1),))
    try:
        assert m.hot_group_of == [0, 0]
        a = m.allocate(D, 0, 6)
        assert m.num_free(D, 1) == 4
        assert m.allocate(D, 1, 5) is None
        b = m.allocate(D, 1, 4)
        wa, wb = fill_random(m, 0, a, 3), fill_random(m, 1, b, 4)
        np.testing.assert_array_equal(hot_pages(m, 0, m.migrate(0, K, m.migrate(0, D, a, K), D)), wa)
        np.testing.assert_array_equal(hot_pages(m, 1, m.migrate(1, K, m.migrate(1, D, b, K), D)), wb)
    finally:
        m.close()


# Layer-group layouts for the concat round trips: (specs, hot_pool_groups, cold_pool_groups). With
# the concatenating codec a cold page is the hot page, so layer groups of one hot layout encode to
# equal sizes and share a cold pool group by default; an explicit cold grouping splits them.
A = SPECS[0]  # 2 layers x 2 heads, f32: 4 KiB pages
B = SPECS[1]  # 4 layers x 1 head, f32: another hot layout, also 4 KiB pages
C = SPECS[2]  # bf16, 8 KiB pages
LAYOUTS = {
    # lg0/lg1: different hot layouts, one cold pool group (shared cold, not hot).
    "cold-shared": ((A, B, C), None, None),
    # lg0/lg1: one hot pool group and one cold pool group.
    "hot-and-cold-shared": ((A, A, C), ((0, 1), (2,)), None),
    # lg0/lg1: one hot pool group, two cold pool groups (shared hot, not cold).
    "hot-shared-cold-split": ((A, A, C), ((0, 1), (2,)), ((0,), (1,), (2,))),
    # lg0/lg1: the same hot layout in two hot pool groups, one cold pool group.
    "same-layout-hot-split": ((A, A, C), ((0,), (1,), (2,)), None),
    # Both at once: lg1 shares its hot pool group with lg0 and its cold pool group with lg2 (a
    # different hot layout of the same page size), lg3 alone in both.
    "both": ((A, A, B, C), ((0, 1), (2,), (3,)), ((0,), (1, 2), (3,))),
}


def make_layout_manager(tmp_path, name, *, disk_io_threads=None):
    specs, hot, cold = LAYOUTS[name]
    num_hot = len(hot) if hot is not None else len(specs)
    config = StorageConfig(layer_groups=specs, device_slots=(24,) * num_hot, hot_pool_groups=hot,
                           cold_pool_groups=cold, host_bytes=1 << 20, disk_dir=str(tmp_path),
                           disk_bytes=1 << 20, disk_io_threads=disk_io_threads)
    return StorageManager(config, device=jax.devices("cpu")[0])


def raw_hot_pages(m: StorageManager, lg: int, slots: np.ndarray) -> np.ndarray:
    """``[n, cold_page_bytes]`` uint8: the pages' bytes as the concat codec lays them out."""
    k, v = m.pools[m.hot_group_of[lg]]
    idx = jnp.asarray(np.asarray(slots, np.int32))
    kk, vv = np.asarray(k[:, idx]), np.asarray(v[:, idx])  # [L, n, P, H, D]
    pages = np.stack([np.moveaxis(kk, 1, 0), np.moveaxis(vv, 1, 0)], axis=2)  # [n, L, 2, ...]
    return pages.reshape(len(slots), -1).view(np.uint8)


def wait_host(m: StorageManager, cold_group: int, slots: np.ndarray) -> None:
    """Waits for the encodes that last wrote these host slots (the manager's own fences)."""
    fences = {id(f): f for f in m._host_fences[cold_group][slots] if f is not None}
    for f in fences.values():
        f.wait()


def test_layouts_have_the_groupings_they_claim(tmp_path):
    expect = {  # name: (hot_group_of, cold_group_of)
        "cold-shared": ([0, 1, 2], [0, 0, 1]),
        "hot-and-cold-shared": ([0, 0, 1], [0, 0, 1]),
        "hot-shared-cold-split": ([0, 0, 1], [0, 1, 2]),
        "same-layout-hot-split": ([0, 1, 2], [0, 0, 1]),
        "both": ([0, 0, 1, 2], [0, 1, 1, 2]),
    }
    for name, (hot, cold) in expect.items():
        m = make_layout_manager(tmp_path, name)
        try:
            assert (m.hot_group_of, m.cold_group_of) == (hot, cold), name
            assert len(m.host_pools) == len(m.disk_pools) == max(cold) + 1, name
            if name == "hot-shared-cold-split":  # equal hot shares -> equal cold slot counts
                assert m.host_pools[0].num_slots == m.host_pools[1].num_slots > 0
                assert m.disk_pools[0].num_slots == m.disk_pools[1].num_slots > 0
        finally:
            m.close()


@pytest.mark.parametrize("cold, match", [
    (((0,), (1,)), "exactly one"),             # layer group 2 missing
    (((0, 1), (1, 2)), "exactly one"),         # layer group 1 twice
    (((0, 1), (2,), ()), "exactly one"),       # an empty group
    (((0, 2), (1,)), "different cold page sizes"),
])
def test_bad_cold_pool_groups_are_refused(tmp_path, cold, match):
    config = StorageConfig(layer_groups=SPECS, device_slots=(4, 4, 4), cold_pool_groups=cold,
                           host_bytes=1 << 20)
    with pytest.raises(ValueError, match=match):
        StorageManager(config, device=jax.devices("cpu")[0])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_concat_round_trips_over_layouts(tmp_path, name, seed):
    """hot->host->disk->host->hot and hot->disk->hot with the concat codec, every layer group at
    once over random page sets, interleaved in random order so the pages of layer groups that
    share a pool group sit side by side in it: every page comes back byte-exact, the host tier
    holds the concatenated layout, pages that stayed hot are untouched, and layer groups sharing
    a pool group never share a slot."""
    print(f"seed={seed} layout={name}")
    rng = np.random.default_rng(seed)
    m = make_layout_manager(tmp_path, name, disk_io_threads=1 + seed)
    lgs = list(range(len(m.specs)))
    try:
        # Fill a random number of hot pages per layer group (hot groups shared -> interleaved).
        held: dict[int, np.ndarray] = {lg: np.zeros(0, np.int32) for lg in lgs}
        for _ in range(3):
            for lg in rng.permutation(lgs):
                lg = int(lg)
                got = m.allocate(D, lg, int(rng.integers(1, 4)))
                held[lg] = np.concatenate([held[lg], got])
        for lg in lgs:
            fill_random(m, lg, held[lg], seed * 100 + lg)
        want = {lg: raw_hot_pages(m, lg, held[lg]) for lg in lgs}  # [page, bytes], held's order

        def check_hot(where: dict[int, np.ndarray], what: str) -> None:
            for lg in lgs:
                got = raw_hot_pages(m, lg, where[lg])
                np.testing.assert_array_equal(got, want[lg], err_msg=f"{what} lg={lg} {name} "
                                                                     f"seed={seed}")

        def migrate_all(slots: dict[int, np.ndarray], src, dst, level_name: str):
            """Moves every layer group's ``slots`` from src to dst, layer groups in random order;
            returns the new slots (same order)."""
            out = dict(slots)
            for lg in rng.permutation(lgs):
                lg = int(lg)
                moved = m.migrate(lg, src, slots[lg], dst)
                assert moved is not None, f"{level_name} lg={lg} {name} seed={seed}"
                out[lg] = moved
            if dst is not D:  # layer groups sharing a cold pool group: disjoint slots
                for g in set(m.cold_group_of):
                    members = [lg for lg in lgs if m.cold_group_of[lg] == g]
                    flat = np.concatenate([out[lg] for lg in members])
                    assert np.unique(flat).size == flat.size, f"{level_name} cold group {g}"
            return out

        # Fragment the cold pools: keep a random half of some allocated cold slots, so the
        # migrations below get scattered (non-adjacent) host and disk slots.
        fillers = []
        for level in (H, K):
            for lg in lgs:
                slots = m.allocate(level, lg, 12)
                keep = rng.random(12) < 0.5
                m.free(level, lg, slots[~keep])
                fillers.append((level, lg, slots[keep]))
        # A random subset (order shuffled) of each layer group's pages travels; the rest stays.
        pick = {lg: rng.permutation(len(held[lg]))[:max(1, len(held[lg]) * 2 // 3)] for lg in lgs}
        for chain in ("hot->host->disk->host->hot", "hot->disk->hot"):
            src = {lg: held[lg][pick[lg]] for lg in lgs}
            stay = {lg: np.delete(held[lg], pick[lg]) for lg in lgs}
            stay_bytes = {lg: raw_hot_pages(m, lg, stay[lg]) for lg in lgs}
            if chain.startswith("hot->host"):
                h1 = migrate_all(src, D, H, "D->H")
                for lg in lgs:  # the host tier holds the concatenated layout
                    g = m.cold_group_of[lg]
                    wait_host(m, g, h1[lg])
                    np.testing.assert_array_equal(
                        m.host_pools[g].view()[h1[lg]][:, :m.cold_page_bytes[lg]],
                        want[lg][pick[lg]], err_msg=f"host bytes lg={lg} {name} seed={seed}")
                k1 = migrate_all(h1, H, K, "H->K")
                h2 = migrate_all(k1, K, H, "K->H")
                back = migrate_all(h2, H, D, "H->D")
            else:
                back = migrate_all(migrate_all(src, D, K, "D->K"), K, D, "K->D")
            for lg in lgs:
                np.testing.assert_array_equal(raw_hot_pages(m, lg, back[lg]), want[lg][pick[lg]],
                                              err_msg=f"{chain} lg={lg} {name} seed={seed}")
                np.testing.assert_array_equal(raw_hot_pages(m, lg, stay[lg]), stay_bytes[lg],
                                              err_msg=f"{chain}: a page that stayed hot changed, "
                                                      f"lg={lg} {name} seed={seed}")
                held[lg] = np.concatenate([stay[lg], back[lg]])
                order = np.concatenate([np.delete(np.arange(len(want[lg])), pick[lg]), pick[lg]])
                want[lg] = want[lg][order]
                pick[lg] = rng.permutation(len(held[lg]))[:max(1, len(held[lg]) // 2)]
            check_hot(held, f"after {chain}")
        # Everything went home: the cold tiers hold only the fillers.
        for level, lg, slots in fillers:
            m.free(level, lg, slots)
        assert m.governor.usage(H).current == 0 and m.governor.usage(K).current == 0
    finally:
        m.close()


def test_slot_zero_is_never_handed_out(tmp_path):
    m = make_manager(tmp_path, host=False, disk=False, device_slots=(4, 4, 4))
    try:
        slots = m.allocate(D, 0, 4)
        assert sorted(slots.tolist()) == [1, 2, 3, 4]
        assert m.allocate(D, 0, 1) is None
    finally:
        m.close()


# -- transactions under fault injection -------------------------------------------------------

PATHS = [(D, H), (H, D), (D, K), (K, D), (H, K), (K, H), (H, H), (K, K), (D, D)]


def place(m, lg, level, n, seed):
    slots = m.allocate(D, lg, n)
    want = fill_random(m, lg, slots, seed)
    if level is H:
        slots = m.migrate(lg, D, slots, H)
    elif level is K:
        slots = m.migrate(lg, D, slots, K)
    return slots, want


def read_back(m, lg, level, slots):
    if level is D:
        return hot_pages(m, lg, slots)
    d = m.migrate(lg, level, slots, D)
    out = hot_pages(m, lg, d)
    return out


def cold_bytes(m, lg, level, slots):
    g = m.cold_group_of[lg]
    if level is H:
        return m.host_pools[g].view()[slots].copy()
    return None


class Boom(RuntimeError):
    pass


def _hook_at(point):
    def hook(p):
        if p == point:
            raise Boom(point)
    return hook


def _fault_cases():
    """Every (path, fault) pair where the fault can happen on that path."""
    for (src, dst), fault in itertools.product(PATHS, [
            "reserve", "allocate", "submit", "disk_write", "disk_read", "enospc", "short_write",
            "short_read", "eio_read", "bitflip"]):
        if fault in ("disk_write", "enospc", "short_write") and dst is not K:
            continue
        if fault in ("disk_read", "short_read", "eio_read", "bitflip") and src is not K:
            continue
        yield pytest.param(src, dst, fault, id=f"{src.name}-{dst.name}-{fault}")


@pytest.mark.parametrize("src,dst,fault", list(_fault_cases()))
def test_failed_migration_changes_nothing_and_retry_succeeds(tmp_path, src, dst, fault):
    lg = 0
    m = make_manager(tmp_path)
    try:
        src_slots, want = place(m, lg, src, 3, seed=7)
        before = snapshot(m)
        src_bytes = cold_bytes(m, lg, src, src_slots)
        g = m.cold_group_of[lg]
        expect: type[BaseException] | None = OSError
        if fault in ("reserve", "submit", "disk_write", "disk_read"):
            m._fault_hook = _hook_at(fault)
            expect = Boom
        elif fault == "allocate":  # exhaust the destination, then it returns None
            hog = m.allocate(dst, lg, m.num_free(dst, lg))
            before = snapshot(m)
            expect = None
        elif fault == "bitflip":
            path = f"/proc/self/fd/{m.disk_pools[g].fileno}"  # its name is unlinked
            with open(path, "r+b") as f:
                f.seek(int(src_slots[1]) * m.disk_pools[g].slot_bytes + 5)
                b = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([b[0] ^ 0x10]))
            expect = CorruptPageError
        else:
            m.disk_pools[g]._inject_fault(fault)
        if expect is None:
            assert m.migrate(lg, src, src_slots, dst) is None
        else:
            with pytest.raises(expect):
                m.migrate(lg, src, src_slots, dst)
        after = snapshot(m)
        assert after == before, f"{fault}: state changed\n{before}\n{after}"
        if src_bytes is not None:
            np.testing.assert_array_equal(cold_bytes(m, lg, src, src_slots), src_bytes)
        # Retry without the fault.
        m._fault_hook = None
        if fault == "allocate":
            m.free(dst, lg, hog)
        if fault == "bitflip":  # a corrupt page is a miss: the good ones still move
            bad = np.asarray([src_slots[1]])
            with pytest.raises(CorruptPageError) as e:
                m.migrate(lg, src, src_slots, dst)
            np.testing.assert_array_equal(e.value.slots, bad)
            keep = np.asarray([0, 2])
            m.free(src, lg, bad)
            src_slots, want = src_slots[keep], want[keep]
        out = m.migrate(lg, src, src_slots, dst)
        assert out is not None
        np.testing.assert_array_equal(read_back(m, lg, dst, out), want)
    finally:
        m.close()


@pytest.mark.parametrize("fault", ["bitflip", "submit", "refused"])
def test_migrate_many_is_one_transaction(tmp_path, fault):
    """A later move failing (corrupt disk page, submission error) or refused (no destination
    room) after earlier moves were submitted: nothing changed at all (ledger with its peaks,
    free counts, stats, source bytes); the retry moves everything."""
    m = make_manager(tmp_path)
    events = []
    m.add_observer(events.append)
    try:
        hs, want_h = place(m, 0, H, 2, seed=3)    # host -> device first (submitted, then undone)
        ds, want_d = place(m, 0, K, 3, seed=4)    # disk -> device second (fails)
        ks, want_k = place(m, 2, D, 2, seed=5)    # device -> disk (staging), lg 2
        moves = [(0, H, hs, D), (2, D, ks, K), (0, K, ds, D)]
        hog = None
        if fault == "refused":  # the last move cannot get its destination slots
            hog = m.allocate(D, 0, m.num_free(D, 0) - 2)
        before = snapshot(m)
        host_bytes = cold_bytes(m, 0, H, hs)
        n_events = len(events)
        if fault == "bitflip":
            pool = m.disk_pools[m.cold_group_of[0]]
            with open(f"/proc/self/fd/{pool.fileno}", "r+b") as f:
                f.seek(int(ds[2]) * pool.slot_bytes + 5)
                b = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([b[0] ^ 0x10]))
            with pytest.raises(CorruptPageError):
                m.migrate_many(moves)
        elif fault == "submit":
            calls = []

            def hook(point):
                calls.append(point)
                if point == "submit" and calls.count("submit") == 3:
                    raise Boom(point)
            m._fault_hook = hook
            with pytest.raises(Boom):
                m.migrate_many(moves)
            m._fault_hook = None
        else:
            assert m.migrate_many(moves) is None
        assert snapshot(m) == before
        assert len(events) == n_events
        np.testing.assert_array_equal(cold_bytes(m, 0, H, hs), host_bytes)
        if fault == "bitflip":
            m.free(K, 0, ds[2:])
            ds, want_d = ds[:2], want_d[:2]
            moves[2] = (0, K, ds, D)
        if hog is not None:
            m.free(D, 0, hog)
        out = m.migrate_many(moves)
        np.testing.assert_array_equal(hot_pages(m, 0, out[0]), want_h)
        np.testing.assert_array_equal(read_back(m, 2, K, out[1]), want_k)
        np.testing.assert_array_equal(hot_pages(m, 0, out[2]), want_d)
        with pytest.raises(ValueError, match="moved twice"):
            m.migrate_many([(0, D, out[0][:1], H), (0, D, out[0], H)])
    finally:
        m.close()


def test_injectors_fire(tmp_path):
    """Negative control: every native injector makes the next matching call fail."""
    m = make_manager(tmp_path)
    try:
        g = m.cold_group_of[0]
        for fault, src, dst in (("enospc", D, K), ("short_write", D, K), ("short_read", K, D),
                                ("eio_read", K, D)):
            slots, _ = place(m, 0, src, 2, seed=1)
            m.disk_pools[g]._inject_fault(fault)
            with pytest.raises(OSError):
                m.migrate(0, src, slots, dst)
            assert m.migrate(0, src, slots, dst) is not None
    finally:
        m.close()


def _threaded_disk_fault_cases():
    """Every disk path with each native fault it can meet."""
    for src, dst in PATHS:
        faults = (["enospc", "short_write"] if dst is K else []) + (
            ["short_read", "eio_read"] if src is K else [])
        for fault in faults:
            yield pytest.param(src, dst, fault, id=f"{src.name}-{dst.name}-{fault}")


@pytest.mark.parametrize("after", [0, 2, 4])
@pytest.mark.parametrize("src,dst,fault", list(_threaded_disk_fault_cases()))
def test_threaded_disk_fault_changes_nothing_and_retry_succeeds(tmp_path, src, dst, fault, after):
    """Disk migrations whose pages run as separate pieces on several native threads: an injected
    fault in the (after+1)-th piece raises, leaves ledgers, free counts, stats and the source as
    they were, and a retry moves the pages byte-exactly."""
    lg, n = 0, 6
    m = make_manager(tmp_path, disk_io_threads=4)
    try:
        g = m.cold_group_of[lg]
        pool = m.disk_pools[g]
        pool._set_io_tuning(piece_bytes=1, min_thread_bytes=1)  # one piece per page
        src_slots, want = place(m, lg, src, n, seed=11 + after)
        before = snapshot(m)
        src_bytes = cold_bytes(m, lg, src, src_slots)
        pool._inject_fault(fault, after_ios=after)
        with pytest.raises(OSError):
            m.migrate(lg, src, src_slots, dst)
        assert pool._file._last_workers == min(4, after + 1)
        assert snapshot(m) == before, f"{fault} after {after}: state changed"
        if src_bytes is not None:
            np.testing.assert_array_equal(cold_bytes(m, lg, src, src_slots), src_bytes)
        out = m.migrate(lg, src, src_slots, dst)
        assert out is not None
        assert pool._file._last_workers > 1, "the retry ran on one thread"
        np.testing.assert_array_equal(read_back(m, lg, dst, out), want)
    finally:
        m.close()


# -- construction, codec ownership, events ----------------------------------------------------

def test_codec_is_consumed_on_success_and_on_failure(tmp_path):
    codec = create_default_cold_page_codec()
    m = make_manager(tmp_path, codec=codec)
    m.close()
    assert codec.consumed
    with pytest.raises(RuntimeError):
        make_manager(tmp_path, codec=codec)
    bad = make_cold_page_codec("concat")
    with pytest.raises(ValueError):
        make_manager(tmp_path, codec=bad, device_slots=(4, 4))  # wrong number of groups
    assert bad.consumed
    with pytest.raises(RuntimeError):
        make_manager(tmp_path, codec=bad)


def test_default_codec_is_configured_without_cold_tiers(tmp_path):
    m = make_manager(tmp_path, host=False, disk=False)
    try:
        assert m.codec.consumed
        assert m.cold_page_bytes[0] == SPECS[0].hot_page_bytes
        with pytest.raises(ValueError):
            m.migrate(0, D, m.allocate(D, 0, 1), H)
    finally:
        m.close()


def test_disk_files_leave_no_name_and_close(tmp_path):
    m = make_manager(tmp_path)
    paths = [p.path for p in m.disk_pools]
    assert paths and not any(__import__("os").path.exists(p) for p in paths)
    assert list(tmp_path.iterdir()) == []
    m.close()
    assert all(p.closed for p in m.disk_pools)


def test_events_and_stats(tmp_path):
    m = make_manager(tmp_path)
    events = []
    m.add_observer(events.append)
    try:
        slots = m.allocate(D, 0, 2)
        h = m.migrate(0, D, slots, H)
        kinds = [(e.kind, e.level) for e in events]
        assert kinds == [("stored", D), ("migrated", H), ("removed", D)]
        np.testing.assert_array_equal(events[1].src_slots, slots)
        np.testing.assert_array_equal(events[1].slots, h)
        st = m.stats()
        assert st["num_migrations"] == 1 and st["num_pages_migrated"] == 2
        assert st["host"]["current"] == 2 * m.cold_page_bytes[0]
        peak = m.governor.get_and_reset_iteration_peak_stats(H)
        assert peak.peak_bytes >= 2 * m.cold_page_bytes[0]
    finally:
        m.close()


def test_large_batches_are_split(tmp_path):
    """More pairs than one 64 KiB index batch: several codec calls, same bytes."""
    spec = LayerGroupSpec(num_layers=1, page_size=8, num_kv_heads=1, head_dim=8,
                          dtype=jnp.float32)
    config = StorageConfig(layer_groups=(spec,), device_slots=(9000,), host_bytes=9000 * 512)
    m = StorageManager(config, device=jax.devices("cpu")[0])
    try:
        slots = m.allocate(D, 0, 8500)
        want = fill_random(m, 0, slots, 5)
        h = m.migrate(0, D, slots, H)
        back = m.migrate(0, H, h, D)
        np.testing.assert_array_equal(hot_pages(m, 0, back), want)
    finally:
        m.close()


@pytest.mark.parametrize("bad", [[-1], [10_000], [1, 1], "unallocated"])
def test_bad_source_slots_are_refused_by_name(tmp_path, bad):
    m = make_manager(tmp_path)
    try:
        slots = m.allocate(D, 0, 2)
        before = snapshot(m)
        src = np.asarray([int(slots[0]) + 5] if bad == "unallocated" else bad, np.int32)
        with pytest.raises(ValueError, match="src_slots"):
            m.migrate(0, D, src, H)
        assert snapshot(m) == before
    finally:
        m.close()


@pytest.mark.parametrize("src,dst", [(a, b) for a in (D, H, K) for b in (H, K)])
def test_copy_pages_keeps_the_source(tmp_path, src, dst):
    """copy_pages between tiers: the copy reads back as the source did and the source stays
    allocated and unchanged; when the destination has no room the answer is None and nothing
    changed."""
    m = make_manager(tmp_path)
    slots, want = place(m, 0, src, 3, seed=7)
    got = m.copy_pages([(0, src, slots, dst)])
    assert got is not None and got[0].size == 3
    assert src is not dst or not set(got[0].tolist()) & set(slots.tolist())
    copy = read_back(m, 0, dst, got[0])
    np.testing.assert_array_equal(read_back(m, 0, src, slots), want)
    np.testing.assert_array_equal(copy, want)
    slots, want = place(m, 0, src, 2, seed=8)
    while m.allocate(dst, 0, 1) is not None:       # fill the destination tier
        pass
    before = snapshot(m)
    assert m.copy_pages([(0, src, slots, dst)]) is None
    assert snapshot(m) == before
    np.testing.assert_array_equal(read_back(m, 0, src, slots), want)
    m.close()
