"""Runs the example Llama server on a HF checkpoint (or a built-in random one) and prints each
generation and the KV report.

    python examples/llama/run.py                      # built-in default (CPU: a few seconds)
    python examples/llama/run.py --model DIR --prompt "Hello" --max-new-tokens 64
    python examples/llama/run.py --prompt-ids 1,5,9 --prompt-ids 1,5,7 --json
    python examples/llama/run.py --kv-dtype fp8      # K/V pools in float8_e4m3fn
    python examples/llama/run.py --quantize fp8      # FP8 weights and GEMMs (fp8_weights.py)
    python examples/llama/run.py --quantize fp8 --static-input-scales 256  # + static act. scales
    python examples/llama/run.py --tensor-parallel 2  # split over 2 devices (examples/llama/tp.py)

With no ``--model``, a small Llama (2 layers, hidden 128, vocab 512) with deterministic random
weights is written as a HF-format checkpoint into a temporary directory and loaded back through
the loader; its built-in prompts (token ids: the random model has no tokenizer) share a 40-token
prefix. The first prompt runs alone, then the rest as one batch, so the later ones reuse its
committed prefix pages (a batch admitted at once cannot reuse pages none of it has written yet).
The default device pool is small enough that the batch runs under pressure: cached pages move to
the host tier and running sequences are suspended and resumed.

Each generation is printed as soon as it completes (``--json``: one JSON object per request,
``request``, ``prompt_ids``, ``generated_ids``, ``finish_reason``, ..., in completion order),
then the KV report (``--json``: one ``{"kv_report": {...}}``). Every argument is checked before
the checkpoint is loaded; a bad one ends the run with ``run.py: error: ...`` (exit status 2),
never a traceback. Sizes take units: ``4GiB``, ``512MiB``, ``64K`` (binary), ``1GB`` (decimal).
Needs the ``llama`` extra (``pip install ".[llama]"``: safetensors, tokenizers, tqdm).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import jax_kvcm  # noqa: F401  (the installed package first; then the repo root)

if not __package__:  # run as a script (python examples/llama/run.py): import the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    __package__ = "examples.llama"

import numpy as np  # noqa: E402

from . import fp8_weights  # noqa: E402
from . import loader  # noqa: E402  (safetensors etc. are imported on use)
from . import model as llama  # noqa: E402
from . import serve  # noqa: E402
from .hot_backend import HOT_BACKENDS  # noqa: E402

DEFAULT_CONFIG = llama.LlamaConfig(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
    max_position_embeddings=1024, bos_token_id=1, eos_token_ids=(2,), dtype="float32")

EXTRA = ("safetensors", "tokenizers", "tqdm")  # the package's "llama" extra


def missing_extra() -> list[str]:
    """The runner's dependencies (the ``llama`` extra) that are not installed."""
    def missing(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is None
        except (ImportError, ValueError):
            return True
    return [m for m in EXTRA if missing(m)]


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20,
          "mib": 1 << 20, "mb": 10**6, "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
          "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}


def size(text: str) -> int:
    """A byte count: an integer with an optional unit (``B``; ``K``/``KiB``, ``M``/``MiB``,
    ``G``/``GiB``, ``T``/``TiB`` binary; ``KB``, ``MB``, ``GB``, ``TB`` decimal)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4GiB, 512MiB, 65536)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole number of bytes: {text!r}")
    return int(value)


def count(minimum: int):
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {n}")
        return n
    parse.__name__ = "integer"
    return parse


def real(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
    return x


def token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("got an empty list")
    if min(ids) < 0:
        raise argparse.ArgumentTypeError(f"token ids must be >= 0, got {min(ids)}")
    return ids


# --static-input-scales FILE: the calibration text's first this many tokens.
CALIBRATION_TOKENS = 2048


def calibration_source(text: str) -> int | Path:
    """``--static-input-scales``: a token count (that many random token ids, seed 0) or the path
    of a UTF-8 text file (tokenized with the checkpoint's tokenizer)."""
    if text.strip().isdigit():
        n = int(text)
        if n < 1:
            raise argparse.ArgumentTypeError(f"a token count must be >= 1, got {n}")
        return n
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"neither a token count nor a file: {text!r}")
    return path


def build_parser() -> argparse.ArgumentParser:
    """The runner's command line: prompts and sampling, then :func:`add_engine_args`."""
    p = argparse.ArgumentParser(
        prog="run.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--prompt", action="append", default=[], metavar="TEXT",
      help="a text prompt (repeatable; needs tokenizer.json in --model; default: none)")
    a("--prompt-ids", action="append", default=[], metavar="1,2,3", type=token_ids,
      help="a prompt as token ids (repeatable; default: none, the built-in model's prompts "
           "when no prompt is given)")
    a("--max-new-tokens", type=count(1), default=24, metavar="N",
      help="new tokens per request (default: %(default)s)")
    a("--temperature", type=real, default=0.0, metavar="T",
      help="0 is greedy (default: %(default)s)")
    a("--top-p", type=real, default=1.0, metavar="P", help="in (0, 1] (default: %(default)s)")
    a("--seed", type=count(0), default=0, metavar="N", help="sampling seed (default: %(default)s)")
    a("--json", action="store_true",
      help="one JSON object per request, then one with the KV report (default: text)")
    a("--speculate", choices=["none", "ngram", "draft"], default="none",
      help="speculative decoding: ngram (drafts by prompt lookup from the request's own "
           "tokens) or draft (a draft model's greedy tokens, --draft-model); drafts verified "
           "in one step, rejected ones rolled back; greedy output unchanged; requests run in "
           "lockstep, max_batch at a time, without preemption (default: %(default)s)")
    a("--num-draft-tokens", type=count(1), default=4, metavar="K",
      help="drafts per step with --speculate (default: %(default)s)")
    a("--draft-model", default=None, metavar="DIR",
      help="the draft model's checkpoint for --speculate draft (same vocabulary; default: the "
           "model itself, which accepts every draft: a check, not a speed-up)")
    add_engine_args(p)
    return p


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The model, tier, codec and batching flags (shared with examples/llama/server.py; checked
    by :func:`check_engine_args`)."""
    a = p.add_argument
    a("--model", metavar="DIR",
      help="HF checkpoint directory (default: a built-in random Llama written to a temporary "
           "directory)")
    a("--dtype", choices=["float32", "bfloat16", "float16"],
      help="override the checkpoint dtype (default: the checkpoint's)")
    a("--page-size", type=count(1), default=8, metavar="N",
      help="tokens per page (default: %(default)s)")
    a("--device-pages", type=count(1), default=None, metavar="N",
      help="device pages (default: 20 for the built-in model, else 1024)")
    a("--host-bytes", type=size, default=None, metavar="SIZE",
      help="host tier size, e.g. 4GiB (default: 4MiB for the built-in model, else 0: none)")
    a("--disk-dir", default=None, metavar="DIR",
      help="disk tier directory, created if missing (default: no disk tier)")
    a("--disk-bytes", type=size, default=None, metavar="SIZE",
      help="disk tier size, e.g. 64GiB (default: 64MiB with --disk-dir)")
    a("--cold-codec", choices=sorted(serve.CODECS), default="concat",
      help="cold page codec (default: %(default)s)")
    a("--kv-dtype", choices=sorted(serve.KV_DTYPES), default="auto",
      help="K/V cache dtype: auto (the model's) or fp8 (float8_e4m3fn, scales from the "
           "checkpoint's k_scale/v_scale tensors, else 1.0; needs --cold-codec concat) "
           "(default: %(default)s)")
    a("--quantize", choices=sorted(fp8_weights.QUANTIZE_CHOICES), default=None,
      help="quantize the layers' linear weights at load time to float8_e4m3fn and run FP8 "
           "GEMMs: fp8 (a scale per output channel), fp8-tensor (one per weight); activations "
           "per token; an FP8 checkpoint loads in FP8 without it; one device only "
           "(default: as stored)")
    a("--static-input-scales", type=calibration_source, default=None, metavar="N|FILE",
      help="static FP8 activation scales (max|x| / 448 of each linear's input over one "
           "prefill, fp8_weights.calibrate_input_scales) instead of per-token ones: over N "
           f"random tokens, or a text file's first {CALIBRATION_TOKENS} tokens (needs the "
           "checkpoint's tokenizer.json); needs FP8 weights (--quantize or an FP8 checkpoint); "
           "replaces a checkpoint's input_scale (default: none)")
    a("--max-batch", type=count(1), default=8, metavar="N",
      help="most sequences per step (default: %(default)s)")
    a("--max-tokens-per-step", type=count(1), default=64, metavar="N",
      help="token budget of one step, chunked prefill; >= --max-batch (default: %(default)s)")
    a("--max-seq-len", type=count(1), default=512, metavar="N",
      help="prompt + new tokens per request (default: %(default)s)")
    a("--tensor-parallel", type=count(1), default=1, metavar="N",
      help="split the model (Megatron-style) and the K/V pools (over KV heads) over the first "
           "N devices (default: %(default)s)")
    a("--hot-backend", choices=HOT_BACKENDS, default="paged",
      help="what holds the K/V pools on the device: paged (preallocated) or arena (virtual "
           "reservations mapped on demand, a contiguous range per sequence; one device; "
           "sliding-window layers stay paged); --device-pages pages either way "
           "(default: %(default)s)")
    a("--cascade", action="store_true",
      help="decode steps read each shared prefix (a system prompt the prefix cache shares) "
           "once per group of rows instead of once per row (cascade attention; one device, "
           "no sliding-window layers)")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every check that needs no checkpoint, so a bad argument fails before the (slow) load."""
    if args.temperature < 0:
        p.error(f"argument --temperature: must be >= 0, got {args.temperature}")
    if not 0.0 < args.top_p <= 1.0:
        p.error(f"argument --top-p: must be in (0, 1], got {args.top_p}")
    check_engine_args(p, args)
    if args.model is None:
        if args.prompt:
            p.error("argument --prompt: the built-in model has no tokenizer: use --prompt-ids, "
                    "or --model with a tokenizer.json")
    else:
        m = Path(args.model)
        if not args.prompt and not args.prompt_ids:
            p.error("argument --model: needs --prompt or --prompt-ids")
        if args.prompt and not (m / "tokenizer.json").is_file():
            p.error(f"argument --prompt: needs a tokenizer.json in the model directory ({m}); "
                    "use --prompt-ids instead")
    for ids in args.prompt_ids:
        if len(ids) + args.max_new_tokens > args.max_seq_len:
            p.error(f"argument --prompt-ids: {len(ids)} prompt + {args.max_new_tokens} new "
                    f"tokens exceed --max-seq-len {args.max_seq_len}")


def check_engine_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The checks of :func:`add_engine_args`' flags that need no checkpoint (``p.error`` on the
    first bad one); fills in ``args.disk_bytes`` (64 MiB with ``--disk-dir``, else 0) and
    creates ``--disk-dir``."""
    if args.max_tokens_per_step < args.max_batch:
        p.error(f"argument --max-tokens-per-step: must be >= --max-batch ({args.max_batch}), "
                f"got {args.max_tokens_per_step}")
    if args.kv_dtype == "fp8" and args.cold_codec == "int8":
        p.error("argument --kv-dtype: fp8 needs --cold-codec concat (the int8 codec does not "
                "take fp8 pools)")
    if args.disk_bytes and not args.disk_dir:
        p.error("argument --disk-bytes: needs --disk-dir")
    if args.disk_dir is not None:
        d = Path(args.disk_dir)
        if d.exists() and not d.is_dir():
            p.error(f"argument --disk-dir: {d} exists and is not a directory")
        if args.disk_bytes == 0:
            p.error("argument --disk-bytes: must be > 0 with --disk-dir")
        if args.disk_bytes is None:
            args.disk_bytes = 64 << 20
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            p.error(f"argument --disk-dir: cannot create {d}: {e.strerror or e}")
        if not os.access(d, os.W_OK | os.X_OK):
            p.error(f"argument --disk-dir: {d} is not writable")
    else:
        args.disk_bytes = 0
    if args.static_input_scales is not None and args.model is None and args.quantize is None:
        p.error("argument --static-input-scales: needs FP8 weights: add --quantize (the "
                "built-in model is not FP8)")
    if args.quantize and args.tensor_parallel > 1:
        p.error(f"argument --quantize: {args.quantize} weights are not split for tensor "
                "parallelism (examples/llama/tp.py shards float weights only); drop "
                "--tensor-parallel or --quantize")
    if args.tensor_parallel > 1:
        import jax
        if args.tensor_parallel > jax.device_count():
            p.error(f"argument --tensor-parallel: {args.tensor_parallel} devices asked, "
                    f"{jax.device_count()} visible")
    if args.model is not None:
        m = Path(args.model)
        if not m.is_dir():
            p.error(f"argument --model: {m} is not a directory")
        if not (m / "config.json").is_file():
            p.error(f"argument --model: {m} has no config.json (not a HF checkpoint)")


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    missing = missing_extra()
    if missing:
        parser.error(f"the Llama runner needs {', '.join(missing)} (the package's 'llama' "
                     "extra): pip install \"jax_kvcm[llama]\" (from the repository: "
                     "pip install \".[llama]\")")
    check_args(parser, args)

    default_model = args.model is None
    cfg = serve_config(parser, args)
    t0 = time.perf_counter()
    path, config, params, tokenizer, tmp = load_model(parser, args, progress=not args.json)
    load_s = time.perf_counter() - t0

    prompts: list[list[int]] = []
    if args.prompt:
        prompts += [tokenizer.encode(t).ids for t in args.prompt]
    prompts += args.prompt_ids
    builtin = not prompts
    if builtin:
        prompts = default_prompts()

    if not args.json:
        kv = "fp8" + (" (checkpoint scales)" if "kv_scales" in params else " (scales 1.0)")
        weights = "fp8" if fp8_weights.has_fp8_weights(params) else config.dtype
        if args.static_input_scales is not None:
            weights += " (static activation scales)"
        print(f"model: {'built-in random Llama' if default_model else path} "
              f"({config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab "
              f"{config.vocab_size}, {config.dtype}, K/V "
              f"{kv if args.kv_dtype == 'fp8' else config.dtype}, weights {weights}); loaded "
              f"in {load_s:.2f}s; "
              f"{len(prompts)} requests", flush=True)

    def emit(out) -> None:
        if args.json:
            d = {"request": out.request_id, **out.to_dict()}
            if tokenizer is not None:
                d["text"] = tokenizer.decode(out.generated_ids)
            print(json.dumps(d), flush=True)
            return
        print(f"\n[request {out.request_id}] prompt ({len(out.prompt_ids)} tokens, "
              f"{out.prefix_hit_tokens} from the prefix cache): {out.prompt_ids}")
        print(f"  generated ({len(out.generated_ids)}, {out.finish_reason}): "
              f"{out.generated_ids}")
        if tokenizer is not None:
            print(f"  text: {tokenizer.decode(out.generated_ids)!r}")
        sys.stdout.flush()

    if args.speculate != "none":
        return _speculate(parser, args, params, config, cfg, prompts, emit, tmp)
    try:
        server = serve.Server(params, config, cfg)
        requests = [serve.Request(p, args.max_new_tokens, temperature=args.temperature,
                                  top_p=args.top_p, seed=args.seed) for p in prompts]
        # Built-in prompts: the first alone, then the rest (they reuse its prefix pages).
        waves = [requests[:1], requests[1:]] if builtin else [requests]
        for wave in waves:
            for r in wave:
                server.submit(r)
            while server.has_work():  # each generation is printed as soon as it completes
                for out in sorted(server.step(), key=lambda o: o.request_id):
                    emit(out)
    except ValueError as e:
        parser.error(str(e))
    report = server.report()
    report["load_seconds"] = load_s
    report["model"] = "built-in random Llama" if default_model else str(path)
    if args.json:
        print(json.dumps({"kv_report": report}))
    else:
        print("\n" + format_report(report))
    if tmp is not None:
        tmp.cleanup()
    return 0


def _speculate(parser, args, params, config, cfg, prompts, emit, tmp) -> int:
    """``--speculate ngram|draft``: the requests through examples/llama/speculate.py."""
    from .speculate import SpeculativeGenerator
    draft = None
    if args.speculate == "draft":
        draft = (params, config)
        if args.draft_model is not None:
            try:
                dconfig, dparams, _ = loader.load_checkpoint(Path(args.draft_model),
                                                             dtype=args.dtype, progress=False,
                                                             quantize=args.quantize)
            except (ValueError, OSError) as e:
                parser.error(f"argument --draft-model: cannot load {args.draft_model}: {e}")
            draft = (dparams, dconfig)
    elif args.draft_model is not None:
        parser.error("argument --draft-model: only with --speculate draft")
    try:
        gen = SpeculativeGenerator(params, config, cfg, num_draft_tokens=args.num_draft_tokens,
                                   draft=draft)
        requests = [serve.Request(p, args.max_new_tokens, temperature=args.temperature,
                                  top_p=args.top_p, seed=args.seed) for p in prompts]
        for out in gen.generate(requests):
            emit(out)
    except ValueError as e:
        parser.error(str(e))
    st = gen.stats
    rate = st["accepted"] / st["drafted"] if st["drafted"] else 0.0
    if args.json:
        print(json.dumps({"speculation_report": {**st, "acceptance_rate": rate}}))
    else:
        print(f"\nspeculation: {st['generated']} tokens in {st['steps']} verify steps, "
              f"{st['accepted']} of {st['drafted']} drafts accepted ({rate:.0%})")
    gen.manager.shutdown()
    if gen.draft is not None:
        gen.draft.manager.shutdown()
    if tmp is not None:
        tmp.cleanup()
    return 0


def serve_config(p: argparse.ArgumentParser, args: argparse.Namespace,
                 **overrides) -> serve.ServeConfig:
    """The ServeConfig of :func:`add_engine_args`' flags (after :func:`check_engine_args`);
    the built-in model gets a small device pool and a host tier, so that it runs under
    pressure. ``overrides``: other ServeConfig fields. A bad combination ends with
    ``p.error``."""
    default_model = args.model is None
    device_pages = args.device_pages or (20 if default_model else 1024)
    host_bytes = args.host_bytes if args.host_bytes is not None else (
        (4 << 20) if default_model else 0)
    try:
        return serve.ServeConfig(
            page_size=args.page_size, device_pages=device_pages, host_bytes=host_bytes,
            disk_dir=args.disk_dir, disk_bytes=args.disk_bytes, cold_codec=args.cold_codec,
            max_batch=args.max_batch, max_tokens_per_step=args.max_tokens_per_step,
            max_seq_len=args.max_seq_len, kv_dtype=args.kv_dtype,
            tensor_parallel=args.tensor_parallel, hot_backend=args.hot_backend,
            cascade=args.cascade, **overrides)
    except ValueError as e:
        p.error(str(e))


def load_model(p: argparse.ArgumentParser, args: argparse.Namespace, *, progress: bool = True,
               write_default=None):
    """``(path, config, params, tokenizer, tmp)`` for ``--model``, or for the built-in random
    Llama written by ``write_default(directory) -> path`` (default:
    :func:`write_default_checkpoint`) into ``tmp``, a ``TemporaryDirectory`` the caller cleans
    up (None with ``--model``). A checkpoint that does not load ends with ``p.error``."""
    tmp = None
    if args.model is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvcm-llama-")
        path = (write_default or write_default_checkpoint)(Path(tmp.name))
    else:
        path = Path(args.model)
    try:
        config, params, tokenizer = loader.load_checkpoint(path, dtype=args.dtype,
                                                           progress=progress,
                                                           quantize=args.quantize)
    except (ValueError, OSError) as e:
        if tmp is not None:
            tmp.cleanup()
        p.error(f"cannot load {path}: {e}")
    if args.tensor_parallel > 1 and fp8_weights.has_fp8_weights(params):
        p.error(f"argument --tensor-parallel: {path} has FP8 weights, which are not split for "
                "tensor parallelism (examples/llama/tp.py); use --tensor-parallel 1")
    if args.static_input_scales is not None:
        params = calibrate(p, args.static_input_scales, config, params, tokenizer)
    return path, config, params, tokenizer, tmp


def calibrate(p: argparse.ArgumentParser, source: int | Path, config, params, tokenizer):
    """``params`` with static activation scales calibrated over ``source`` (see
    :func:`calibration_source`); a model without FP8 weights, or a text file without a
    tokenizer, ends with ``p.error``."""
    if not fp8_weights.has_fp8_weights(params):
        p.error("argument --static-input-scales: needs FP8 weights (--quantize, or an FP8 "
                "checkpoint)")
    if isinstance(source, int):
        tokens = np.random.default_rng(0).integers(0, config.vocab_size, source).tolist()
    else:
        if tokenizer is None:
            p.error(f"argument --static-input-scales: {source} is text and the model has no "
                    "tokenizer.json; give a token count instead")
        try:
            text = source.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            p.error(f"argument --static-input-scales: cannot read {source}: {e}")
        tokens = tokenizer.encode(text).ids[:CALIBRATION_TOKENS]
        if not tokens:
            p.error(f"argument --static-input-scales: {source} has no tokens")
    return fp8_weights.calibrate_input_scales(params, config, tokens)


def write_default_checkpoint(directory: Path) -> Path:
    """The built-in random Llama (:data:`DEFAULT_CONFIG`, seed 0) as a HF checkpoint under
    ``directory``; returns its path."""
    return loader.write_random_checkpoint(directory / "random-llama", DEFAULT_CONFIG, seed=0)


def default_prompts() -> list[list[int]]:
    rng = np.random.default_rng(1234)
    system = [1] + rng.integers(3, 512, 39).tolist()          # 40 shared tokens (5 pages of 8)
    return [system + rng.integers(3, 512, n).tolist() for n in (6, 13, 2, 21, 9)]


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
        f"onboarded: {r['pages_onboarded']}; codec {r['cold_codec']}; K/V {r['kv_dtype']}",
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
