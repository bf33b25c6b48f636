"""export_sequence / import_sequence (issue 37, item 2): a sequence's K/V handed from one manager
to another. Oracle: the fake model and value checker of ``test_manager.py`` (every cached K/V
value of every active sequence, read back through its page table) on the importing manager,
which then decodes on and reuses the imported pages as a prefix; the invariants; and for each
refusal, the importer's state before and after (nothing changed)."""

from __future__ import annotations

import pytest
from test_arena_hot import arena_config
from test_manager import make, tiny_config

import jax_kvcm



def cfg(hot: str, **kw):
    kw.setdefault("host_pages", 16)
    if hot == "paged":
        return tiny_config(device_pages=kw.pop("device_pages", 24), head_dim=128,
                           max_seq_len=64, **kw)
    return arena_config(device_pages=kw.pop("device_pages", 24), head_dim=128, max_seq_len=64,
                        max_sequences=4, **kw)


def prefilled(hot: str, prompt: list[int]):
    """A manager that ran ``prompt`` plus 3 decoded tokens (ids known), and that sequence."""
    h = make(cfg(hot))
    s = h.add(prompt)
    h.run([(s, len(prompt))], as_ids=[True])
    for _ in range(3):
        h.run([(s, 1)], as_ids=[True])
    return h, s


def state(h):
    st = h.mgr.stats()
    return (st["pages_per_pool"], len(h.mgr._rows.seqs), st["num_committed_pages"])


@pytest.mark.parametrize("src,dst", [("paged", "paged"), ("paged", "arena"), ("arena", "paged")])
def test_a_sequence_moves_to_another_manager_and_decodes_on(src, dst):
    prompt = list(range(1, 15))
    a, s = prefilled(src, prompt)
    exp = a.mgr.export_sequence(s, "tiny")
    a.check()                                       # the exporter is unchanged
    assert exp.num_tokens == 17 and len(exp.pages) == 1 and exp.pages[0].shape[0] == 5
    b = make(cfg(dst))
    t = b.mgr.import_sequence(exp, "tiny")
    assert t is not None and t.num_tokens == 17 and t.num_known_tokens == 17
    b.tokens[t.seq_id] = list(a.tokens[s.seq_id])
    b.check()                                       # every imported value, read back
    assert b.mgr.stats()["num_committed_pages"] == 4
    b.run([(t, 5)], as_ids=[True])                  # decodes on
    b.check()
    u = b.add(prompt + [99])
    assert u.num_reused_tokens == 12                # the imported pages, reused as a prefix
    b.run([(u, 3)], as_ids=[True])
    b.check()


@pytest.mark.parametrize("what", ["model", "page size", "head_dim", "kv dtype", "checksum",
                                  "shape"])
def test_a_mismatch_is_refused_and_changes_nothing(what):
    import dataclasses

    import jax.numpy as jnp
    a, s = prefilled("paged", list(range(1, 15)))
    exp = a.mgr.export_sequence(s, "tiny")
    kw, model = {}, "tiny"
    if what == "model":
        model = "other"
    elif what == "page size":
        kw["tpp"] = 8
    elif what == "head_dim":
        kw["head_dim"] = 64
    elif what == "kv dtype":
        kw["fp8"] = True
    elif what == "checksum":
        pages = exp.pages[0].copy()
        pages[2, 17] ^= 1
        exp = dataclasses.replace(exp, pages=(pages,))
    else:
        exp = dataclasses.replace(exp, pages=(exp.pages[0][:-1],))
    if "head_dim" in kw:
        config = tiny_config(device_pages=24, head_dim=64, max_seq_len=64, host_pages=16)
    elif kw.pop("fp8", False):
        config = cfg("paged")
        config = dataclasses.replace(config, layer_groups=tuple(
            dataclasses.replace(g, kv_dtype=jnp.float8_e4m3fn) for g in config.layer_groups))
    else:
        config = cfg("paged", **kw)
    b = make(config)
    before = state(b)
    match = {"model": "model_id", "page size": "tokens_per_page", "head_dim": "head_dim",
             "kv dtype": "kv dtype", "checksum": r"pages \[2\] do not match",
             "shape": "pages: layer group 0"}[what]
    with pytest.raises(ValueError, match=match):
        b.mgr.import_sequence(exp, model)
    assert state(b) == before
    b.check()


