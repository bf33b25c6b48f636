"""The example Llama on a dense per-sequence JAX cache: the serving benchmark's baseline.

The usual JAX approach to a KV cache, run through the same model code as the paged runner
(``examples/llama/model.py``: its params, its layer loop ``_decoder`` under ``lax.scan``, its
RoPE/RMSNorm/MLP and logits); only the cache and the attention differ:

- **cache**: ``k, v [L, B, Hkv, max_len, Dh]`` (head-major), one row (slot) per running
  sequence, allocated for ``max_len`` tokens whatever the sequence's length;
- **prefill** (:func:`prefill`): ``G`` whole prompts padded to ``S`` tokens from position 0,
  causal attention over their own K/V (einsum, float32 softmax); returns the logits of each
  prompt's last token and the K/V ``[L, G, Hkv, S, Dh]``. It takes no cache, so it compiles once
  per ``(G, S)`` whatever the cache shape;
- **insert** (:func:`insert`): ``lax.dynamic_update_slice`` of each prompt's K/V into its slot
  row (caches donated: in place);
- **decode** (:func:`decode`): one token for every slot; the new K/V is written at
  ``positions[b]`` (a scatter: the batched ``dynamic_update_slice``), attention reads the slot's
  whole row (``max_len`` positions) masked to ``<= positions[b]``.

:class:`DenseServer` is the serving loop: ``B`` slots, FIFO admission into free slots, prefill of
the admitted prompts in groups of ``G = prefill_tokens // S`` (a short group is padded by
repeating a real row, which writes the same bytes to the same slot: one prefill program per prompt
bucket ``S``), then decode steps over all
slots until every request has its ``max_new_tokens`` (greedy; EOS only when the request names
one). Inactive slots decode too (token 0 at position 0: the next prefill of that slot overwrites
it). Same outputs as :class:`examples.llama.serve.Server` (``RequestOutput``, time to first token
and each token's arrival from submission).
"""

from __future__ import annotations

import collections
import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from examples.llama import model as llama
from examples.llama.serve import Request, RequestOutput, greedy_tokens

__all__ = ["prefill", "insert", "decode", "make_dense_caches", "dense_cache_bytes", "DenseServer"]

_HIGHEST = jax.lax.Precision.HIGHEST


def make_dense_caches(config: llama.LlamaConfig, batch: int, max_len: int):
    """Zeroed ``(k, v)`` ``[L, batch, Hkv, max_len, Dh]`` in the model dtype (head-major, as
    HF/torch keep it: both attention matmuls then read the cache without a transpose)."""
    shape = (config.num_hidden_layers, batch, config.num_key_value_heads, max_len,
             config.head_dim)
    return jnp.zeros(shape, config.jnp_dtype), jnp.zeros(shape, config.jnp_dtype)


def dense_cache_bytes(config: llama.LlamaConfig, batch: int, max_len: int) -> int:
    """Bytes of K + V for ``batch`` slots of ``max_len`` tokens."""
    return (2 * config.num_hidden_layers * batch * max_len * config.num_key_value_heads
            * config.head_dim * jnp.dtype(config.jnp_dtype).itemsize)


def _check(config: llama.LlamaConfig) -> None:
    if config.sliding_window is not None:
        raise NotImplementedError("the dense baseline has no sliding window")


def _attention(q, k, v, mask, scale):
    """GQA attention: q ``[N, Q, H, Dh]``, k/v ``[N, Hkv, K, Dh]``, mask ``[N, Q, K]`` (True:
    attend); float32 scores and softmax, float32 accumulation. Returns ``[N, Q, H, Dh]``.
    float32 models compute at HIGHEST precision (the CPU oracle check); bf16 at the default."""
    N, Q, H, Dh = q.shape
    Hkv = k.shape[1]
    precision = _HIGHEST if q.dtype == jnp.float32 else None
    qg = q.reshape(N, Q, Hkv, H // Hkv, Dh)
    s = jnp.einsum("nqkrd,nksd->nkrqs", qg, k, preferred_element_type=jnp.float32,
                   precision=precision) * scale
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("nkrqs,nksd->nqkrd", p.astype(v.dtype), v,
                   preferred_element_type=jnp.float32, precision=precision)
    return o.reshape(N, Q, H, Dh).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("config",))
