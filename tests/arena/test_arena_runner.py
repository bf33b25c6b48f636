"""The arena under donated jitted steps on CPU, and the example Llama server on it.

Why the CPU arena's pools are taken by address (recorded here, so a jax/XLA upgrade that changes
it shows up): XLA's CPU client aliases a donated input only when it allocated the buffer itself;
a buffer imported from outside (DLPack, ``device_put`` of host memory) gets a fresh output with
the whole input copied into it, which on the arena reads unmapped super-pages. On CPU the
manager's ``caches`` are therefore :class:`~jax_kvcm.ArenaPool`s by address, which the ops take in
place of arrays; on the GPU they are the reservation itself (XLA aliases it; the gpu tests check).

Checked: the Llama server on the arena generates HF's greedy tokens and the paged server's, with
a shared system prompt read in place across ranges and a small budget that suspends and resumes;
in equal memory the arena admits as many sequences as paged (its step count is at most 1.1x).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kvcm import ArenaHot, ArenaPool, _ffi

pytestmark = pytest.mark.slow  # seconds to minutes: `pytest -m "not gpu and not slow"` skips it

ROOT = Path(__file__).resolve().parents[2]
GRAN = 4096


def test_xla_cpu_copies_a_donated_buffer_it_did_not_allocate():
    """The cause: a fully mapped reservation (so the copy cannot fault) imported without a copy
    through DLPack comes back from a donated step at another address; an array XLA allocated
    keeps its address."""
    res = _ffi._kvcm_cpu.Reservation(16 * GRAN, GRAN)
    offsets = list(range(0, 16 * GRAN, GRAN))
    res.map_many(offsets, res.create_physical_many(len(offsets)))
    n = 16 * GRAN // 4
    step = jax.jit(lambda a: a.at[3].set(1.0), donate_argnums=0)
    x = jax.dlpack.from_dlpack(res.dlpack(0, [n], "float32"))
    assert x.unsafe_buffer_pointer() == res.base, "the import copied"
    y = step(x)
    assert y.unsafe_buffer_pointer() != res.base, "XLA aliased it (revisit the CPU design)"
    assert float(y[3]) == 1.0
    z = jnp.zeros(n, jnp.float32)
    p = z.unsafe_buffer_pointer()
    assert step(z).unsafe_buffer_pointer() == p
    res.close()


def _setup(**model):
    sys.path.insert(0, str(ROOT))
    pytest.importorskip("torch")
    from conftest import random_hf_llama
    from examples.llama import loader as llama_loader
    from test_llama_serve import BASE

    hf = random_hf_llama("llama", {**BASE, "rope_theta": 10000.0, **model}, 7)
    with tempfile.TemporaryDirectory() as path:
        hf.save_pretrained(path, safe_serialization=True)
        config, params, _ = llama_loader.load_checkpoint(path, dtype="float32", progress=False)
    return hf, config, params


def _server(params, config, hot_backend: str, device_pages: int, *, page: int, max_len: int,
            max_batch: int = 4, host_bytes: int = 1 << 20):
    from examples.llama import serve
    arena = ArenaHot(max_sequences=2 * max_batch, super_page_bytes=GRAN, backend="cpu")
    return serve.Server(params, config, serve.ServeConfig(
        hot_backend=hot_backend, arena=arena if hot_backend == "arena" else None,
        device_pages=device_pages, page_size=page, max_batch=max_batch,
        max_tokens_per_step=32, prefill_chunk_tokens=32, max_seq_len=max_len,
        host_bytes=host_bytes))


def test_llama_server_on_the_arena_generates_hf_and_paged_tokens():
    """Greedy tokens equal HF's and the paged server's; prompts sharing a system prompt read it
    in place from the range that committed it; a small budget suspends and resumes."""
    from conftest import random_prompt
    from examples.llama import serve
    from test_llama_serve import _check_greedy

    hf, config, params = _setup()
    page, max_len = 4, 96
    rng = np.random.default_rng(9)
    system = random_prompt(rng, 4 * page)
    prompts = [system + rng.integers(3, 128, 3 + 2 * i).tolist() for i in range(4)]
    prompts += [random_prompt(rng, n) for n in (11, 30)]
    outs = {}
    for name, hb, pages in (("paged", "paged", 96), ("arena", "arena", 96),
                            ("arena, small budget", "arena", 20)):
        srv = _server(params, config, hb, pages, page=page, max_len=max_len)
        (first,) = srv.generate([serve.Request(system, 6, eos_token_ids=[])])
        got = srv.generate([serve.Request(p, 12, eos_token_ids=[]) for p in prompts])
        outs[name] = [first.generated_ids] + [o.generated_ids for o in got]
        if hb == "arena":
            st = srv.manager.stats()["arena"]
            print(name, st, srv.report()["suspends"])
            assert st["shared_pages"] + st["affine_pages"] >= 3, st
            if pages < 96:
                rep = srv.report()
                assert rep["suspends"] > 0 and rep["resumes"] == rep["suspends"], rep
            srv.manager.check_invariants()
        srv.manager.shutdown()
    assert outs["arena"] == outs["paged"]
    assert outs["arena, small budget"] == outs["paged"]
    for i, (p, g) in enumerate(zip([system] + prompts, outs["arena"])):
        _check_greedy(hf, p, g, len(g), f"prompt {i}")


def test_equal_memory_admits_as_many_sequences_as_paged():
    """12 greedy requests over two shared prefixes, max_batch 4, 8 tokens per page, the same
    device pages for both, tight enough that paged must suspend: the arena counts parked ranges
    and cached pages as obtainable, so it runs as many sequences at once as paged (steps within
    1.1x; the previous round's arena took 91 steps against paged's 31). Head dim 32 makes one
    page of one pool a 4 KiB super-page (one page per chunk); with two pages per chunk a range's
    last chunk strands up to one page (measured in the results, not asserted here)."""
    from conftest import random_prompt
    from examples.llama import serve

    _, config, params = _setup(hidden_size=128)
    page, max_len = 8, 128
    rng = np.random.default_rng(21)
    prefixes = [random_prompt(rng, 24), random_prompt(rng, 32)]
    reqs = [prefixes[i % 2] + rng.integers(3, 128, 5 + i).tolist() for i in range(12)]
    steps, tokens, suspends = {}, {}, {}
    for hb in ("paged", "arena"):
        srv = _server(params, config, hb, 24, page=page, max_len=max_len)
        got = srv.generate([serve.Request(p, 24, eos_token_ids=[]) for p in reqs])
        rep = srv.report()
        steps[hb], suspends[hb] = rep["steps"], rep["suspends"]
        tokens[hb] = [o.generated_ids for o in got]
        if hb == "arena":
            assert srv.manager.stats()["arena"]["pages_per_chunk"] == 1
        srv.manager.check_invariants()
        srv.manager.shutdown()
    print("steps", steps, "suspends", suspends)
    assert suspends["paged"] > 0                       # memory, not max_batch, binds
    assert tokens["arena"] == tokens["paged"]
    assert steps["arena"] <= 1.1 * steps["paged"], steps


def test_arena_pools_are_taken_by_address_on_cpu():
    """The manager's CPU caches are ArenaPools by address at the reservation (what the ops and
    the donated steps above use)."""
    from jax_kvcm import KVCacheConfig, KVCacheManager, LayerGroupConfig
    cfg = KVCacheConfig(tokens_per_page=4, layer_groups=(LayerGroupConfig(1, 1, 256,
                                                                          jnp.float32),),
                        device_pages=8, max_seq_len=32,
                        hot=ArenaHot(super_page_bytes=GRAN, backend="cpu"))
    mgr = KVCacheManager(cfg, device=jax.devices("cpu")[0])
    (k, v), = mgr.caches
    assert isinstance(k, ArenaPool) and k.by_address and v.by_address
    assert k.shape == (1, cfg.arena_geometries()[0].num_slots, 4, 1, 256)
    assert v.unsafe_buffer_pointer() - k.unsafe_buffer_pointer() == \
        cfg.arena_geometries()[0].pool_bytes
    mgr.shutdown()
