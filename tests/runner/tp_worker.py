"""The example Llama server with tensor parallelism (``ServeConfig(tensor_parallel=N)``,
``examples/llama/tp.py``) on ``N`` devices, against the same server on one device and against HF
transformers; run as a script by ``test_llama_tp.py`` in its own process (the CPU device count is
fixed when jax starts).

Usage: ``python tp_worker.py --devices N [--platform cpu|gpu] [--cases a,b] [--tp T[:a,b] ...]``
(``--tp`` repeated: several degrees in one process, each case's TP-1 runs shared; default
``--tp N``). Exits 0 when every check passes, after one ``OK ... tp=T cases=...`` line per degree.

Per model (float32 HF checkpoints with random weights, saved and loaded back through the loader):

- the TP-N server's greedy tokens equal the TP-1 server's, token for token, and its logits are
  within rel L2 1e-5 of TP-1's (only the all-reduce's summation order differs);
- every token is HF's greedy choice (one teacher-forced HF forward per request: each token the
  argmax at the position before it), logits within rel L2 1e-4 of HF's;
- prefix reuse happened on the sharded pools (a second wave reuses the first wave's pages);
- the pools are split over KV heads (``Hkv / N`` heads per device, or one replicated head each
  when ``Hkv < N``);
- the compiled decode and ragged steps hold exactly ``2 L`` all-reduces (one per attention
  block, one per MLP block), one all-gather of the logits when the vocabulary is split (none
  when it is not) and no other collective.

Cases: ``llama`` (GQA 4/2), ``tied`` (tied embeddings, one KV head: replicated for any N > 1;
vocabulary 126, split over 2 devices, not over 4), ``qwen2_mixed`` (q/k/v biases, sliding and
full layers: two KV groups with ring tables), ``qwen3`` (per-head q/k norms); ``llama`` also runs
with FP8 K/V pools (TP-N tokens equal TP-1's) and under page pressure with a small host tier
and a disk tier (suspends, offloads to host and disk, onboarding: every shard's piece of every
page moves; the tokens still equal TP-1's).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

WINDOW = 16
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
CASES = {
    "llama": ("llama", {}, (1.0, 0.6)),
    "tied": ("llama", dict(tie_word_embeddings=True, num_key_value_heads=1, vocab_size=126),
             (0.5, 1.5)),
    "qwen2_mixed": ("qwen2", dict(num_hidden_layers=4, use_sliding_window=True,
                                  sliding_window=WINDOW,
                                  layer_types=["sliding_attention", "full_attention",
                                               "sliding_attention", "sliding_attention"]),
                    (1.0, 0.6)),
    "qwen3": ("qwen3", {}, (1.0, 0.6)),
}
NEW_TOKENS = 12


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, required=True)
    ap.add_argument("--platform", default="cpu", choices=["cpu", "gpu"])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--tp", action="append", metavar="N[:CASES]",
                    help="a tensor-parallel degree to check (default: --devices), with its cases "
                         "after a colon (default: --cases); repeat it to check several degrees "
                         "in this process, each case against one TP-1 run")
    args = ap.parse_args()
    plan = []
    for spec in args.tp or [str(args.devices)]:
        n, _, cases = spec.partition(":")
        plan.append((int(n), (cases or args.cases).split(",")))
    if args.platform == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.devices}")
    import jax
    import jax_kvcm  # noqa: F401  (the installed package first; the repo root after)
    assert jax.device_count() >= args.devices >= max(n for n, _ in plan), (
        jax.devices(), args.devices, plan)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path += [os.path.dirname(here), os.path.dirname(os.path.dirname(here))]  # tests/, the root
    for name in CASES:
        degrees = [n for n, cases in plan if name in cases]
        if degrees:
            check_case(name, degrees)
    for n, cases in plan:
        print(f"OK devices={args.devices} tp={n} cases={','.join(cases)}")


def check_case(name: str, degrees: list[int]) -> None:
    """Case ``name``'s checkpoint and TP-1 runs, then :func:`check_degree` per TP degree."""
    import numpy as np

    from conftest import random_hf_llama
    from examples.llama import loader, serve

    kind, extra, (embed_std, scale) = CASES[name]
    hf = random_hf_llama(kind, {**BASE, **extra}, seed=7 + len(name), embed_std=embed_std,
                         weight_scale=scale)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d, safe_serialization=True)
        config, params, _ = loader.load_checkpoint(d, dtype="float32", progress=False)
    rng = np.random.default_rng(3)
    vocab = config.vocab_size
    system = [1] + rng.integers(3, vocab, 15).tolist()              # 4 pages of 4
    waves = [[system + rng.integers(3, vocab, 5).tolist()],
             [system + rng.integers(3, vocab, 9).tolist(), [1] + rng.integers(3, vocab, 2).tolist(),
              [1] + rng.integers(3, vocab, 22).tolist(), system[:9]]]

    def run(tp: int, kv_dtype: str = "auto", **tiers):
        srv = serve.Server(params, config, serve.ServeConfig(
            page_size=4, max_batch=4, max_tokens_per_step=16, max_seq_len=64,
            record_logits=True, tensor_parallel=tp, kv_dtype=kv_dtype,
            **(tiers or dict(device_pages=96))))
        outs = []
        for wave in waves:
            outs += srv.generate([serve.Request(p, NEW_TOKENS, eos_token_ids=()) for p in wave])
        return srv, outs

    _, want = run(1)
    fp8_one = run(1, "fp8")[1] if name == "llama" else None
    for n in degrees:
        check_degree(name, n, hf, config, run, waves, want, fp8_one)


