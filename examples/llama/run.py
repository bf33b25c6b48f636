"""Runs the example Llama server on a HF checkpoint (or a built-in random one) and prints each
generation and the KV report.

    python examples/llama/run.py                      # built-in default (CPU: a few seconds)
    python examples/llama/run.py --model DIR --prompt "Hello" --max-new-tokens 64
    python examples/llama/run.py --prompt-ids 1,5,9 --prompt-ids 1,5,7 --json

With no ``--model``, a small Llama (2 layers, hidden 128, vocab 512) with deterministic random
weights is written as a HF-format checkpoint into a temporary directory and loaded back through
the loader; its built-in prompts (token ids: the random model has no tokenizer) share a 40-token
prefix. The first prompt runs alone, then the rest as one batch, so the later ones reuse its
committed prefix pages (a batch admitted at once cannot reuse pages none of it has written yet).
The default device pool is small enough that the batch runs under pressure: cached pages move to
the host tier and running sequences are suspended and resumed.

``--json``: one JSON object per request (``request``, ``prompt_ids``, ``generated_ids``,
``finish_reason``, ...), then one ``{"kv_report": {...}}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import jax_kvcm  # noqa: F401  (the installed package first; then the repo root)

if not __package__:  # run as a script (python examples/llama/run.py): import the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    __package__ = "examples.llama"

import numpy as np  # noqa: E402

from . import loader  # noqa: E402
from . import model as llama  # noqa: E402
from . import serve  # noqa: E402

DEFAULT_CONFIG = llama.LlamaConfig(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
    max_position_embeddings=1024, bos_token_id=1, eos_token_ids=(2,), dtype="float32")


def default_prompts() -> list[list[int]]:
    rng = np.random.default_rng(1234)
    system = [1] + rng.integers(3, 512, 39).tolist()          # 40 shared tokens (5 pages of 8)
    return [system + rng.integers(3, 512, n).tolist() for n in (6, 13, 2, 21, 9)]


def _ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise SystemExit(f"--prompt-ids wants comma-separated integers, got {text!r}") from None
    if not ids:
        raise SystemExit("--prompt-ids got an empty list")
    return ids


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a text prompt (repeatable; needs tokenizer.json in --model)")
    p.add_argument("--prompt-ids", action="append", default=[], metavar="1,2,3",
                   help="a prompt as token ids (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true",
                   help="one JSON object per request, then one with the KV report")
    add_engine_args(p)
    return p.parse_args(argv)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The model, tier, codec and batching flags (shared with examples/llama/server.py)."""
    p.add_argument("--model", metavar="DIR",
                   help="HF checkpoint directory (default: a built-in random Llama)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="override the checkpoint dtype")
    p.add_argument("--page-size", type=int, default=8, help="tokens per page")
    p.add_argument("--device-pages", type=int, default=None,
                   help="device pages (default 20 for the built-in model, else 1024)")
    p.add_argument("--host-bytes", type=int, default=None,
                   help="host tier bytes (default 4 MiB for the built-in model, else 0)")
    p.add_argument("--disk-dir", default=None, help="disk tier directory")
    p.add_argument("--disk-bytes", type=int, default=0)
    p.add_argument("--cold-codec", choices=sorted(serve.CODECS), default="concat")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-tokens-per-step", type=int, default=64,
                   help="token budget of one step (chunked prefill)")
    p.add_argument("--max-seq-len", type=int, default=512)


def load_model(args: argparse.Namespace, progress: bool = True, write_default=None):
    """``(path, config, params, tokenizer, tmp)`` for ``args.model``, or for the built-in random
    Llama written by ``write_default(dir) -> path`` (default: the checkpoint alone) into ``tmp``,
    a ``TemporaryDirectory`` the caller cleans up (None with ``--model``)."""
    tmp = None
    if args.model is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvcm-llama-")
        path = (write_default or write_default_checkpoint)(Path(tmp.name))
    else:
        path = Path(args.model)
    try:
        config, params, tokenizer = loader.load_checkpoint(path, dtype=args.dtype,
                                                           progress=progress)
    except (ValueError, OSError) as e:
        raise SystemExit(f"cannot load {path}: {e}") from None
    return path, config, params, tokenizer, tmp


def write_default_checkpoint(directory: Path) -> Path:
    """The built-in random Llama as a HF checkpoint under ``directory``."""
    return loader.write_random_checkpoint(directory / "random-llama", DEFAULT_CONFIG, seed=0)


