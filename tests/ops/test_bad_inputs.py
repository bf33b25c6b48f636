"""Bad inputs: Python errors naming the argument (before tracing), and handler errors at run time.

Shape/dtype/rank/attribute errors are TypeError/ValueError raised by the op in Python: they are
raised under ``jax.eval_shape`` (abstract tracing only, no handler runs), eagerly, and under jit.
Bad indices that only the data shows (page table entries, slots, lengths, query_start, a traced
layer) are refused by the handler when the jitted call runs, with the argument named in the message;
a refused write_kv changes nothing. The CUDA handlers check indices only under
JAX_KVCM_CHECK_INDICES=1, which the ``index_checks`` fixture sets before the first call.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import (assert_bits_equal, assert_close, make_caches, random_page_table, reference,
                      runtime_error_types)
from jax_kvcm import ops

NUM_PAGES, PAGE, HKV, D, H = 6, 8, 2, 64, 4
B, P, T, L = 3, 4, 10, 3  # batch, max_pages, ragged tokens / new tokens, layers


def _f32(*shape):
    return np.ones(shape, np.float32)


def _base(op: str, layers: bool = False) -> dict:
    """Valid arguments of an op (numpy; put on the backend in the test)."""
    cache = _f32(*(((L,) if layers else ()) + (NUM_PAGES, PAGE, HKV, D)))
    args = dict(k_cache=cache, v_cache=cache.copy())
    if op == "write_kv":
        args.update(k=_f32(T, HKV, D), v=_f32(T, HKV, D),
                    slot_mapping=np.arange(T, dtype=np.int32))
    else:
        args["q"] = _f32(T if op == "ragged" else B, H, D)
        args["page_table"] = np.zeros((B, P), np.int32)
        args["seq_lens"] = np.zeros((B,), np.int32)
        if op == "ragged":
            args["query_start"] = np.zeros((B + 1,), np.int32)
    if layers:
        args["layer"] = 1
    return args


def _call(op: str, args: dict):
    fn = {"write_kv": ops.write_kv, "paged": ops.paged_attention,
          "ragged": ops.ragged_paged_attention}[op]
    order = {"write_kv": ["k_cache", "v_cache", "k", "v", "slot_mapping"],
             "paged": ["q", "k_cache", "v_cache", "page_table", "seq_lens"],
             "ragged": ["q", "k_cache", "v_cache", "page_table", "seq_lens", "query_start"]}[op]
    positional = [args[name] for name in order]
    static = {name: value for name, value in args.items() if name not in order}
    return functools.partial(fn, **static), positional


def _set(**changes):
    return lambda args: args.update(changes)


def _edit(name, f):
    return lambda args: args.update({name: f(args[name])})


# (op, layers?, mutation id, argument the message must name, exception type, mutation)
_CACHE_MUTATIONS = [
    ("k_cache-rank3", "k_cache", ValueError, _edit("k_cache", lambda x: x[0])),
    ("k_cache-rank6", "k_cache", ValueError, _edit("k_cache", lambda x: x[None, None])),
    ("k_cache-int32", "k_cache", TypeError, _edit("k_cache", lambda x: x.astype(np.int32))),
    ("k_cache-int8", "k_cache", TypeError, _edit("k_cache", lambda x: x.astype(np.int8))),
    ("k_cache-not-array", "k_cache", TypeError, _set(k_cache=None)),
    ("k_cache-empty", "k_cache", ValueError,
     lambda a: a.update(k_cache=a["k_cache"][:0], v_cache=a["v_cache"][:0])),
    ("v_cache-pages", "v_cache", ValueError, _edit("v_cache", lambda x: x[:-1])),
    ("v_cache-heads", "v_cache", ValueError, _edit("v_cache", lambda x: x[..., :1, :])),
    ("v_cache-rank5", "v_cache", ValueError, _edit("v_cache", lambda x: x[None])),
    ("v_cache-f16", "v_cache", TypeError, _edit("v_cache", lambda x: x.astype(np.float16))),
]

WRITE_MUTATIONS = _CACHE_MUTATIONS + [
    ("k-rank2", "k", ValueError, _edit("k", lambda x: x[:, 0])),
    ("k-rank4", "k", ValueError, _edit("k", lambda x: x[None])),
    ("k-heads", "k", ValueError, _edit("k", lambda x: np.concatenate([x, x], 1))),
    ("k-head_dim", "k", ValueError, _edit("k", lambda x: x[..., :32])),
    ("k-f16", "k", TypeError, _edit("k", lambda x: x.astype(np.float16))),
    ("k-not-array", "k", TypeError, _set(k=None)),
    ("v-tokens", "v", ValueError, _edit("v", lambda x: x[:-1])),
    ("v-rank2", "v", ValueError, _edit("v", lambda x: x[:, 0])),
    ("v-head_dim", "v", ValueError, _edit("v", lambda x: x[..., :32])),
    ("v-bf16", "v", TypeError, _edit("v", lambda x: x.astype(jnp.bfloat16))),
    ("slot_mapping-float32", "slot_mapping", TypeError,
     _edit("slot_mapping", lambda x: x.astype(np.float32))),
    ("slot_mapping-uint32", "slot_mapping", TypeError,
     _edit("slot_mapping", lambda x: x.astype(np.uint32))),
    ("slot_mapping-int16", "slot_mapping", TypeError,
     _edit("slot_mapping", lambda x: x.astype(np.int16))),
    ("slot_mapping-rank2", "slot_mapping", ValueError, _edit("slot_mapping", lambda x: x[:, None])),
    ("slot_mapping-rank0", "slot_mapping", ValueError, _edit("slot_mapping", lambda x: x[0])),
    ("slot_mapping-length", "slot_mapping", ValueError,
     _edit("slot_mapping", lambda x: np.arange(T + 1, dtype=np.int32))),
    ("layer-given-for-4d", "layer", ValueError, _set(layer=0)),
    ("check_indices-str", "check_indices", TypeError, _set(check_indices="1")),
]

_ATTENTION_MUTATIONS = _CACHE_MUTATIONS + [
    ("q-rank2", "q", ValueError, _edit("q", lambda x: x[:, 0])),
    ("q-rank4", "q", ValueError, _edit("q", lambda x: x[None])),
    ("q-f16", "q", TypeError, _edit("q", lambda x: x.astype(np.float16))),
    ("q-head_dim", "q", ValueError, _edit("q", lambda x: x[..., :32])),
    ("q-heads-not-multiple", "q", ValueError, _edit("q", lambda x: x[:, :3])),
    ("q-not-array", "q", TypeError, _set(q=None)),
    ("page_table-float32", "page_table", TypeError,
     _edit("page_table", lambda x: x.astype(np.float32))),
    ("page_table-uint32", "page_table", TypeError,
     _edit("page_table", lambda x: x.astype(np.uint32))),
    ("page_table-rank1", "page_table", ValueError, _edit("page_table", lambda x: x[0])),
    ("page_table-rank3", "page_table", ValueError, _edit("page_table", lambda x: x[None])),
    ("seq_lens-float32", "seq_lens", TypeError, _edit("seq_lens", lambda x: x.astype(np.float32))),
    ("seq_lens-rank2", "seq_lens", ValueError, _edit("seq_lens", lambda x: x[:, None])),
    ("seq_lens-length", "seq_lens", ValueError, _edit("seq_lens", lambda x: x[:-1])),
    ("layer-given-for-4d", "layer", ValueError, _set(layer=0)),
    ("scale-nan", "scale", ValueError, _set(scale=float("nan"))),
    ("scale-inf", "scale", ValueError, _set(scale=float("inf"))),
    ("scale-str", "scale", ValueError, _set(scale="0.1")),
    ("scale-array", "scale", ValueError, _set(scale=np.ones((2,), np.float32))),
    ("sliding_window-0", "sliding_window", ValueError, _set(sliding_window=0)),
    ("sliding_window-negative", "sliding_window", ValueError, _set(sliding_window=-4)),
    ("sliding_window-float", "sliding_window", ValueError, _set(sliding_window=2.5)),
    ("sliding_window-str", "sliding_window", ValueError, _set(sliding_window="8")),
    ("soft_cap-0", "soft_cap", ValueError, _set(soft_cap=0.0)),
    ("soft_cap-negative", "soft_cap", ValueError, _set(soft_cap=-5.0)),
    ("soft_cap-nan", "soft_cap", ValueError, _set(soft_cap=float("nan"))),
    ("soft_cap-inf", "soft_cap", ValueError, _set(soft_cap=float("inf"))),
    ("soft_cap-str", "soft_cap", ValueError, _set(soft_cap="30")),
    ("ring_table-int", "ring_table", TypeError, _set(ring_table=1)),
    ("check_indices-int", "check_indices", TypeError, _set(check_indices=1)),
]

PAGED_MUTATIONS = _ATTENTION_MUTATIONS + [
    ("q-batch", "q", ValueError, _edit("q", lambda x: x[:-1])),
]

RAGGED_MUTATIONS = _ATTENTION_MUTATIONS + [
    ("query_start-float32", "query_start", TypeError,
     _edit("query_start", lambda x: x.astype(np.float32))),
    ("query_start-rank2", "query_start", ValueError, _edit("query_start", lambda x: x[None])),
    ("query_start-length-B", "query_start", ValueError, _edit("query_start", lambda x: x[:-1])),
    ("query_start-length-B+2", "query_start", ValueError,
     _edit("query_start", lambda x: np.zeros((B + 2,), np.int32))),
]

# The layer argument with 5-D caches.
LAYER_MUTATIONS = [
    ("layer-missing", "layer", ValueError, _set(layer=None)),
    ("layer-out-of-range", "layer", ValueError, _set(layer=L)),
    ("layer-negative", "layer", ValueError, _set(layer=-1)),
    ("layer-float", "layer", TypeError, _set(layer=1.0)),
    ("layer-float-array", "layer", TypeError, _set(layer=np.float32(1.0))),
    ("layer-vector", "layer", TypeError, _set(layer=np.array([1], np.int32))),
    ("layer-bool", "layer", TypeError, _set(layer=True)),
    ("layer-numpy-bool", "layer", TypeError, _set(layer=np.bool_(False))),
    ("layer-bool-array", "layer", TypeError, _set(layer=np.array(True))),
]

PYTHON_CASES = (
    [("write_kv", False) + m for m in WRITE_MUTATIONS]
    + [("paged", False) + m for m in PAGED_MUTATIONS]
    + [("ragged", False) + m for m in RAGGED_MUTATIONS]
    + [(op, True) + m for op in ("write_kv", "paged", "ragged") for m in LAYER_MUTATIONS]
)


def _names(message: str, name: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", message) is not None


def _put_arrays(backend, args):
    return {k: backend.put(v) if isinstance(v, np.ndarray) and v.ndim > 0 else v
            for k, v in args.items()}


@pytest.mark.parametrize("op,layers,mutation,name,exc,mutate", PYTHON_CASES,
                         ids=[f"{c[0]}-{'5d' if c[1] else '4d'}-{c[2]}" for c in PYTHON_CASES])
def test_bad_argument_raises_python_error_naming_it(backend, op, layers, mutation, name, exc,
                                                    mutate):
    args = _base(op, layers)
    fn, positional = _call(op, _put_arrays(backend, args))
    fn(*positional)  # the unmodified arguments are accepted
    mutate(args)
    fn, positional = _call(op, _put_arrays(backend, args))

    # Abstract evaluation: no handler can run, so the error comes from the Python checks.
    with pytest.raises(exc) as info:
        jax.eval_shape(fn, *positional)
    assert _names(str(info.value), name), f"message does not name {name!r}: {info.value}"
    # Eagerly and under jit: the same error, before anything runs.
    with pytest.raises(exc) as info:
        fn(*positional)
    assert _names(str(info.value), name), f"message does not name {name!r}: {info.value}"
    with pytest.raises(exc) as info:
        jax.jit(fn)(*positional)
    assert _names(str(info.value), name), f"message does not name {name!r}: {info.value}"


# ---------------------------------------------------------------------------------------------
# Bad indices seen only at run time: the handler refuses them, naming the argument.


def _refused(name: str):
    """pytest.raises for a handler error whose message names `name`."""
    return pytest.raises(runtime_error_types(), match=rf"(?<![\w.]){re.escape(name)}(?!\w)")


def _attention_inputs(seed, ragged, num_layers=None):
    """A valid small batch: seq_lens [13, 32, 5], ragged queries [3, 1, 5] + 1 padding row."""
    rng = np.random.default_rng(seed)
    seq_lens = np.array([13, 32, 5], np.int32)
    page_table = random_page_table(rng, seq_lens, PAGE, P, NUM_PAGES * 3)
    k_cache, v_cache = make_caches(rng, num_layers, NUM_PAGES * 3, PAGE, HKV, D, page_table,
                                   seq_lens)
    query_start = np.array([0, 3, 4, 9], np.int32)
    q = rng.standard_normal((T if ragged else B, H, D)).astype(np.float32)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table, seq_lens=seq_lens,
                query_start=query_start)


def _attention_fn(ragged, **static):
    if ragged:
        return jax.jit(lambda q, kc, vc, pt, sl, qs, layer=None: ops.ragged_paged_attention(
            q, kc, vc, pt, sl, qs, layer=layer, **static))
    return jax.jit(lambda q, kc, vc, pt, sl, qs, layer=None: ops.paged_attention(
        q, kc, vc, pt, sl, layer=layer, **static))


def _run_attention(backend, inputs, ragged, layer=None, **static):
    keys = ("q", "k_cache", "v_cache", "page_table", "seq_lens", "query_start")
    args = backend.put(*(inputs[k] for k in keys))
    layer = None if layer is None else backend.put(np.int32(layer))
    return np.asarray(jax.block_until_ready(_attention_fn(ragged, **static)(*args, layer=layer)))


BAD_INDEX_CASES = [
    # (id, ops it applies to, argument named, mutation of the inputs)
    ("page-past-cache", ("paged", "ragged"), "page_table",
     lambda x: x["page_table"].__setitem__((1, 2), NUM_PAGES * 3)),
    ("page-far-past-cache", ("paged", "ragged"), "page_table",
     lambda x: x["page_table"].__setitem__((0, 0), 2**31 - 1)),
    ("page-negative", ("paged", "ragged"), "page_table",
     lambda x: x["page_table"].__setitem__((0, 1), -1)),
    ("seq_lens-past-capacity", ("paged", "ragged"), "seq_lens",
     lambda x: x["seq_lens"].__setitem__(2, P * PAGE + 1)),
    ("seq_lens-negative", ("paged", "ragged"), "seq_lens",
     lambda x: x["seq_lens"].__setitem__(2, -1)),
    ("query_start-decreasing", ("ragged",), "query_start",
     lambda x: x.update(query_start=np.array([0, 3, 2, 9], np.int32))),
    ("query_start-past-tokens", ("ragged",), "query_start",
     lambda x: x.update(query_start=np.array([0, 3, 4, T + 1], np.int32))),
    ("query_start-negative", ("ragged",), "query_start",
     lambda x: x.update(query_start=np.array([-1, 3, 4, 9], np.int32))),
    ("query_start-more-queries-than-seq_lens", ("ragged",), "query_start",
     lambda x: x.update(query_start=np.array([0, 3, 4, 10], np.int32))),  # 6 queries, 5 tokens
]


BAD_INDEX_PARAMS = [(op, c) for c in BAD_INDEX_CASES for op in c[1]]


@pytest.mark.parametrize("op,case", BAD_INDEX_PARAMS,
                         ids=[f"{op}-{c[0]}" for op, c in BAD_INDEX_PARAMS])
def test_attention_bad_index_refused_by_handler(index_checks, op, case):
    backend = index_checks
    _, _, name, mutate = case
    seed = 3
    print(f"seed={seed}")
    inputs = _attention_inputs(seed, op == "ragged")
    _run_attention(backend, inputs, op == "ragged")  # the unmodified batch runs
    mutate(inputs)
    with _refused(name):
        _run_attention(backend, inputs, op == "ragged")


@pytest.mark.parametrize("op", ["paged", "ragged"])
@pytest.mark.parametrize("layer", [-1, L, 2**31 - 1])
def test_attention_traced_layer_out_of_range_refused(index_checks, op, layer):
    backend = index_checks
    inputs = _attention_inputs(4, op == "ragged", num_layers=L)
    _run_attention(backend, inputs, op == "ragged", layer=L - 1)
    with _refused("layer"):
        _run_attention(backend, inputs, op == "ragged", layer=layer)


def _write_inputs(seed, num_layers=None):
    rng = np.random.default_rng(seed)
    shape = ((num_layers,) if num_layers else ()) + (NUM_PAGES, PAGE, HKV, D)
    kc = rng.standard_normal(shape).astype(np.float32)
    vc = rng.standard_normal(shape).astype(np.float32)
    k = rng.standard_normal((T, HKV, D)).astype(np.float32)
    v = rng.standard_normal((T, HKV, D)).astype(np.float32)
    slots = rng.choice(np.arange(PAGE, NUM_PAGES * PAGE), size=T, replace=False).astype(np.int32)
    return kc, vc, k, v, slots


@pytest.mark.parametrize("bad_slot", [NUM_PAGES * PAGE, 2**31 - 1])
@pytest.mark.parametrize("donate", [False, True])
def test_write_kv_slot_past_cache_refused_and_cache_unchanged(index_checks, bad_slot, donate):
    backend = index_checks
    seed = 5
    print(f"seed={seed}")
    kc, vc, k, v, slots = _write_inputs(seed)
    slots[-1] = bad_slot  # valid slots first: nothing may be written before the refusal
    write = jax.jit(ops.write_kv, donate_argnums=(0, 1) if donate else ())
    kc_dev, vc_dev = backend.put(kc, vc)
    with _refused("slot_mapping"):
        jax.block_until_ready(write(kc_dev, vc_dev, *backend.put(k, v, slots)))
    # The cache is unchanged. (A donated input may have been consumed by the failed call; if it is
    # still alive it must hold the old values.)
    for name, dev, old in (("k_cache", kc_dev, kc), ("v_cache", vc_dev, vc)):
        if not dev.is_deleted():
            assert_bits_equal(np.asarray(dev), old, f"{name} after a refused write_kv", seed)
        else:
            assert donate, f"{name} was consumed by a call that did not donate it"
    # A fresh cache takes a valid write afterwards (the handler is not left in a bad state).
    slots[-1] = -1
    k_out, _ = write(*backend.put(kc, vc, k, v, slots))
    want = reference("write_kv", kc, vc, k, v, slots)[0]
    np.testing.assert_array_equal(np.asarray(k_out), want, err_msg=f"seed={seed}")


@pytest.mark.parametrize("layer", [-1, L, 2**31 - 1])
def test_write_kv_traced_layer_out_of_range_refused(index_checks, layer):
    backend = index_checks
    seed = 6
    print(f"seed={seed}")
    kc, vc, k, v, slots = _write_inputs(seed, num_layers=L)
    write = jax.jit(ops.write_kv)
    args = backend.put(kc, vc, k, v, slots)
    jax.block_until_ready(write(*args, layer=backend.put(np.int32(L - 1))))
    with _refused("layer"):
        jax.block_until_ready(write(*args, layer=backend.put(np.int32(layer))))
    assert_bits_equal(np.asarray(args[0]), kc, "k_cache after a refused write_kv", seed)


def test_check_indices_keyword_without_env(backend, monkeypatch):
    """check_indices=True (an FFI attribute) turns checked mode on with no environment variable:
    a bad page is refused by name on every backend."""
    monkeypatch.delenv("JAX_KVCM_CHECK_INDICES", raising=False)
    seed = 8
    inputs = _attention_inputs(seed, ragged=False)
    inputs["page_table"][1, 2] = NUM_PAGES * 3
    args = [inputs[k] for k in ("q", "k_cache", "v_cache", "page_table", "seq_lens")]
    with _refused("page_table"):
        jax.block_until_ready(ops.paged_attention(*backend.put(*args), check_indices=True))
    kc, vc, k, v, slots = _write_inputs(seed)
    slots[3] = NUM_PAGES * PAGE + 5
    with _refused("slot_mapping"):
        jax.block_until_ready(ops.write_kv(*backend.put(kc, vc, k, v, slots), check_indices=True))


def test_bad_indices_without_check_env(backend, monkeypatch):
    """Without JAX_KVCM_CHECK_INDICES: the CPU handler still refuses; the CUDA kernels never read
    or write out of bounds, give NaN rows for attention rows that referenced a bad page and skip
    bad write_kv slots."""
    monkeypatch.delenv("JAX_KVCM_CHECK_INDICES", raising=False)
    seed = 8
    print(f"seed={seed}")
    inputs = _attention_inputs(seed, ragged=False)
    good = reference("paged_attention", *(inputs[k] for k in
                                          ("q", "k_cache", "v_cache", "page_table", "seq_lens")))
    inputs["page_table"][1, 2] = NUM_PAGES * 3
    kc, vc, k, v, slots = _write_inputs(seed)
    slots[3] = NUM_PAGES * PAGE + 5
    if not backend.index_checks_env:
        with _refused("page_table"):
            _run_attention(backend, inputs, ragged=False)
        with _refused("slot_mapping"):
            jax.block_until_ready(ops.write_kv(*backend.put(kc, vc, k, v, slots)))
        return
    out = _run_attention(backend, inputs, ragged=False)
    assert np.isnan(out[1].astype(np.float32)).all(), "row that read a bad page must be NaN"
    assert_close(out[[0, 2]], good[[0, 2]], jnp.float32, "rows without bad pages", seed)
    k_out, v_out = ops.write_kv(*backend.put(kc, vc, k, v, slots))
    keep = np.arange(T) != 3
    want_k, want_v = reference("write_kv", kc, vc, k[keep], v[keep], slots[keep])
    np.testing.assert_array_equal(np.asarray(k_out), want_k, err_msg=f"seed={seed}")
    np.testing.assert_array_equal(np.asarray(v_out), want_v, err_msg=f"seed={seed}")


# ---------------------------------------------------------------------------------------------
# Attribute types: numpy scalars are accepted, windows beyond int32 are refused by name.


@pytest.mark.parametrize("attr", ["scale", "soft_cap"])
def test_numpy_float32_attributes_accepted(backend, attr):
    seed = 9
    print(f"seed={seed}")
    inputs = _attention_inputs(seed, ragged=False)
    args = [inputs[k] for k in ("q", "k_cache", "v_cache", "page_table", "seq_lens")]
    value = 0.25 if attr == "scale" else 3.0
    out = ops.paged_attention(*backend.put(*args), **{attr: np.float32(value)})
    want = reference("paged_attention", *args, **{attr: value})
    assert_close(out, want, jnp.float32, f"{attr}=np.float32({value})", seed)


@pytest.mark.parametrize("window", [2**31, np.int64(2**32 + 5)], ids=["2**31", "np.int64(2**32+5)"])
def test_sliding_window_beyond_int32_refused_or_unbounded(backend, window):
    seed = 10
    print(f"seed={seed}")
    inputs = _attention_inputs(seed, ragged=False)
    args = [inputs[k] for k in ("q", "k_cache", "v_cache", "page_table", "seq_lens")]
    try:
        out = ops.paged_attention(*backend.put(*args), sliding_window=window)
    except ValueError as e:  # refusing it, naming the argument, is fine
        assert _names(str(e), "sliding_window"), str(e)
        return
    # Otherwise a window longer than any sequence means no window.
    want = reference("paged_attention", *args)
    assert_close(out, want, jnp.float32, f"sliding_window={window!r}", seed)
