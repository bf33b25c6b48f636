"""The arena hot backend under donated jitted steps on CPU: the pools by address.

Why it is needed (recorded here, so a jax/XLA upgrade that changes it shows up): XLA's CPU client
aliases a donated input only when it allocated the buffer itself; a buffer imported from outside
(DLPack, ``device_put`` of host memory) gets a fresh output with the whole input copied into it,
which on the arena reads unmapped super-pages. On CPU the manager's ``caches`` are therefore
:class:`~jax_kvcm._arena_ops.ArenaPool`s, which the ops take in place of arrays.

Checked: a donated jitted step over the manager's ArenaPools writes the reservation itself (the
bytes read back from the mapped memory are the K/V the step wrote, 1,000 steps, the pools'
address the reservation's base after every step, the tokens counting the writes), attention
inside and after the steps equals the pure-JAX reference over the oracle's K/V, suspend/resume
round-trips; misuse fails with errors, not faults; the example Llama server on the arena
generates HF's greedy tokens and the paged server's, with prefix aliasing and suspensions.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvcm
from jax_kvcm import _ffi
from jax_kvcm._arena import Arena, ArenaConfig, ArenaLayout
from jax_kvcm._arena_ops import ArenaPool
from jax_kvcm.ops import reference
from test_arena_manager import CT, GRAN, MAX_LEN, H, L, D, TPP, Oracle, make, prompt

ROOT = Path(__file__).resolve().parents[1]


def _mapped_reservation(nbytes: int):
    res = _ffi._kvcm_cpu.Reservation(nbytes, GRAN)
    for off in range(0, nbytes, GRAN):
        res.map(off, res.create_physical())
    return res


def test_xla_cpu_copies_a_donated_buffer_it_did_not_allocate():
    """The cause: a fully mapped reservation (so the copy cannot fault) imported without a copy
    through DLPack or device_put comes back from a donated step at another address; an array
    XLA allocated keeps its address."""
    res = _mapped_reservation(16 * GRAN)
    n = 16 * GRAN // 4
    step = jax.jit(lambda a: a.at[3].set(1.0), donate_argnums=0)
    imports = {"dlpack": lambda: jax.dlpack.from_dlpack(res.dlpack(0, [n], "float32")),
               "device_put": lambda: jax.device_put(
                   np.frombuffer(res.view(), np.float32, count=n), may_alias=True)}
    for name, make_array in imports.items():
        x = make_array()
        assert x.unsafe_buffer_pointer() == res.base, f"{name}: the import copied"
        y = step(x)
        assert y.unsafe_buffer_pointer() != res.base, f"{name}: XLA aliased it (revisit)"
        assert float(y[3]) == 1.0
    z = jnp.zeros(n, jnp.float32)
    p = z.unsafe_buffer_pointer()
    assert step(z).unsafe_buffer_pointer() == p
    res.close()


def _runner(mgr, reads=None):
    """``run(batch, kn, vn)`` for :meth:`Oracle.step`: a jitted step donating the manager's
    ArenaPools, writing with :func:`jax_kvcm.write_kv`, then (``reads``) decode attention of
    the step's rows inside the same step (kept in ``run.out``)."""
    def step(k, v, kn, vn, batch, q):
        for layer in range(L):
            k, v = jax_kvcm.write_kv(k, v, kn[layer], vn[layer], batch.slot_mapping,
                                     layer=layer)
        out = None
        if reads:
            out = jnp.stack([jax_kvcm.paged_attention(q, k, v, batch.page_table, batch.seq_lens,
                                                      layer=layer) for layer in range(L)])
        return k, v, out

    jitted = jax.jit(step, donate_argnums=(0, 1))
    base, nbytes = mgr.arena.base_address, mgr.caches[0][0].nbytes

    def run(batch, kn, vn):
        T, Tb, B = kn.shape[1], batch.slot_mapping.shape[-1], batch.seq_lens.shape[0]
        pad = np.zeros((L, Tb, H, D), np.float32)
        kp, vp = pad.copy(), pad.copy()
        kp[:, :T], vp[:, :T] = kn, vn
        k, v = mgr.caches[0]
        before = int(k.token)
        q = np.random.default_rng(T).standard_normal((B, 2 * H, D)).astype(np.float32)
        k, v, run.out = jitted(k, v, jnp.asarray(kp), jnp.asarray(vp), batch, jnp.asarray(q))
        assert isinstance(k, ArenaPool) and k.unsafe_buffer_pointer() == base
        assert v.unsafe_buffer_pointer() == base + nbytes
        assert int(k.token) == int(v.token) == before + L   # the step wrote through the arena op
        run.q = q
        return [(k, v)]

    run.out = run.q = None
    return run


