"""Checks :mod:`jax_kvcm.sharded` on a mesh of several devices; run as a script by
``test_sharded.py`` in its own process, because the CPU device count
(``--xla_force_host_platform_device_count``) is fixed when jax starts.

Usage: ``python sharded_worker.py --devices N --tp T --seed S [--platform cpu|gpu]``. Exits 0 when
every check passes; prints each case with its seed.

Oracles: the pure-JAX reference (``jax_kvcm.ops.reference``, float32) for values, and the plain
unsharded custom call for bit equality (each KV head is computed independently, so splitting heads
over devices must not change a single bit).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

# NOTE: run as a script: the tests' folders on sys.path as under pytest (faults.py is in manager/)
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import group_paths  # noqa: E402

group_paths.add_to_sys_path()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, required=True)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--platform", default="cpu", choices=["cpu", "gpu"])
    ap.add_argument("--manager", action="store_true",
                    help="check a KVCacheManager on the mesh instead of the bare ops")
    ap.add_argument("--tiers", metavar="DISKDIR",
                    help="check the cold tiers per shard (storage round trips, rollback, and "
                         "the manager's suspend / resume / onboarding) with a disk tier there")
    args = ap.parse_args()
    if args.platform == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.devices}")
    import jax
    devices = jax.devices()
    assert len(devices) >= args.devices, (len(devices), args.devices)
    mesh = jax.make_mesh((args.tp,), ("tp",), devices=devices[:args.tp])
    if args.tiers:
        from sharded_manager_check import check_manager
        from sharded_tiers_check import check_tiers
        num_checks = check_tiers(mesh, args.seed, args.tiers)
        num_steps = check_manager(mesh, args.seed, diskdir=args.tiers)
        print(f"OK tiers devices={args.devices} tp={args.tp} seed={args.seed} "
              f"checks={num_checks} steps={num_steps}")
        return
    if args.manager:
        from sharded_manager_check import check_manager
        num_cases = check_manager(mesh, args.seed)
        print(f"OK manager devices={args.devices} tp={args.tp} seed={args.seed} steps={num_cases}")
        return
    checks = Checks(mesh, args.seed, exact=args.platform == "cpu")
    checks.all()
    print(f"OK devices={args.devices} tp={args.tp} seed={args.seed} cases={checks.num_cases}")


class Checks:
    def __init__(self, mesh, seed: int, exact: bool) -> None:
        import jax
        import jax.numpy as jnp
        import ml_dtypes
        import numpy as np

        from jax_kvcm import ops, sharded
        from jax_kvcm.ops import reference as ref
        self.jax, self.jnp, self.np = jax, jnp, np
        self.ops, self.sharded, self.ref = ops, sharded, ref
        self.fp8 = np.dtype(ml_dtypes.float8_e4m3fn)
        self.mesh, self.seed, self.num_cases = mesh, seed, 0
        self.tp = int(mesh.shape["tp"])
        # NOTE: on the CPU each head is computed alone, so splitting heads changes no bit; the
        # CUDA kernels may pick another work split for fewer heads (another summation order):
        # there the attention outputs are compared with a tolerance (writes stay bit-exact).
        self.exact = exact

    # -- helpers ----------------------------------------------------------------------------

    def put_heads(self, x, ndim_pool: int | None = None):
        sh = (self.sharded.cache_sharding(self.mesh, ndim=ndim_pool) if ndim_pool
              else self.sharded.head_sharding(self.mesh))
        return self.jax.device_put(x, sh)

    def put_scale(self, x):
        from jax.sharding import NamedSharding, PartitionSpec as P
        spec = P(*([None] * (x.ndim - 1)), "tp")
        return self.jax.device_put(x, NamedSharding(self.mesh, spec))

    def replicated(self, x):
        from jax.sharding import NamedSharding, PartitionSpec as P
        return self.jax.device_put(x, NamedSharding(self.mesh, P()))

    def case(self, what: str) -> str:
        self.num_cases += 1
        tag = f"{what} tp={self.tp} seed={self.seed}"
        print(tag, flush=True)
        return tag

    def assert_same(self, got, want, tag):
        np = self.np
        got, want = np.asarray(got), np.asarray(want)
        assert got.shape == want.shape, f"{tag}: shape {got.shape} != {want.shape}"
        g = got.view(np.uint8) if got.dtype == self.fp8 else got
        w = want.view(np.uint8) if want.dtype == self.fp8 else want
        assert np.array_equal(g, w), f"{tag}: {int((g != w).sum())} elements differ"

    def assert_close(self, got, want, tag):
        np = self.np
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.isfinite(got).all(), f"{tag}: non-finite output"
        err = float(np.max(np.abs(got - want)))
        limit = 2e-4 * max(1.0, float(np.abs(want).max()))
        assert err <= limit, f"{tag}: max abs error {err} > {limit}"

    def assert_head_sharded(self, x, tag):
        spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
        assert spec[x.ndim - 2] == "tp", f"{tag}: output sharding {x.sharding.spec}"

    def layout(self, rng, batch, page_size, max_pages, num_pages, ragged):
        """Random seq_lens, distinct pages per row (never the null page 0), query_start."""
        np = self.np
        seq_lens = rng.integers(1, page_size * max_pages + 1, size=batch).astype(np.int32)
        seq_lens[rng.integers(batch)] = 0  # a padded row
        perm = rng.permutation(np.arange(1, num_pages))[:batch * max_pages]
        table = perm.reshape(batch, max_pages).astype(np.int32)
        if ragged:
            num_new = np.minimum(seq_lens, rng.integers(1, 6, size=batch)).astype(np.int32)
            query_start = np.concatenate([[0], np.cumsum(num_new)]).astype(np.int32)
        else:
            query_start = None
        return table, seq_lens, query_start

    def caches(self, rng, shape, fp8):
        np, jnp = self.np, self.jnp
        k = rng.standard_normal(shape).astype(np.float32)
        v = rng.standard_normal(shape).astype(np.float32)
        if not fp8:
            return jnp.asarray(k), jnp.asarray(v), None, None
        ks = rng.uniform(0.004, 0.05, size=(shape[0], shape[-2])).astype(np.float32)
        vs = rng.uniform(0.004, 0.05, size=(shape[0], shape[-2])).astype(np.float32)
        kq = np.clip(k / ks[:, None, None, :, None] * 0.01, -448, 448).astype(self.fp8)
        vq = np.clip(v / vs[:, None, None, :, None] * 0.01, -448, 448).astype(self.fp8)
        return jnp.asarray(kq), jnp.asarray(vq), jnp.asarray(ks), jnp.asarray(vs)

    # -- cases ------------------------------------------------------------------------------

    def all(self) -> None:
        # (Hkv, H, fp8, [(window, ring), ...]): GQA groups of 1, 2 and 4 heads; the full window
        # variety once, fp8 once (each case compiles several programs, so few of them).
        plan = ((self.tp, 2 * self.tp, False, ((None, False), (6, False), (6, True))),
                (2 * self.tp, 2 * self.tp, False, ((6, True),)),
                (self.tp, 4 * self.tp, True, ((None, False), (6, True))))
        for num_kv_heads, num_heads, fp8, windows in plan:
            self.write(num_kv_heads, fp8)
            for ragged in (False, True):
                for window, ring in windows:
                    self.attention(num_kv_heads, num_heads, ragged, fp8, window, ring)
        self.refusals()
        self.in_place()

    def write(self, num_kv_heads, fp8):
        jax, jnp, np, ops, sharded = self.jax, self.jnp, self.np, self.ops, self.sharded
        tag = self.case(f"write_kv Hkv={num_kv_heads} fp8={fp8}")
        rng = np.random.default_rng([self.seed, num_kv_heads, fp8])
        num_layers, num_pages, page_size, head_dim, num_tokens = 3, 9, 4, 8, 7
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        kc, vc, ks, vs = self.caches(rng, shape, fp8)
        k = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads, head_dim)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads, head_dim)), jnp.float32)
        if not fp8:
            k, v = k.astype(kc.dtype), v.astype(vc.dtype)
        slots = rng.permutation(num_pages * page_size)[:num_tokens].astype(np.int32)
        slots[rng.integers(num_tokens)] = -1  # padding
        layer = int(rng.integers(num_layers))
        want_k, want_v = ops.write_kv(kc, vc, k, v, jnp.asarray(slots), layer=layer,
                                      k_scale=ks, v_scale=vs)
        ref_k, ref_v = self.ref.write_kv(kc, vc, k, v, jnp.asarray(slots), layer=layer,
                                         k_scale=ks, v_scale=vs)
        fn = jax.jit(lambda kc_, vc_, k_, v_, sm, lay, ks_, vs_: sharded.write_kv(
            kc_, vc_, k_, v_, sm, mesh=self.mesh, layer=lay, k_scale=ks_, v_scale=vs_),
            donate_argnums=(0, 1))
        got_k, got_v = fn(self.put_heads(kc, 5), self.put_heads(vc, 5), self.put_heads(k),
                          self.put_heads(v), self.replicated(jnp.asarray(slots)),
                          self.replicated(np.int32(layer)),
                          None if ks is None else self.put_scale(ks),
                          None if vs is None else self.put_scale(vs))
        self.assert_head_sharded(got_k, tag)
        self.assert_same(got_k, want_k, tag + " k vs unsharded")
        self.assert_same(got_v, want_v, tag + " v vs unsharded")
        self.assert_same(got_k, ref_k, tag + " k vs reference")
        self.assert_same(got_v, ref_v, tag + " v vs reference")

    def attention(self, num_kv_heads, num_heads, ragged, fp8, window, ring):
        jax, jnp, np, ops, sharded = self.jax, self.jnp, self.np, self.ops, self.sharded
        tag = self.case(f"{'ragged' if ragged else 'decode'} Hkv={num_kv_heads} H={num_heads} "
                        f"fp8={fp8} window={window} ring={ring}")
        rng = np.random.default_rng([self.seed, num_kv_heads, num_heads, ragged, fp8,
                                     window or 0, ring])
        num_layers, page_size, head_dim, batch = 2, 4, 8, 4
        max_pages = 4 if ring else 5
        num_pages = batch * max_pages + 2
        kc, vc, ks, vs = self.caches(rng, (num_layers, num_pages, page_size, num_kv_heads,
                                           head_dim), fp8)
        table, seq_lens, query_start = self.layout(rng, batch, page_size, max_pages, num_pages,
                                                   ragged)
        if ring:  # a ring of 4 entries holds any window read here: seq_lens outgrow it
            seq_lens = np.where(seq_lens > 0, seq_lens + page_size * max_pages, 0).astype(np.int32)
        rows = int(query_start[-1]) + 2 if ragged else batch
        q = jnp.asarray(rng.standard_normal((rows, num_heads, head_dim)), jnp.float32)
        layer = int(rng.integers(num_layers))
        static = dict(sliding_window=window, ring_table=ring, soft_cap=30.0 if window else None)
        idx = (jnp.asarray(table), jnp.asarray(seq_lens))
        if ragged:
            idx += (jnp.asarray(query_start),)
        plain = ops.ragged_paged_attention if ragged else ops.paged_attention
        refop = self.ref.ragged_paged_attention if ragged else self.ref.paged_attention
        op = sharded.ragged_paged_attention if ragged else sharded.paged_attention
        want = plain(q, kc, vc, *idx, layer=layer, k_scale=ks, v_scale=vs, **static)
        # The oracle jitted: op by op, the reference spends seconds dispatching small ops.
        oracle = jax.jit(functools.partial(refop, layer=layer, **static))(
            q, kc, vc, *idx, k_scale=ks, v_scale=vs)
        fn = jax.jit(lambda q_, kc_, vc_, idx_, lay, ks_, vs_: op(
            q_, kc_, vc_, *idx_, mesh=self.mesh, layer=lay, k_scale=ks_, v_scale=vs_, **static))
        got = fn(self.put_heads(q), self.put_heads(kc, 5), self.put_heads(vc, 5),
                 tuple(self.replicated(x) for x in idx), self.replicated(np.int32(layer)),
                 None if ks is None else self.put_scale(ks),
                 None if vs is None else self.put_scale(vs))
        self.assert_head_sharded(got, tag)
        (self.assert_same if self.exact else self.assert_close)(got, want, tag + " vs unsharded")
        self.assert_close(got, oracle, tag + " vs reference")
        # A Python-int layer and no jit: the same bits.
        if not fp8:
            eager = op(self.put_heads(q), self.put_heads(kc, 5), self.put_heads(vc, 5), *idx,
                       mesh=self.mesh, layer=layer, **static)
            (self.assert_same if self.exact else self.assert_close)(eager, want,
                                                                    tag + " eager int layer")

    def in_place(self):
        """A donated write_kv per shard writes each shard's buffer in place: no pool copy in
        the compiled program, the same buffers before and after."""
        jax, jnp, sharded = self.jax, self.jnp, self.sharded
        tag = self.case("in place")
        shape = (2, 16, 4, 2 * self.tp, 8)
        kc, vc = (self.put_heads(jnp.zeros(shape, jnp.float32), 5) for _ in range(2))
        rows = jnp.ones((8, 2 * self.tp, 8), jnp.float32)
        slots = jnp.arange(8, dtype=jnp.int32)

        def two_layers(kc_, vc_, r, sm):
            for layer in range(2):
                kc_, vc_ = sharded.write_kv(kc_, vc_, r, r, sm, mesh=self.mesh, layer=layer)
            return kc_, vc_

        fn = jax.jit(two_layers, donate_argnums=(0, 1))
        hlo = fn.lower(kc, vc, rows, slots).compile().as_text()
        pool = "f32[2,16,4,2,8]"   # one shard of a pool
        copies = [line for line in hlo.splitlines()
                  if pool in line and (" copy(" in line or "copy-start" in line)]
        assert pool in hlo, f"{tag}: no {pool} in the compiled step (shard shape changed?)"
        assert not copies, f"{tag}: the compiled step copies a pool: {copies[:3]}"
        before = [x.data.unsafe_buffer_pointer() for x in kc.addressable_shards]
        kc, vc = fn(kc, vc, rows, slots)
        after = [x.data.unsafe_buffer_pointer() for x in kc.addressable_shards]
        assert before == after, f"{tag}: shard buffers moved {before} -> {after}"

    def refusals(self):
        jnp, sharded = self.jnp, self.sharded
        tag = self.case("refusals")
        q = jnp.zeros((2, 4 * self.tp, 8), jnp.float32)
        table, lens = jnp.ones((2, 2), jnp.int32), jnp.ones((2,), jnp.int32)
        few = jnp.zeros((4, 4, self.tp // 2, 8), jnp.float32)
        try:
            sharded.paged_attention(q, few, few, table, lens, mesh=self.mesh)
        except ValueError as e:
            assert "num_kv_heads" in str(e) and "replicate" in str(e), f"{tag}: {e}"
        else:
            raise AssertionError(f"{tag}: Hkv < tp accepted")
        odd = jnp.zeros((4, 4, self.tp + 1, 8), jnp.float32)
        q_odd = jnp.zeros((2, self.tp + 1, 8), jnp.float32)
        try:
            sharded.paged_attention(q_odd, odd, odd, table, lens, mesh=self.mesh)
        except ValueError as e:
            assert "divisible" in str(e), f"{tag}: {e}"
        else:
            raise AssertionError(f"{tag}: Hkv % tp != 0 accepted")
        try:
            sharded.write_kv(few, few, few[0], few[0], jnp.zeros((4,), jnp.int32),
                             mesh=self.mesh, axis="dp")
        except ValueError as e:
            assert "axis 'dp'" in str(e), f"{tag}: {e}"
        else:
            raise AssertionError(f"{tag}: unknown axis accepted")


if __name__ == "__main__":
    sys.exit(main())
