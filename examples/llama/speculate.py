"""Speculative decoding on the KV-cache manager: drafts by prompt lookup (n-gram drafts from a
sequence's own tokens) or from a small draft model, ``k`` verified at a time in one ragged step,
the rejected ones rolled back with :meth:`KVCacheManager.truncate` (in the draft model's manager
too).

One step of a sequence feeds ``[last] + drafts`` (``last``: its newest token, not yet in the
cache) and takes the logits of every fed position: position ``i`` predicts the token after
``drafts[:i]``. Greedy: the longest prefix of drafts equal to the predictions is accepted and the
prediction after it is the next token, so the output equals plain greedy decoding token for
token. Sampling: :func:`accept_sampled`, the speculative sampling rule for a proposal that is
one token (a point mass), so the output follows the model's own distribution. Either way the
K/V of the rejected drafts is truncated before the next step.

- :func:`propose_ngram`: the drafts (the tokens that followed the latest earlier occurrence of the
  context's last ``n`` tokens, ``n`` from ``max_ngram`` down to 1);
- :func:`accept_greedy`, :func:`accept_sampled`: how many drafts a step keeps, and the next token;
- :class:`SpeculativeGenerator`: a batch of requests generated in lockstep (no preemption: the
  device pages must hold them; a simple loop for the example, next to the continuous-batching
  :class:`~examples.llama.scheduler.Server`). With ``draft=(params, config)`` (a model of the
  same vocabulary) the drafts are that model's greedy tokens: it keeps its own sequence per
  request in its own manager, fed one draft position a step for every request at once, and cut
  back to the accepted tokens after each verification. Its drafts are point masses too, so the
  sampling rule stays exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvcm import KVCacheManager

from . import model as llama
from .serve_types import Request, RequestOutput, ServeConfig, kv_cache_config
from .step import model_caches, step_kv_config

__all__ = ["SpeculativeGenerator", "accept_greedy", "accept_sampled", "propose_ngram"]


def propose_ngram(context: Sequence[int], k: int, max_ngram: int = 3) -> list[int]:
    """Up to ``k`` draft tokens: for ``n = max_ngram .. 1``, the latest earlier occurrence of the
    context's last ``n`` tokens, and the tokens that followed it; ``[]`` when none matches."""
    ctx = list(context)
    for n in range(min(max_ngram, len(ctx) - 1), 0, -1):
        tail = ctx[-n:]
        for start in range(len(ctx) - n - 1, -1, -1):
            if ctx[start:start + n] == tail:
                return ctx[start + n:start + n + k]
    return []


def accept_greedy(drafts: Sequence[int], preds: Sequence[int]) -> tuple[int, int]:
    """``(accepted, next_token)``: ``preds[i]`` is the greedy token after ``drafts[:i]``
    (``len(preds) == len(drafts) + 1``)."""
    a = 0
    while a < len(drafts) and int(preds[a]) == int(drafts[a]):
        a += 1
    return a, int(preds[a])


def accept_sampled(probs: np.ndarray, drafts: Sequence[int],
                   rng: np.random.Generator) -> tuple[int, int]:
    """``(accepted, next_token)`` by speculative sampling with a point-mass proposal:
    ``probs [len(drafts) + 1, V]`` the model's distributions at the fed positions. Draft ``i``
    is kept with probability ``p_i(d_i)``; at the first rejection the token is drawn from
    ``p_i`` without ``d_i`` (``max(p - q, 0)`` renormalized); after every draft is kept, from
    ``p_k``. Each output token is distributed as ``p`` given the tokens before it."""
    for i, d in enumerate(drafts):
        p = probs[i]
        if rng.random() < p[d]:
            continue
        rest = p.astype(np.float64).copy()
        rest[d] = 0.0
        total = rest.sum()
        if total <= 0.0:  # p was a point mass on d after all (rounding): keep it
            continue
        return i, int(rng.choice(rest.size, p=rest / total))
    p = probs[len(drafts)].astype(np.float64)
    return len(drafts), int(rng.choice(p.size, p=p / p.sum()))


