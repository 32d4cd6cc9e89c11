"""One process x N devices against P processes x N/P devices, in one run: what handing each step over costs.

  PYTHONPATH=$PWD python3 scripts/bench_handover.py                      # CPU: 4 host devices, 2 processes
  PYTHONPATH=$PWD python3 scripts/bench_handover.py --gpus 4 --processes 4 --model llama2-13b --dtype bfloat16

Two layouts of the same N devices (--layouts): `instances`, N serving instances with one sequence each (a step
with no collective in one process), and `tp`, tensor parallel N with one sequence (all-reduces in every layer:
over gloo between processes on the CPU). For each, two arms alternate for --rounds rounds: one process with N
devices, then P processes of N/P devices started by scripts/launch.py (their steps handed over on the step
channel: sharding.step_channel). Each arm is a fresh run of this script as its worker (--worker): the model
(random weights for presets), one untimed pass of the load (its compiles), then --passes timed passes: every
sequence a prompt of --prompt-tokens and --new-tokens greedy tokens (ignore_eos), prefix caching off.

Reported per arm and, over the rounds, per layout: decode ms a step (the gap between steps' tokens reaching
process 0's host, median), the prefill step's ms; each process's host CPU time a step (process 0: its engine
and launcher threads, a follower: its loop, which receives, places and launches each step; both: ZeroMQ's I/O
thread; the devices' compute threads not counted), and the hand-over's own share of the decode step: process
0's CPU time inside `send` a step (its wall time beside it: on a busy machine it also holds the waits for a
core after waking ZeroMQ's I/O thread), plus the followers' wait beyond each send (from the moment process 0
sent a step to its arrival, where the follower was already waiting: the host clock is one on one machine). The greedy tokens must be the
same in every arm (`same_tokens`). Writes JSON and a Markdown table under benchmarks/results/
(`<device>-<date>-<HHMM>-handover.json`) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import threading
import time

import numpy as np

from scripts.common import harness
from scripts.common.arms import run_arm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RESULT = "RESULT "  # a worker's result line on stdout


# ----- the worker: one process of an arm -----

def _thread_cpu_ns(native_id: int) -> int:
    """A thread's time on a CPU so far (Linux's schedstat, ns), 0 where unreadable."""
    try:
        with open(f"/proc/self/task/{native_id}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _zmq_threads() -> list[int]:
    """ZeroMQ's I/O threads of this process (C threads, named ZMQbg/...)."""
    found = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith("ZMQbg"):
                    found.append(int(tid))
        except OSError:
            pass
    return found


def _host_cpu_ns(native_ids: list[int]) -> dict[str, int]:
    named = {"engine": native_ids[0]}
    named.update({f"thread{i}": t for i, t in enumerate(native_ids[1:], 1)})
    out = {name: _thread_cpu_ns(t) for name, t in named.items()}
    out["zmq_io"] = sum(_thread_cpu_ns(t) for t in _zmq_threads())
    return out


def _options(args):
    from jaxllm import EngineOptions

    n = args.devices_total
    mesh = dict(instances=n) if args.layout == "instances" else dict(tensor_parallel=n)
    return EngineOptions(prefix_caching=False, **mesh)


def _requests(args):
    from jaxllm.contract import SamplingParams
    from jaxllm.engine.core import Request

    rng = np.random.default_rng(0)
    seqs = args.devices_total if args.layout == "instances" else 1
    return [Request(rng.integers(3, 259, size=args.prompt_tokens).tolist(),
                    SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True))
            for _ in range(seqs)]


def _follow(args, config) -> dict:
    """A follower: launch every step process 0 sends; per received step, (arrival ns, loop CPU ns, wait, late,
    the whole process's CPU ns)."""
    from jaxllm import build_engine
    from sharding import multihost

    built = build_engine(config, progress=False)
    channel = multihost.step_channel()
    receive, samples, me = channel.receive, [], threading.get_native_id()

    def recording():
        got = receive()
        stats = channel.stats()
        samples.append((time.monotonic_ns(), _thread_cpu_ns(me), round(stats.wait_s * 1e9), round(stats.late_s * 1e9),
                        time.process_time_ns()))
        return got

    channel.receive = recording  # this bench's own probe on its own object
    zmq_before = sum(_thread_cpu_ns(t) for t in _zmq_threads())
    calls = built.follow()
    return dict(role="follower", calls=calls, samples=samples,
                zmq_io_ns=sum(_thread_cpu_ns(t) for t in _zmq_threads()) - zmq_before)


