"""benchmarks/bench_mixed_step.py on the tiny model (CPU): the mixed step's logits equal its
parts' (decode rows, chunk), every step is timed and broken down, the ratios are computed from
the timed steps; a batching with the chunk's positions off by one fails the check; bad arguments
are refused by name."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import bench_mixed_step as bench
from benchmarks.harness.serve_setup import TINY
from examples.llama import model as llama


def test_tiny_mixed_step_against_its_parts(tmp_path):
    out = tmp_path / "mixed.json"
    assert bench.main(["--tiny", "--decode-rows", "5", "--context", "40", "--chunk", "24",
                       "--chunk-context", "8", "--page-size", "8", "--repeats", "2",
                       "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["check"]["decode rows"] <= bench.TOLERANCE, row["check"]
    assert row["check"]["chunk"] <= bench.TOLERANCE, row["check"]
    steps = row["steps"]
    assert [(k, s["rows"], s["tokens"]) for k, s in steps.items()] == [
        ("decode", 5, 5), ("chunk", 1, 24), ("mixed", 6, 29)]
    for s in steps.values():
        assert s["ms"] > 0 and s["breakdown"]["weight GEMMs"] > 0, s
    assert steps["decode"]["breakdown"]["paged attention"] > 0
    assert steps["mixed"]["breakdown"]["ragged attention"] > 0
    ms = {k: s["ms"] for k, s in steps.items()}
    assert row["mixed_over_parts"] == pytest.approx(ms["mixed"] / (ms["decode"] + ms["chunk"]))
    b = steps["chunk"]["breakdown"]
    assert row["bound_ms"] == pytest.approx(ms["decode"] + b["weight GEMMs"]
                                            + b["ragged attention"])


def test_the_check_sees_a_wrong_batching():
    """The oracle the benchmark relies on is sensitive: the mixed step's chunk given decode row
    0's page-table row (another sequence's context, a batching bug) moves its logits past the
    tolerance, while the decode rows, untouched, still agree."""
    B, C, P = 4, 16, 8
    inputs, num_pages = bench.step_inputs(B, 24, C, 8, P, TINY.vocab_size,
                                          np.random.default_rng(3))
    params = llama.init_params(TINY)
    k, v = llama.make_caches(TINY, num_pages, P)
    k, v = bench._fill(k, jax.random.key(1)), bench._fill(v, jax.random.key(2))

    def logits(step, a):
        out, _, _ = step(params, jnp.array(k), jnp.array(v), *map(jnp.asarray, a), config=TINY)
        return np.asarray(out)

    decode = logits(llama.decode_step, inputs["decode"])
    chunk = logits(llama.forward_step, inputs["chunk"])
    tokens, pos, slots, table, *rest = inputs["mixed"]
    right = logits(llama.forward_step, inputs["mixed"])
    assert bench.rel_l2(right[:B], decode) <= bench.TOLERANCE
    assert bench.rel_l2(right[B:], chunk) <= bench.TOLERANCE
    wrong_table = np.concatenate([table[:B], table[:1]])
    wrong = logits(llama.forward_step, (tokens, pos, slots, wrong_table, *rest))
    assert bench.rel_l2(wrong[:B], decode) <= bench.TOLERANCE
    assert bench.rel_l2(wrong[B:], chunk) > bench.TOLERANCE


@pytest.mark.parametrize("argv,needle", [
    (["--decode-rows", "0"], "--decode-rows: at least 1"),
    (["--chunk", "16", "0"], "--chunk: at least 1"),
    (["--page-size", "12"], "--page-size: a power of two"),
    (["--static-input-scales", "8"], "--static-input-scales: needs --quantize"),
])
def test_bad_arguments_are_refused_by_name(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--tiny", *argv])
    assert e.value.code == 2 and needle in capsys.readouterr().err