def _check_bytes(o, mgr, seqs) -> None:
    """The reservation's mapped memory (read by memcpy, not through XLA) holds the oracle's K/V
    at every page of every sequence."""
    for s in seqs:
        aseq = mgr._aseq[s.seq_id]
        k, v = mgr.arena.read_pages(aseq, 0, s.num_pages)   # [L, pages, TPP, H, D]
        want = np.stack(o.kv[s.seq_id][:s.num_tokens], axis=2)  # [2, L, n, H, D]
        n = want.shape[2]
        np.testing.assert_array_equal(k.reshape(L, -1, H, D)[:, :n], want[0])
        np.testing.assert_array_equal(v.reshape(L, -1, H, D)[:, :n], want[1])


def test_donated_steps_on_arena_pools_write_the_reservation():
    o = Oracle(41)
    mgr = make(budget_chunks=16)
    try:
        caches = mgr.caches[0]
        assert all(isinstance(a, ArenaPool) for a in caches)
        run = _runner(mgr)
        seqs = [mgr.add_sequence(prompt(o.rng, n)) for n in (9, CT + 3, 2 * CT)]
        for s in seqs:
            o.step(mgr, [(s, s.num_known_tokens)], run)
        _check_bytes(o, mgr, seqs)
        o.check_attention(mgr, seqs)
        # 1,000 more steps (run() checks both pools' addresses and tokens after each one): a
        # sequence at max_seq_len is checked, closed and replaced (its range adopted).
        for i in range(1000):
            for j, s in enumerate(seqs):
                if s.num_tokens == MAX_LEN:
                    _check_bytes(o, mgr, [s])
                    mgr.close(s)
                    seqs[j] = mgr.add_sequence(prompt(o.rng, 3 + i % 7))
            fresh = [s for s in seqs if s.num_tokens == 0]
            o.step(mgr, [(s, s.num_known_tokens if s in fresh else 1) for s in seqs], run)
            if i % 250 == 0:
                _check_bytes(o, mgr, seqs)
        _check_bytes(o, mgr, seqs)
        o.check_attention(mgr, seqs)
        assert int(mgr.caches[0][0].token) == L * 1003
        assert mgr.stats()["arena"]["num_adoptions"] > 10
        # Suspend / resume byte-identical, then more donated steps on the resumed range.
        other = o.suspend_resume_round_trip(mgr, seqs, run, CT)
        _check_bytes(o, mgr, seqs + [other])
        o.check_attention(mgr, seqs + [other])
    finally:
        mgr.shutdown()


def test_attention_inside_the_step_reads_what_the_step_wrote():
    """The ordering tokens: paged_attention inside the step, after write_kv of the step's new
    tokens, reads them (the reference over the oracle's K/V)."""
    o = Oracle(42)
    mgr = make()
    try:
        run = _runner(mgr, reads=True)
        seqs = [mgr.add_sequence(prompt(o.rng, n)) for n in (5, CT + 1)]
        for s in seqs:
            o.step(mgr, [(s, s.num_known_tokens)], run)
        for _ in range(3):
            batch = o.step(mgr, [(s, 1) for s in seqs], run)
            B, P = len(seqs), batch.page_table.shape[1]
            dense, rows = o.dense_pool(seqs, P, mgr.layout)
            table = np.zeros((batch.seq_lens.shape[0], P), np.int32)
            table[:B] = rows
            for layer in range(L):
                want = reference.paged_attention(
                    jnp.asarray(run.q), jnp.asarray(dense[0]), jnp.asarray(dense[1]),
                    jnp.asarray(table), jnp.asarray(batch.seq_lens), layer=layer)
                np.testing.assert_allclose(np.asarray(run.out[layer][:B]),
                                           np.asarray(want)[:B], rtol=1e-5, atol=1e-5)
    finally:
        mgr.shutdown()


