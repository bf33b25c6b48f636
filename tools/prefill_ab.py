#!/usr/bin/env python
"""A/B timing of our ragged prefill (with ``--fp8`` also over fp8 K/V; with ``--decode``, paged
decode in bf16 and fp8; with ``--write``, write_kv into bf16 and fp8 caches) across builds of
jax_kvcm, alternated in one run.

A kernel change is judged against the build it changes, on the same GPU in the same minutes:
each build (a ``pip install --target DIR .`` of one source tree) is timed in its own process, in
turns (A, B, A, B, ...), over benchmarks/bench_attention.py's prefill shapes and inputs, each output
checked against the float32 reference first. On the GPU machine:

    python3 -m pip install --no-build-isolation --no-deps --target /tmp/site_a .   # build A
    # (change the kernel)
    python3 -m pip install --no-build-isolation --no-deps --target /tmp/site_b .   # build B
    python3 -m tools.prefill_ab /tmp/site_a /tmp/site_b --rounds 2

Prints one line per build and round, then a table of each build's median ms per shape and its
time over the first build's (< 1: faster). FlashInfer and cuDNN are not timed here:
python -m benchmarks.bench_attention --only prefill gives the side-by-side ratios.
    JAX_PLATFORMS=cpu python -m tools.prefill_ab SITE --quick     # tiny shapes, CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
ROOT = Path(__file__).resolve().parents[1]


def time_decode(quick: bool, repeats: int, cases: list[str] | None = None) -> dict[str, dict]:
    """Decode at bench_attention's shapes, bf16 and fp8 K/V (one power-of-two scale), each
    output checked against the float32 reference first: {shape: {"ms", "check"}}; with cases,
    only the shapes whose name holds one of them."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_kvcm
    from benchmarks.harness import attention_cases as A
    from benchmarks.harness import timing as _timing

    h, hkv, d, page = A.NUM_HEADS, A.NUM_KV_HEADS, A.HEAD_DIM, A.PAGE
    out: dict[str, dict] = {}
    for i, (b, s) in enumerate(A.QUICK_DECODE_SHAPES if quick else A.DECODE_SHAPES):
        kinds = [k for k in ("bf16", "fp8") if wanted(f"decode {k} B={b} S={s}", cases)]
        if not kinds:
            continue
        rng = np.random.default_rng(200 + i)
        per = -(-s // page)
        table = (1 + rng.permutation(b * per).reshape(b, per)).astype(np.int32)
        k_cache, v_cache = (jnp.asarray(rng.standard_normal((b * per + 1, page, hkv, d)),
                                        A.DTYPE) for _ in range(2))
        q = jnp.asarray(rng.standard_normal((b, h, d)), A.DTYPE)
        lens = jnp.full((b,), s, jnp.int32)
        table = jnp.asarray(table)
        ref = A.reference_decode(q, k_cache, v_cache, table, lens)
        k8, v8, scale, kd, vd = A.fp8_caches(k_cache, v_cache)
        ref8 = A.reference_decode(q, kd, vd, table, lens)
        sc = jnp.full((hkv,), scale, jnp.float32)
        for kind, (kc, vc, extra, want) in {"bf16": (k_cache, v_cache, {}, ref),
                                            "fp8": (k8, v8, dict(k_scale=sc, v_scale=sc),
                                                    ref8)}.items():
            if kind not in kinds:
                continue
            f = jax.jit(lambda q, kc, vc, t, n, extra=extra: jax_kvcm.paged_attention(
                q, kc, vc, t, n, **extra))
            A.poison_allocator((b, h, d), A.DTYPE)
            checked = A.check(f(q, kc, vc, table, lens), want)
            tm = _timing.time_jax(f, [(q, kc, vc, table, lens)], repeats=repeats)
            out[f"decode {kind} B={b} S={s}"] = {"ms": tm["ms"], "check": checked["text"]}
        del k_cache, v_cache, k8, v8, kd, vd
    return out


# write_kv cases: tokens per call (a decode step's rows, trtllm-bench's, a prompt chunk), written
# into an 8B-shaped pool (32 layers, 8 kv heads of 128, pages of 16) once per layer, as a step does.
WRITE_TOKENS, QUICK_WRITE_TOKENS = (128, 459, 2048), (5, 40)
WRITE_LAYERS = 32


def time_write(quick: bool, repeats: int, cases: list[str] | None = None) -> dict[str, dict]:
    """write_kv of T bf16 tokens into bf16 and fp8 caches: one program writes every layer (the
    caches donated, so written in place), checked bit for bit against the reference's writes
    first: {"write KIND T=...": {"ms" (per layer), "check"}}."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_kvcm
    from benchmarks.harness import attention_cases as A
    from benchmarks.harness import timing as _timing
    from jax_kvcm.ops import reference

    hkv, d, page = A.NUM_KV_HEADS, A.HEAD_DIM, A.PAGE
    layers = 2 if quick else WRITE_LAYERS
    out: dict[str, dict] = {}
    for i, t in enumerate(QUICK_WRITE_TOKENS if quick else WRITE_TOKENS):
        kinds = [k for k in ("bf16", "fp8") if wanted(f"write {k} T={t}", cases)]
        rng = np.random.default_rng(300 + i)
        pages = 2 * -(-t // page) + 1
        slots = jnp.asarray(page + rng.permutation((pages - 1) * page)[:t], jnp.int32)
        k, v = (jnp.asarray(rng.standard_normal((t, hkv, d)) * 2, A.DTYPE) for _ in range(2))
        scale = jnp.asarray(rng.uniform(0.5, 2.0, (layers, hkv)), jnp.float32)
        for kind in kinds:
            dtype = jnp.float8_e4m3fn if kind == "fp8" else A.DTYPE
            extra = dict(k_scale=scale, v_scale=scale) if kind == "fp8" else {}

            def write_all(kc, vc, k, v, slots, write, extra=extra):
                for li in range(layers):
                    kc, vc = write(kc, vc, k, v, slots, layer=jnp.int32(li), **extra)
                return kc, vc

            zeros = lambda: jnp.zeros((layers, pages, page, hkv, d), dtype)  # noqa: E731
            ours = jax.jit(lambda *a: write_all(*a, jax_kvcm.write_kv), donate_argnums=(0, 1))
            want = jax.jit(lambda *a: write_all(*a, reference.write_kv))(zeros(), zeros(), k, v,
                                                                          slots)
            state = list(ours(zeros(), zeros(), k, v, slots))
            same = all(np.array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))
                       for g, w in zip(state, want))
            del want

            def step():
                state[:] = ours(state[0], state[1], k, v, slots)
                jax.block_until_ready(state)

            ms = _timing.time_blocking(step, repeats) * 1e3 / layers
            out[f"write {kind} T={t}"] = {"ms": ms, "check": "ok (bit-exact)" if same
                                          else "FAILED: not the reference's bytes"}
            state.clear()   # the pools, before the next case allocates its own
    return out


def wanted(case: str, cases: list[str] | None) -> bool:
    """Whether ``--cases`` keeps a case (its name as printed, e.g. "decode bf16 B=256 S=256")."""
    return not cases or any(c in case for c in cases)


def time_build(quick: bool, repeats: int, fp8: bool = False,
               cases: list[str] | None = None) -> dict[str, dict]:
    """In the child process (started in the build's folder, so that its jax_kvcm comes first on
    sys.path; the repository on PYTHONPATH): {shape: {"ms", "check"}}. fp8: also each shape over
    float8_e4m3fn copies of the caches (one power-of-two scale), checked against the reference
    on the dequantized K/V. cases: as time_decode's."""
    import jax
    import jax.numpy as jnp

    import jax_kvcm
    from benchmarks.harness import attention_cases as A
    from benchmarks.harness import timing as _timing
    from jax_kvcm.ops import reference

    h, hkv, d = A.NUM_HEADS, A.NUM_KV_HEADS, A.HEAD_DIM
    out: dict[str, dict] = {}
    shapes = A.QUICK_PREFILL_SHAPES if quick else A.PREFILL_SHAPES
    for i, (b, s) in enumerate(shapes):  # bench_attention's seeds at its default --seed 0
        do16, do8 = wanted(f"B={b} S={s}", cases), fp8 and wanted(f"fp8 B={b} S={s}", cases)
        if not (do16 or do8):
            continue
        t, c = b * s, A.prefill_case(b, s, 100 + i)
        zeros = jnp.zeros((c["num_pages"], A.PAGE, hkv, d), A.DTYPE)
        k_cache, v_cache = jax.jit(reference.write_kv)(
            zeros, zeros, c["k"].reshape(t, hkv, d), c["v"].reshape(t, hkv, d), c["slots"])
        ref = jax.jit(A.dense_causal_reference)(c["q"], c["k"], c["v"], c["pos"])
        args = (k_cache, v_cache, c["page_table"], c["seq_lens"], c["query_start"])

        def checked_and_timed(f, args, ref):
            """f(q, *args) checked against ref (into a poisoned allocator), then timed."""
            A.poison_allocator((t, h, d), A.DTYPE)
            got = f(c["q"].reshape(t, h, d), *args).reshape(b, s, h, d)[:, c["pos"]]
            checked = A.check(got, ref)
            tm = _timing.time_jax(f, [(c["q2"].reshape(t, h, d), *args),
                                      (c["q"].reshape(t, h, d), *args)], repeats=repeats)
            return {"ms": tm["ms"], "check": checked["text"]}

        if do16:
            out[f"B={b} S={s}"] = checked_and_timed(jax.jit(jax_kvcm.ragged_paged_attention),
                                                    args, ref)
        if do8:
            k8, v8, scale, _, _ = A.fp8_caches(k_cache, v_cache)
            # The reference reads the dense K/V through the same quantization (the same scale:
            # the paged caches hold the same values and zeros); fp8_caches quantizes and
            # dequantizes in separate programs, since inside one XLA on the GPU may drop the
            # f32 -> fp8 -> f32 round trip and the reference would read unquantized K/V.
            _, _, _, kd, vd = A.fp8_caches(c["k"], c["v"])
            ref8 = jax.jit(A.dense_causal_reference)(c["q"], kd, vd, c["pos"])
            sc = jnp.full((hkv,), scale, jnp.float32)
            args8 = (k8, v8, c["page_table"], c["seq_lens"], c["query_start"], sc, sc)
            f8 = jax.jit(lambda q, kc, vc, t, n, qs, ks, vs: jax_kvcm.ragged_paged_attention(
                q, kc, vc, t, n, qs, k_scale=ks, v_scale=vs))
            out[f"fp8 B={b} S={s}"] = checked_and_timed(f8, args8, ref8)
            del k8, v8, kd, vd
        del k_cache, v_cache
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m tools.prefill_ab``."""
    p = argparse.ArgumentParser(
        prog="python -m tools.prefill_ab", description=__doc__.splitlines()[0])
    p.add_argument("sites", nargs="*", help="install folders of the builds (the first: baseline)")
    p.add_argument("--rounds", type=int, default=2, help="turns per build (alternated)")
    p.add_argument("--repeats", type=int, default=9, help="timing samples per call (median)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per child process")
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--fp8", action="store_true",
                   help="also the prefill shapes over fp8 K/V caches (one power-of-two scale)")
    p.add_argument("--decode", action="store_true",
                   help="also paged decode at bench_attention's five shapes, bf16 and fp8")
    p.add_argument("--write", action="store_true",
                   help="also write_kv of 128 / 459 / 2,048 tokens into bf16 and fp8 caches "
                        "(ms per layer; cases 'write bf16 T=459', ...)")
    p.add_argument("--cases", nargs="+", metavar="TEXT",
                   help="only the cases whose name holds one of these (the names as printed, "
                        "e.g. 'decode bf16 B=256 S=256' or 'S=256')")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.child:
        res = time_build(a.quick, a.repeats, a.fp8, a.cases)
        if a.decode:
            res.update(time_decode(a.quick, a.repeats, a.cases))
        if a.write:
            res.update(time_write(a.quick, a.repeats, a.cases))
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    if not a.sites:
        p.error("sites: give at least one build's install folder")
    for site in a.sites:
        if not (Path(site) / "jax_kvcm").is_dir():
            p.error(f"sites: {site} holds no jax_kvcm/ (build it with pip install --target)")
    runs: dict[str, list[dict]] = {site: [] for site in a.sites}
    failed = False
    for r in range(a.rounds):
        for site in a.sites:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
            cmd = [sys.executable, "-m", "tools.prefill_ab", "--child", "--repeats", str(a.repeats)]
            flags = ((["--quick"] if a.quick else []) + (["--fp8"] if a.fp8 else []) +
                     (["--decode"] if a.decode else []) + (["--write"] if a.write else []) +
                     (["--cases", *a.cases] if a.cases else []))
            try:
                proc = subprocess.run(cmd + flags, env=env, cwd=site,
                                      capture_output=True, text=True, timeout=a.timeout)
            except subprocess.TimeoutExpired:
                print(f"round {r + 1} {site}: TIMEOUT after {a.timeout:.0f} s", flush=True)
                failed = True
                continue
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(f"round {r + 1} {site}: FAILED rc={proc.returncode}\n{proc.stderr[-2000:]}",
                      flush=True)
                failed = True
                continue
            res = json.loads(lines[-1][len("RESULT "):])
            runs[site].append(res)
            print(f"round {r + 1} {site}: " + ", ".join(
                f"{k} {v['ms']:.4f} ms ({v['check']})" for k, v in res.items()), flush=True)
    base = a.sites[0]
    shapes = list(dict.fromkeys(k for rs in runs.values() for res in rs for k in res))
    print("\n| build | " + " | ".join(f"{s} ms | / first" for s in shapes) + " |")
    print("|---|" + "---:|---:|" * len(shapes))
    med = {site: {s: statistics.median([res[s]["ms"] for res in rs if s in res])
                  for s in shapes if any(s in res for res in rs)} for site, rs in runs.items()}
    for site in a.sites:
        cells = []
        for s in shapes:
            ms, ms0 = med[site].get(s), med[base].get(s)
            cells.append("-" if ms is None else f"{ms:.4f}")
            cells.append("-" if ms is None or ms0 is None else f"{ms / ms0:.3f}")
        print(f"| {site} | " + " | ".join(cells) + " |")
    bad = [f"{site} {s}" for site, rs in runs.items() for res in rs for s, v in res.items()
           if not v["check"].startswith("ok")]
    if bad:
        print("check failed: " + ", ".join(bad))
    return 1 if failed or bad else 0


if __name__ == "__main__":
    sys.exit(main())