def prefill(params, tokens, lengths, *, config: llama.LlamaConfig):
    """Whole prompts from position 0: ``tokens [G, S]`` int32 (row ``g`` valid up to
    ``lengths[g]``, the rest any token). Returns ``(logits [G, V] float32 at each prompt's last
    token, k [L, G, Hkv, S, Dh], v)``."""
    _check(config)
    c = config
    G, S = tokens.shape
    L, Hkv, Dh = c.num_hidden_layers, c.num_key_value_heads, c.head_dim
    causal = jnp.tril(jnp.ones((S, S), jnp.bool_))[None].repeat(G, axis=0)
    scale = Dh ** -0.5

    def kv_attend(q, k, v, kc, vc, layer):
        k4 = k.reshape(G, S, Hkv, Dh).transpose(0, 2, 1, 3)  # [G, Hkv, S, Dh]
        v4 = v.reshape(G, S, Hkv, Dh).transpose(0, 2, 1, 3)
        kc = jax.lax.dynamic_update_slice(kc, k4[None], (layer, 0, 0, 0, 0))
        vc = jax.lax.dynamic_update_slice(vc, v4[None], (layer, 0, 0, 0, 0))
        o = _attention(q.reshape(G, S, -1, Dh), k4, v4, causal, scale)
        return o.reshape(G * S, -1, Dh), kc, vc

    out = jnp.zeros((L, G, Hkv, S, Dh), c.jnp_dtype)
    positions = jnp.tile(jnp.arange(S, dtype=jnp.int32), G)
    h, k, v = llama._decoder(params, c, out, out, tokens.reshape(-1), positions, kv_attend)
    last = jnp.arange(G, dtype=jnp.int32) * S + lengths - 1
    return llama._logits(params, c, h[last]), k, v


@functools.partial(jax.jit, donate_argnames=("k_cache", "v_cache"))
def insert(k_cache, v_cache, k, v, slots):
    """Writes prefill K/V ``[L, G, Hkv, S, Dh]`` into slot rows ``slots [G]`` at position 0."""
    for g in range(k.shape[1]):
        k_cache = jax.lax.dynamic_update_slice(k_cache, k[:, g:g + 1], (0, slots[g], 0, 0, 0))
        v_cache = jax.lax.dynamic_update_slice(v_cache, v[:, g:g + 1], (0, slots[g], 0, 0, 0))
    return k_cache, v_cache


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("k_cache", "v_cache"))
def decode(params, k_cache, v_cache, tokens, positions, *, config: llama.LlamaConfig):
    """One token per slot: ``tokens [B]`` at ``positions [B]`` (< max_len). Returns
    ``(logits [B, V] float32, k_cache, v_cache)`` (caches donated)."""
    _check(config)
    c = config
    B, M = k_cache.shape[1], k_cache.shape[3]
    rows = jnp.arange(B, dtype=jnp.int32)
    mask = (jnp.arange(M, dtype=jnp.int32)[None, :] <= positions[:, None])[:, None, :]
    scale = c.head_dim ** -0.5

    def kv_attend(q, k, v, kc, vc, layer):
        kc = kc.at[layer, rows, :, positions].set(k)  # k [B, Hkv, Dh] at (b, :, pos_b)
        vc = vc.at[layer, rows, :, positions].set(v)
        o = _attention(q[:, None], kc[layer], vc[layer], mask, scale)
        return o[:, 0], kc, vc

    h, k_cache, v_cache = llama._decoder(params, c, k_cache, v_cache, tokens, positions,
                                         kv_attend)
    return llama._logits(params, c, h), k_cache, v_cache


