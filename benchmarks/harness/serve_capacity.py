"""The largest concurrency the device memory holds, for a setup with ``auto_concurrency``
(``--workload trtllm-bench``: TensorRT-LLM's protocol runs as many sequences at once as its K/V
memory holds). Computed when the run starts, from the memory left after the weights are on the
device, and printed."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from benchmarks.harness.run_log import device_memory_stats
from benchmarks.harness.serve_setup import Setup
from benchmarks.harness.tp_scaling import device_weight_bytes, max_concurrency
from examples.llama import tp


def page_bytes_per_device(setup: Setup) -> int:
    """One page's K/V bytes on one device: K and V of every layer, the device's KV heads
    (``tp.kv_heads / n`` under ``--tensor-parallel n``), at the paged runs' K/V dtype."""
    m, n = setup.model, setup.tensor_parallel
    heads = tp.kv_heads(m, n) // n
    return (2 * m.num_hidden_layers * setup.page_size * heads * m.head_dim
            * setup.paged_kv_itemsize)


def device_memory(params: Any) -> tuple[int | None, int, str]:
    """``(limit, in use, source)`` of the first device: the allocator's ``bytes_limit`` and
    ``bytes_in_use`` (every live buffer: the weights, whatever else is held) where it reports
    them; else ``(None, the params' bytes there, ...)``."""
    dev = jax.devices()[0]
    stats = device_memory_stats()
    if "bytes_limit" in stats and "bytes_in_use" in stats:
        return (int(stats["bytes_limit"]), int(stats["bytes_in_use"]),
                "the allocator's bytes_limit - bytes_in_use")
    return None, device_weight_bytes(params, dev), "--device-memory-gib - the weights' bytes"


def largest_free_block() -> int | None:
    """The allocator's largest contiguous free block on the first device (BFC's
    ``largest_free_block_bytes``), or None where it reports none. Each K/V pool is one
    allocation: free bytes in pieces smaller than a pool do not hold it."""
    n = device_memory_stats().get("largest_free_block_bytes")
    return None if n is None else int(n)


def resolve_concurrency(setup: Setup, params: Any,
                        log: Callable[[str], None]) -> tuple[Setup, dict[str, Any] | None]:
    """``setup`` with its random rows' concurrency set to the largest the memory holds (at most
    the number of requests), the step budget following it (the concurrency + one prompt chunk),
    and the arithmetic as a ``kind="max_concurrency"`` row; unchanged (and None) without
    ``auto_concurrency``. Memory: the device's allocator limit less what is in use with the
    params in place, or ``setup.device_memory_bytes`` less the params' bytes where the device
    reports none (the CPU); with neither, the preset's concurrency. That memory counts at most
    the allocator's largest free block (each pool is one allocation). Budget:
    ``kv_memory_fraction`` of that, for a pool of ``c x (pages per sequence + 1)`` pages (as
    the run sizes it) plus the null page (``tp_scaling.max_concurrency``)."""
    if not setup.auto_concurrency:
        return setup, None
    limit, in_use, source = device_memory(params)
    if limit is None and setup.device_memory_bytes is not None:
        limit = setup.device_memory_bytes
    if limit is None:
        c = min(setup.concurrencies)
        log(f"concurrency {c}: the device reports no memory limit (the CPU) and "
            f"--device-memory-gib gives none; the preset's")
        row = {"kind": "max_concurrency", "max_concurrency": c, "source": "the preset"}
    else:
        block = largest_free_block()
        # Each pool is one allocation: free bytes in pieces smaller than both pools together
        # would let the second pool fail (as the H100's FP8 run did before the weights were
        # compacted), so the budget counts at most the largest free block.
        usable = limit - in_use if block is None else min(limit - in_use, block)
        row = max_concurrency(in_use + usable, in_use, page_bytes_per_device(setup),
                              setup.pages_per_seq, setup.kv_memory_fraction)
        if row["max_concurrency"] < 1:
            raise RuntimeError(
                f"no sequence of {setup.max_total_len} tokens fits: "
                f"{(limit - in_use) / 2**30:.2f} GiB free after the weights ({source})")
        c = min(row["max_concurrency"], setup.requests_at(row["max_concurrency"]))
        row.update(kind="max_concurrency", source=source, concurrency=c,
                   largest_free_block_bytes=block)
        pool_bytes = c * (setup.pages_per_seq + 1) * row["page_bytes_per_device"] / 2
        log(f"concurrency {c} (as large as memory allows): {limit / 2**30:.2f} GiB limit - "
            f"{in_use / 2**30:.2f} GiB in use with the weights ({source})"
            + ("" if usable == limit - in_use else
               f", of which the largest free block {usable / 2**30:.2f} GiB (each pool is one "
               f"allocation: free bytes in pieces cannot hold both)")
            + f", x {setup.kv_memory_fraction} = {row['kv_budget_bytes'] / 2**30:.2f} GiB of K/V = "
            f"{row['pool_pages_fit']} pages of {row['page_bytes_per_device'] / 2**20:.2f} MiB; "
            f"{setup.pages_per_seq} + 1 pages per sequence of {setup.max_total_len} tokens -> "
            f"{row['max_concurrency']} sequences"
            + (f", capped at the {c} requests" if c < row["max_concurrency"] else "")
            + ("" if block is None else
               f"; largest free block {block / 2**30:.2f} GiB, each of the K and V pools one "
               f"allocation of {pool_bytes / 2**30:.2f} GiB"))
    setup = dataclasses.replace(setup, concurrencies=(c,), step_tokens=c + setup.prefill_chunk)
    return setup, row
