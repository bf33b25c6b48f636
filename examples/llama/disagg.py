"""Disaggregated prefill on one machine: a prefill process computes each prompt and hands its
K/V to a decode process, which generates.

    python -m examples.llama.disagg [--model DIR] [--prompt-ids 1,2,3 ...] [--max-new-tokens N]
                                    [--num-draft-tokens K] [--json]

This process is the prefill engine: it starts the decode engine (``--role decode``, the same
module) as a child process, prefills every request (its first token sampled), exports the
sequence (``KVCacheManager.export_sequence``) and offers its pages on a
:class:`jax_kvcm.handoff.KVSender`; the ticket (a JSON line on the child's stdin) names them.
The decode engine pulls them (:class:`jax_kvcm.handoff.KVReceiver`, JAX's transfer server over
loopback), says so on its stdout (the prefill engine then drops its copy and closes the
sequence), imports the sequence (``import_sequence``) and, once every request arrived, decodes
them in lockstep (examples/llama/speculate.py; ``--num-draft-tokens K`` > 0 speculates there
too). The generated tokens equal the single-process runner's (greedy). Both processes load the
same checkpoint (the built-in random Llama, written once, by default).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


from . import loader
from .run import default_prompts, token_ids, write_default_checkpoint
from .serve_types import Request, ServeConfig
from .speculate import SpeculativeGenerator

SERVE = ServeConfig(page_size=8, device_pages=256, host_bytes=64 << 20, max_batch=8,
                    max_tokens_per_step=64, max_seq_len=512)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.llama.disagg",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", metavar="DIR", help="HF checkpoint (default: the built-in random "
                   "Llama, written to a temporary directory)")
    p.add_argument("--prompt-ids", action="append", default=[], type=token_ids,
                   metavar="1,2,3", help="a prompt (repeatable; default: the built-in prompts)")
    p.add_argument("--max-new-tokens", type=int, default=24, metavar="N")
    p.add_argument("--num-draft-tokens", type=int, default=0, metavar="K",
                   help="speculative drafts per step in the decode engine (default: 0)")
    p.add_argument("--json", action="store_true", help="one JSON object per request")
    p.add_argument("--role", choices=["prefill", "decode"], default="prefill",
                   help=argparse.SUPPRESS)
    return p


def _engine(path: Path, k: int) -> tuple[SpeculativeGenerator, str]:
    config, params, _ = loader.load_checkpoint(path, progress=False)
    return SpeculativeGenerator(params, config, SERVE, num_draft_tokens=k), f"{path.resolve()}"


def decode_role(args: argparse.Namespace) -> int:
    """Reads tickets from stdin until ``end``, imports each sequence, then decodes them all and
    prints one JSON line per request."""
    from jax_kvcm.handoff import KVReceiver
    engine, model_id = _engine(Path(args.model), args.num_draft_tokens)
    receiver, states = KVReceiver(), []
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("end"):
            break
        exp = receiver.fetch(msg)
        print(json.dumps({"pulled": msg["request_id"]}), flush=True)
        seq = engine.manager.import_sequence(exp, model_id)
        if seq is None:
            raise RuntimeError(f"request {msg['request_id']}: no device room to import it")
        req = Request(msg["prompt"], msg["max_new_tokens"])
        states.append(engine.state_of(req, msg["request_id"], seq, msg["first_token"]))
    for out in engine.finish(states):
        print(json.dumps({"request": out.request_id, **out.to_dict()}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.role == "decode":
        return decode_role(args)
    from jax_kvcm.handoff import KVSender
    tmp = None
    if args.model is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvcm-disagg-")
        args.model = str(write_default_checkpoint(Path(tmp.name)))
    prompts = args.prompt_ids or default_prompts()
    child = subprocess.Popen(
        [sys.executable, "-m", "examples.llama.disagg", "--role", "decode", "--model",
         args.model, "--num-draft-tokens", str(args.num_draft_tokens)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        cwd=str(Path(__file__).resolve().parents[2]))
    try:
        engine, model_id = _engine(Path(args.model), 0)
        sender = KVSender()
        for i, prompt in enumerate(prompts):
            state = engine.start(Request(prompt, args.max_new_tokens), i)
            ticket = sender.offer(engine.manager.export_sequence(state["seq"], model_id))
            ticket.update(request_id=i, prompt=[int(t) for t in prompt],
                          first_token=state["gen"][0], max_new_tokens=args.max_new_tokens)
            child.stdin.write(json.dumps(ticket) + "\n")
            child.stdin.flush()
            ack = json.loads(child.stdout.readline())   # pulled: our copy can go
            assert ack["pulled"] == i, ack
            sender.forget(ticket)
            engine.manager.close(state["seq"])
        child.stdin.write(json.dumps({"end": True}) + "\n")
        child.stdin.flush()
        outs = [json.loads(line) for line in child.stdout]
    finally:
        child.stdin.close()
        rc = child.wait(timeout=600)
        if tmp is not None:
            tmp.cleanup()
    if rc != 0:
        raise SystemExit(f"the decode engine failed (exit status {rc})")
    for d in sorted(outs, key=lambda d: d["request"]):
        if args.json:
            print(json.dumps(d))
        else:
            print(f"[request {d['request']}] generated ({len(d['generated_ids'])}): "
                  f"{d['generated_ids']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
