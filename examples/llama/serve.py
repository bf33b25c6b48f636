"""The serving loop of the example Llama runner: continuous batching on :class:`KVCacheManager`.

- **Requests** (prompt ids, ``max_new_tokens``, sampling params) wait in a FIFO queue and are
  admitted while the batch has room and the device has pages for the prompt (free + cached +
  pending pages, less one page of growth headroom per running sequence); a request that could
  never fit alone on the device is refused at submission. A request whose prompt shares whole
  pages with a prompt a running request is still writing waits (keeping its place) until those
  pages are written, then reuses them (``ServeConfig.defer_shared_prompts``).
- **Steps** pack every running sequence's pending tokens: one per decoding sequence, then prompt
  chunks (chunked prefill: prompts stream in while the others decode) up to
  ``prefill_chunk_tokens`` prompt tokens and ``max_tokens_per_step`` tokens in all. The manager's
  ``prepare_step`` gives the bucketed index buffers; pure-decode steps go through the model's
  ``decode_step`` (``paged_attention``), others through ``forward_step``
  (``ragged_paged_attention``); one jitted program per (kind, batch bucket, token bucket) does
  the model step and the sampling, caches donated. A steady state compiles nothing new.
- **Overlap** (``ServeConfig.overlap``, on by default): the host prepares step n+1 (admission,
  ``prepare_step``, page allocation) while the device runs step n. Sampled tokens stay on the
  device: step n+1 gathers its input tokens from step n's output array (the manager gets a
  count for them), and the host reads step n's tokens (``copy_to_host_async`` at dispatch, read
  after step n+1 is dispatched) one step late: EOS and length checks then, and the read ids go
  to the manager (``record_token_ids``) so full pages of generated text still enter the prefix
  cache. A sequence that produced EOS has already been fed to step n+1: the token it generates
  there is dropped. A sequence that reached ``max_new_tokens`` is known to be done without
  reading anything and is closed at once (its pages stay fenced by the manager until the steps
  that read them complete). The only blocking reads are that one-step-late read, and a drain
  (read everything outstanding) before a preemption or after a failed step. With
  ``overlap=False`` each step's tokens are read right after it (the synchronous loop): both
  produce exactly the same tokens.
- **Pressure**: when ``prepare_step`` answers :class:`OutOfPagesError` (the manager has already
  evicted every cached page down the tiers), the most recently admitted running sequence is
  suspended (its pages go to host, else disk); when no tier can take it the sequence is closed and
  its request re-queued at the front to be recomputed from ``prompt + generated`` (prefix reuse
  usually brings most of it back). Suspended sequences are resumed, oldest first and before any
  new admission, when the device has room for them; one whose parked pages fail their checksum
  (:class:`CorruptPageError`) is closed and recomputed the same way.
- **Sampling** (on the device): greedy (temperature 0) or temperature + top-p, with a
  per-request key ``fold_in(fold_in(PRNGKey(seed), request_id), i)`` for the ``i``-th generated
  token (request ids count submissions from 0): a request's samples do not depend on what it was
  batched with or whether it was preempted, and two requests with one seed still draw
  independent noise.
- **Tensor parallelism** (``ServeConfig.tensor_parallel = N``): the params are split over the
  first N devices (``tp.shard_params``), the manager's pools over KV heads
  (``KVCacheConfig(mesh=...)``), and the steps run ``tp.forward_step`` / ``tp.decode_step``; the
  host side (scheduling, the manager, tiers) is the same. ``multihost.py`` runs it across
  processes.
- **Finish** on an EOS id or ``max_new_tokens``; the sequence is closed, its full pages stay in
  the prefix cache.
- **Faults**: a step that raises (out of memory, a kernel error) is undone in the manager
  (``KVCacheManager.abort_step`` where the manager has it; otherwise its sequences are closed and
  recomputed), its requests are retried (recomputed when the manager lost their pages) and fail
  with ``finish_reason == "error"`` after more than ``max_step_retries`` failed steps in a row;
  a storage error of one request (a corrupt or unreadable cold page while admitting,
  suspending or resuming it) recomputes or fails that request only. The loop keeps serving
  the others.

:meth:`Server.report` is the KV report: pages per tier, prefix hit rate (reused prompt tokens /
prompt tokens, first admissions only), pages offloaded (device -> host/disk) and onboarded
(host/disk -> device), suspends/resumes/recomputes, tokens/s (all steps, and steady state: the
steps that compiled nothing) and the compiled step shapes. With ``ServeConfig.record_steps``,
:attr:`Server.step_records` keeps a :class:`StepRecord` per dispatched step (its kind, rows,
buckets, queue lengths, when it was dispatched and when its tokens reached the host, and how long
that read blocked): the serving benchmark derives where the loop's time goes from them.

The loop lives in three modules, re-exported here: ``serve_types`` (:class:`Request`,
:class:`RequestOutput`, :class:`ServeConfig`, :class:`StepRecord`), ``step`` (the jitted
:func:`model_step` and its host inputs) and ``scheduler`` (:class:`Server`, with
``admission``'s deferral of prompts that share a prefix still being written).
"""

from jax_kvcm import CacheLevel

from .scheduler import Server
from .serve_types import (CODECS, KV_DTYPES, Request, RequestOutput, ServeConfig, StepRecord,
                          kv_cache_config)
from .step import greedy_tokens, model_caches, model_step, sample_tokens

__all__ = ["Request", "RequestOutput", "ServeConfig", "Server", "StepRecord", "sample_tokens",
           "greedy_tokens", "CODECS", "KV_DTYPES", "kv_cache_config", "model_step",
           "model_caches"]

D = CacheLevel.DEVICE  # the device tier (tests compare event levels with it)
