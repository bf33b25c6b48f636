"""KVCacheManager with ``hot_backend="arena"`` on CPU: the manager's calls over the arena.

These tests write each step's new K/V with ``write_step_kv`` (host writes at the batch's slot
mapping; tests/test_arena_runner.py runs donated jitted steps instead) and read them back
through the real attention op over ``manager.caches`` (on CPU the pools by address:
:class:`~jax_kvcm._arena_ops.ArenaPool`, no copy) with the manager's own page tables. The oracle: the K/V the test wrote per position,
gathered into a dense pool and fed to the pure-JAX reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvcm
from jax_kvcm import _ffi
from jax_kvcm._arena import ArenaConfig
from jax_kvcm._arena_ops import ArenaPool
from jax_kvcm._arena_manager import ArenaKVCacheManager
from jax_kvcm._manager import SequenceState
from jax_kvcm._types import CacheLevel
from jax_kvcm.ops import reference

GRAN = _ffi._kvcm_cpu.arena_granularity()
L, H, D, TPP = 2, 2, 16, 4           # 512-byte slots
PPC = GRAN // (TPP * H * D * 4)      # pages per chunk with one-granule super-pages
CT = PPC * TPP                       # tokens per chunk
CHUNK_BYTES = 2 * L * GRAN
PAGE_BYTES = 2 * L * TPP * H * D * 4  # one page in every pool-layer (a cold page)
MAX_LEN = 4 * CT


def make(*, budget_chunks=12, max_sequences=4, host_bytes=1 << 20, reuse=True, disk_dir=None,
         disk_bytes=0, **arena_kw):
    cfg = jax_kvcm.KVCacheConfig(
        tokens_per_page=TPP,
        layer_groups=(jax_kvcm.LayerGroupConfig(L, H, D, dtype=jnp.float32),),
        host_bytes=host_bytes, disk_dir=disk_dir, disk_bytes=disk_bytes, max_batch=4,
        max_tokens_per_step=4 * CT, max_seq_len=MAX_LEN,
        enable_prefix_reuse=reuse, hot_backend="arena",
        arena=ArenaConfig(max_sequences=max_sequences, max_pages_per_sequence=MAX_LEN // TPP,
                          budget_bytes=budget_chunks * CHUNK_BYTES, super_page_bytes=GRAN,
                          **arena_kw))
    mgr = jax_kvcm.KVCacheManager(cfg)
    assert isinstance(mgr, ArenaKVCacheManager)
    return mgr


class Oracle:
    """The K/V written at each position of each sequence (what the arena must hold)."""

    def __init__(self, seed: int, tol: float = 1e-5, det: bool = False) -> None:
        print("seed", seed)
        self.tol, self.seed, self.det = tol, seed, det
        self.rng = np.random.default_rng(seed)
        self.kv: dict[int, list[np.ndarray]] = {}   # seq_id -> [(k, v) [2, L, H, D]] per pos

    def step(self, mgr, work, run=None):
        """One step through the manager: new K/V written at the batch's slots (by
        ``write_step_kv``, or ``run(batch, k, v)`` returning the step's caches, e.g. a donated
        jitted step); returns the batch after complete_step."""
        lay = mgr.layout
        batch = mgr.prepare_step(work)
        T = sum(n if isinstance(n, int) else len(n) for _, n in work)
        kv = self.rng.standard_normal((2, lay.num_layers, T, lay.num_kv_heads,
                                       lay.head_dim)).astype(np.float32)
        if self.det:  # prompt tokens: K/V a function of (token, position), as in a model
            t = 0
            for seq, n in work:
                for i in range(n):
                    pos = seq.num_tokens - n + i
                    if pos < seq.num_known_tokens:
                        kv[:, :, t + i] = self.det_kv(int(mgr._tokens[seq._row, pos]), pos,
                                                      lay)
                t += n
        if run is None:
            mgr.write_step_kv(kv[0], kv[1])
            caches = mgr.caches
        else:
            caches = run(batch, kv[0], kv[1])
        t = 0
        for seq, n in work:
            n = n if isinstance(n, int) else len(n)
            rows = self.kv.setdefault(seq.seq_id, [])
            for i in range(n):
                rows.append(kv[:, :, t + i])
            t += n
        mgr.complete_step(caches)
        return batch

    def det_kv(self, token: int, pos: int, lay) -> np.ndarray:
        r = np.random.default_rng([self.seed, token, pos])
        return r.standard_normal((2, lay.num_layers, lay.num_kv_heads,
                                  lay.head_dim)).astype(np.float32)

    def adopt_prompt(self, mgr, seq, tokens) -> None:
        """``seq``'s reused tokens hold the deterministic K/V of its prompt (``det``)."""
        self.kv[seq.seq_id] = [self.det_kv(int(tokens[p]), p, mgr.layout)
                               for p in range(seq.num_reused_tokens)]

    def adopt_prefix(self, seq, owner_id: int) -> None:
        self.kv[seq.seq_id] = list(self.kv[owner_id][:seq.num_reused_tokens])

    def dense_pool(self, seqs, P: int, lay) -> tuple[np.ndarray, np.ndarray]:
        """The oracle's K/V of ``seqs`` as a paged pool ``[2, L, 1 + B * P, TPP, H, D]`` (row
        ``b``'s pages at ``1 + b * P``, page 0 null) and its ``[B, P]`` table."""
        L, TPP, H, D = lay.num_layers, lay.tokens_per_page, lay.num_kv_heads, lay.head_dim
        B = len(seqs)
        dense = np.zeros((2, L, 1 + B * P, TPP, H, D), np.float32)
        dtable = np.zeros((B, P), np.int32)
        for b, s in enumerate(seqs):
            kv = np.stack(self.kv[s.seq_id][:s.num_tokens], axis=2)  # [2, L, n, H, D]
            n = kv.shape[2]
            np_ = -(-n // TPP)
            pad = np.zeros((2, L, np_ * TPP, H, D), np.float32)
            pad[:, :, :n] = kv
            dense[:, :, 1 + b * P:1 + b * P + np_] = pad.reshape(2, L, np_, TPP, H, D)
            dtable[b, :np_] = np.arange(1 + b * P, 1 + b * P + np_)
        return dense, dtable

    def suspend_resume_round_trip(self, mgr, seqs, run, new_len: int):
        """Suspends ``seqs[1]``, runs a new sequence's ``new_len``-token prompt in its place,
        resumes it and checks its pages byte-identical, then one step of all of them; returns the
        new sequence."""
        a = seqs[1]
        k0, v0 = mgr.arena.read_pages(mgr._aseq[a.seq_id], 0, a.num_pages)
        assert mgr.suspend(a) is jax_kvcm.SuspendResult.SUSPENDED
        other = mgr.add_sequence(prompt(self.rng, new_len))
        self.step(mgr, [(other, new_len)], run)
        assert mgr.resume(a)
        k1, v1 = mgr.arena.read_pages(mgr._aseq[a.seq_id], 0, a.num_pages)
        np.testing.assert_array_equal(k0, k1)
        np.testing.assert_array_equal(v0, v1)
        self.step(mgr, [(s, 1) for s in seqs + [other]], run)
        return other

    def check_attention(self, mgr, seqs) -> None:
        """Decode attention over the manager's caches and tables == the reference over a dense
        pool of the oracle's K/V, for every layer."""
        kc, vc = mgr.caches[0]
        lay = mgr.layout
        L, H, D = lay.num_layers, lay.num_kv_heads, lay.head_dim
        B = len(seqs)
        lens = np.array([s.num_tokens for s in seqs], np.int32)
        P = mgr.config.pages_per_seq
        table = np.zeros((B, P), np.int32)
        for b, s in enumerate(seqs):
            pages = s.page_ids()
            # NOTE: consecutive, or two runs after a partial alias (the shared chunk's rest skipped)
            assert (np.diff(pages) != 1).sum() <= int(mgr._aseq[s.seq_id].skip > 0), pages
            table[b, :pages.size] = pages
        dense, dtable = self.dense_pool(seqs, P, lay)
        q = self.rng.standard_normal((B, 2 * H, D)).astype(np.float32)
        for layer in range(L):
            got = jax_kvcm.paged_attention(jax.device_put(q, kc.device), kc, vc,
                                           jax.device_put(table, kc.device),
                                           jax.device_put(lens, kc.device), layer=layer)
            with jax.default_device(jax.devices("cpu")[0]):
                want = reference.paged_attention(jnp.asarray(q), jnp.asarray(dense[0]),
                                                 jnp.asarray(dense[1]), jnp.asarray(dtable),
                                                 jnp.asarray(lens), layer=layer)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=self.tol,
                                       atol=self.tol)