class DenseServer:
    """Greedy continuous batching over ``batch`` dense slots of ``max_len`` tokens (module doc).

    ``prefill_tokens``: the token budget of one prefill call (``G = prefill_tokens // S``
    prompts, at least 1); ``prefill_bucket``: prompts are padded to a multiple of it;
    ``record_logits``: keep each sampled token's float32 logits (``RequestOutput.logits``).
    """

    def __init__(self, params: Any, config: llama.LlamaConfig, *, batch: int, max_len: int,
                 prefill_tokens: int = 4096, prefill_bucket: int = 128,
                 record_logits: bool = False):
        _check(config)
        if batch < 1 or max_len < 2 or prefill_tokens < 1 or prefill_bucket < 1:
            raise ValueError("need batch >= 1, max_len >= 2, prefill_tokens >= 1, "
                             "prefill_bucket >= 1")
        self.params, self.config = params, config
        self.batch, self.max_len = batch, max_len
        self.prefill_tokens, self.prefill_bucket = prefill_tokens, prefill_bucket
        self.record_logits = record_logits
        self.k, self.v = make_dense_caches(config, batch, max_len)
        self.cache_bytes = dense_cache_bytes(config, batch, max_len)
        self.counters: collections.Counter = collections.Counter()
        self.decode_ms: list[float] = []   # wall time of each decode step (model + sampling)
        self.on_step: Callable[[], None] | None = None   # progress hook, called after each step

    # -- shapes ------------------------------------------------------------------------------

    def prompt_bucket(self, n: int) -> int:
        return min(self.max_len, -(-n // self.prefill_bucket) * self.prefill_bucket)

    def group_size(self, S: int) -> int:
        """Prompts per prefill call for prompts padded to ``S``."""
        return max(1, min(self.batch, self.prefill_tokens // S))

    def warmup(self, prompt_lens: Sequence[int]) -> None:
        """Compiles every program a run over prompts of these lengths uses (prefill and insert
        per prompt bucket, decode, greedy sampling); writes garbage into the cache."""
        for S in sorted({self.prompt_bucket(n) for n in prompt_lens}):
            G = self.group_size(S)
            logits, k, v = prefill(self.params, np.zeros((G, S), np.int32),
                                   np.full((G,), S, np.int32), config=self.config)
            self.k, self.v = insert(self.k, self.v, k, v, np.zeros((G,), np.int32))
            np.asarray(greedy_tokens(logits))
        zeros = np.zeros((self.batch,), np.int32)
        logits, self.k, self.v = decode(self.params, self.k, self.v, zeros, zeros,
                                        config=self.config)
        np.asarray(greedy_tokens(logits))

    # -- serving -----------------------------------------------------------------------------

    def generate(self, requests: Sequence[Request]) -> list[RequestOutput]:
        """Runs ``requests`` (greedy) to completion; outputs in order."""
        for i, r in enumerate(requests):
            if r.temperature != 0:
                raise ValueError("the dense baseline is greedy only")
            if not r.prompt or len(r.prompt) + r.max_new_tokens - 1 > self.max_len:
                raise ValueError(f"request {i}: {len(r.prompt)} prompt + {r.max_new_tokens} new "
                                 f"tokens do not fit max_len {self.max_len}")
        t0 = time.perf_counter()
        waiting = collections.deque(range(len(requests)))
        free = list(range(self.batch - 1, -1, -1))
        slot_of: dict[int, int] = {}                # request -> slot, while running
        tokens = [list(map(int, r.prompt)) for r in requests]
        ttft = [0.0] * len(requests)
        times: list[list[float]] = [[] for _ in requests]   # each token's arrival (from t0)
        rows: list[list[np.ndarray]] = [[] for _ in requests]
        outs: list[RequestOutput | None] = [None] * len(requests)
        eos = [frozenset(int(e) for e in (r.eos_token_ids if r.eos_token_ids is not None
                                          else self.config.eos_token_ids)) for r in requests]

        def accept(i: int, tok: int, logits_row: np.ndarray | None) -> None:
            r = requests[i]
            now = time.perf_counter() - t0
            if len(tokens[i]) == len(r.prompt):
                ttft[i] = now
            times[i].append(now)
            tokens[i].append(tok)
            if logits_row is not None:
                rows[i].append(logits_row)
            self.counters["generated_tokens"] += 1
            n_gen = len(tokens[i]) - len(r.prompt)
            if tok in eos[i] or n_gen >= r.max_new_tokens:
                free.append(slot_of.pop(i))
                outs[i] = RequestOutput(i, list(map(int, r.prompt)), tokens[i][len(r.prompt):],
                                        "eos" if tok in eos[i] else "length", 0,
                                        time_to_first_token_s=ttft[i],
                                        logits=np.stack(rows[i]) if self.record_logits else None,
                                        token_times_s=times[i])

        while waiting or slot_of:
            admitted = []
            while waiting and free:
                i = waiting.popleft()
                slot_of[i] = free.pop()
                admitted.append(i)
            by_len = collections.defaultdict(list)
            for i in admitted:
                by_len[self.prompt_bucket(len(requests[i].prompt))].append(i)
            for S, group in sorted(by_len.items()):
                G = self.group_size(S)
                for start in range(0, len(group), G):
                    self._prefill(group[start:start + G], S, tokens, slot_of, accept)
            if not slot_of:
                continue
            ts = time.perf_counter()
            tok = np.zeros(self.batch, np.int32)
            pos = np.zeros(self.batch, np.int32)
            for i, s in slot_of.items():
                tok[s], pos[s] = tokens[i][-1], len(tokens[i]) - 1
            logits, self.k, self.v = decode(self.params, self.k, self.v, tok, pos,
                                            config=self.config)
            nxt = np.asarray(greedy_tokens(logits)).tolist()
            host = np.asarray(logits) if self.record_logits else None
            self.counters["decode_steps"] += 1
            for i, s in list(slot_of.items()):
                accept(i, nxt[s], None if host is None else host[s])
            self.decode_ms.append((time.perf_counter() - ts) * 1e3)
            if self.on_step is not None:
                self.on_step()
        return outs  # type: ignore[return-value]

    def _prefill(self, group: list[int], S: int, tokens, slot_of, accept) -> None:
        G = self.group_size(S)
        rows = group + [group[0]] * (G - len(group))   # padding repeats a real row
        tok = np.zeros((G, S), np.int32)
        lens = np.zeros(G, np.int32)
        slots = np.zeros(G, np.int32)
        for g, i in enumerate(rows):
            n = len(tokens[i])
            tok[g, :n], lens[g], slots[g] = tokens[i], n, slot_of[i]
        logits, k, v = prefill(self.params, tok, lens, config=self.config)
        self.k, self.v = insert(self.k, self.v, k, v, slots)
        nxt = np.asarray(greedy_tokens(logits)).tolist()
        host = np.asarray(logits) if self.record_logits else None
        self.counters["prefill_calls"] += 1
        self.counters["prompt_tokens"] += int(lens[:len(group)].sum())
        for g, i in enumerate(group):
            accept(i, nxt[g], None if host is None else host[g])
        if self.on_step is not None:
            self.on_step()