def test_no_room_is_a_value_and_no_host_tier_an_error():
    a, s = prefilled("paged", list(range(1, 15)))
    exp = a.mgr.export_sequence(s, "m")
    b = make(cfg("paged", device_pages=4))
    before = state(b)
    assert b.mgr.import_sequence(exp, "m") is None
    assert state(b) == before
    b.check()
    c = make(tiny_config(device_pages=24, head_dim=128, max_seq_len=64))
    s2 = c.add([1, 2, 3])
    c.run([(s2, 3)], as_ids=[True])
    with pytest.raises(ValueError, match="host_bytes"):
        c.mgr.export_sequence(s2)
    assert isinstance(exp, jax_kvcm.SequenceExport)


def test_header_round_trip():
    a, s = prefilled("paged", list(range(1, 10)))
    exp = a.mgr.export_sequence(s, "m")
    import json
    again = jax_kvcm.SequenceExport.from_parts(json.loads(json.dumps(exp.header())),
                                               list(exp.pages))
    b = make(cfg("paged"))
    t = b.mgr.import_sequence(again, "m")
    b.tokens[t.seq_id] = list(a.tokens[s.seq_id])
    b.check()


def _sender(prompt, *flags):
    import os
    import subprocess
    import sys
    worker = os.path.join(os.path.dirname(__file__), "handoff_worker.py")
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    return subprocess.Popen([sys.executable, worker, ",".join(map(str, prompt)), *flags],
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_a_sender_that_dies_before_the_pull_leaves_the_receiver_clean():
    """The sender exits right after its offer: fetch gives up (TimeoutError, or the
    transport's error), the importing manager is untouched, and the same receiver then takes
    a sequence from a live sender."""
    import json

    from jax_kvcm.handoff import KVReceiver
    dead = _sender(list(range(3, 16)), "--crash")
    ticket = json.loads(dead.stdout.readline())
    dead.wait(timeout=60)
    b = make(cfg("paged"))
    before = state(b)
    receiver = KVReceiver()
    with pytest.raises(Exception) as e:
        receiver.fetch(ticket, timeout=5)
    print("fetch from a dead sender:", repr(e.value))
    assert state(b) == before
    live = _sender(list(range(3, 16)))
    try:
        exp = receiver.fetch(json.loads(live.stdout.readline()), timeout=60)
        live.stdin.write("pulled\n")
        live.stdin.flush()
    finally:
        live.stdin.close()
        live.wait(timeout=60)
    t = b.mgr.import_sequence(exp, "tiny")
    b.tokens[t.seq_id] = [int(x) for x in exp.token_ids]
    b.check()


def test_pages_move_between_processes_through_jax_transfer():
    """Two processes: the worker prefills and offers its pages on a KVSender (JAX's transfer
    server, loopback); this one pulls them with a KVReceiver, imports the sequence, and every
    value reads back right and decodes on."""
    import json
    import os
    import subprocess
    import sys

    from jax_kvcm.handoff import KVReceiver
    worker = os.path.join(os.path.dirname(__file__), "handoff_worker.py")
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    prompt = list(range(3, 16))
    proc = subprocess.Popen([sys.executable, worker, ",".join(map(str, prompt))], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-4000:]
        ticket = json.loads(line)
        exp = KVReceiver().fetch(ticket)
        proc.stdin.write("pulled\n")
        proc.stdin.flush()
        assert "OK" in proc.stdout.readline()
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    b = make(cfg("paged"))
    t = b.mgr.import_sequence(exp, "tiny")
    assert t is not None and t.num_tokens == 15
    b.tokens[t.seq_id] = [int(x) for x in ticket["token_ids"]]
    assert b.tokens[t.seq_id][:13] == prompt
    b.check()
    b.run([(t, 4)], as_ids=[True])
    b.check()
