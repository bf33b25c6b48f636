"""FP8 K/V scale values: zero, negative (-0.0 too), NaN and inf scales are refused, never used.

What is pinned (docs/fp8.md, "Scale values"):

- concrete scales (numpy, an eager ``jax.Array``, a constant closed over by a jitted function)
  given to ``write_kv`` / ``paged_attention`` / ``ragged_paged_attention`` and to the
  ``jax_kvcm.sharded`` wrappers raise ValueError naming the argument and the bad entry, before
  anything runs (a ``write_kv`` leaves the cache's bytes as they were);
- traced scales (arguments of a jitted step) traced within ``ops.check_traced_scales()`` are
  checked under ``checkify.checkify``: the error names the argument; good scales give no error
  and the same output as the plain ``jax.jit``; traced outside it, the step has no effect (the
  effect would send every ``jax.jit`` dispatch through its slow Python path);
- the loader (examples/llama/loader.py) refuses checkpoint scales that are not finite and > 0 in
  float32 (values that under- or overflow float32 included), naming the tensor.

Oracle: the bad entries are placed by the test (random position and value, seed printed), and
the expected message is built from that position, not from the code under test.
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from jax_kvcm import ops, sharded

L, HKV, D, PAGE, PAGES = 2, 2, 16, 4, 6
MAX = 2.0 ** 119   # the largest scale: 448 * MAX is a finite float32
BAD = [0.0, -0.0, -1.0, -1e-30, float("nan"), float("inf"), float("-inf"),
       float(np.nextafter(np.float32(MAX), np.float32(np.inf)))]
OPS = ["write_kv", "paged", "ragged"]


def _seed() -> int:
    seed = int.from_bytes(os.urandom(2), "little")
    print(f"seed={seed}")
    return seed


def _args(rng):
    kc = jnp.asarray(rng.uniform(-8, 8, (L, PAGES, PAGE, HKV, D)).astype(np.float32)
                     ).astype(jnp.float8_e4m3fn)
    vc = jnp.asarray(rng.uniform(-8, 8, (L, PAGES, PAGE, HKV, D)).astype(np.float32)
                     ).astype(jnp.float8_e4m3fn)
    k = jnp.asarray(rng.standard_normal((3, HKV, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((3, HKV, D)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((2, 2 * HKV, D)), jnp.float32)
    idx = dict(slots=jnp.array([4, 5, 9], jnp.int32), pt=jnp.array([[1, 2], [2, 0]], jnp.int32),
               sl=jnp.array([6, 3], jnp.int32), qs=jnp.array([0, 1, 2], jnp.int32))
    return kc, vc, k, v, q, idx


def _call(op, kc, vc, k, v, q, idx, ks, vs, layer=1):
    if op == "write_kv":
        return ops.write_kv(kc, vc, k, v, idx["slots"], layer=layer, k_scale=ks, v_scale=vs)
    if op == "paged":
        return ops.paged_attention(q, kc, vc, idx["pt"], idx["sl"], layer=layer, k_scale=ks,
                                   v_scale=vs)
    return ops.ragged_paged_attention(q, kc, vc, idx["pt"], idx["sl"], idx["qs"], layer=layer,
                                      k_scale=ks, v_scale=vs)


def _good(rng, shape=(L, HKV)):
    return rng.uniform(0.01, 2.0, shape).astype(np.float32)


def _with_bad(rng, value):
    s = _good(rng)
    pos = (int(rng.integers(L)), int(rng.integers(HKV)))
    s[pos] = value
    return s, pos


def _expected(name, value, pos):
    return (f"{name} must be finite and > 0.*got "
            + re.escape(f"{float(np.float32(value))} at [{pos[0]}, {pos[1]}]"))


@pytest.mark.parametrize("form", ["numpy", "jax", "closed_over"])
@pytest.mark.parametrize("op", OPS)
def test_bad_concrete_scales_refused_naming_the_argument(op, form):
    rng = np.random.default_rng(_seed())
    kc, vc, k, v, q, idx = _args(rng)
    before = (np.asarray(kc).tobytes(), np.asarray(vc).tobytes())
    for i, value in enumerate(BAD):
        name = ("k_scale", "v_scale")[i % 2]
        bad, pos = _with_bad(rng, value)
        good = _good(rng)
        ks, vs = (bad, good) if name == "k_scale" else (good, bad)
        if form == "jax":
            ks, vs = jnp.asarray(ks), jnp.asarray(vs)
        with pytest.raises(ValueError, match=_expected(name, value, pos)):
            if form == "closed_over":   # concrete while the jitted function is traced
                jax.jit(lambda kc, vc, ks=ks, vs=vs: _call(op, kc, vc, k, v, q, idx, ks,
                                                               vs))(kc, vc)
            else:
                _call(op, kc, vc, k, v, q, idx, ks, vs)
        assert (np.asarray(kc).tobytes(), np.asarray(vc).tobytes()) == before
    # Rank-4 caches take [Hkv] scales: the position has one index there.
    s = _good(rng, (HKV,))
    s[1] = np.nan
    with pytest.raises(ValueError, match=r"k_scale must be finite and > 0.*got nan at \[1\]"):
        _call(op, kc[0], vc[0], k, v, q, idx, s, _good(rng, (HKV,)), layer=None)


@pytest.mark.parametrize("op", OPS)
def test_good_scales_accepted(op):
    """Positive finite scales pass, tiny ones and the largest too (they saturate on write; they
    read back finite)."""
    rng = np.random.default_rng(_seed())
    kc, vc, k, v, q, idx = _args(rng)
    for s in (_good(rng), np.full((L, HKV), 1e-30, np.float32),
              np.full((L, HKV), MAX, np.float32)):
        out = _call(op, kc, vc, k, v, q, idx, s, jnp.asarray(s))
        leaves = [np.asarray(x, np.float32) for x in jax.tree.leaves(out)]
        if op != "write_kv":
            assert all(np.isfinite(x).all() for x in leaves), s.flat[0]


@pytest.mark.parametrize("op", OPS)
def test_traced_scales_checked_under_checkify(op):
    rng = np.random.default_rng(_seed())
    kc, vc, k, v, q, idx = _args(rng)
    step = jax.jit(lambda ks, vs: _call(op, kc, vc, k, v, q, idx, ks, vs))
    good = jnp.asarray(_good(rng))
    with ops.check_traced_scales():
        err, out = checkify.checkify(step)(good, good)
    assert err.get() is None
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(step(good, good))):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    for i, value in enumerate(BAD):
        bad, _ = _with_bad(rng, value)
        name = ("k_scale", "v_scale")[i % 2]
        args = (bad, good) if name == "k_scale" else (good, bad)
        with ops.check_traced_scales():
            err, _ = checkify.checkify(step)(*map(jnp.asarray, args))
        msg = err.get()
        assert msg is not None and f"{name} must be finite and > 0" in msg, (value, msg)
        with pytest.raises(checkify.JaxRuntimeError, match=name):
            err.throw()


@pytest.mark.parametrize("op", OPS)
def test_traced_scales_add_no_effect_by_default(op):
    """Outside ``check_traced_scales`` a jitted step with traced fp8 scales has no effect, so
    ``jax.jit`` keeps its C++ dispatch path; inside, the check's effect is there (what the
    default avoids)."""
    rng = np.random.default_rng(_seed())
    kc, vc, k, v, q, idx = _args(rng)
    s = jnp.asarray(_good(rng))

    def step():   # a new function each time: jax caches a function's trace
        return lambda ks, vs: _call(op, kc, vc, k, v, q, idx, ks, vs)
    assert jax.make_jaxpr(step())(s, s).effects == set()
    with ops.check_traced_scales():
        assert jax.make_jaxpr(step())(s, s).effects != set()


def test_traced_check_compiles_to_nothing():
    """Outside checkify the traced check costs nothing: the compiled step has no isfinite."""
    rng = np.random.default_rng(_seed())
    kc, vc, k, v, q, idx = _args(rng)
    s = jnp.asarray(_good(rng))
    step = jax.jit(lambda ks, vs: _call("paged", kc, vc, k, v, q, idx, ks, vs))
    text = step.lower(s, s).compile().as_text()
    assert "is-finite" not in text and "kvcm_paged_attention" in text


@pytest.mark.parametrize("op", OPS)
def test_sharded_wrappers_refuse_bad_scales(op):
    """The sharded wrappers check the global scales: eagerly (concrete, split over heads), and
    under checkify on a mesh with Auto axes (traced)."""
    rng = np.random.default_rng(_seed())
    kc, vc, k, v, q, idx = _args(rng)
    mesh = jax.make_mesh((1,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "tp"))

    def call(ks, vs):
        if op == "write_kv":
            return sharded.write_kv(kc, vc, k, v, idx["slots"], mesh=mesh, layer=1, k_scale=ks,
                                    v_scale=vs)
        if op == "paged":
            return sharded.paged_attention(q, kc, vc, idx["pt"], idx["sl"], mesh=mesh, layer=1,
                                           k_scale=ks, v_scale=vs)
        return sharded.ragged_paged_attention(q, kc, vc, idx["pt"], idx["sl"], idx["qs"],
                                              mesh=mesh, layer=1, k_scale=ks, v_scale=vs)

    good = jax.device_put(_good(rng), split)
    for i, value in enumerate(BAD):
        bad, pos = _with_bad(rng, value)
        name = ("k_scale", "v_scale")[i % 2]
        args = (jax.device_put(bad, split), good)
        if name == "v_scale":
            args = args[::-1]
        with pytest.raises(ValueError, match=_expected(name, value, pos)):
            call(*args)
        with ops.check_traced_scales():
            err, _ = checkify.checkify(jax.jit(call))(*args)
        assert f"{name} must be finite and > 0" in (err.get() or ""), (value, err.get())
    with ops.check_traced_scales():
        err, _ = checkify.checkify(jax.jit(call))(good, good)
    assert err.get() is None


def test_loader_refuses_bad_checkpoint_scales():
    """kv_scales_from_tensors: every name scheme; per-tensor and per-head; values that are bad
    only once cast to float32 (1e-50 -> 0, 1e40 -> inf) too."""
    from examples.llama import loader as llama_loader
    from examples.llama.model import LlamaConfig
    rng = np.random.default_rng(_seed())
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      dtype="float32")
    schemes = [("self_attn.k_scale", "self_attn.v_scale"),
               ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
               ("self_attn.kv_scale", "self_attn.kv_scale")]
    for k_name, v_name in schemes:
        good = {}
        for i in range(2):
            good[f"model.layers.{i}.{k_name}"] = np.float32(0.5 + i)
            good[f"model.layers.{i}.{v_name}"] = np.float32(0.5 + i)
        got = llama_loader.kv_scales_from_tensors(good, cfg)
        np.testing.assert_array_equal(np.asarray(got["k"]), [[0.5, 0.5], [1.5, 1.5]])
        for value in BAD + [1e-50, 1e40, 1e36]:
            layer, per_head = int(rng.integers(2)), bool(rng.integers(2))
            target = f"model.layers.{layer}.{(k_name, v_name)[int(rng.integers(2))]}"
            arr = np.array(value, np.float64)
            if per_head:
                arr = np.array([0.25, value], np.float64)[::1 - 2 * int(rng.integers(2))].copy()
            with pytest.raises(llama_loader.CheckpointError,
                               match=f"tensor '{target}': FP8 K/V scales must be finite and > 0"):
                llama_loader.kv_scales_from_tensors({**good, target: arr}, cfg)
