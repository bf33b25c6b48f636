"""One process of the two-process test (``test_multihost.py``): joins ``jax.distributed`` on a
local coordinator with one CPU device, builds the example server with tensor parallelism over
both processes' devices (TP = 2), and leads (process 0: schedules, prints the generated ids as
JSON) or follows (process 1: runs the published steps).

Usage: ``python multihost_worker.py --coordinator 127.0.0.1:PORT --process-id 0|1
[--platform cpu|gpu]`` (gpu: the caller gives each process one GPU with
``CUDA_VISIBLE_DEVICES``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--platform", default="cpu", choices=["cpu", "gpu"])
    args = ap.parse_args()
    if args.platform == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ.pop("XLA_FLAGS", None)        # one CPU device per process
    import jax
    import jax_kvcm  # noqa: F401  (the installed package first; the repo root after)
    jax.distributed.initialize(args.coordinator, num_processes=args.num_processes,
                               process_id=args.process_id, initialization_timeout=60)
    sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from examples.llama import multihost
    from test_multihost import make_server, requests

    assert jax.process_count() == args.num_processes and jax.device_count() == args.num_processes
    server = make_server(tensor_parallel=jax.device_count())
    shard_devices = {d.process_index for d in server.manager.caches[0][0].sharding.device_set}
    assert shard_devices == set(range(args.num_processes)), shard_devices
    channel = multihost.StepChannel()
    if args.process_id == 0:
        multihost.lead(server, channel)
        outs = []
        for wave in requests():
            outs += server.generate(wave)
        multihost.finish(channel)
        print("IDS " + json.dumps([o.generated_ids for o in outs]), flush=True)
    else:
        steps = multihost.follow(server, channel)
        print(f"FOLLOWED {steps} steps", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