def test_arena_pool_misuse_is_an_error_not_a_fault():
    lay = ArenaLayout(L, TPP, H, D, "float32")
    arena = Arena(ArenaConfig(max_sequences=2, max_pages_per_sequence=8,
                              budget_bytes=8 * 2 * L * GRAN, super_page_bytes=GRAN), lay,
                  backend="cpu")
    k, v = arena.pool_arrays()
    tok = jnp.zeros((), jnp.int32)
    kp = ArenaPool.by_address(tok, arena.base_address, k.shape, k.dtype, slot_major=False)
    vp = ArenaPool.by_address(tok + 0, arena.base_address + k.nbytes, k.shape, k.dtype,
                               slot_major=False)
    rows = jnp.ones((1, H, D), jnp.float32)
    with pytest.raises(TypeError, match="both be ArenaPools"):
        jax_kvcm.write_kv(kp, v, rows, rows, jnp.zeros((1,), jnp.int32), layer=0)
    seq = arena.admit()
    arena.ensure(seq, 1)
    mapped = seq.base_slot * TPP
    # NOTE: slot 1 * chunk of an unmapped range: the op refuses it before writing anything.
    unmapped = (seq.base_slot + 3 * arena.pages_per_chunk) * TPP
    with pytest.raises(Exception, match="unmapped part of the arena"):
        jax_kvcm.write_kv(kp, vp, jnp.concatenate([rows, rows]), jnp.concatenate([rows, rows]),
                          jnp.array([mapped, unmapped], jnp.int32), layer=0)
    got, _ = arena.read_pages(seq, 0, 1)
    assert not got.any(), "a refused write wrote something"
    kp2, vp2 = jax_kvcm.write_kv(kp, vp, rows, 2 * rows, jnp.array([mapped], jnp.int32), layer=1)
    assert int(kp2.token) == 1
    got_k, got_v = arena.read_pages(seq, 0, 1)
    assert (got_k[1, 0, 0] == 1).all() and (got_v[1, 0, 0] == 2).all()
    # A write is a side effect on the arena: kept even when a jitted caller drops the pools.
    jax.jit(lambda kp, vp, sm: (jax_kvcm.write_kv(kp, vp, 3 * rows, 3 * rows, sm, layer=0),
                                jnp.int32(0))[1])(kp2, vp2, jnp.array([mapped], jnp.int32))
    got_k, _ = arena.read_pages(seq, 0, 1)
    assert (got_k[0, 0, 0] == 3).all()
    arena.close_arena()
    with pytest.raises(Exception, match="not inside an open arena reservation"):
        jax_kvcm.paged_attention(rows, kp2, vp2, jnp.zeros((1, 8), jnp.int32),
                                 jnp.ones((1,), jnp.int32), layer=0).block_until_ready()


def test_llama_server_on_the_arena_generates_hf_and_paged_tokens():
    """examples/llama/serve.Server on the CPU arena (donated jitted steps over ArenaPools):
    greedy tokens equal HF's and the paged server's; prompts sharing a whole-chunk system
    prompt alias it; a small budget suspends and resumes sequences through the arena."""
    sys.path.insert(0, str(ROOT))
    pytest.importorskip("torch")
    from conftest import random_hf_llama, random_prompt
    from examples.llama import loader as llama_loader
    from examples.llama import serve
    from test_llama_serve import BASE, _check_greedy

    import tempfile
    hf = random_hf_llama("llama", {**BASE, "rope_theta": 10000.0}, 7)
    with tempfile.TemporaryDirectory() as path:
        hf.save_pretrained(path, safe_serialization=True)
        config, params, _ = llama_loader.load_checkpoint(path, dtype="float32", progress=False)
    page, max_len = 4, 96
    slot = page * 2 * 16 * 4                     # 2 KV heads of 16 dims, float32: 512 bytes
    ppc = GRAN // slot                           # pages per chunk with one-granule super-pages
    rng = np.random.default_rng(9)
    system = random_prompt(rng, ppc * page)      # a whole chunk
    prompts = [system + rng.integers(3, 128, 3 + 2 * i).tolist() for i in range(4)]
    prompts += [random_prompt(rng, n) for n in (11, 30)]
    chunk_bytes = 2 * 2 * GRAN

    def server(hot_backend, budget_chunks=64):
        arena = (ArenaConfig(max_sequences=4, max_pages_per_sequence=max_len // page,
                             budget_bytes=budget_chunks * chunk_bytes, super_page_bytes=GRAN)
                 if hot_backend == "arena" else None)
        return serve.Server(params, config, serve.ServeConfig(
            hot_backend=hot_backend, arena=arena, device_pages=96, page_size=page,
            max_batch=4, max_tokens_per_step=32, prefill_chunk_tokens=32, max_seq_len=max_len,
            host_bytes=1 << 20))

    outs = {}
    for name, hb, budget in (("paged", "paged", 0), ("arena", "arena", 64),
                             ("arena, small budget", "arena", 5)):
        srv = server(hb, budget)
        (first,) = srv.generate([serve.Request(system, 6, eos_token_ids=[])])
        got = srv.generate([serve.Request(p, 12, eos_token_ids=[]) for p in prompts])
        outs[name] = [first.generated_ids] + [o.generated_ids for o in got]
        if hb == "arena":
            st = srv.manager.stats()
            print(name, st["arena"]["num_alias_hits"], srv.report()["suspends"])
            assert st["arena"]["num_alias_hits"] >= 3, st["arena"]
            if budget < 64:
                rep = srv.report()
                assert rep["suspends"] > 0 and rep["resumes"] == rep["suspends"], rep
            srv.manager.check_invariants()
            srv.manager.shutdown()
    assert outs["arena"] == outs["paged"]
    assert outs["arena, small budget"] == outs["paged"]
    for i, (p, g) in enumerate(zip([system] + prompts, outs["arena"])):
        _check_greedy(hf, p, g, len(g), f"prompt {i}")