def prompt(rng, n, prefix=()):
    return np.concatenate([np.asarray(prefix, np.int32),
                           rng.integers(0, 1000, n - len(prefix)).astype(np.int32)])


def test_steps_through_the_manager_read_back_through_the_ops():
    o = Oracle(1)
    mgr = make()
    try:
        seqs = [mgr.add_sequence(prompt(o.rng, n)) for n in (5, CT + 3, 2 * CT)]
        # Chunked prefill, then decode; the batch's tables are base + arange.
        batch = o.step(mgr, [(s, min(CT, n)) for s, n in zip(seqs, (5, CT + 3, 2 * CT))])
        for b, s in enumerate(seqs):
            row = batch.page_table[b]
            npg = -(-s.num_tokens // TPP)
            assert (row[:npg] == s.page_ids()).all() and not row[npg:].any()
        o.step(mgr, [(seqs[1], 3), (seqs[2], CT)])
        o.check_attention(mgr, seqs)
        for _ in range(9):
            o.step(mgr, [(s, 1) for s in seqs])
        o.check_attention(mgr, seqs)
        mgr.check_invariants()
        assert mgr.stats()["num_steps"] == 11
    finally:
        mgr.shutdown()


def test_steady_state_maps_and_unmaps_nothing():
    o = Oracle(2)
    mgr = make(reuse=False)
    try:
        counts = []
        for cycle in range(12):
            seqs = [mgr.add_sequence(prompt(o.rng, int(o.rng.integers(2, 2 * CT))))
                    for _ in range(3)]
            for s in seqs:
                o.step(mgr, [(s, s.num_known_tokens)])
            for _ in range(3):
                o.step(mgr, [(s, 1) for s in seqs])
            o.check_attention(mgr, seqs)
            for s in seqs:
                mgr.close(s)
            a = mgr.stats()["arena"]
            counts.append((a["num_map_calls"], a["num_unmap_calls"], a["mapped_bytes"]))
        # The first cycles map the ranges (growing to the largest prompt); then adoption.
        assert counts[-1] == counts[-6], counts
        assert counts[-1][1] == 0
        assert mgr.stats()["arena"]["num_adoptions"] >= 30
    finally:
        mgr.shutdown()


def test_shared_prefix_aliases_the_same_physical_pages():
    o = Oracle(3)
    mgr = make()
    try:
        system = o.rng.integers(0, 1000, CT).astype(np.int32)  # one whole chunk
        owner = mgr.add_sequence(prompt(o.rng, CT + 7, system))
        assert owner.num_reused_tokens == 0
        o.step(mgr, [(owner, CT + 7)])
        o.step(mgr, [(owner, 1)])
        mgr.close(owner)
        used = mgr.stats()["arena"]["used_chunks"]
        counts = []
        for i in range(6):
            seq = mgr.add_sequence(prompt(o.rng, CT + 5 + i, system))
            assert seq.num_reused_tokens == CT and seq.num_tokens == CT
            o.adopt_prefix(seq, owner.seq_id)
            o.step(mgr, [(seq, seq.num_known_tokens - CT)])
            o.step(mgr, [(seq, 1)])
            o.check_attention(mgr, [seq])
            mgr.close(seq)
            a = mgr.stats()["arena"]
            counts.append((a["num_map_calls"], a["num_unmap_calls"]))
        a = mgr.stats()["arena"]
        # Each closing alias registers its own tail chunk; the next one, adopting the range
        # (prefix-affine), takes that never-aliased span over: the prefix span and the last
        # tail are left.
        assert a["num_alias_hits"] == 6 and a["num_spans"] == 2 and a["num_consumed_spans"] == 6
        assert a["used_chunks"] == used  # the prefix chunk was never copied or re-mapped
        assert counts[-1] == counts[0], counts  # prefix-affine adoption: no map/unmap
        assert mgr.stats()["num_prefix_hit_tokens"] == 6 * CT
        # Two live aliases of one span at once, and a different salt does not match.
        s1 = mgr.add_sequence(prompt(o.rng, CT + 2, system))
        s2 = mgr.add_sequence(prompt(o.rng, CT + 3, system))
        s3 = mgr.add_sequence(prompt(o.rng, CT + 3, system), salt="other")
        assert (s1.num_reused_tokens, s2.num_reused_tokens, s3.num_reused_tokens) == (CT, CT, 0)
        assert s1.page_ids()[0] != s2.page_ids()[0]
        for s in (s1, s2):
            o.adopt_prefix(s, owner.seq_id)
        o.step(mgr, [(s1, 2), (s2, 3), (s3, CT + 3)])
        o.check_attention(mgr, [s1, s2, s3])
        # A prompt of exactly one chunk reuses all but its last page (its last token must be
        # computed): a partial alias.
        s4 = mgr.add_sequence(system)
        assert s4.num_reused_tokens == CT - TPP and s4.page_ids().size == PPC - 1
    finally:
        mgr.shutdown()


def test_a_512_token_system_prompt_aliases_on_an_8b_shaped_chunk():
    """8B-shaped slots (32 KiB: 16 tokens x 8 KV heads x 128 x bf16; here 64 x float32) with
    2 MiB super-pages: a chunk is 64 pages, 1,024 tokens. A 512-token system prompt still
    aliases (the first 32 pages of the owner's chunk, zero budget) and reads back through the
    op; steady-state admissions map nothing."""
    o = Oracle(21)
    tpp, h, d, layers, sp = 16, 8, 64, 2, 2 << 20
    cfg = jax_kvcm.KVCacheConfig(
        tokens_per_page=tpp, layer_groups=(jax_kvcm.LayerGroupConfig(layers, h, d,
                                                                    dtype=jnp.float32),),
        host_bytes=0, max_batch=4, max_tokens_per_step=2048, max_seq_len=2048,
        hot_backend="arena",
        arena=ArenaConfig(max_sequences=3, max_pages_per_sequence=128,
                          budget_bytes=10 * 2 * layers * sp, super_page_bytes=sp))
    mgr = jax_kvcm.KVCacheManager(cfg)
    try:
        assert mgr.arena.pages_per_chunk == 64
        system = o.rng.integers(0, 1000, 512).astype(np.int32)
        owner = mgr.add_sequence(prompt(o.rng, 700, system))
        o.step(mgr, [(owner, 700)])
        mgr.close(owner)
        used = mgr.stats()["arena"]["used_chunks"]
        counts = []
        for i in range(5):
            seq = mgr.add_sequence(prompt(o.rng, 600 + 150 * i, system))
            assert seq.num_reused_tokens == 512 and seq.page_ids().size == 32
            o.adopt_prefix(seq, owner.seq_id)
            o.step(mgr, [(seq, seq.num_known_tokens - 512)])
            o.step(mgr, [(seq, 1)])
            o.check_attention(mgr, [seq])
            a = mgr.stats()["arena"]
            # its own pages start at its next chunk: 1 chunk up to 1,024 own tokens
            assert a["used_chunks"] <= used + 1
            counts.append((a["num_map_calls"], a["num_unmap_calls"]))
            mgr.close(seq)
        a = mgr.stats()["arena"]
        slot = tpp * h * d * 4
        assert (a["num_alias_hits"], a["num_partial_aliases"]) == (5, 5)
        assert a["aliased_bytes"] == 5 * 32 * 2 * layers * slot
        assert counts[-1] == counts[1], counts  # adoption + aliasing: nothing mapped
        print(a)
    finally:
        mgr.shutdown()


def test_prefix_reuse_off_registers_nothing():
    o = Oracle(4)
    mgr = make(reuse=False)
    try:
        system = o.rng.integers(0, 1000, CT).astype(np.int32)
        s = mgr.add_sequence(prompt(o.rng, CT + 4, system))
        o.step(mgr, [(s, CT + 4)])
        mgr.close(s)
        s = mgr.add_sequence(prompt(o.rng, CT + 4, system))
        assert s.num_reused_tokens == 0 and mgr.stats()["arena"]["num_spans"] == 0
    finally:
        mgr.shutdown()


def test_suspend_resume_is_byte_identical_and_host_exhaustion_changes_nothing():
    o = Oracle(5)
    mgr = make(max_sequences=2, host_bytes=1 << 20)
    try:
        a = mgr.add_sequence(prompt(o.rng, CT + 9))
        o.step(mgr, [(a, CT + 9)])
        before = mgr.arena.read_pages(mgr._aseq[a.seq_id], 0, a.num_pages)
        assert mgr.suspend(a) is jax_kvcm.SuspendResult.SUSPENDED
        assert mgr.stats()["host_used_bytes"] > 0 and mgr.stats()["num_suspended_now"] == 1
        # Two others take both ranges (one adopts a's parked range) and overwrite it.
        others = [mgr.add_sequence(prompt(o.rng, 2 * CT)) for _ in range(2)]
        o.step(mgr, [(s, 2 * CT) for s in others])
        assert mgr.resume(a) is False  # no range free: still suspended, nothing changed
        mgr.close(others[0])
        assert mgr.resume(a) is True
        after = mgr.arena.read_pages(mgr._aseq[a.seq_id], 0, a.num_pages)
        for x, y in zip(before, after):
            np.testing.assert_array_equal(x, y)
        assert mgr.stats()["host_used_bytes"] == 0
        o.step(mgr, [(a, 1), (others[1], 1)])
        o.check_attention(mgr, [a, others[1]])
    finally:
        mgr.shutdown()
    # The host cannot take it: MUST_RECOMPUTE, the sequence still active and intact.
    o = Oracle(6)
    mgr = make(host_bytes=2 * PAGE_BYTES)
    try:
        a = mgr.add_sequence(prompt(o.rng, 20))  # 5 pages
        o.step(mgr, [(a, 20)])
        assert mgr.suspend(a) is jax_kvcm.SuspendResult.MUST_RECOMPUTE
        assert a.state is SequenceState.ACTIVE
        o.step(mgr, [(a, 1)])
        o.check_attention(mgr, [a])
        assert mgr.stats()["num_refused_suspends"] == 1
    finally:
        mgr.shutdown()


def _ledger(mgr):
    st = mgr.stats()
    sm = mgr._cold.storage
    return (st["storage"], st["arena"], st["host_used_bytes"],
            [sm.num_free(lv, 0) for lv in (CacheLevel.DEVICE, CacheLevel.HOST)],
            sm.governor.usage(CacheLevel.HOST))


def test_bug_d_host_filled_by_suspended_sequences_refuses_atomically():
    """The seed's fourth bug through the storage transaction: the host tier fills with
    suspended sequences' pages (which nothing may evict); the next suspend reserves first and is
    refused with every ledger, free count, peak and stat unchanged and the sequence intact; once
    one resumes, the refused one suspends. Every resume reads back through the op."""
    o = Oracle(25)
    mgr = make(max_sequences=4, host_bytes=2 * PPC * PAGE_BYTES)  # two chunks of pages
    try:
        seqs = [mgr.add_sequence(prompt(o.rng, CT - 3)) for _ in range(3)]
        o.step(mgr, [(s, CT - 3) for s in seqs])
        assert mgr.suspend(seqs[0]) is jax_kvcm.SuspendResult.SUSPENDED
        assert mgr.suspend(seqs[1]) is jax_kvcm.SuspendResult.SUSPENDED
        before = _ledger(mgr)
        k0 = mgr.arena.read_pages(mgr._aseq[seqs[2].seq_id], 0, PPC)
        assert mgr.suspend(seqs[2]) is jax_kvcm.SuspendResult.MUST_RECOMPUTE
        assert _ledger(mgr)[:4] == before[:4] and seqs[2].state is SequenceState.ACTIVE
        assert mgr.stats()["num_refused_suspends"] == 1
        k1 = mgr.arena.read_pages(mgr._aseq[seqs[2].seq_id], 0, PPC)
        np.testing.assert_array_equal(k0[0], k1[0])
        o.step(mgr, [(seqs[2], 1)])
        o.check_attention(mgr, [seqs[2]])
        assert mgr.resume(seqs[0])
        o.check_attention(mgr, [seqs[0], seqs[2]])
        assert mgr.suspend(seqs[2]) is jax_kvcm.SuspendResult.SUSPENDED
        for s in (seqs[1], seqs[2]):
            assert mgr.resume(s)
        o.step(mgr, [(s, 1) for s in seqs])
        o.check_attention(mgr, seqs)
        assert mgr.stats()["host_used_bytes"] == 0
    finally:
        mgr.shutdown()


def test_suspend_spills_to_disk_when_the_host_is_full(tmp_path):
    """With a disk tier, a suspend the host cannot take goes to disk (one transaction); resume
    from disk is byte-identical and reads back through the op; a corrupt disk page fails the
    resume with nothing changed (the sequence stays suspended and can be closed)."""
    o = Oracle(26)
    mgr = make(max_sequences=4, host_bytes=PPC * PAGE_BYTES, disk_dir=str(tmp_path),
               disk_bytes=4 * PPC * PAGE_BYTES)
    try:
        seqs = [mgr.add_sequence(prompt(o.rng, CT - 3)) for _ in range(3)]
        o.step(mgr, [(s, CT - 3) for s in seqs])
        levels = []
        mgr.add_observer(lambda e: levels.append(e.level) if e.kind == "suspended" else None)
        for s in seqs[:2]:
            assert mgr.suspend(s) is jax_kvcm.SuspendResult.SUSPENDED
        assert levels == [CacheLevel.HOST, CacheLevel.DISK]
        assert mgr.resume(seqs[1])  # from disk
        o.step(mgr, [(s, 1) for s in seqs[1:]])
        o.check_attention(mgr, seqs[1:])
        assert mgr.suspend(seqs[2]) is jax_kvcm.SuspendResult.SUSPENDED  # disk again
        level, slots = mgr._aseq[seqs[2].seq_id].suspended
        assert level is CacheLevel.DISK
        pool = mgr._cold.storage.disk_pools[0]
        with open(f"/proc/self/fd/{pool.fileno}", "r+b") as f:  # its name is unlinked
            f.seek(int(slots[-1]) * pool.slot_bytes + 5)  # one byte of its last page
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x10]))
        before = _ledger(mgr)
        with pytest.raises(jax_kvcm.CorruptPageError):
            mgr.resume(seqs[2])
        # NOTE: the storage side is exactly as before; the arena keeps the range it mapped for
        # the resume parked (adoptable), as the paged backend keeps what it evicted.
        after = _ledger(mgr)
        assert seqs[2].state is SequenceState.SUSPENDED
        assert (after[0], after[2], after[3]) == (before[0], before[2], before[3])
        mgr.close(seqs[2])  # drop and recompute
        assert mgr.resume(seqs[0])  # from host
        o.step(mgr, [(seqs[0], 1)])
        o.check_attention(mgr, [seqs[0], seqs[1]])
    finally:
        mgr.shutdown()