def _lead(args, config) -> dict:
    from jaxllm import LLM
    from sharding import multihost

    llm = LLM(config, progress=False)
    channel = multihost.step_channel()
    try:
        llm.run(_requests(args))  # untimed: every program this load runs compiles here
        launcher = [t.native_id for t in threading.enumerate() if t.name.startswith("jaxllm-launch")]
        threads = [threading.get_native_id()] + launcher
        compiles = llm.compile_count
        prefill, decode, tokens = [], [], None
        messages0 = channel.stats().messages if channel else 0
        send0 = channel.stats() if channel else None
        cpu0, t0, process0 = _host_cpu_ns(threads), time.monotonic_ns(), time.process_time_ns()
        for _ in range(args.passes):
            last = time.perf_counter()

            def on_step(_outputs):
                nonlocal last
                now = time.perf_counter()
                (decode if llm.core.last_plan.kind.label == "decode" else prefill).append(now - last)
                last = now

            outputs = llm.run(_requests(args), on_step=on_step)
            got = [[int(t) for o in outs for t in o.token_ids] for _, outs in sorted(outputs.items())]
            if tokens is not None and got != tokens:
                raise AssertionError("greedy tokens differ between passes of one arm")
            tokens = got
        t1, cpu1, process1 = time.monotonic_ns(), _host_cpu_ns(threads), time.process_time_ns()
        stats = channel.stats() if channel else None
        steps = len(prefill) + len(decode)
        return dict(role="leader", window_ns=[t0, t1], messages=[messages0, stats.messages if stats else 0],
                    steps=steps, decode_steps=len(decode), prefill_steps=len(prefill),
                    decode_ms=1e3 * float(np.median(decode)), decode_spread=harness.spread([1e3 * t for t in decode]),
                    prefill_ms=1e3 * float(np.median(prefill)),
                    host_cpu_ms_per_step={k: (cpu1[k] - cpu0[k]) / 1e6 / steps for k in cpu0},
                    process_cpu_ms_per_step=(process1 - process0) / 1e6 / steps, wall_ms_per_step=(t1 - t0) / 1e6 / steps,
                    send_ms_per_step=1e3 * (stats.send_s - send0.send_s) / steps if stats else 0.0,
                    send_cpu_ms_per_step=1e3 * (stats.send_cpu_s - send0.send_cpu_s) / steps if stats else 0.0,
                    compiles_while_timed=llm.compile_count - compiles, tokens=tokens)
    finally:
        llm.close()


def worker(args) -> int:
    from jaxllm import EngineConfig, console
    from sharding import multihost

    if multihost.initialize(prog="bench_handover"):  # the JAX_* variables launch.py sets, else one process
        console.library_stdout_to_stderr()  # gloo's connection lines stay off the result line
    import jax

    args.devices_total = jax.device_count()
    config = EngineConfig(args.model, dtype=args.dtype, options=_options(args))
    result = _lead(args, config) if multihost.is_leader() else _follow(args, config)
    result.update(process=jax.process_index(), processes=jax.process_count(), devices=jax.device_count(),
                  device_kind=jax.devices()[0].device_kind)
    print(_RESULT + json.dumps(result), flush=True)
    return 0


# ----- the driver: arms in turns -----

def _worker_command(args, layout: str) -> list[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--layout", layout, "--model", args.model,
           "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens), "--passes",
           str(args.passes)]
    return cmd + (["--dtype", args.dtype] if args.dtype else [])


