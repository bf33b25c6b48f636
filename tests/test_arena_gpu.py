"""The arena on CUDA VMM (run on the GPU machine with ``pytest -m gpu tests/test_arena_gpu.py``).

- XLA sees the arena as the pool: the DLPack-imported reservation keeps its pointer over 1,000
  donated ``write_kv`` steps, and what those steps wrote is read back (numpy oracle) through the
  arena's own copies.
- An unmap requested while a kernel still reads the range waits for that kernel's fence: the
  kernel finishes with the right result (pure-JAX reference) and no fault.
- Aliasing on the GPU: one physical chunk mapped at two ranges, data written by a donated step
  through one range is read by the attention op through the other.
- Driver errors name the field; teardown returns every handle; 1,000 cycles keep memory flat.

A GPU test that cannot run (no GPU, no CUDA extension) fails, it never skips.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvcm
from jax_kvcm import _ffi
from jax_kvcm._arena import Arena, ArenaConfig, ArenaLayout
from jax_kvcm.ops import reference

pytestmark = pytest.mark.gpu

SP = 2 << 20
LAYOUT = ArenaLayout(num_layers=2, tokens_per_page=16, num_kv_heads=2, head_dim=64)  # 8 KiB
PPC = SP // LAYOUT.slot_bytes  # 256 pages per chunk


def require_gpu() -> None:
    if jax.default_backend() != "gpu" or not _ffi.cuda_extension_available():
        pytest.fail(f"needs a GPU and the CUDA extension (backend {jax.default_backend()}, "
                    f"{_ffi.CUDA_IMPORT_ERROR})")


def make(max_sequences=4, max_pages=2 * PPC, budget_chunks=8, **kw) -> Arena:
    """Prefix keys are per chunk unless ``alias_unit_pages`` says otherwise."""
    require_gpu()
    kw.setdefault("alias_unit_pages", PPC)
    chunk = 2 * LAYOUT.num_layers * SP
    return Arena(ArenaConfig(max_sequences=max_sequences, max_pages_per_sequence=max_pages,
                             budget_bytes=budget_chunks * chunk, super_page_bytes=SP, **kw),
                 LAYOUT, backend="cuda")


def _step_fn():
    def step(k, v, kn, vn, slots):
        for layer in range(LAYOUT.num_layers):
            k, v = jax_kvcm.write_kv(k, v, kn[layer], vn[layer], slots, layer=layer)
        # NOTE: the fence is a value the next step does not donate, ordered after the writes.
        return k, v, k[0, 0, 0, 0, 0] + v[0, 0, 0, 0, 0]

    return jax.jit(step, donate_argnums=(0, 1))


def test_donated_steps_keep_the_reservation_pointer_over_1000_steps():
    seed = 11
    print("seed", seed)
    rng = np.random.default_rng(seed)
    with make() as a:
        seqs = [a.admit(), a.admit()]
        num_steps = 1000
        pages_needed = -(-num_steps // LAYOUT.tokens_per_page)
        for s in seqs:
            assert a.ensure(s, pages_needed)
        k, v = a.pool_arrays()
        base = a.base_address
        assert k.unsafe_buffer_pointer() == base
        v_base = v.unsafe_buffer_pointer()
        step = _step_fn()
        P = LAYOUT.tokens_per_page
        shape = (LAYOUT.num_layers, len(seqs), LAYOUT.num_kv_heads, LAYOUT.head_dim)
        want_k = np.full((len(seqs), num_steps) + shape[2:] + (LAYOUT.num_layers,), np.nan,
                         np.float32)
        want_v = want_k.copy()
        for t in range(num_steps):
            kn = rng.standard_normal(shape).astype(np.float32)
            vn = rng.standard_normal(shape).astype(np.float32)
            slots = np.array([(s.base_slot + t // P) * P + t % P for s in seqs], np.int32)
            k, v, fence = step(k, v, jnp.asarray(kn), jnp.asarray(vn), jnp.asarray(slots))
            a.record_step(seqs, fence)
            assert k.unsafe_buffer_pointer() == base, f"step {t}: the pool moved (a copy)"
            assert v.unsafe_buffer_pointer() == v_base
            want_k[:, t] = np.moveaxis(kn, 0, -1)
            want_v[:, t] = np.moveaxis(vn, 0, -1)
        stats = a.stats()
        for b, s in enumerate(seqs):
            got_k, got_v = a.read_pages(s, 0, pages_needed)  # waits for the last fence
            for layer in range(LAYOUT.num_layers):
                gk = got_k[layer].reshape(-1, LAYOUT.num_kv_heads, LAYOUT.head_dim)[:num_steps]
                gv = got_v[layer].reshape(-1, LAYOUT.num_kv_heads, LAYOUT.head_dim)[:num_steps]
                np.testing.assert_array_equal(gk, want_k[b, ..., layer])
                np.testing.assert_array_equal(gv, want_v[b, ..., layer])
        assert stats.num_unmap_calls == 0
        del k, v


def _long_reader(iters: int):
    def read(q, k, v, table, lens):
        def body(i, acc):
            return jnp.maximum(acc, jax_kvcm.paged_attention(q + i * 0.0, k, v, table, lens,
                                                               layer=1))
        return jax.lax.fori_loop(0, iters, body, jnp.full(q.shape, -jnp.inf, jnp.float32))

    return jax.jit(read)


def test_unmap_waits_for_a_kernel_still_reading_the_range():
    seed = 12
    print("seed", seed)
    rng = np.random.default_rng(seed)
    with make(max_sequences=2, max_pages=PPC, budget_chunks=2) as a:
        # budget: the null chunk + one sequence chunk; the second sequence needs the first's.
        s = a.admit()
        u = a.admit()  # admitted before s closes, so it cannot simply adopt s's range
        n = PPC
        assert a.ensure(s, n)
        shape = (LAYOUT.num_layers, n, LAYOUT.tokens_per_page, LAYOUT.num_kv_heads,
                 LAYOUT.head_dim)
        k_host = rng.standard_normal(shape).astype(np.float32)
        v_host = rng.standard_normal(shape).astype(np.float32)
        a.write_pages(s, 0, k_host, v_host)
        kp, vp = a.pool_arrays()
        B, H = 4, 4
        q = rng.standard_normal((B, H, LAYOUT.head_dim)).astype(np.float32)
        table = np.tile(s.page_table(n), (B, 1))
        lens = np.array([n * LAYOUT.tokens_per_page - 3 * b for b in range(B)], np.int32)
        reader = _long_reader(20000)
        args = (jnp.asarray(q), kp, vp, jnp.asarray(table), jnp.asarray(lens))
        reader(*args).block_until_ready()  # compile and warm up
        out = reader(*args)
        a.record_step([s], out)
        a.close(s)
        still_running = not out.is_ready()
        t0 = time.perf_counter()
        assert a.ensure(u, 1)  # must unmap s's range: waits for the reader first
        waited = time.perf_counter() - t0
        assert still_running, "the reader finished before the unmap was requested: lengthen it"
        assert a.stats().num_blocking_drains == 1 and out.is_ready()
        print(f"unmap waited {waited * 1e3:.1f} ms for the reader")
        dense_table = np.tile(np.arange(1, n + 1, dtype=np.int32), (B, 1))
        zero = np.zeros((LAYOUT.num_layers, 1) + shape[2:], np.float32)
        want = reference.paged_attention(
            jnp.asarray(q), jnp.asarray(np.concatenate([zero, k_host], 1)),
            jnp.asarray(np.concatenate([zero, v_host], 1)), jnp.asarray(dense_table),
            jnp.asarray(lens), layer=1)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-4, atol=1e-4)
        del kp, vp, args


def test_alias_on_gpu_shares_physical_pages_through_the_ops():
    seed = 13
    print("seed", seed)
    rng = np.random.default_rng(seed)
    with make(max_sequences=3, max_pages=2 * PPC, budget_chunks=6) as a:
        owner = a.admit()
        assert a.ensure(owner, PPC)
        shape = (LAYOUT.num_layers, PPC, LAYOUT.tokens_per_page, LAYOUT.num_kv_heads,
                 LAYOUT.head_dim)
        k_host = rng.standard_normal(shape).astype(np.float32)
        v_host = rng.standard_normal(shape).astype(np.float32)
        a.write_pages(owner, 0, k_host, v_host)
        a.close(owner, ("prompt",))
        keep = a.admit(("prompt",))  # adopts the owner's range (its span in place)
        assert keep.base_slot == owner.base_slot
        alias = a.admit(("prompt",))  # a fresh range, the span mapped into it
        assert alias.num_aliased_pages == PPC and alias.base_slot != owner.base_slot
        used = a.stats().used_chunks
        # A donated step writes token 0 of the alias's page 0: the owner's registered physical
        # page changes too (it is the same memory), seen through the attention op.
        kp, vp = a.pool_arrays()
        step = _step_fn()
        kn = rng.standard_normal((LAYOUT.num_layers, 1, LAYOUT.num_kv_heads,
                                  LAYOUT.head_dim)).astype(np.float32)
        kp, vp, fence = step(kp, vp, jnp.asarray(kn), jnp.asarray(kn),
                             jnp.asarray([alias.base_slot * LAYOUT.tokens_per_page], jnp.int32))
        a.record_step([alias], fence)
        got_k, _ = a.read_pages(alias, 0, 1)
        np.testing.assert_array_equal(got_k[:, 0, 0], kn[:, 0])
        a.close(keep, ("prompt",))
        again = a.admit(("prompt",))  # adopts the owner's range, where the span is mapped
        assert again.base_slot == owner.base_slot
        k2, _ = a.read_pages(again, 0, 1)
        np.testing.assert_array_equal(k2[:, 0, 0], kn[:, 0])
        np.testing.assert_array_equal(k2[:, 0, 1:], k_host[:, 0, 1:])
        assert a.stats().used_chunks == used  # aliases cost no budget
        del kp, vp


def test_vmm_errors_name_the_field():
    require_gpu()
    gran = _ffi._kvcm_cuda.reservation_granularity()
    assert gran > 0 and SP % gran == 0
    if gran > 4096:
        with pytest.raises(ValueError, match="ArenaConfig.super_page_bytes"):
            Arena(ArenaConfig(max_sequences=1, max_pages_per_sequence=4, budget_bytes=1 << 30,
                              super_page_bytes=gran // 2), LAYOUT, backend="cuda")
    with pytest.raises(ValueError, match="ArenaConfig.max_sequences"):
        Arena(ArenaConfig(max_sequences=1 << 20, max_pages_per_sequence=1 << 20,
                          budget_bytes=1 << 30, super_page_bytes=SP), LAYOUT, backend="cuda")


def test_teardown_and_1000_cycles_on_vmm():
    with make(max_sequences=2, budget_chunks=3, adoption=False) as a:
        floor = a.stats().mapped_bytes
        for _ in range(1000):
            s = a.admit()
            assert a.ensure(s, PPC)
            a.close(s)
            assert a.stats().mapped_bytes == floor
        a.close(a.admit(), ())
    n = a.native_counters()
    assert n["num_map_calls"] == n["num_unmap_calls"]
    assert n["num_create_calls"] == n["num_release_calls"] and n["physical_bytes"] == 0


def test_runner_shaped_loop_on_the_arena_matches_the_reference():
    """Prefill then decode through Arena.prepare_step's StepBatch and a step written as for the
    manager (write_kv + ragged_paged_attention per layer, pools donated): every step's output
    equals the pure-JAX reference over a dense cache holding the same tokens."""
    seed = 14
    print("seed", seed)
    rng = np.random.default_rng(seed)
    L, H, Hkv, D, P = LAYOUT.num_layers, 4, LAYOUT.num_kv_heads, LAYOUT.head_dim, \
        LAYOUT.tokens_per_page

    def step(k, v, q, kn, vn, batch):
        outs = []
        for layer in range(L):
            k, v = jax_kvcm.write_kv(k, v, kn[layer], vn[layer], batch.slot_mapping, layer=layer)
            outs.append(jax_kvcm.ragged_paged_attention(
                q[layer], k, v, batch.page_table, batch.seq_lens, batch.query_start,
                layer=layer))
        return k, v, jnp.stack(outs)

    step = jax.jit(step, donate_argnums=(0, 1))
    with make(max_sequences=4, max_pages=64, budget_chunks=6) as a:
        seqs = [a.admit() for _ in range(3)]
        dense_k = np.zeros((len(seqs), L, 64 * P, Hkv, D), np.float32)
        dense_v = np.zeros_like(dense_k)
        k, v = a.pool_arrays()
        prompt = [37, 5, 100]
        for it in range(12):
            work = [(s, prompt[b] if it == 0 else 1) for b, s in enumerate(seqs)]
            starts = [s.num_tokens for s in seqs]
            batch = a.prepare_step(work, batch=4, tokens=256)
            assert batch is not None
            T = 256
            q = rng.standard_normal((L, T, H, D)).astype(np.float32)
            kn = rng.standard_normal((L, T, Hkv, D)).astype(np.float32)
            vn = rng.standard_normal((L, T, Hkv, D)).astype(np.float32)
            t = 0
            for b, (s, n) in enumerate(work):
                dense_k[b, :, starts[b]:starts[b] + n] = kn[:, t:t + n]
                dense_v[b, :, starts[b]:starts[b] + n] = vn[:, t:t + n]
                t += n
            k, v, out = step(k, v, jnp.asarray(q), jnp.asarray(kn), jnp.asarray(vn), batch)
            a.record_step(seqs, out)
            assert k.unsafe_buffer_pointer() == a.base_address
            # Oracle: dense per-sequence caches ([L, 1 + B * 64 pages]), same lengths.
            pool_k = np.zeros((L, 1 + 4 * 64, P, Hkv, D), np.float32)
            pool_v = np.zeros_like(pool_k)
            table = np.zeros((4, 64), np.int32)
            for b in range(len(seqs)):
                pool_k[:, 1 + b * 64:1 + (b + 1) * 64] = dense_k[b].reshape(L, 64, P, Hkv, D)
                pool_v[:, 1 + b * 64:1 + (b + 1) * 64] = dense_v[b].reshape(L, 64, P, Hkv, D)
                table[b] = np.arange(1 + b * 64, 1 + (b + 1) * 64)
            for layer in range(L):
                want = reference.ragged_paged_attention(
                    jnp.asarray(q[layer]), jnp.asarray(pool_k), jnp.asarray(pool_v),
                    jnp.asarray(table), jnp.asarray(batch.seq_lens),
                    jnp.asarray(batch.query_start), layer=layer)
                n = int(batch.query_start[-1])
                np.testing.assert_allclose(np.asarray(out[layer])[:n], np.asarray(want)[:n],
                                           rtol=1e-4, atol=1e-4, err_msg=f"step {it}")
        del k, v
