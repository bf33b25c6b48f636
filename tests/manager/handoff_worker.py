"""The prefill side of tests/manager/test_handoff.py's two-process handoff: a manager runs a
prompt (the fake model of test_manager.py writes its K/V), exports the sequence, offers its pages
on a jax_kvcm.handoff.KVSender and prints the ticket (one JSON line); it stays up until a line
arrives on stdin (the receiver pulled), then prints OK. ``--crash``: exits at once after printing
the ticket, as a sender that dies before the pull."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import group_paths  # noqa: E402

group_paths.add_to_sys_path()

from test_manager import make, tiny_config  # noqa: E402

from jax_kvcm.handoff import KVSender  # noqa: E402


def main() -> None:
    prompt = [int(t) for t in sys.argv[1].split(",")]
    h = make(tiny_config(device_pages=24, head_dim=128, max_seq_len=64, host_pages=16))
    s = h.add(prompt)
    h.run([(s, len(prompt))], as_ids=[True])
    h.run([(s, 2)], as_ids=[True])
    sender = KVSender()
    ticket = sender.offer(h.mgr.export_sequence(s, "tiny"))
    print(json.dumps(ticket), flush=True)
    if "--crash" in sys.argv:
        os._exit(3)              # gone before the receiver pulls
    sys.stdin.readline()
    sender.forget(ticket)
    print("OK handed over", flush=True)


if __name__ == "__main__":
    main()
