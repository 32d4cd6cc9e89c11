"""One process of the fault tests (test_multihost_faults.py): joins a 2-process run, then one process ends
abruptly while the other sends or waits for steps on the step channel, as process 0 or a follower would.

    fault_worker.py --coordinator A --num-processes 2 --process-id I --die I_DEAD

Process I_DEAD leaves with os._exit(9) after the first step (no goodbye, like a crash or SIGKILL); the
other keeps sending / receiving: a follower would wait for good for a step that never comes, and process 0's
send fails once the follower's connection is gone (the step fails, and the worker waits, as the engine would).
The watch (sharding.liveness) must end it with its one line, status 1.
"""

import argparse
import os
import time

import numpy as np


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    parser.add_argument("--die", type=int, required=True)
    args = parser.parse_args()

    from sharding import multihost

    assert multihost.initialize(args.coordinator, args.num_processes, args.process_id, timeout=60, prog="worker")
    channel = multihost.step_channel()
    step = {"tokens": np.arange(4, dtype=np.int32)}
    for i in range(10**6):
        if i == 1 and args.process_id == args.die:
            print(f"worker {args.process_id} dies", flush=True)
            os._exit(9)
        try:
            if multihost.is_leader():
                channel.send(step)
            else:
                channel.receive()
        except Exception as e:  # the channel may notice the dead peer too; as the engine does, fail the step, go on
            print(f"worker {args.process_id}: step failed: {str(e).splitlines()[0]}", flush=True)
            time.sleep(60)  # the watch ends this process
        if i == 0:
            print(f"worker {args.process_id} stepped", flush=True)
        time.sleep(0.05)


if __name__ == "__main__":
    main()
