"""Speculative decoding by prompt lookup against plain decoding (issue 37's benchmark).

    python -m benchmarks.bench_speculate [--batch 1 16 64] [--num-draft-tokens 4]
                                         [--prompt-len 512] [--new-tokens 256] [--tiny]
                                         [--json out.json]

The model: Llama-3.1-8B's shape with random bf16 weights drawn on the device (``--tiny``: the
serving benchmark's tiny model on CPU). The workload is repetitive: each prompt is one random
segment of ``--period`` tokens repeated to ``--prompt-len`` tokens, so the n-gram proposer finds
drafts in it; how many the model accepts is the model's business (a random model's greedy
output falls into loops the proposer then predicts): the accepted tokens per step are measured,
not assumed. Per batch size, on the same requests, three loops, greedy:

- ``plain``: the continuous-batching ``Server`` (examples/llama/scheduler.py; overlapped,
  pure-decode steps through ``paged_attention``): end-to-end tokens/s;
- ``k=0``: the speculative loop with no drafts (one token per row per ragged step);
- ``k=K``: the speculative loop with ``K`` drafts per row: end-to-end tokens/s, decode-phase
  tokens/s (prefill excluded; ``k=0``'s the same way), accepted tokens per step.

Each loop runs once untimed on other prompts of the same shapes (compiles), then timed (the
XLA compiles inside the timed passes are counted: ``compiles_while_timed``, 0 when clean). The
token agreement is reported (equal up to bf16 argmax ties between the
ragged and the decode kernels, and between GEMMs of different token counts: on a random bf16
model the top logits are close, so one flipped argmax changes the rest of a row). It is the
share of tokens before each row's first difference, reported for ``k=K`` against ``plain``,
``k=0`` against ``plain`` (no drafts: the same effect without speculation) and ``k=K`` against
``k=0``; exact equality is what the float32 tests check (tests/runner/test_speculate.py).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import jax
import numpy as np

from examples.llama import model as llama
from examples.llama.scheduler import Server
from examples.llama.serve_types import Request, ServeConfig
from examples.llama.speculate import SpeculativeGenerator

from .harness.run_log import COMPILES, log
from .harness.serve_setup import LLAMA_31_8B, TINY


def requests(rng: np.random.Generator, batch: int, prompt_len: int, period: int, new: int,
             vocab: int) -> list[Request]:
    """``batch`` greedy requests, each a random ``period``-token segment repeated."""
    out = []
    for _ in range(batch):
        seg = rng.integers(10, vocab, size=period).tolist()
        out.append(Request(prompt=(seg * (prompt_len // period + 1))[:prompt_len],
                           max_new_tokens=new))
    return out


def serve_config(batch: int, prompt_len: int, new: int, k: int, page: int) -> ServeConfig:
    """One batch bucket and two token buckets (a decode / verify step's, a prompt chunk's): the
    untimed pass compiles every program the timed one runs."""
    per_seq = -(-(prompt_len + new + k + 1) // page)
    step = 1 << (batch * (k + 1) - 1).bit_length()
    tokens = max(step, 512)
    return ServeConfig(page_size=page, device_pages=batch * per_seq + 8, max_batch=batch,
                       max_tokens_per_step=tokens, prefill_chunk_tokens=512,
                       max_seq_len=prompt_len + new + k + page, batch_buckets=(batch,),
                       token_buckets=tuple(sorted({step, tokens})))


def timed_plain(params, config, serve: ServeConfig, warm: list[Request],
                reqs: list[Request]) -> tuple[float, list[list[int]], int]:
    server = Server(params, config, serve)
    server.generate(warm)
    n0, t0 = COMPILES["n"], time.perf_counter()
    outs = server.generate(reqs)
    dt = time.perf_counter() - t0
    server.manager.shutdown()
    return dt, [o.generated_ids for o in outs], COMPILES["n"] - n0


def timed_speculative(params, config, serve: ServeConfig, k: int, warm: list[Request],
                      reqs: list[Request]) -> dict[str, Any]:
    gen = SpeculativeGenerator(params, config, serve, num_draft_tokens=k)
    gen.finish([gen.start(r, i) for i, r in enumerate(warm)])
    gen.stats = dict.fromkeys(gen.stats, 0)
    n0, t0 = COMPILES["n"], time.perf_counter()
    state = [gen.start(r, i) for i, r in enumerate(reqs)]
    t1 = time.perf_counter()
    outs = gen.finish(state)
    t2 = time.perf_counter()
    gen.manager.shutdown()
    st = gen.stats
    decode_tokens = st["generated"] - len(reqs)   # the first token of each came from prefill
    return {"total_s": t2 - t0, "decode_s": t2 - t1, "steps": st["steps"],
            "drafted": st["drafted"], "accepted": st["accepted"],
            "generated": st["generated"], "decode_tokens": decode_tokens,
            "compiles": COMPILES["n"] - n0,
            "tokens": [o.generated_ids for o in outs]}


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of ``a``'s tokens before each row's first difference from ``b`` (greedy
    continuations diverge for good after one flipped argmax)."""
    same = 0
    for x, y in zip(a, b):
        i = 0
        while i < min(len(x), len(y)) and x[i] == y[i]:
            i += 1
        same += i
    return same / max(sum(len(x) for x in a), 1)


