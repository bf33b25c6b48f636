"""Does the serving step copy the K/V pools? Compiles ``examples.llama.step.model_step`` (the
program ``benchmarks/serve.py`` runs) from abstract shapes only, nothing allocated, and prints
XLA's memory analysis of each program: argument, output, alias and temporary bytes against the
pools' bytes. A donated pool written in place shows as aliased output and adds no temporary; a
temporary of a pool's size is a copy of it.

    python -m tools.step_memory --pages 1000 14000 --kv-dtype bfloat16 float8_e4m3fn \
        --quantize none fp8 --batch 458 --chunk 2048 [--dump DIR]

``--dump DIR`` writes each program's optimized HLO text there (grep it for pool-shaped copies).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks.harness.serve_setup import LLAMA_31_8B
from examples.llama import fp8_weights
from examples.llama import model as llama
from examples.llama.step import model_step
from jax_kvcm import StepBatch


def abstract_params(config: llama.LlamaConfig, quantize: str | None):
    """The params' shapes and dtypes (``jax.eval_shape``: no weights are drawn)."""
    def build():
        p = llama.init_params(config, on_device=True)
        return (p if quantize is None
                else fp8_weights.quantize_params(p, fp8_weights.QUANTIZE_CHOICES[quantize]))
    return jax.eval_shape(build)


def abstract_inputs(config, pages: int, page_size: int, kv_dtype, batch: int, tokens: int,
                    width: int):
    """``(k_cache, v_cache, prev_tokens, gather, host_tokens, StepBatch)`` as ShapeDtypeStructs."""
    pool = jax.ShapeDtypeStruct((config.num_hidden_layers, pages, page_size,
                                 config.num_key_value_heads, config.head_dim), kv_dtype)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)   # noqa: E731
    sb = StepBatch(page_table=i32(batch, width), seq_lens=i32(batch),
                   query_start=i32(batch + 1), slot_mapping=i32(tokens), positions=i32(tokens))
    return pool, pool, i32(batch), i32(tokens), i32(tokens), sb


# Optimized HLO lines that copy a pool-shaped array (``copy``, or a fusion / custom call writing
# one that is not the aliased pool itself shows up as a temporary in the analysis instead).
def pool_copies(hlo: str, pool_shape: tuple[int, ...]) -> list[str]:
    dims = ",".join(map(str, pool_shape))
    pat = re.compile(r"=\s*\w+\[" + re.escape(dims) + r"\]\S*\s+copy\(")
    return [line.strip()[:200] for line in hlo.splitlines() if pat.search(line)]


def analyse(config, quantize, kv_dtype, pages, page_size, batch, chunk, width, decode,
            dump: Path | None) -> dict:
    params = abstract_params(config, quantize)
    tokens = batch if decode else batch + chunk
    args = abstract_inputs(config, pages, page_size, kv_dtype, batch, tokens, width)
    t = time.perf_counter()
    lowered = model_step.lower(params, *args, None, config=config, decode=decode, greedy=True,
                               with_logits=False)
    compiled = lowered.compile()
    seconds = time.perf_counter() - t
    mem = compiled.memory_analysis()
    pool_bytes = math.prod(args[0].shape) * jnp.dtype(kv_dtype).itemsize
    hlo = compiled.as_text() or ""
    row = {
        "quantize": quantize or "none", "kv_dtype": jnp.dtype(kv_dtype).name, "pages": pages,
        "decode": decode, "batch": batch, "tokens": tokens, "compile_s": round(seconds, 1),
        "pool_gib": pool_bytes / 2**30,
        "argument_gib": getattr(mem, "argument_size_in_bytes", 0) / 2**30,
        "output_gib": getattr(mem, "output_size_in_bytes", 0) / 2**30,
        "alias_gib": getattr(mem, "alias_size_in_bytes", 0) / 2**30,
        "temp_gib": getattr(mem, "temp_size_in_bytes", 0) / 2**30,
        "pool_copies": len(pool_copies(hlo, args[0].shape)),
    }
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        name = (f"{row['quantize']}_{row['kv_dtype']}_{pages}p_"
                f"{'decode' if decode else 'mixed'}.hlo.txt")
        (dump / name).write_text(hlo)
        row["copies"] = pool_copies(hlo, args[0].shape)[:8]
    return row


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, nargs="+", default=[1000, 14000])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--kv-dtype", nargs="+", default=["float8_e4m3fn", "bfloat16"])
    ap.add_argument("--quantize", nargs="+", default=["fp8", "none"],
                    help="none, or a --quantize choice of the runner (fp8, fp8-tensor)")
    ap.add_argument("--batch", type=int, default=458)
    ap.add_argument("--chunk", type=int, default=2048, help="prompt tokens of a mixed step")
    ap.add_argument("--width", type=int, default=128, help="page-table width")
    ap.add_argument("--layers", type=int, default=None, help="default: the 8B model's 32")
    ap.add_argument("--steps", nargs="+", choices=["decode", "mixed"], default=["decode", "mixed"])
    ap.add_argument("--dump", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    return ap


def main(argv=None) -> list[dict]:
    args = build_parser().parse_args(argv)
    config = LLAMA_31_8B
    if args.layers is not None:
        config = llama.LlamaConfig(**{**config.__dict__, "num_hidden_layers": args.layers})
    rows = []
    print(f"backend {jax.default_backend()}, {config.num_hidden_layers} layers; GiB")
    print("quantize | kv | pages | step | pool | args | out | alias | temp | pool copies | s")
    for q, kv, pages, step in itertools.product(args.quantize, args.kv_dtype, args.pages,
                                                args.steps):
        try:
            row = analyse(config, None if q == "none" else q, jnp.dtype(kv), pages,
                          args.page_size, args.batch, args.chunk, args.width, step == "decode",
                          args.dump)
        except Exception as e:  # noqa: BLE001  (one program failing to compile: report, go on)
            print(f"{q} | {kv} | {pages} | {step} | FAILED: {type(e).__name__}: {e}"[:2000])
            rows.append({"quantize": q, "kv_dtype": kv, "pages": pages, "step": step,
                         "error": f"{type(e).__name__}: {e}"[:2000]})
            continue
        rows.append(row)
        print(f"{row['quantize']} | {row['kv_dtype']} | {pages} | {step} | "
              f"{row['pool_gib']:.2f} | {row['argument_gib']:.2f} | {row['output_gib']:.2f} | "
              f"{row['alias_gib']:.2f} | {row['temp_gib']:.2f} | {row['pool_copies']} | "
              f"{row['compile_s']}", flush=True)
        for line in row.get("copies", []):
            print("   ", line)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