def check_degree(name, n, hf, config, run, waves, want, fp8_one) -> None:
    """The TP-``n`` server against the TP-1 one's outputs ``want`` (``fp8_one``: its FP8 K/V
    outputs, ``llama`` only) and against ``hf``."""
    import torch

    srv, got = run(n)
    what = f"{name} tp={n}"
    hits = sum(o.prefix_hit_tokens for o in got)
    assert hits >= 16 and hits == sum(o.prefix_hit_tokens for o in want), (what, hits)
    prompts = [p for wave in waves for p in wave]
    for i, (a, b, p) in enumerate(zip(got, want, prompts)):
        assert a.generated_ids == b.generated_ids, (
            f"{what} request {i}: {a.generated_ids} != TP-1 {b.generated_ids}")
        err = rel_l2(a.logits, b.logits)
        assert err <= 1e-5, f"{what} request {i}: logits rel L2 {err:.2e} against TP-1"
        with torch.no_grad():
            ref = hf(torch.tensor([p + a.generated_ids]), use_cache=False).logits[0].numpy()
        ref = ref[len(p) - 1:len(p) - 1 + NEW_TOKENS]
        assert a.generated_ids == ref.argmax(-1).tolist(), (
            f"{what} request {i}: {a.generated_ids} != HF greedy {ref.argmax(-1).tolist()}")
        err = max(rel_l2(a.logits[j], ref[j]) for j in range(NEW_TOKENS))
        assert err <= 1e-4, f"{what} request {i}: logits rel L2 {err:.2e} against HF"
    assert len({t for o in got for t in o.generated_ids}) > 10, "degenerate generations"
    check_pools(srv, config, n, what)
    if n > 1:
        check_collectives(srv, config, n, what)
    if name == "llama":   # under page pressure: suspends, offloads and onboarding per shard
        with tempfile.TemporaryDirectory() as d:
            tight, outs = run(n, device_pages=14, host_bytes=8 << 10, disk_dir=d,
                              disk_bytes=1 << 20)
            rep = tight.report()
            tight.manager.shutdown()   # its disk file, before the directory goes
            del tight
        for i, (a, b) in enumerate(zip(outs, want)):
            assert a.generated_ids == b.generated_ids, (f"{what} under pressure request {i}: "
                                                        f"{a.generated_ids} != {b.generated_ids}")
        assert rep["suspends"] and rep["pages_offloaded_to_disk"] and rep["pages_onboarded"], rep
        print(f"{what} under pressure: suspends {rep['suspends']}, offloaded "
              f"{rep['pages_offloaded']} ({rep['pages_offloaded_to_disk']} to disk), onboarded "
              f"{rep['pages_onboarded']}", flush=True)
    if name == "llama":   # FP8 K/V pools: kv_scales split with the heads
        _, fp8_n = run(n, "fp8")
        for i, (a, b) in enumerate(zip(fp8_n, fp8_one)):
            assert a.generated_ids == b.generated_ids, (f"{what} fp8 request {i}: "
                                                        f"{a.generated_ids} != {b.generated_ids}")
    print(f"{what}: {len(got)} requests x {NEW_TOKENS} tokens equal TP-1 and HF; prefix hits "
          f"{hits} tokens", flush=True)


def rel_l2(a, b) -> float:
    import numpy as np
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def check_pools(srv, config, n: int, what: str) -> None:
    hkv = max(config.num_key_value_heads, n)
    for k, v in srv.manager.caches:
        for a in (k, v):
            assert len(a.sharding.device_set) == n, (what, a.sharding)
            shapes = {s.data.shape[3] for s in a.addressable_shards}
            assert shapes == {hkv // n}, (what, shapes)


def check_collectives(srv, config, n: int, what: str) -> None:
    """Compiles the server's decode and ragged steps at batch 4 and counts collectives."""
    import jax.numpy as jnp
    import numpy as np

    from examples.llama import tp
    caches = srv.manager.caches
    k, v = (caches[0] if len(caches) == 1 else tuple(zip(*caches)))
    groups = config.kv_groups()
    G, B = len(groups), 4
    rings = tuple(w if win else 0 for (win, _), w in zip(groups, srv.kv_config.table_widths))
    lead = () if G == 1 else (G,)
    i32 = jnp.int32
    table = jnp.zeros(lead + (B, max(srv.kv_config.table_widths)), i32)
    common = dict(config=config, rings=rings, mesh=srv.mesh)
    texts = {
        "decode": tp.decode_step.lower(
            srv.params, k, v, jnp.zeros(B, i32), jnp.zeros(B, i32), jnp.zeros(lead + (B,), i32),
            table, jnp.ones(B, i32), **common),
        "ragged": tp.forward_step.lower(
            srv.params, k, v, jnp.zeros(8, i32), jnp.zeros(8, i32), jnp.zeros(lead + (8,), i32),
            table, jnp.ones(B, i32), jnp.asarray(np.arange(B + 1), i32), **common),
    }
    gathers = int(config.vocab_size % n == 0)
    for kind, lowered in texts.items():
        counts = tp.collective_counts(lowered.compile().as_text())
        want = {"all-reduce": 2 * config.num_hidden_layers, "all-gather": gathers,
                "reduce-scatter": 0, "all-to-all": 0, "collective-permute": 0}
        assert counts == want, f"{what} {kind} step: collectives {counts}, expected {want}"


if __name__ == "__main__":
    main()