def _arm_env(devices: int | None) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(name, None)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    if devices:  # the CPU's host devices
        env["JAX_PLATFORMS"] = "cpu"
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def _run_arm(args, layout: str, processes: int) -> list[dict]:
    """One arm: the worker in one process or through launch.py; every process's result."""
    n = args.gpus or args.cpu_devices
    cmd = _worker_command(args, layout)
    if processes == 1:
        env = _arm_env(None if args.gpus else n)
        if args.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(n)))
    else:
        env = _arm_env(None)
        per = ["--gpus-per-process", str(n // processes)] if args.gpus else ["--cpu-devices", str(n // processes)]
        cmd = [sys.executable, os.path.join(ROOT, "scripts", "launch.py"), "--num-processes", str(processes), *per,
               "--timeout", str(args.arm_timeout), "--no-flags", "--", *cmd]
    _log(f"[{layout}] {processes} process(es) x {n // processes} device(s): {shlex.join(cmd[1:4])} ...")
    start = time.monotonic()
    proc = run_arm(cmd, env, ROOT, args.arm_timeout + 60, f"the {layout} arm with {processes} process(es)")
    results = []
    for line in proc.stdout.splitlines():
        text = line.split("] ", 1)[1] if processes > 1 and line.startswith("[") else line
        if text.startswith(_RESULT):
            results.append(json.loads(text[len(_RESULT):]))
    if len(results) != processes:
        raise RuntimeError(f"the {layout} arm gave {len(results)} results of {processes}:\n{proc.stdout[-2000:]}")
    results.sort(key=lambda r: r["process"])
    _log(f"[{layout}] {processes} process(es): {results[0]['decode_ms']:.2f} ms a decode step "
         f"({time.monotonic() - start:.0f} s)")
    return results


def _arm_row(results: list[dict]) -> dict:
    """An arm's figures: process 0's timings, and each follower's cut to process 0's timed window."""
    lead = results[0]
    steps = lead["steps"]
    row = dict(processes=len(results), device_kind=lead["device_kind"], decode_ms=lead["decode_ms"], decode_spread=lead["decode_spread"],
               prefill_ms=lead["prefill_ms"], decode_steps=lead["decode_steps"],
               compiles_while_timed=lead["compiles_while_timed"],
               leader_host_cpu_ms_per_step=lead["host_cpu_ms_per_step"],
               leader_host_ms_per_step=sum(lead["host_cpu_ms_per_step"].values()),
               process_cpu_ms_per_step=lead["process_cpu_ms_per_step"], wall_ms_per_step=lead["wall_ms_per_step"],
               send_ms_per_step=lead["send_ms_per_step"], send_cpu_ms_per_step=lead["send_cpu_ms_per_step"],
               followers=[])
    m0, m1 = lead["messages"]
    for f in results[1:]:
        s = f["samples"]  # s[i]: after the (i + 1)-th message
        if len(s) < m1:
            raise RuntimeError(f"process {f['process']} received {len(s)} steps, process 0 sent {m1}")
        a, b = s[m0 - 1], s[m1 - 1]
        row["followers"].append(dict(process=f["process"], host_ms_per_step=(b[1] - a[1]) / 1e6 / steps,
                                     wait_ms_per_step=(b[2] - a[2]) / 1e6 / steps,
                                     late_ms_per_step=(b[3] - a[3]) / 1e6 / steps,
                                     process_cpu_ms_per_step=(b[4] - a[4]) / 1e6 / steps,
                                     zmq_io_ms_per_message=f["zmq_io_ns"] / 1e6 / max(f["calls"], 1)))
    late = max((f["late_ms_per_step"] for f in row["followers"]), default=0.0)
    row["handover_ms_per_step"] = row["send_cpu_ms_per_step"] + late
    row["handover_share"] = row["handover_ms_per_step"] / row["decode_ms"]
    row["handover_wall_share"] = (row["send_ms_per_step"] + late) / row["decode_ms"]  # the send's waits for a core too
    return row


def _summary(rows: dict[int, list[dict]]) -> dict:
    one, many = rows[1], rows[max(rows)]
    med = lambda xs: float(np.median(xs))  # noqa: E731
    out = dict(one_process_decode_ms=med([r["decode_ms"] for r in one]),
               processes_decode_ms=med([r["decode_ms"] for r in many]),
               one_process_prefill_ms=med([r["prefill_ms"] for r in one]),
               processes_prefill_ms=med([r["prefill_ms"] for r in many]),
               send_ms_per_step=med([r["send_ms_per_step"] for r in many]),
               send_cpu_ms_per_step=med([r["send_cpu_ms_per_step"] for r in many]),
               late_ms_per_step=med([max((f["late_ms_per_step"] for f in r["followers"]), default=0.0)
                                     for r in many]),
               handover_share=med([r["handover_share"] for r in many]),
               handover_wall_share=med([r["handover_wall_share"] for r in many]),
               leader_host_ms_per_step=med([r["leader_host_ms_per_step"] for r in many]),
               one_process_host_ms_per_step=med([r["leader_host_ms_per_step"] for r in one]),
               follower_host_ms_per_step=med([f["host_ms_per_step"] for r in many for f in r["followers"]]))
    out["decode_ratio"] = out["processes_decode_ms"] / out["one_process_decode_ms"]
    out["prefill_ratio"] = out["processes_prefill_ms"] / out["one_process_prefill_ms"]
    return out


def _table(layouts: dict, devices: int, processes: int) -> str:
    header = ["layout", f"1 x {devices} decode ms", f"{processes} x {devices // processes} decode ms", "ratio",
              "prefill ms (1 / P)", "send ms CPU (wall)", "late ms", "hand-over share",
              "host ms a step (1 / p0 / followers)"]
    rows = []
    for name, layout in layouts.items():
        s = layout["summary"]
        rows.append([name, f"{s['one_process_decode_ms']:.2f}", f"{s['processes_decode_ms']:.2f}",
                     f"{s['decode_ratio']:.2f}", f"{s['one_process_prefill_ms']:.1f} / {s['processes_prefill_ms']:.1f}",
                     f"{s['send_cpu_ms_per_step']:.3f} ({s['send_ms_per_step']:.3f})", f"{s['late_ms_per_step']:.3f}",
                     f"{s['handover_share']:.1%}",
                     f"{s['one_process_host_ms_per_step']:.2f} / {s['leader_host_ms_per_step']:.2f} / "
                     f"{s['follower_host_ms_per_step']:.2f}"])
    return harness.markdown_table(header, rows)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", nargs="+", default=["instances", "tp"], choices=["instances", "tp"])
    p.add_argument("--cpu-devices", type=int, default=4, help="N on the CPU: host devices in all (default: 4)")
    p.add_argument("--gpus", type=int, default=None, help="N GPUs instead of CPU devices")
    p.add_argument("--processes", type=int, default=2, help="P (default: 2)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", default=None)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--passes", type=int, default=3, help="timed passes an arm (after its untimed one)")
    p.add_argument("--rounds", type=int, default=3, help="times each arm runs, in turns (default: 3)")
    p.add_argument("--arm-timeout", type=int, default=900)
    p.add_argument("--out", default=harness.RESULTS_DIR)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", default="instances", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    n = args.gpus or args.cpu_devices
    if args.processes < 2 or n % args.processes:
        p.error(f"--processes must be at least 2 and divide the {n} devices, got {args.processes}")
    layouts = {}
    for layout in args.layouts:
        rows: dict[int, list[dict]] = {1: [], args.processes: []}
        tokens = []
        for _ in range(args.rounds):
            for processes in (1, args.processes):
                results = _run_arm(args, layout, processes)
                rows[processes].append(_arm_row(results))
                tokens.append(results[0]["tokens"])
        layouts[layout] = dict(arms={str(k): v for k, v in rows.items()}, summary=_summary(rows),
                               same_tokens=all(t == tokens[0] for t in tokens))
    device = "cpu" if not args.gpus else layouts[args.layouts[0]]["arms"]["1"][0].get("device_kind", "gpu")
    result = dict(name="handover", device=device, command="PYTHONPATH=$PWD python3 scripts/bench_handover.py " +
                  shlex.join(argv if argv is not None else sys.argv[1:]), devices=n, processes=args.processes,
                  model=args.model, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, passes=args.passes,
                  rounds=args.rounds, cpu_count=os.cpu_count(), layouts=layouts)
    table = _table(layouts, n, args.processes)
    path = harness.write_result_and_table(args.out, harness.result_stem(device, "handover"), result, table)
    print(table)
    for name, layout in layouts.items():
        print(f"{name}: same greedy tokens in every arm: {layout['same_tokens']}")
    print(f"wrote {path}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
