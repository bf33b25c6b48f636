"""Times the decode kernel's experimental variants (JAX_KVCM_DECODE_VARIANT) at the benchmark
decode shapes, in one process (the handler reads the variable on every call).

0 default (3-stage ring per warp), 1 two stages (3 CTAs/SM), 2 three stages + L2::256B hint,
3 four stages, 4 = 1 + wave-aware split count, 5 = 0 + wave-aware split count. Outputs of every
variant are compared with variant 0's (MISMATCH is printed otherwise)."""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_kvcm


def bench(fn, *args, iters=50):
    fn(*args).block_until_ready()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        out.block_until_ready()
        samples.append((time.perf_counter() - t0) / iters)
    return float(np.median(samples))


def main():
    rng = np.random.default_rng(0)
    h, hkv, d, page = 32, 8, 128, 16
    fn = jax.jit(jax_kvcm.paged_attention)
    print(f"{'shape':>14} {'variant':>8} {'ms':>8} {'TB/s':>6}")
    for b, s in ((64, 4096), (256, 1024), (8, 32768)):
        pages = b * s // page
        kc = jax.random.normal(jax.random.PRNGKey(0), (pages + 1, page, hkv, d), jnp.bfloat16)
        vc = jax.random.normal(jax.random.PRNGKey(1), (pages + 1, page, hkv, d), jnp.bfloat16)
        pt = jnp.asarray(rng.permutation(np.arange(1, pages + 1)).reshape(b, s // page), jnp.int32)
        sl = jnp.full((b,), s, jnp.int32)
        q = jax.random.normal(jax.random.PRNGKey(2), (b, h, d), jnp.bfloat16)
        kv_bytes = 2 * b * s * hkv * d * 2
        ref = None
        for variant in ("0", "1", "2", "3", "4", "5"):
            os.environ["JAX_KVCM_DECODE_VARIANT"] = variant
            out = np.asarray(fn(q, kc, vc, pt, sl), np.float32)
            if ref is None:
                ref = out
            same = np.allclose(out, ref, atol=1e-2)
            t = bench(fn, q, kc, vc, pt, sl)
            print(f"{b:>5}x{s:<8} {variant:>8} {t * 1e3:8.3f} {kv_bytes / t / 1e12:6.2f} {'' if same else 'MISMATCH'}")
        del kc, vc
    os.environ.pop("JAX_KVCM_DECODE_VARIANT")


if __name__ == "__main__":
    main()