def one_batch(params, config, batch: int, args) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed + batch)
    vocab = config.vocab_size
    warm = requests(rng, batch, args.prompt_len, args.period, args.new_tokens, vocab)
    reqs = requests(rng, batch, args.prompt_len, args.period, args.new_tokens, vocab)
    k = args.num_draft_tokens
    def serve(k: int) -> ServeConfig:
        return serve_config(batch, args.prompt_len, args.new_tokens, k, args.page_size)

    plain_s, plain_tokens, plain_compiles = timed_plain(params, config, serve(0), warm, reqs)
    zero = timed_speculative(params, config, serve(0), 0, warm, reqs)
    spec = timed_speculative(params, config, serve(k), k, warm, reqs)
    n = sum(len(t) for t in plain_tokens)
    row = {"batch": batch, "num_draft_tokens": k, "generated_tokens": n,
           "plain_tok_per_s": n / plain_s,
           "k0_tok_per_s": zero["generated"] / zero["total_s"],
           "k0_decode_tok_per_s": zero["decode_tokens"] / zero["decode_s"],
           "spec_tok_per_s": spec["generated"] / spec["total_s"],
           "spec_decode_tok_per_s": spec["decode_tokens"] / spec["decode_s"],
           "spec_steps": spec["steps"],
           "accepted_per_step": spec["accepted"] / max(spec["steps"], 1) / batch,
           "tokens_per_row_step": spec["decode_tokens"] / max(spec["steps"], 1) / batch,
           "acceptance_rate": spec["accepted"] / max(spec["drafted"], 1),
           "token_agreement_with_plain": agreement(plain_tokens, spec["tokens"]),
           "k0_agreement_with_plain": agreement(plain_tokens, zero["tokens"]),
           "spec_agreement_with_k0": agreement(zero["tokens"], spec["tokens"]),
           "compiles_while_timed": plain_compiles + zero["compiles"] + spec["compiles"]}
    row["spec_over_plain"] = row["spec_tok_per_s"] / row["plain_tok_per_s"]
    row["spec_over_k0_decode"] = row["spec_decode_tok_per_s"] / row["k0_decode_tok_per_s"]
    return {key: (round(v, 4) if isinstance(v, float) else v) for key, v in row.items()}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_speculate",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--period", type=int, default=64, help="the repeated segment's length")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="the tiny model (CPU)")
    ap.add_argument("--json", default=None)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_draft_tokens < 1:
        raise SystemExit("--num-draft-tokens must be >= 1 (k=0 is measured anyway)")
    config = TINY if args.tiny else LLAMA_31_8B
    params = llama.init_params(config, seed=args.seed, on_device=jax.default_backend() != "cpu")
    dev = jax.devices()[0]
    rows = []
    for b in args.batch:
        rows.append(one_batch(params, config, b, args))
        log(json.dumps(rows[-1]))
    log(f"speculative decoding on {dev.device_kind}, {'tiny' if args.tiny else '8B-shaped'} "
        f"random model, prompt {args.prompt_len} (period {args.period}), {args.new_tokens} new "
        f"tokens, k={args.num_draft_tokens}, greedy")
    log("| batch | plain tok/s | spec tok/s | spec/plain | decode k=0 | decode k=K | ratio "
        "| accepted/row-step | agreement k=K, k=0 vs plain |")
    log("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        log(f"| {r['batch']} | {r['plain_tok_per_s']:.0f} | {r['spec_tok_per_s']:.0f} | "
            f"{r['spec_over_plain']:.2f}x | {r['k0_decode_tok_per_s']:.0f} | "
            f"{r['spec_decode_tok_per_s']:.0f} | {r['spec_over_k0_decode']:.2f}x | "
            f"{r['accepted_per_step']:.2f} | {r['token_agreement_with_plain']:.3f}, "
            f"{r['k0_agreement_with_plain']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev.device_kind, "platform": dev.platform,
                       "jax": jax.__version__, "args": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