def test_capacity_planning_counts_physical_chunks():
    o = Oracle(7)
    # 9 chunks: the null chunk and 8 for sequences; a CT + 1 token sequence maps 2 chunks.
    mgr = make(budget_chunks=9, max_sequences=8)
    try:
        assert mgr.max_num_sequences(CT + 1) == 4
        assert mgr.max_num_sequences(CT) == 8
        assert mgr.max_seq_len_for(4) == 2 * CT
        assert mgr.max_seq_len_for(9) == 0
        assert mgr.device_capacity_pages == 8 * PPC
        seqs = [mgr.add_sequence(prompt(o.rng, CT + 1)) for _ in range(5)]
        for s in seqs[:4]:
            o.step(mgr, [(s, CT + 1)])
        assert mgr.num_obtainable_pages() == 0
        with pytest.raises(jax_kvcm.OutOfPagesError):
            mgr.prepare_step([(seqs[4], CT + 1)])
        assert seqs[4].num_tokens == 0  # nothing scheduled
        mgr.close(seqs[0])  # parked, still mapped: reclaimed (unmapped) under pressure
        o.step(mgr, [(seqs[4], CT + 1)])
        assert mgr.stats()["arena"]["num_reclaimed_ranges"] == 1
        o.check_attention(mgr, seqs[1:])
        with pytest.raises(jax_kvcm.OutOfPagesError):  # every range held by active sequences
            for _ in range(8):
                mgr.add_sequence(prompt(o.rng, 3))
    finally:
        mgr.shutdown()