class SpeculativeGenerator:
    """Greedy or sampled generation with prompt-lookup or draft-model drafts (see the module
    doc).

    ``serve``: the manager's shape (pages, ``max_batch``, ``max_tokens_per_step``, which must
    hold ``max_batch x (num_draft_tokens + 1)`` tokens; the draft model's manager gets the same);
    ``num_draft_tokens``: ``k``; ``draft``: ``(params, config)`` of a draft model, or None for
    n-gram lookup."""

    def __init__(self, params: Any, config: llama.LlamaConfig, serve: ServeConfig | None = None,
                 *, num_draft_tokens: int = 4, max_ngram: int = 3,
                 draft: tuple[Any, llama.LlamaConfig] | None = None) -> None:
        serve = serve or ServeConfig()
        if num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be >= 0 (0: plain decoding), got "
                             f"{num_draft_tokens}")
        if serve.max_batch * (num_draft_tokens + 1) > serve.max_tokens_per_step:
            raise ValueError(f"max_tokens_per_step {serve.max_tokens_per_step} cannot hold "
                             f"max_batch {serve.max_batch} x (num_draft_tokens "
                             f"{num_draft_tokens} + 1) tokens")
        if draft is not None and draft[1].vocab_size != config.vocab_size:
            raise ValueError(f"draft: its vocabulary has {draft[1].vocab_size} tokens, the "
                             f"model's {config.vocab_size}")
        self.params, self.config, self.serve = params, config, serve
        self.k, self.max_ngram = num_draft_tokens, max_ngram
        self.target = _Model(params, config, serve, num_draft_tokens)
        self.draft = None if draft is None else _Model(*draft, serve, num_draft_tokens)
        self.kv_config, self.manager = self.target.kv_config, self.target.manager
        self.stats = {"steps": 0, "drafted": 0, "accepted": 0, "generated": 0}

    def generate(self, requests: Sequence[Request]) -> list[RequestOutput]:
        """Generates every request, in lockstep waves of at most ``max_batch`` whose pages fit
        the device pool at their longest (prompt, new tokens and one step's drafts)."""
        serve, out, wave, pages, first = self.serve, [], [], 0, 0
        cap = self.manager.device_capacity_pages
        for i, req in enumerate(requests):
            need = -(-(len(req.prompt) + req.max_new_tokens + self.k) // serve.page_size)
            if need > cap:
                raise ValueError(f"device_pages: request {i} needs {need} pages at its longest, "
                                 f"the pool has {cap}")
            if wave and (len(wave) == serve.max_batch or pages + need > cap):
                out.extend(self._generate(wave, first_id=first))
                wave, pages, first = [], 0, i
            wave.append(req)
            pages += need
        if wave:
            out.extend(self._generate(wave, first_id=first))
        return out

    def _next(self, logits: np.ndarray, req: Request, rng: np.random.Generator) -> int:
        if req.temperature == 0.0:
            return int(np.argmax(logits))
        return int(rng.choice(logits.size, p=_softmax(logits, req.temperature)))

    def start(self, req: Request, request_id: int) -> dict[str, Any]:
        """Admits and prefills one request; its state for :meth:`finish` (``"seq"``: its
        sequence, ``"gen"``: ``[first generated token]``, not yet in the cache)."""
        if req.temperature > 0.0 and req.top_p < 1.0:
            raise ValueError("top_p: speculative sampling here samples the full "
                             "distribution (top_p must be 1.0)")
        prompt = np.asarray(req.prompt, np.int32)
        seq = self.manager.add_sequence(prompt)
        rng = np.random.default_rng(req.seed)
        first = self._next(self.target.prefill(seq, prompt), req, rng)
        return self.state_of(req, request_id, seq, first, seq.num_reused_tokens, rng)

    def state_of(self, req: Request, request_id: int, seq: Any, first: int, hit: int = 0,
                 rng: np.random.Generator | None = None) -> dict[str, Any]:
        """The state of a prefilled sequence (e.g. imported from a prefill engine)."""
        eos = (set(req.eos_token_ids) if req.eos_token_ids is not None
               else set(self.config.eos_token_ids))
        prompt = [int(t) for t in req.prompt]
        dseq = None
        if self.draft is not None:   # the draft model's own sequence, its prompt prefilled
            dseq = self.draft.manager.add_sequence(np.asarray(prompt, np.int32))
            self.draft.prefill(dseq, np.asarray(prompt, np.int32))
        return dict(req=req, seq=seq, rng=rng or np.random.default_rng(req.seed), gen=[first],
                    eos=eos, ended=first in eos, hit=hit, prompt=prompt, id=request_id,
                    dseq=dseq)

    def _generate(self, reqs: list[Request], first_id: int) -> list[RequestOutput]:
        return self.finish([self.start(req, first_id + j) for j, req in enumerate(reqs)])

    def finish(self, state: list[dict[str, Any]]) -> list[RequestOutput]:
        """Decodes the started requests in lockstep to their end; closes their sequences."""
        mgr = self.manager
        live = [s for s in state if not self._done(s)]
        while live:
            drafts = self._propose(live)
            work = [(s["seq"], np.asarray([s["gen"][-1]] + d, np.int32))
                    for s, d in zip(live, drafts)]
            greedy = all(s["req"].temperature == 0.0 for s in live)
            for s, d, logits in zip(live, drafts, self.target.forward(work, greedy=greedy)):
                req = s["req"]
                if greedy:
                    a, nxt = accept_greedy(d, logits)
                elif req.temperature == 0.0:
                    a, nxt = accept_greedy(d, np.argmax(logits, axis=-1))
                else:
                    a, nxt = accept_sampled(_softmax(logits, req.temperature), d, s["rng"])
                seq = s["seq"]
                if not mgr.truncate(seq, seq.num_tokens - (len(d) - a)):  # rejected drafts' K/V
                    raise RuntimeError(f"request {s['id']}: the manager refused to roll back "
                                       f"{len(d) - a} rejected drafts (an arena range another "
                                       "sequence reads)")
                if s["dseq"] is not None:   # its K/V past the accepted drafts goes too
                    self.draft.manager.truncate(
                        s["dseq"], min(s["dseq"].num_tokens,
                                       len(s["prompt"]) + len(s["gen"]) + a))
                new = d[:a] + [nxt]
                s["gen"].extend(new)
                s["ended"] = s["ended"] or any(t in s["eos"] for t in new)
                self.stats["drafted"] += len(d)
                self.stats["accepted"] += a
            self.stats["steps"] += 1
            live = [s for s in live if not self._done(s)]
        outs = []
        for s in state:
            gen, reason = self._trim(s)
            self.stats["generated"] += len(gen)
            mgr.close(s["seq"])
            if s["dseq"] is not None:
                self.draft.manager.close(s["dseq"])
            outs.append(RequestOutput(request_id=s["id"], prompt_ids=s["prompt"],
                                      generated_ids=gen, finish_reason=reason,
                                      prefix_hit_tokens=s["hit"]))
        return outs

    def _propose(self, live: list[dict]) -> list[list[int]]:
        """Each live request's drafts (at most ``k``, and one fewer than the tokens it still
        needs): n-gram lookup, or the draft model's greedy tokens, all rows in one step per
        draft position (its first step feeds the tokens the draft model has not seen)."""
        want = [min(self.k, s["req"].max_new_tokens - len(s["gen"]) - 1) for s in live]
        if self.draft is None:
            return [propose_ngram(s["prompt"] + s["gen"], n, self.max_ngram)
                    for s, n in zip(live, want)]
        drafts: list[list[int]] = [[] for _ in live]
        feed = [np.asarray((s["prompt"] + s["gen"])[s["dseq"].num_tokens:], np.int32)
                for s in live]
        for i in range(max(want, default=0)):
            rows = [b for b, n in enumerate(want) if n > i]
            preds = self.draft.forward([(live[b]["dseq"], feed[b]) for b in rows],
                                       greedy=True, last_only=True)
            for b, p in zip(rows, preds):
                drafts[b].append(int(p[0]))
                feed[b] = np.asarray(drafts[b][-1:], np.int32)
        return drafts

    @staticmethod
    def _done(s: dict) -> bool:
        return len(s["gen"]) >= s["req"].max_new_tokens or s["ended"]

    @staticmethod
    def _trim(s: dict) -> tuple[list[int], str]:
        gen = s["gen"]
        for i, t in enumerate(gen):
            if t in s["eos"]:
                return gen[:i + 1], "eos"
        return gen[:s["req"].max_new_tokens], "length"


class _Model:
    """A model with its own KV-cache manager (``rollback`` tokens of window slack) and its
    ragged steps: the target of :class:`SpeculativeGenerator`, or its draft model."""

    def __init__(self, params: Any, config: llama.LlamaConfig, serve: ServeConfig,
                 rollback: int) -> None:
        self.params, self.config, self.budget = params, config, serve.max_tokens_per_step
        # NOTE: window groups keep `rollback` tokens more, so rejected drafts can be rolled back
        self.kv_config = step_kv_config(dataclasses.replace(
            kv_cache_config(serve, config, config.num_key_value_heads), rollback_tokens=rollback),
            params)
        self.manager = KVCacheManager(self.kv_config)
        self.rings = tuple(w if g.sliding_window else 0 for g, w in
                           zip(self.kv_config.layer_groups, self.kv_config.table_widths))

    def forward(self, work: list[tuple[Any, np.ndarray]], *, greedy: bool = False,
                last_only: bool = False) -> list[np.ndarray]:
        """One ragged step over ``work`` (``(seq, token ids)``); per item, the float32 logits
        ``[len(ids), V]`` of every fed token (``[1, V]``, its last one, with ``last_only``), or
        with ``greedy`` their argmax (taken on the device: only the ids cross to the host)."""
        mgr = self.manager
        batch = mgr.prepare_step(work)
        T = batch.positions.shape[0]
        tokens = np.zeros(T, np.int32)
        tokens[:sum(ids.size for _, ids in work)] = np.concatenate([ids for _, ids in work])
        k, v = model_caches(mgr.caches)
        logits, k, v = llama.forward_step(
            self.params, k, v, jnp.asarray(tokens), batch.positions, batch.slot_mapping,
            batch.page_table, batch.seq_lens, batch.query_start,
            None if last_only else jnp.arange(T, dtype=jnp.int32), config=self.config,
            rings=self.rings)
        mgr.complete_step(list(zip(k, v)) if isinstance(k, tuple) else [(k, v)])
        logits = np.asarray(jax.device_get(llama.greedy_tokens(logits) if greedy else logits))
        if last_only:
            return [logits[b:b + 1] for b in range(len(work))]
        qs = np.asarray(batch.query_start)
        return [logits[qs[b]:qs[b] + ids.size] for b, (_, ids) in enumerate(work)]

    def prefill(self, seq: Any, prompt: np.ndarray) -> np.ndarray:
        """Writes the prompt's K/V (past any reused prefix); the last position's logits."""
        pos, logits = seq.num_tokens, None
        while pos < prompt.size:
            chunk = prompt[pos:pos + self.budget]
            logits = self.forward([(seq, chunk)], last_only=True)[0]
            pos += chunk.size
        return logits[-1]  # the manager reuses at most all but the prompt's last token


def _softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    z = logits.astype(np.float64) / temperature
    z -= z.max(axis=-1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(axis=-1, keepdims=True)
