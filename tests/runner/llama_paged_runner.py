"""A minimal paged driver for the example Llama model, a test oracle: its own free list and prefix
sharing, no ``KVCacheManager`` (the serving loop proper, ``examples/llama/serve.py``, runs on the
manager). tests/runner/test_llama_model.py checks the model against HF transformers through it.

It owns its pages with a simple free list (page 0 is the null page and never handed out), shares
full prompt pages between sequences with equal prefixes (hash chain over page-sized token blocks,
refcounted, evicted LRU when free pages run out), and runs chunked prefill plus batched decode with
greedy sampling:

- a step packs every running sequence's pending tokens: one per decoding sequence, and prompt
  chunks of the prefilling ones up to ``chunk_size`` tokens in all; mixed steps go through
  :func:`model.forward_step` (``ragged_paged_attention``), pure-decode steps through
  :func:`model.decode_step` (``paged_attention``) unless ``paged_decode=False``;
- shapes are bucketed (tokens to a power of two, batch to ``max_batch``, page table to the
  longest sequence allowed) so a run compiles a handful of programs.

No preemption: a sequence is admitted only when pages for its prompt plus ``max_new_tokens`` can be
reserved.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from examples.llama import model as llama

__all__ = ["PagedRunner", "RunnerStats"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _bucket(n: int, minimum: int = 8) -> int:
    b = minimum
    while b < n:
        b *= 2
    return b


@dataclasses.dataclass
class RunnerStats:
    steps: int = 0
    prefill_steps: int = 0          # steps with at least one prompt chunk (ragged op)
    decode_steps: int = 0           # pure-decode steps
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0      # prompt tokens whose K/V came from shared pages
    generated_tokens: int = 0


@dataclasses.dataclass
class _Seq:
    index: int
    prompt_len: int
    tokens: list[int]
    max_new: int
    pages: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0           # tokens whose K/V is in the cache
    reserved: int = 0               # pages still reserved (not yet allocated)
    started: bool = False
    done: bool = False
    hashes: list[int] = dataclasses.field(default_factory=list)
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


class PagedRunner:
    """Batched greedy generation over a paged cache, with prefix sharing across calls."""

    def __init__(self, params: Any, config: llama.LlamaConfig, *, num_pages: int = 128,
                 page_size: int = 16, max_batch: int = 8, max_seq_len: int = 512,
                 chunk_size: int = 32, paged_decode: bool = True, prefix_sharing: bool = True):
        if chunk_size < 1 or max_batch < 1 or num_pages < 2:
            raise ValueError("need chunk_size >= 1, max_batch >= 1 and num_pages >= 2")
        if len(config.kv_groups()) > 1:
            raise ValueError("config: PagedRunner has one pool for all layers; a model with "
                             "full and sliding layers (layer_types) runs in serve.Server")
        self.params, self.config = params, config
        self.page_size, self.max_batch, self.chunk_size = page_size, max_batch, chunk_size
        self.max_seq_len = max_seq_len
        self.max_pages_per_seq = _cdiv(max_seq_len, page_size)
        self.paged_decode, self.prefix_sharing = paged_decode, prefix_sharing
        self.num_pages = num_pages
        self.k_cache, self.v_cache = llama.make_caches(config, num_pages, page_size)
        self._free = list(range(num_pages - 1, 0, -1))   # pop() hands out low pages first
        self._refs = np.zeros(num_pages, np.int64)
        self._hash_to_page: dict[int, int] = {}
        self._page_to_hash: dict[int, int] = {}
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._reserved = 0
        self.stats = RunnerStats()

    # -- pages ------------------------------------------------------------------------------

    def available_pages(self) -> int:
        return len(self._free) + len(self._evictable) - self._reserved

    def _alloc(self) -> int:
        if self._free:
            page = self._free.pop()
        elif self._evictable:
            page, _ = self._evictable.popitem(last=False)
            del self._hash_to_page[self._page_to_hash.pop(page)]
        else:  # pragma: no cover  (reservations make this unreachable)
            raise RuntimeError("out of pages")
        self._refs[page] = 1
        return page

    def _release(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] == 0:
            if page in self._page_to_hash:
                self._evictable[page] = None
            else:
                self._free.append(page)

    def _block_hashes(self, seq: _Seq, upto_pages: int) -> list[int]:
        while len(seq.hashes) < upto_pages:
            i = len(seq.hashes)
            prev = seq.hashes[-1] if seq.hashes else 0
            block = tuple(seq.tokens[i * self.page_size:(i + 1) * self.page_size])
            seq.hashes.append(hash((prev, block)))
        return seq.hashes[:upto_pages]

    def _start(self, seq: _Seq) -> None:
        """First scheduling of a sequence: reuse cached full prompt pages (leaving >= 1 token)."""
        seq.started = True
        self.stats.prompt_tokens += seq.prompt_len
        if not self.prefix_sharing:
            return
        for h in self._block_hashes(seq, (seq.prompt_len - 1) // self.page_size):
            page = self._hash_to_page.get(h)
            if page is None:
                break
            if self._refs[page] == 0:
                self._evictable.pop(page)
                # It was counted as available; it now backs this sequence's reservation.
                seq.reserved -= 1
                self._reserved -= 1
            self._refs[page] += 1
            seq.pages.append(page)
            seq.num_computed += self.page_size
            self.stats.prefix_hit_tokens += self.page_size

    def _register_full_pages(self, seq: _Seq) -> None:
        if not self.prefix_sharing:
            return
        full = min(seq.num_computed, seq.prompt_len) // self.page_size
        for i, h in enumerate(self._block_hashes(seq, full)):
            page = seq.pages[i]
            if h not in self._hash_to_page and page not in self._page_to_hash:
                self._hash_to_page[h] = page
                self._page_to_hash[page] = h

    def _ensure_pages(self, seq: _Seq, length: int) -> None:
        while len(seq.pages) * self.page_size < length:
            seq.pages.append(self._alloc())
            seq.reserved -= 1
            self._reserved -= 1

    def _finish(self, seq: _Seq) -> None:
        seq.done = True
        for page in seq.pages:
            self._release(page)
        seq.pages = []
        self._reserved -= seq.reserved
        seq.reserved = 0

    # -- steps ------------------------------------------------------------------------------

    def _page_row(self, seq: _Seq) -> np.ndarray:
        row = np.zeros(self.max_pages_per_seq, np.int32)
        row[:len(seq.pages)] = seq.pages
        return row

    def _slots(self, seq: _Seq, positions: np.ndarray) -> np.ndarray:
        pages = np.asarray(seq.pages, np.int64)[positions // self.page_size]
        return (pages * self.page_size + positions % self.page_size).astype(np.int32)

    def _step(self, running: list[_Seq]) -> list[tuple[_Seq, np.ndarray]]:
        """Runs one step over ``running``; returns (seq, logits) for sequences that reached
        the end of their tokens (their next token is due)."""
        work: list[tuple[_Seq, int]] = []   # (seq, number of new tokens)
        budget = self.chunk_size
        for seq in running:                 # decoding sequences first: one token each
            if seq.num_computed == len(seq.tokens) - 1 and seq.num_computed >= seq.prompt_len:
                work.append((seq, 1))
                budget -= 1
        budget = max(budget, 1)             # prompts always progress, however many decode
        for seq in running:
            if seq.num_computed < seq.prompt_len and budget > 0:
                if not seq.started:
                    self._start(seq)
                n = min(len(seq.tokens) - seq.num_computed, budget)
                work.append((seq, n))
                budget -= n
        for seq, n in work:
            self._ensure_pages(seq, seq.num_computed + n)

        B = self.max_batch
        page_table = np.zeros((B, self.max_pages_per_seq), np.int32)
        seq_lens = np.zeros(B, np.int32)
        pure_decode = all(n == 1 and s.num_computed >= s.prompt_len for s, n in work)
        if pure_decode and self.paged_decode:
            tokens = np.zeros(B, np.int32)
            positions = np.zeros(B, np.int32)
            slots = np.full(B, -1, np.int32)
            for b, (seq, _) in enumerate(work):
                pos = seq.num_computed
                tokens[b], positions[b] = seq.tokens[pos], pos
                slots[b] = self._slots(seq, np.asarray([pos]))[0]
                page_table[b], seq_lens[b] = self._page_row(seq), pos + 1
            logits, self.k_cache, self.v_cache = llama.decode_step(
                self.params, self.k_cache, self.v_cache, jnp.asarray(tokens),
                jnp.asarray(positions), jnp.asarray(slots), jnp.asarray(page_table),
                jnp.asarray(seq_lens), config=self.config)
            rows = list(range(len(work)))
        else:
            total = sum(n for _, n in work)
            T = _bucket(total)
            tokens = np.zeros(T, np.int32)
            positions = np.zeros(T, np.int32)
            slots = np.full(T, -1, np.int32)
            query_start = np.full(B + 1, total, np.int32)
            logits_index = np.zeros(B, np.int32)
            start = 0
            for b, (seq, n) in enumerate(work):
                pos = np.arange(seq.num_computed, seq.num_computed + n)
                tokens[start:start + n] = seq.tokens[seq.num_computed:seq.num_computed + n]
                positions[start:start + n] = pos
                slots[start:start + n] = self._slots(seq, pos)
                page_table[b], seq_lens[b] = self._page_row(seq), seq.num_computed + n
                query_start[b] = start
                logits_index[b] = start + n - 1
                start += n
            logits, self.k_cache, self.v_cache = llama.forward_step(
                self.params, self.k_cache, self.v_cache, jnp.asarray(tokens),
                jnp.asarray(positions), jnp.asarray(slots), jnp.asarray(page_table),
                jnp.asarray(seq_lens), jnp.asarray(query_start), jnp.asarray(logits_index),
                config=self.config)
            rows = list(range(len(work)))
        self.stats.steps += 1
        if pure_decode:
            self.stats.decode_steps += 1
        else:
            self.stats.prefill_steps += 1
        logits = np.asarray(logits)
        due = []
        for b, (seq, n) in zip(rows, work):
            seq.num_computed += n
            self._register_full_pages(seq)
            if seq.num_computed == len(seq.tokens):
                due.append((seq, logits[b]))
        return due

    # -- public -----------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 eos_token_ids: Sequence[int] | None = None,
                 record_logits: bool = False) -> list[list[int]] | tuple[list, list]:
        """Greedy generation for every prompt (admitted up to ``max_batch`` at a time).

        Returns the generated ids per prompt (ending with the EOS token when one was produced);
        with ``record_logits`` also, per prompt, the float32 logits ``[n_generated, vocab]`` each
        token was sampled from.
        """
        eos = set(self.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
        seqs = []
        for i, p in enumerate(prompts):
            p = [int(t) for t in p]
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if len(p) + max_new_tokens > self.max_seq_len:
                raise ValueError(f"prompt {i}: {len(p)} + {max_new_tokens} new tokens exceeds "
                                 f"max_seq_len={self.max_seq_len}")
            seqs.append(_Seq(i, len(p), p, max_new_tokens))
        waiting = collections.deque(seqs)
        running: list[_Seq] = []
        while waiting or running:
            while waiting and len(running) < self.max_batch:
                seq = waiting[0]
                need = _cdiv(len(seq.tokens) + seq.max_new, self.page_size)
                if need > self.available_pages():
                    if not running:
                        raise RuntimeError(
                            f"prompt {seq.index} needs {need} pages; only "
                            f"{self.available_pages()} of {self.num_pages - 1} can be had")
                    break
                waiting.popleft()
                seq.reserved = need
                self._reserved += need
                running.append(seq)
            if max_new_tokens == 0:
                for seq in running:
                    self._finish(seq)
                running = []
                continue
            for seq, logits in self._step(running):
                token = int(np.argmax(logits))
                if record_logits:
                    seq.logits.append(logits)
                seq.tokens.append(token)
                self.stats.generated_tokens += 1
                if token in eos or len(seq.generated) >= seq.max_new:
                    self._finish(seq)
            running = [s for s in running if not s.done]
        out = [s.generated for s in seqs]
        if record_logits:
            return out, [np.stack(s.logits) if s.logits else np.zeros((0, self.config.vocab_size),
                                                                       np.float32) for s in seqs]
        return out