def test_close_during_a_step_waits_for_it_and_abort_rolls_back():
    o = Oracle(8)
    mgr = make()
    try:
        a, b = mgr.add_sequence(prompt(o.rng, 10)), mgr.add_sequence(prompt(o.rng, 12))
        o.step(mgr, [(a, 10), (b, 12)])
        mgr.prepare_step([(a, 1), (b, 1)])
        mgr.close(a)  # the step may still write a's range: parked after complete_step
        assert mgr.stats()["arena"]["num_parked"] == 0
        with pytest.raises(jax_kvcm.StepInFlightError):
            mgr.suspend(b)
        assert mgr.abort_step() == []
        assert b.num_tokens == 12 and mgr.stats()["arena"]["num_parked"] == 1
        o.step(mgr, [(b, 1)])
        o.check_attention(mgr, [b])
    finally:
        mgr.shutdown()
    with pytest.raises(RuntimeError):
        mgr.add_sequence([1, 2])


def test_bad_config_and_misuse_name_the_field():
    lg = jax_kvcm.LayerGroupConfig(L, H, D, dtype=jnp.float32)
    arena = ArenaConfig(max_sequences=2, max_pages_per_sequence=32, budget_bytes=1 << 20,
                        super_page_bytes=GRAN)
    base = dict(tokens_per_page=TPP, layer_groups=(lg,), max_seq_len=128)
    cases = [
        (dict(hot_backend="vmm", device_pages=8), "hot_backend"),
        (dict(hot_backend="arena", arena={"max_sequences": 2}), "arena"),
        (dict(hot_backend="arena", arena=arena, device_pages=8), "device_pages"),
        (dict(hot_backend="arena", arena=arena, max_seq_len=256), "max_pages_per_sequence"),
        (dict(device_pages=8, arena=arena), "arena"),
        (dict(hot_backend="arena", arena=arena,
              layer_groups=(jax_kvcm.LayerGroupConfig(L, H, D, sliding_window=8),)),
         r"layer_groups\[0\]\.sliding_window"),
        (dict(hot_backend="arena", arena=arena,
              layer_groups=(jax_kvcm.LayerGroupConfig(L, H, D, kv_dtype=jnp.float8_e4m3fn),)),
         r"layer_groups\[0\]\.kv_dtype"),
        (dict(hot_backend="arena", arena=arena, layer_groups=(lg, lg)), "layer_groups"),
    ]
    for kw, field in cases:
        with pytest.raises((ValueError, TypeError), match=field):
            jax_kvcm.KVCacheConfig(**{**base, **kw})
    mgr = make()
    try:
        s = mgr.add_sequence([1, 2, 3])
        mgr.prepare_step([(s, 3)])
        with pytest.raises(ValueError, match="float32"):
            mgr.write_step_kv(np.zeros((L, 3, H, D), np.float16), np.zeros((L, 3, H, D),
                                                                            np.float16))
        with pytest.raises(ValueError, match="T covering"):
            mgr.write_step_kv(np.zeros((L, 2, H, D), np.float32), np.zeros((L, 2, H, D),
                                                                            np.float32))
        kc, vc = mgr.caches[0]
        # NOTE: on CPU a step returns ArenaPools (arrays would be XLA's copies of the arena).
        with pytest.raises(TypeError, match="must be an ArenaPool"):
            mgr.complete_step([(jnp.zeros(kc.shape, kc.dtype), jnp.zeros(vc.shape, vc.dtype))])
        with pytest.raises(ValueError, match="not this arena's pool"):
            mgr.complete_step([(kc, ArenaPool.by_address(vc.token, vc.address + 4096, vc.shape,
                                                              vc.dtype, slot_major=False))])
        mgr.abort_step()
        with pytest.raises(TypeError, match="compact"):
            mgr.compact([0])
    finally:
        mgr.shutdown()


