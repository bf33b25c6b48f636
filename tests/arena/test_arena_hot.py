"""The arena hot tier under the one manager, on CPU: memfd reservations mapped on demand (the
same semantics as CUDA VMM), slot-major pools the ops take by address.

Oracles: the fake model of ``test_manager.py`` (every cached K/V value of every active sequence
read back from the reservation through its page table, after every step), the manager's
invariants (page census per tier, the governor's ledger, the arena's ranges and slot index), and
counters read from the native reservation (map/unmap calls).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kvcm import (ArenaHot, CacheLevel, KVCacheConfig, KVCacheManager, LayerGroupConfig,
                      OutOfPagesError, PagedHot, paged_attention, write_kv)
from jax_kvcm.hot.arena.geometry import ArenaGeometry
from jax_kvcm.hot.arena.ranges import RangeBook
from jax_kvcm.manager import SequenceState, SuspendResult
from test_manager import Harness, _state, make

D, H, K = CacheLevel.DEVICE, CacheLevel.HOST, CacheLevel.DISK
TPP = 4
GRAN = 4096  # the memfd backend's super-page (the system page)


def arena_config(*, device_pages=16, max_seq_len=32, max_batch=4, head_dim=256, windows=(None,),
                 host_pages=0, disk_dir=None, disk_pages=0, max_sequences=None, prefix=True,
                 kv_dtype=None, super_page_bytes=GRAN, max_tokens_per_step=32,
                 **extra) -> KVCacheConfig:
    """One layer, one KV head, float32, 4 tokens per page: with ``head_dim`` 256 a page of one
    pool is 4 KiB, one memfd super-page (one page per chunk); 128 gives two pages per chunk."""
    lgs = tuple(LayerGroupConfig(num_layers=1, num_kv_heads=1, head_dim=head_dim,
                                 dtype=jnp.float32, sliding_window=w, kv_dtype=kv_dtype)
                for w in windows)
    hot = sum(2 * TPP * head_dim * 4 for _ in lgs)
    return KVCacheConfig(tokens_per_page=TPP, layer_groups=lgs, device_pages=device_pages,
                         host_bytes=int(host_pages * hot * 1.25), disk_dir=disk_dir,
                         disk_bytes=int(disk_pages * hot * 1.25), enable_prefix_reuse=prefix,
                         max_batch=max_batch, max_tokens_per_step=max_tokens_per_step, max_seq_len=max_seq_len,
                         hot=ArenaHot(max_sequences=max_sequences, super_page_bytes=super_page_bytes,
                                      backend="cpu"),
                         ring_tables=any(w for w in windows), **extra)


def arena_stats(h: Harness) -> dict:
    return h.mgr.stats()["arena"]


def run_to(h: Harness, seq, n: int, step: int = 8) -> None:
    while seq.num_tokens < n:
        h.run([(seq, min(step, n - seq.num_tokens))], as_ids=[True])
        h.check()


# -- geometry and configuration --------------------------------------------------------------


def test_the_mapping_unit_follows_the_super_page():
    """Llama-3.1-8B shape (32 layers, 8 KV heads, 128 dims, bf16, 16 tokens per page): one page
    of one slot-major pool is 1 MiB, so a 2 MiB super-page holds 2 pages (4 MiB with V); the
    layer-major layout would map 2 x 32 super-pages (128 MiB, 64 pages) at once."""
    pool_page = 32 * 16 * 8 * 128 * 2
    geo = ArenaGeometry(pool_page, 2 << 20, pages_per_seq=128, max_sequences=512,
                        tokens_per_page=16, budget_pages=8192)
    assert geo.pages_per_chunk == 2 and geo.chunk_bytes == 4 << 20
    assert geo.chunks_per_range == 64 and geo.budget_chunks == 4096
    assert geo.range_base(0) == 2 and geo.range_base(1) == 2 + 128
    assert geo.range_of_slot(2 + 127) == 0 and geo.range_of_slot(130) == 1
    assert geo.range_of_slot(1) == -1
    small = ArenaGeometry(2048, 4096, 8, 4, 4, 16)
    assert small.pages_per_chunk == 2 and small.super_pages_per_chunk == 1


def test_range_book_prefers_a_prefix_in_place_then_adoption_when_tight():
    book = RangeBook(4)
    assert book.choose([], tight=False) == 0          # fresh, lowest first
    book.bind("a", 0)
    book.bind("b", book.choose([], tight=False))
    assert book.range_of("b") == 1 and book.num_unbound == 2
    book.unbind("a")
    book.unbind("b")                                  # parked: 0 (older), 1
    assert list(book.parked()) == [0, 1]
    # (range, pages in place, pages to evict, mapped chunks where the holder writes)
    assert book.choose([(0, 0, 3, 0), (1, 2, 5, 0)], tight=False) == 1  # the prefix in place
    assert book.choose([(0, 0, 3, 4), (1, 0, 1, 4)], tight=False) == 2  # loose: fresh
    assert book.choose([(0, 0, 3, 4), (1, 0, 1, 4)], tight=True) == 1   # fewest evictions
    assert book.choose([(0, 0, 3, 5), (1, 0, 1, 4)], tight=True) == 0   # most mapped
    book.bind("c", 1)
    assert book.num_adoptions == 1 and book.num_fresh == 2
    with pytest.raises(ValueError, match="bound"):
        book.bind("d", 1)
    book.check()
    off = RangeBook(2, adoption=False)
    off.bind("a", 0)
    off.unbind("a")
    assert off.choose([(0, 0, 0, 9)], tight=True) == 1  # no adoption but for a prefix in place
    assert off.choose([(0, 1, 0, 0)], tight=False) == 0


@pytest.mark.parametrize("change,field", [
    (dict(max_sequences=0), "ArenaHot.max_sequences"),
    (dict(super_page_bytes=3000), "ArenaHot.super_page_bytes"),
    (dict(backend="tpu"), "ArenaHot.backend"),
    (dict(adoption=1), "ArenaHot.adoption"),
])
def test_bad_arena_options_name_the_field(change, field):
    with pytest.raises((ValueError, TypeError), match=field):
        ArenaHot(**change)


def test_refused_combinations_say_why():
    with pytest.raises(ValueError, match="offload_ahead_pages"):
        arena_config(host_pages=4, offload_ahead_pages=2)
    with pytest.raises(ValueError, match="hot.max_sequences / max_seq_len"):
        arena_config(max_sequences=1 << 20, max_seq_len=1 << 12)  # 2^31 token slots
    lg = LayerGroupConfig(1, 1, 256, jnp.float32)
    other = LayerGroupConfig(2, 1, 256, jnp.float32)
    with pytest.raises(ValueError, match="share one page layout"):
        KVCacheConfig(tokens_per_page=TPP, layer_groups=(lg, other), device_pages=8,
                      max_seq_len=32, hot=ArenaHot(super_page_bytes=GRAN, backend="cpu"))


# -- steps -----------------------------------------------------------------------------------


def test_pages_sit_at_the_range_base_plus_their_index():
    h = make(arena_config())
    a, b = h.add(list(range(1, 10))), h.add(list(range(20, 27)))
    h.run([(a, 9), (b, 7)], as_ids=[True, True])
    for _ in range(6):
        h.run([(a, 1), (b, 1)])
        h.check()
    pa, pb = a.page_ids(0), b.page_ids(0)
    assert (np.diff(pa) == 1).all() and (np.diff(pb) == 1).all(), (pa, pb)
    assert abs(int(pa[0]) - int(pb[0])) >= 8  # separate ranges (8 pages each)
    st = arena_stats(h)
    assert st["num_bound"] == 2 and st["mapped_chunks"] == len(pa) + len(pb)
    assert st["num_map_calls"] == 2 * (1 + st["mapped_chunks"])  # K and V, the null chunk too


def test_a_shared_prefix_is_read_in_place_from_another_range():
    h = make(arena_config())
    prompt = list(range(1, 14))
    a = h.add(prompt)
    h.run([(a, 13)], as_ids=[True])
    b = h.add(prompt[:12] + [99])
    assert b.num_reused_tokens == 12
    h.run([(b, 1)], as_ids=[True])
    h.check()
    assert (b.page_ids(0)[:3] == a.page_ids(0)[:3]).all()
    st = arena_stats(h)
    assert st["shared_pages"] == 3 and st["mapped_chunks"] == 4 + 1  # b owns one page
    for _ in range(5):
        h.run([(a, 1), (b, 1)])
        h.check()


def test_prefix_affine_adoption_needs_no_map_call():
    """A closed sequence's range, its prefix in place, goes to the next sequence with that
    prefix: its pages are where they were, and growth stays inside the mapped chunks."""
    h = make(arena_config(device_pages=8, max_sequences=2))
    prompt = list(range(1, 22))
    a = h.add(prompt)
    run_to(h, a, 28)
    pages = a.page_ids(0).copy()
    h.mgr.close(a)
    maps = arena_stats(h)["num_map_calls"]
    c = h.add(prompt + [5])
    assert c.num_reused_tokens == 20
    run_to(h, c, 28)
    st = arena_stats(h)
    assert st["adoptions"] == 1 and st["affine_pages"] == 5
    assert (c.page_ids(0)[:5] == pages[:5]).all() and (c.page_ids(0) == pages).all()
    assert st["num_map_calls"] == maps and st["num_unmap_calls"] == 0


def rounds_of_map_calls(h: Harness, prompts, rounds: int, decode: int) -> list[tuple[int, int]]:
    """Rounds of ``prompts()`` (lists of token ids) computed together, decoded ``decode`` steps
    and closed; ``(map calls, unmap calls)`` after each round."""
    counts = []
    for _ in range(rounds):
        seqs = [h.add(p) for p in prompts()]
        h.run([(s, s.num_known_tokens - s.num_tokens) for s in seqs], as_ids=[True] * len(seqs))
        for _ in range(decode):
            h.run([(s, 1) for s in seqs])
        h.check()
        for s in seqs:
            h.mgr.close(s)
        st = arena_stats(h)
        counts.append((st["num_map_calls"], st["num_unmap_calls"]))
    print("map/unmap calls per round", counts)
    return counts


def test_steady_state_makes_no_map_or_unmap_call():
    """Rounds of unique prompts at the budget's edge: after the first round every admission
    adopts a parked range whose chunks are mapped."""
    h = make(arena_config(device_pages=4 * 8, max_sequences=8, host_pages=64))
    rng = np.random.default_rng(3)
    counts = rounds_of_map_calls(h, lambda: [rng.integers(0, 50, 8).tolist() for _ in range(4)],
                                 rounds=6, decode=20)
    assert counts[-1] == counts[1], counts
    assert arena_stats(h)["adoptions"] >= 16


# -- pressure, refusals, tiers ---------------------------------------------------------------


def test_pressure_reclaims_chunks_and_refusal_changes_nothing():
    """Two pages per chunk, a budget of 6 chunks: a sequence that outgrows the parked range it
    adopted takes chunks back from another parked range (its cached pages evicted to the host,
    the chunks unmapped); a step no eviction could make room for changes nothing."""
    h = make(arena_config(device_pages=12, head_dim=128, max_seq_len=64, max_sequences=4,
                          host_pages=16))
    rng = np.random.default_rng(5)
    s1, s2 = h.add(rng.integers(0, 50, 20).tolist()), h.add(rng.integers(0, 50, 12).tolist())
    h.run([(s1, 20), (s2, 12)], as_ids=[True, True])
    h.mgr.close(s1)                           # parked ranges of 3 and 2 chunks, pages cached
    h.mgr.close(s2)
    h.check()
    a = h.add(rng.integers(0, 50, 9).tolist())
    run_to(h, a, 40)                          # 10 pages: 5 chunks, more than either range had
    st = arena_stats(h)
    assert st["adoptions"] >= 1 and st["reclaimed_chunks"] > 0, st
    assert st["num_unmap_calls"] > 0 and st["num_quiesces"] > 0, st
    assert h.mgr.stats()["num_evicted_pages"][H] > 0
    before = _state(h)
    with pytest.raises(OutOfPagesError):
        h.mgr.prepare_step([(a, 24)])         # 16 pages: more than the budget
    assert _state(h) == before
    h.check()
    h.run([(a, 1)])
    h.check()


def test_one_quiesce_harvests_a_32nd_of_the_budget():
    """Unmapping waits for the device, so reclaim takes budget / 32 chunks per quiesce, not one
    step's need: 32 parked ranges of 4 mapped chunks (4 tokens a page, 2 pages a chunk) fill a
    128-chunk budget; three sequences adopt three of them and grow to 8 chunks one token a step
    (what the budget has left first, then chunks taken back, 4 per quiesce)."""
    h = make(arena_config(device_pages=256, head_dim=128, max_seq_len=64, max_sequences=40,
                          max_tokens_per_step=64))
    rng = np.random.default_rng(7)
    for _ in range(16):
        seqs = [h.add(rng.integers(0, 50, 32).tolist()) for _ in range(2)]
        h.run([(s, 32) for s in seqs], as_ids=[True] * 2)
        for s in seqs:
            h.mgr.close(s)
    assert arena_stats(h)["mapped_chunks"] >= 120   # the last admissions adopted parked ranges
    grow = [h.add(rng.integers(0, 50, n).tolist()) for n in (18, 21, 24)]  # chunks fill apart
    h.run([(s, s.num_known_tokens) for s in grow], as_ids=[True] * 3)
    for _ in range(40):
        h.run([(s, 1) for s in grow])
    h.check()
    st = arena_stats(h)
    print("reclaimed chunks", st["reclaimed_chunks"], "quiesces", st["num_quiesces"])
    assert st["reclaimed_chunks"] >= 8, st
    assert st["num_quiesces"] <= -(-st["reclaimed_chunks"] // 4), st


def test_suspend_and_resume_through_host_and_disk(tmp_path):
    h = make(arena_config(device_pages=16, host_pages=3, disk_dir=str(tmp_path), disk_pages=16))
    a = h.add(list(range(1, 18)))
    run_to(h, a, 24)
    b = h.add(list(range(30, 37)))
    run_to(h, b, 12)
    assert h.mgr.suspend(a) is SuspendResult.SUSPENDED   # 6 pages: more than the host holds
    assert a.state is SequenceState.SUSPENDED
    h.check()
    run_to(h, b, 20)
    assert h.mgr.resume(a)
    h.check()                                            # byte-identical through disk
    h.run([(a, 1), (b, 1)])
    h.check()


def test_window_groups_stay_paged_beside_an_arena():
    h = make(arena_config(windows=(None, 6), device_pages=24))
    assert h.mgr.storage.hot_tier(0).kind == "arena"
    assert h.mgr.storage.hot_tier(1).kind == "paged"
    a = h.add(list(range(1, 12)))
    b = h.add(list(range(1, 9)) + [40, 41])
    for s in (a, b):
        run_to(h, s, 20, step=3)
    assert arena_stats(h)["num_bound"] == 2


def test_compact_state_and_recovery_work_on_the_arena():
    h = make(arena_config())
    a, b = h.add(list(range(1, 7))), h.add(list(range(9, 15)))
    h.run([(a, 6), (b, 6)], as_ids=[True, True])
    h.mgr.close(a)
    new_to_old = h.mgr.compact(np.array([-1, 0]) if b.row == 1 else np.array([0, -1]))
    assert b.row == 0 and new_to_old[0] >= 0
    h.run([(b, 1)])
    h.check()
    view = h.mgr.state(b)
    assert view.num_tokens == 7 and view.retained == ((0, 2),)
    assert h.mgr.private_pages_per_sequence() == (8,)
    assert h.mgr.recover_from_failed_step() == []    # the arena's memory outlived its arrays
    h.check()
    h.run([(b, 1)])
    h.check()


def test_fp8_pools_on_the_arena_attend_as_paged_does():
    """FP8 K/V (scales per layer and kv head) through the manager: the same prompts and decode
    steps on paged and on the arena write the same fp8 bytes where each page table points, so
    paged_attention reads equal outputs (the paged pools are the oracle; page ids differ)."""
    seed = 11
    print("seed", seed)
    outs = {}
    for name, hot in (("paged", PagedHot()), ("arena", ArenaHot(super_page_bytes=GRAN,
                                                                 backend="cpu"))):
        lg = LayerGroupConfig(num_layers=1, num_kv_heads=2, head_dim=128, dtype=jnp.bfloat16,
                              kv_dtype=jnp.float8_e4m3fn)
        mgr = KVCacheManager(KVCacheConfig(tokens_per_page=TPP, layer_groups=(lg,),
                                           device_pages=32, max_seq_len=64, max_batch=4,
                                           max_tokens_per_step=64, hot=hot),
                             device=jax.devices("cpu")[0])
        rng = np.random.default_rng(seed)
        scale = jnp.full((1, 2), 0.05, jnp.float32)
        seqs = [mgr.add_sequence(rng.integers(0, 50, n).astype(np.int32)) for n in (9, 14)]
        got = []
        for step in range(4):
            work = [(s, s.num_known_tokens - s.num_tokens if step == 0 else 1) for s in seqs]
            batch = mgr.prepare_step(work)
            (k, v), = mgr.caches
            T, B = batch.slot_mapping.shape[0], batch.seq_lens.shape[0]
            kv = jnp.asarray(rng.standard_normal((2, T, 2, 128)), jnp.bfloat16)
            k, v = write_kv(k, v, kv[0], kv[1], batch.slot_mapping, layer=0, k_scale=scale,
                            v_scale=scale)
            q = jnp.asarray(rng.standard_normal((B, 8, 128)), jnp.bfloat16)
            got.append(np.asarray(paged_attention(q, k, v, batch.page_table, batch.seq_lens,
                                                  layer=0, k_scale=scale, v_scale=scale),
                                  np.float32)[:2])
            mgr.complete_step([(k, v)])
        if name == "arena":
            assert mgr.stats()["arena"]["num_map_calls"] > 0
            mgr.check_invariants()
        outs[name] = got
        mgr.shutdown()
    for a, b in zip(outs["paged"], outs["arena"]):
        np.testing.assert_array_equal(a, b)


def test_the_governor_counts_mapped_chunks():
    h = make(arena_config(head_dim=128))
    a = h.add(list(range(1, 12)))
    h.run([(a, 11)], as_ids=[True])
    gov = h.mgr.storage.governor
    st = arena_stats(h)
    assert gov.usage(D).committed == st["mapped_chunks"] * st["chunk_bytes"]
    assert gov.limit(D) == (16 // 2) * st["chunk_bytes"]
    assert h.mgr.stats()["pages"]["device"]["capacity"] == 16


def test_reused_prefixes_do_not_shift_the_ranges_they_leave():
    """A system prompt of one page, read in place from its holder's range by every request:
    each request's own pages (1..4) start at its range's base, whatever the previous holder
    left cached there. Three ranges of two chunks and the holder's one fill the budget of 7
    chunks exactly; a range shifted by the previous holder's cached page needs a third chunk,
    and the second round ran out of device pages (red before the fix)."""
    h = make(arena_config(device_pages=14, head_dim=128, max_seq_len=24, max_sequences=8,
                          host_pages=64))
    system = [7, 8, 9, 10]
    holder = h.add(system + [11])
    h.run([(holder, 5)], as_ids=[True])
    rng = np.random.default_rng(5)

    def prompts():
        return [system + rng.integers(20, 50, 4).tolist() for _ in range(3)]
    counts = rounds_of_map_calls(h, prompts, rounds=5, decode=12)
    assert arena_stats(h)["shared_pages"] == 15          # the system page, read in place
    assert counts[-1] == counts[0], counts   # every round after the first adopts, maps nothing


def test_a_host_hit_onboards_into_mapped_free_slots_at_full_budget():
    """Every chunk of the budget mapped (the governor has no DEVICE byte left) and a prefix
    hit on the host: its pages go to free slots of mapped chunks, which cost no budget, so the
    hit is onboarded (planned by slots, not by governor bytes: red before the fix)."""
    h = make(arena_config(device_pages=8, head_dim=128, max_seq_len=32, max_sequences=2,
                          host_pages=16))
    prompt = list(range(1, 18))
    a = h.add(prompt)
    h.run([(a, 17)], as_ids=[True])
    h.mgr.close(a)
    b = h.add(list(range(40, 57)))                  # reclaims a's chunks: a's pages to host
    h.run([(b, 17)], as_ids=[True])
    h.mgr.close(b)
    st = h.mgr.stats()
    print(st["pages"], arena_stats(h))
    assert st["pages"]["host"]["cached"] >= 4
    c = h.add(prompt + [3])
    assert c.num_reused_tokens == 16, (c.num_reused_tokens, h.mgr.stats()["pages"])
    assert h.mgr.stats()["num_onboarded_pages"] >= 4
    h.run([(c, 2)], as_ids=[True])
    h.check()


def test_the_last_chunk_slots_are_allocated_slots_to_the_storage_manager():
    """The arena's slot count (``num_slots``, the null chunk's spare slots not counted) is not
    its highest slot index: a page in the last chunk's top slots moved to the host used to be
    refused as "not distinct allocated DEVICE slots" (tools/random_run.py seed 1806339567, a
    suspend at operation 63,820); it moves, and a slot never allocated is still refused."""
    h = make(arena_config(device_pages=16, head_dim=128, host_pages=8))
    st = h.mgr.storage
    geo = st.hot_tier(0).geometry
    top = np.array([geo.num_slots - 1], np.int32)
    assert top[0] >= st.allocator(CacheLevel.DEVICE, 0).num_slots   # past the count
    assert not st.allocator(CacheLevel.DEVICE, 0).all_allocated(top)
    assert st.allocate(CacheLevel.DEVICE, 0, 1, top) is not None
    assert st.allocator(CacheLevel.DEVICE, 0).all_allocated(top)
    (host,) = st.migrate_many([(0, CacheLevel.DEVICE, top, CacheLevel.HOST)])
    assert host.size == 1 and not st.allocator(CacheLevel.DEVICE, 0).all_allocated(top)
    with pytest.raises(ValueError, match="not distinct allocated DEVICE slots"):
        st.migrate_many([(0, CacheLevel.DEVICE, top, CacheLevel.HOST)])
