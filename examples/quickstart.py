"""A tiny paged decode loop with jax_kvcm's custom calls inside one jitted, donated step.

    python examples/quickstart.py

Runs on whatever JAX backend is present (CPU here, the CUDA kernels on a GPU). It prefills two
sequences of different lengths with ragged_paged_attention, decodes a few steps with
paged_attention, and checks every output against the pure-JAX reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jax_kvcm
from jax_kvcm.ops import reference

PAGE, PAGES, HKV, H, D, LAYERS = 16, 64, 2, 8, 64, 2


@functools.partial(jax.jit, donate_argnums=(0, 1))
def step(k_cache, v_cache, q, k, v, slot_mapping, page_table, seq_lens, query_start):
    """Writes the new tokens' K/V for every layer, then attends (ragged: prefill and decode)."""
    def layer_body(caches, layer):
        kc, vc = jax_kvcm.write_kv(*caches, k, v, slot_mapping, layer=layer)
        out = jax_kvcm.ragged_paged_attention(q, kc, vc, page_table, seq_lens, query_start,
                                              layer=layer)
        return (kc, vc), out
    (k_cache, v_cache), outs = jax.lax.scan(layer_body, (k_cache, v_cache), jnp.arange(LAYERS))
    return k_cache, v_cache, outs


def main() -> None:
    rng = np.random.default_rng(0)
    k_cache = jnp.zeros((LAYERS, PAGES, PAGE, HKV, D), jnp.float32)
    v_cache = jnp.zeros_like(k_cache)
    page_table = jnp.asarray([[1, 2, 3, 4], [5, 6, 7, 8]], jnp.int32)  # page 0 is the null page
    lens = [0, 0]
    for new_tokens in ([20, 7], [1, 1], [1, 1], [1, 1]):
        t = sum(new_tokens)
        q = jnp.asarray(rng.standard_normal((t, H, D)), jnp.float32)
        k = jnp.asarray(rng.standard_normal((t, HKV, D)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((t, HKV, D)), jnp.float32)
        slots, starts = [], [0]
        for b, n in enumerate(new_tokens):
            for pos in range(lens[b], lens[b] + n):
                slots.append(int(page_table[b, pos // PAGE]) * PAGE + pos % PAGE)
            lens[b] += n
            starts.append(starts[-1] + n)
        args = (q, k, v, jnp.asarray(slots, jnp.int32), page_table, jnp.asarray(lens, jnp.int32),
                jnp.asarray(starts, jnp.int32))
        k_cache, v_cache, outs = step(k_cache, v_cache, *args)
        want = reference.ragged_paged_attention(q, k_cache, v_cache, *args[4:], layer=LAYERS - 1)
        err = float(jnp.max(jnp.abs(outs[-1] - want)))
        print(f"step: new tokens {new_tokens}, lengths {lens}, max |out - reference| = {err:.2e}")
        assert err < 1e-4
    # Decode form: one query per sequence.
    q = jnp.asarray(rng.standard_normal((2, H, D)), jnp.float32)
    out = jax.jit(jax_kvcm.paged_attention)(q, k_cache[0], v_cache[0], page_table,
                                            jnp.asarray(lens, jnp.int32))
    want = reference.paged_attention(q, k_cache[0], v_cache[0], page_table,
                                     jnp.asarray(lens, jnp.int32))
    print(f"paged_attention: max |out - reference| = {float(jnp.max(jnp.abs(out - want))):.2e}")
    print(f"backend: {jax.default_backend()}, CUDA extension: {jax_kvcm.cuda_extension_available()}")


if __name__ == "__main__":
    main()