def test_recorded_token_ids_make_generated_chunks_reusable():
    o = Oracle(9)
    mgr = make()
    try:
        p = prompt(o.rng, CT - 4)
        s = mgr.add_sequence(p)
        o.step(mgr, [(s, CT - 4)])
        for _ in range(8):  # decode by count, the ids read later (an overlapped loop)
            o.step(mgr, [(s, 1)])
        gen = o.rng.integers(0, 1000, 8).astype(np.int32)
        mgr.record_token_ids(s, gen)
        assert s.num_known_tokens == CT + 4
        owner = s.seq_id
        mgr.close(s)
        t = mgr.add_sequence(np.concatenate([p, gen, [7]]))
        # Every committed page, generated ones too: chunk 0 whole and one page of chunk 1.
        assert t.num_reused_tokens == CT + 4
        o.adopt_prefix(t, owner)
        o.step(mgr, [(t, 5)])
        o.check_attention(mgr, [t])
        u = mgr.add_sequence(np.concatenate([p, gen[:-1] + 1, [7, 7]]))
        # The pages before the first changed token (at CT - 4) alias: part of a chunk.
        assert u.num_reused_tokens == CT - 4
        assert mgr.stats()["arena"]["num_partial_aliases"] == 2
        o.adopt_prefix(u, owner)
        o.step(mgr, [(u, 10)])
        o.check_attention(mgr, [t, u])
    finally:
        mgr.shutdown()