def serve_config(args: argparse.Namespace, **overrides) -> serve.ServeConfig:
    """The ServeConfig of the engine flags (built-in model: a small device pool and a host
    tier, so that it runs under pressure). Raises ValueError for bad values."""
    if args.disk_bytes and not args.disk_dir:
        raise SystemExit("--disk-bytes needs --disk-dir")
    disk_bytes = args.disk_bytes or ((64 << 20) if args.disk_dir else 0)
    default_model = args.model is None
    device_pages = args.device_pages or (20 if default_model else 1024)
    host_bytes = args.host_bytes if args.host_bytes is not None else (
        (4 << 20) if default_model else 0)
    return serve.ServeConfig(
        page_size=args.page_size, device_pages=device_pages, host_bytes=host_bytes,
        disk_dir=args.disk_dir, disk_bytes=disk_bytes, cold_codec=args.cold_codec,
        max_batch=args.max_batch, max_tokens_per_step=args.max_tokens_per_step,
        max_seq_len=args.max_seq_len, **overrides)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    path, config, params, tokenizer, tmp = load_model(args, progress=not args.json)
    load_s = time.perf_counter() - t0

    prompts: list[list[int]] = []
    if args.prompt:
        if tokenizer is None:
            raise SystemExit(f"--prompt needs a tokenizer.json in the model directory ({path}); "
                             "use --prompt-ids instead")
        prompts += [tokenizer.encode(t).ids for t in args.prompt]
    prompts += [_ids(t) for t in args.prompt_ids]
    builtin = not prompts
    if builtin:
        if args.model is not None:
            raise SystemExit("--model needs --prompt or --prompt-ids")
        prompts = default_prompts()

    default_model = args.model is None
    try:
        server = serve.Server(params, config, serve_config(args))
        requests = [serve.Request(p, args.max_new_tokens, temperature=args.temperature,
                                  top_p=args.top_p, seed=args.seed) for p in prompts]
        # Built-in prompts: the first alone, then the rest (they reuse its prefix pages).
        waves = [requests[:1], requests[1:]] if builtin else [requests]
        outputs = []
        for wave in waves:
            outputs += server.generate(wave)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    report = server.report()
    report["load_seconds"] = load_s
    report["model"] = "built-in random Llama" if default_model else str(path)

    if args.json:
        for out in outputs:
            d = {"request": out.request_id, **out.to_dict()}
            if tokenizer is not None:
                d["text"] = tokenizer.decode(out.generated_ids)
            print(json.dumps(d))
        print(json.dumps({"kv_report": report}))
    else:
        print(f"model: {report['model']} ({config.num_hidden_layers} layers, hidden "
              f"{config.hidden_size}, vocab {config.vocab_size}, {config.dtype}); loaded in "
              f"{load_s:.2f}s")
        for out in outputs:
            print(f"\n[request {out.request_id}] prompt ({len(out.prompt_ids)} tokens, "
                  f"{out.prefix_hit_tokens} from the prefix cache): {out.prompt_ids}")
            print(f"  generated ({len(out.generated_ids)}, {out.finish_reason}): "
                  f"{out.generated_ids}")
            if tokenizer is not None:
                print(f"  text: {tokenizer.decode(out.generated_ids)!r}")
        print("\n" + format_report(report))
    if tmp is not None:
        tmp.cleanup()
    return 0


def format_report(r: dict) -> str:
    lines = ["KV report"]
    for tier, c in r["pages"].items():
        lines.append(f"  pages {tier:>6}: capacity {c['capacity']}, free {c['free']}, "
                     f"pending {c['pending']}, referenced {c['referenced']}, "
                     f"cached {c['cached']}")
    lines += [
        f"  prefix hit rate: {r['prefix_hit_rate']:.1%} ({r['prefix_hit_tokens']} of "
        f"{r['prompt_tokens']} prompt tokens reused; page size {r['page_size']})",
        f"  pages offloaded: {r['pages_offloaded']} (to host {r['pages_offloaded_to_host']}, "
        f"to disk {r['pages_offloaded_to_disk']}; host -> disk {r['pages_host_to_disk']}); "
        f"onboarded: {r['pages_onboarded']}; codec {r['cold_codec']}",
        f"  suspends: {r['suspends']}, resumes: {r['resumes']}, recomputes: {r['recomputes']}",
        f"  steps: {r['steps']} ({r['decode_steps']} decode, {r['mixed_steps']} prefill/mixed), "
        f"{len(r['compiled_shapes'])} compiled step shapes",
        f"  tokens/s: {r['generated_tokens_per_s']:.1f} generated ({r['generated_tokens']} in "
        f"{r['seconds']:.2f}s incl. compilation), {r['step_tokens_per_s']:.1f} processed; "
        f"steady state (steps that compiled nothing) {r['steady_generated_tokens_per_s']:.1f} "
        f"generated",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
