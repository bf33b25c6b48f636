"""The Mooncake transport of benchmarks/bench_handoff.py (benchmarks/harness/mooncake_transport.py):
byte-exact between two processes, damaged bytes refused, a sender that is gone an error. Skipped
with the reason where the Mooncake transfer engine does not import (CI installs only the
project's extras); the missing-package error is checked everywhere."""

import json
import socket
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvcm  # noqa: F401  (the installed package before the repo root goes on sys.path)
from jax_kvcm import write_kv

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repo root: benchmarks/

from benchmarks import bench_handoff  # noqa: E402
from benchmarks.harness import mooncake_transport as mt  # noqa: E402

MISSING = mt.mooncake_available()
needs_mooncake = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))


def test_missing_mooncake_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    with pytest.raises(ImportError, match="pip install mooncake-transfer-engine"):
        mt.MooncakeSender()
    assert "libibverbs" in mt.mooncake_available()


@needs_mooncake
@pytest.mark.parametrize("processes", [1, 2])
def test_bench_measures_both_transports_byte_exact(tmp_path, capsys, processes):
    out = tmp_path / "h.json"
    assert bench_handoff.main(["--tokens", "64", "--repeats", "1", "--layers", "2",
                               "--transport", "jax", "mooncake", "--processes", str(processes),
                               "--json", str(out)]) == 0
    row, = json.loads(out.read_text())["rows"]
    assert row["transport"] == "jax" and row["processes"] == processes
    assert row["transport_ms"] > 0 and row["transport_mooncake_ms"] > 0
    assert "mooncake transport ms" in capsys.readouterr().out


def _export(mgr):
    """A 40-token sequence of random K/V (3 pages), exported."""
    ids = np.arange(1, 41, dtype=np.int32)
    seq = mgr.add_sequence(ids)
    batch = mgr.prepare_step([(seq, ids)])
    (k, v), = mgr.caches
    shape = (batch.slot_mapping.shape[0], bench_handoff.KV_HEADS, bench_handoff.HEAD_DIM)
    new = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
    mgr.complete_step([write_kv(k, v, new, -new, batch.slot_mapping, layer=0)])
    return mgr.export_sequence(seq, "m")


def _state(mgr):
    st = mgr.stats()
    return st["pages_per_pool"], st["num_committed_pages"]


@needs_mooncake
def test_damaged_bytes_are_refused_and_the_importer_unchanged():
    src, dst = bench_handoff.manager(64, 2), bench_handoff.manager(64, 2)
    exp = _export(src)
    sender, receiver = mt.MooncakeSender(), mt.MooncakeReceiver()
    ticket = sender.offer(exp)
    got = receiver.fetch(ticket)
    mt.check_pages(ticket, list(got.pages))
    assert all(np.array_equal(a, b) for a, b in zip(got.pages, exp.pages))
    sender._offered[ticket["transfer_id"]][0][1, 7] ^= 0xFF   # the registered bytes change
    bad = receiver.fetch(ticket)
    with pytest.raises(ValueError, match="page 1"):
        mt.check_pages(ticket, list(bad.pages))
    before = _state(dst)
    with pytest.raises(ValueError, match="(?i)checksum|crc"):
        dst.import_sequence(bad, "m")
    assert _state(dst) == before
    assert dst.import_sequence(got, "m") is not None
    sender.forget(ticket)
    src.shutdown()
    dst.shutdown()


@needs_mooncake
def test_a_sender_that_is_gone_is_an_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ticket = {"session": f"127.0.0.1:{port}", "transfer_id": 1, "addresses": [4096],
              "page_shapes": [[2, 64]]}
    with pytest.raises(RuntimeError, match="is the sender up"):
        mt.MooncakeReceiver().fetch(ticket)