@pytest.mark.parametrize("seed", [11, 12, 13, 14, 16])
def test_random_walk_through_the_manager_keeps_every_sequence_readable(seed, tmp_path):
    """Random admissions (some sharing a system prompt), steps, closes (also inside a
    step), suspends and resumes under a tight budget (seed 14: a small host tier and a disk
    tier; seed 16: ``remap_spans`` off); every ACTIVE sequence's K/V are checked through the
    op after every operation. Refusals (OutOfPagesError, MUST_RECOMPUTE, resume False) must
    change nothing."""
    o = Oracle(seed, det=True)
    rng = o.rng
    disk = dict(host_bytes=PPC * PAGE_BYTES, disk_dir=str(tmp_path),
                disk_bytes=6 * PPC * PAGE_BYTES) if seed == 14 else {}
    mgr = make(budget_chunks=8, max_sequences=5, remap_spans=seed != 16,
               **{"host_bytes": 6 * PPC * PAGE_BYTES, **disk})
    # NOTE: a system prompt of one chunk, of half a chunk plus a page, of one and a half.
    system = rng.integers(0, 1000, (CT, CT // 2 + TPP, 3 * CT // 2)[seed % 3]).astype(np.int32)
    live: list = []
    try:
        for _ in range(100):
            op = rng.choice(["add", "step", "step", "step", "close", "suspend", "resume"])
            active = [s for s in live if s.state is SequenceState.ACTIVE]
            if op == "add":
                n = int(rng.integers(2, 2 * CT))
                p = (prompt(rng, max(n, system.size + 1), system) if rng.random() < 0.5
                     else prompt(rng, n))
                try:
                    s = mgr.add_sequence(p)
                except jax_kvcm.OutOfPagesError:
                    continue
                o.adopt_prompt(mgr, s, p)
                live.append(s)
            elif op == "step" and active:
                pick = ([s for s in active if rng.random() < 0.7] or active[:1])[:4]
                work = [(s, 1 if s.num_tokens >= s.num_known_tokens
                         else min(s.num_known_tokens - s.num_tokens, CT)) for s in pick]
                work = [(s, n) for s, n in work if s.num_tokens + n <= MAX_LEN]
                if not work:
                    continue
                lens = [s.num_tokens for s, _ in work]
                try:
                    o.step(mgr, work)
                except jax_kvcm.OutOfPagesError:
                    assert [s.num_tokens for s, _ in work] == lens
                    continue
            elif op == "close" and live:
                s = live.pop(int(rng.integers(len(live))))
                mgr.close(s)
            elif op == "suspend" and active:
                s = active[int(rng.integers(len(active)))]
                n = s.num_tokens
                r = mgr.suspend(s)
                assert s.num_tokens == n
                assert (s.state is SequenceState.SUSPENDED) == (
                    r is jax_kvcm.SuspendResult.SUSPENDED)
            elif op == "resume":
                for s in live:
                    if s.state is SequenceState.SUSPENDED:
                        assert mgr.resume(s) == (s.state is SequenceState.ACTIVE)
                        break
            mgr.check_invariants()
            active = [s for s in live if s.state is SequenceState.ACTIVE and s.num_tokens]
            if active:
                o.check_attention(mgr, active[:4])
        print(mgr.stats()["arena"], mgr.stats()["storage"])
    finally:
        mgr.shutdown()
