"""Checks every CUDA kernel path against the pure-JAX reference on fresh random inputs.

Cache slots that no valid token occupies are poisoned with NaN, so a kernel that reads past
seq_lens, outside the window or into a wrong page produces NaN and fails. Run on the GPU machine:
    python3 scripts/gpu_verify.py
"""

from __future__ import annotations

import itertools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_kvcm
from jax_kvcm.ops import reference as ref


def rel_l2(x, y):
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


def make_case(rng, *, batch, max_pages, page, hkv, d, dtype, lens, layers=None):
    num_pages = batch * max_pages + 1
    shape = (num_pages, page, hkv, d) if layers is None else (layers, num_pages, page, hkv, d)
    k = np.full(shape, np.nan, np.float32)
    v = np.full(shape, np.nan, np.float32)
    perm = rng.permutation(np.arange(1, num_pages))[: batch * max_pages].reshape(batch, max_pages)
    for b, n in enumerate(lens):
        for i in range(n):
            p, o = perm[b, i // page], i % page
            k[..., p, o, :, :] = rng.standard_normal(k.shape[:-4] + (hkv, d)) if layers else rng.standard_normal((hkv, d))
            v[..., p, o, :, :] = rng.standard_normal(v.shape[:-4] + (hkv, d)) if layers else rng.standard_normal((hkv, d))
        used = (n + page - 1) // page
        perm[b, used:] = 0  # padding points at the null page
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(perm, jnp.int32)


def main() -> int:
    platform = sys.argv[1] if len(sys.argv) > 1 else "gpu"  # "cpu" checks the harness itself
    if platform == "gpu":
        assert jax_kvcm.cuda_extension_available(), "CUDA extension not available"
    gpu = jax.devices(platform)[0]
    cpu = jax.devices("cpu")[0]
    failures = 0
    rows = []
    seed = int(time.time()) % 100000
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    configs = list(itertools.product(
        [jnp.bfloat16, jnp.float16, jnp.float32], [64, 128, 256], [(8, 8), (32, 8), (8, 1)],
        [8, 16, 64]))
    if platform == "cpu":
        configs = configs[::9]
    for dtype, d, (h, hkv), page in configs:
        tol = 1e-4 if dtype == jnp.float32 else 2e-2
        window = int(rng.choice([0, 0, 37]))
        cap = float(rng.choice([0.0, 30.0]))
        kw = dict(sliding_window=window or None, soft_cap=cap or None)
        # decode
        batch, max_pages = 5, 40 // page + 3
        lens = [0, 1, page, int(rng.integers(2, max_pages * page)), max_pages * page]
        kc, vc, pt = make_case(rng, batch=batch, max_pages=max_pages, page=page, hkv=hkv, d=d,
                               dtype=dtype, lens=lens)
        sl = jnp.asarray(lens, jnp.int32)
        q = jnp.asarray(rng.standard_normal((batch, h, d)), dtype)
        want = ref.paged_attention(*jax.device_put((q, kc, vc, pt, sl), cpu), **kw)
        got = jax.jit(lambda *a: jax_kvcm.paged_attention(*a, **kw))(*jax.device_put((q, kc, vc, pt, sl), gpu))
        err = rel_l2(got.astype(jnp.float32), want.astype(jnp.float32))
        ok = err < tol and not np.isnan(np.asarray(got, np.float32)).any()
        failures += not ok
        rows.append(("decode", jnp.dtype(dtype).name, d, f"{h}/{hkv}", page, window, cap, err, ok))
        # decode over an fp8 cache (per-kv-head scales), against the reference on the
        # dequantized cache; NaN poison stays NaN through the quantization
        ks = jnp.asarray(rng.uniform(0.005, 0.05, hkv), jnp.float32)
        vs = jnp.asarray(rng.uniform(0.005, 0.05, hkv), jnp.float32)
        k8, v8 = ref.quantize(kc, ks), ref.quantize(vc, vs)
        kdq, vdq = ref.dequantize(k8, ks), ref.dequantize(v8, vs)
        want = ref.paged_attention(*jax.device_put((q, kdq, vdq, pt, sl), cpu), **kw)
        got = jax.jit(lambda *a: jax_kvcm.paged_attention(*a[:5], k_scale=a[5], v_scale=a[6], **kw))(
            *jax.device_put((q, k8, v8, pt, sl, ks, vs), gpu))
        err = rel_l2(got.astype(jnp.float32), want.astype(jnp.float32))
        ok = err < tol and not np.isnan(np.asarray(got, np.float32)).any()
        failures += not ok
        rows.append(("dec-fp8", jnp.dtype(dtype).name, d, f"{h}/{hkv}", page, window, cap, err, ok))
        # ragged: mixed prefill chunks, a decode row, an empty sequence, trailing padding rows
        lens = [int(rng.integers(1, max_pages * page)), 1, 0, max_pages * page, int(rng.integers(1, 30))]
        nq = [min(l, int(rng.integers(1, 70))) for l in lens]
        nq[1], nq[2] = 1, 0
        kc, vc, pt = make_case(rng, batch=batch, max_pages=max_pages, page=page, hkv=hkv, d=d,
                               dtype=dtype, lens=lens)
        qs = jnp.asarray(np.concatenate([[0], np.cumsum(nq)]), jnp.int32)
        t = int(sum(nq)) + 3
        q = jnp.asarray(rng.standard_normal((t, h, d)), dtype)
        sl = jnp.asarray(lens, jnp.int32)
        want = ref.ragged_paged_attention(*jax.device_put((q, kc, vc, pt, sl, qs), cpu), **kw)
        got = jax.jit(lambda *a: jax_kvcm.ragged_paged_attention(*a, **kw))(
            *jax.device_put((q, kc, vc, pt, sl, qs), gpu))
        err = rel_l2(got.astype(jnp.float32), want.astype(jnp.float32))
        ok = err < tol and not np.isnan(np.asarray(got, np.float32)).any()
        failures += not ok
        rows.append(("ragged", jnp.dtype(dtype).name, d, f"{h}/{hkv}", page, window, cap, err, ok))
    # write_kv with a layer axis, traced layer
    for dtype in (jnp.bfloat16, jnp.float32):
        kc = jnp.asarray(rng.standard_normal((3, 9, 16, 4, 128)), dtype)
        vc = jnp.asarray(rng.standard_normal((3, 9, 16, 4, 128)), dtype)
        k = jnp.asarray(rng.standard_normal((20, 4, 128)), dtype)
        v = jnp.asarray(rng.standard_normal((20, 4, 128)), dtype)
        sm = jnp.asarray(np.where(rng.random(20) < 0.2, -1, rng.permutation(9 * 16)[:20]), jnp.int32)
        layer = jnp.int32(2)
        want = ref.write_kv(*jax.device_put((kc, vc, k, v, sm), cpu), layer=jax.device_put(layer, cpu))
        got = jax.jit(lambda *a: jax_kvcm.write_kv(*a[:5], layer=a[5]), donate_argnums=(0, 1))(
            *jax.device_put((kc, vc, k, v, sm, layer), gpu))
        ok = all(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32)) for a, b in zip(got, want))
        failures += not ok
        rows.append(("write_kv", jnp.dtype(dtype).name, 128, "4", 16, 0, 0.0, 0.0 if ok else 1.0, ok))
    print(f"{'op':9} {'dtype':9} {'D':>4} {'H/Hkv':>6} {'page':>4} {'win':>4} {'cap':>5} {'relL2':>9}  ok")
    for r in rows:
        print(f"{r[0]:9} {r[1]:9} {r[2]:4d} {r[3]:>6} {r[4]:4d} {r[5]:4d} {r[6]:5.1f} {r[7]:9.2e}  {'ok' if r[8] else 'FAIL'}")
    print(f"gpu_verify: {len(rows) - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
