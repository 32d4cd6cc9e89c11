"""What a user sees, one process against several: `LLM.generate` and the HTTP server, time a generated token.

  PYTHONPATH=$PWD python3 scripts/bench_end_to_end.py --modes generate serve      # CPU: 4 host devices, 2 processes
  PYTHONPATH=$PWD python3 scripts/bench_end_to_end.py --dry-run                    # the arithmetic on made-up runs

`generate` (issue 61's user test): `LLM(model, max_context=512, options=EngineOptions(instances=4))` with 4 prompts,
and `EngineOptions(tensor_parallel=4)` with one (--layouts), `generate(..., max_new_tokens=96, temperature=0.0,
ignore_eos=True)`. Each arm is a fresh run of this script as its worker: one process with N host devices, or P
processes of N/P devices started by scripts/launch.py. A worker runs one untimed call (its compiles), then the
issue's own measurement, a second call without warm-up (`second_call_unwarmed`: its prompts now hit the prefix
cache, so its prefill runs a smaller bucket that this call compiles, on every process), then --passes timed calls,
which compile nothing (`compiles_while_timed`: every shape of the load is compiled by then); an arm's time a token
is the whole call's wall time over max_new_tokens (one decode step of every sequence: what the issue calls a token).
The arms alternate for --rounds rounds; reported are the best and the median over every timed call of an arm kind,
and the greedy tokens must be the same in every arm (`same_tokens`).

Each side's time a token is split into its parts by this script's own perf_counter probes on the objects the worker
holds (no engine code is changed for it). Process 0's engine thread: `scheduler` (plan, plan_continuation, update),
`layout` (InputLayout.build or, for a continuation, advance: the plan padded and stacked, the penalty rows with it;
the runs up to cpu-2026-12-08-0027 timed build alone, so a continuation's advance fell in dispatch_rest), `send`
(the step call and its inputs handed to the followers), `dispatch_rest` (the rest of ModelRunner.dispatch: the
tuner's choice, the call, the submission), `wait_tokens` (InFlight.tokens: the engine thread waiting for the step's
tokens; of it, `results_read`: the host read of the tokens, with the followers' rows from the results channel),
`output` (the rest of EngineCore.step: detokenising, stop checks, RequestOutputs) and `outside_step` (the generate
call beyond its steps: request checks, Completions). Beside it, on process 0's launcher thread, `launch` (inputs
placed and the jitted step enqueued: Worker.place + Worker.run). A follower: `receive` (waiting for and reading the
next call), `place`, `launch` (Worker.run) and `return_send` (the rows process 0 lacks handed to the results
channel's thread). Sampling and penalties run inside the step program (on the devices); their host share is the
layout's. After the timed calls a worker times the step program alone (`step_ms`: the same decode bucket, its rows
at the run's mean context, launched and waited for one at a time), so one process's time a token is read against its
step.

`serve`: `python -m jaxllm.serve --http-only` with `--instances N` on one process and on P processes (through
scripts/launch.py), its buckets cut to the load (`--max-running` --requests, `--max-tokens-per-step`
--serve-tokens-per-step, `--max-logprobs 0`) so that its warm-up, every bucket compiled before it serves, takes
seconds, not minutes, on the CPU (and one persistent compile cache for every arm), driven by the `openai` package's
client: --concurrency streamed chat completions at a time, the same prompts in every arm, greedy, ignore_eos,
exactly --max-tokens tokens each, two untimed batches first (as generate's untimed calls); TTFT (request to the
first chunk whose continuous usage stats count a token) and TPOT (the time after it over the tokens after it) of
every request, medians and best per arm, the arms alternating for --rounds rounds; then each prompt alone, one
stream at a time, --passes times (`single_ttft_ms`: in a concurrent batch the first request to arrive is often
admitted alone and the others wait for its step, so a batch's TTFT is bimodal, on one process and on several alike).

Writes `<device>-<date>-<HHMM>-end-to-end.json` and a Markdown table under benchmarks/results/ and prints it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from scripts.common import harness, load_report
from scripts.common.arms import run_arm
from scripts.common.server_process import free_port, wait_healthy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEADER_PARTS = ("scheduler", "layout", "send", "dispatch_rest", "wait_tokens", "output", "outside_step")
FOLLOWER_PARTS = ("receive", "place", "launch", "return_send")


# ----- probes: this script's own timers on the objects a worker holds -----

class Probe:
    """Seconds spent in named calls, summed (thread-safe: the launcher thread adds too)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def timed(self, fn, name: str):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - start)
        return wrapper

    def wrap(self, obj, attr: str, name: str) -> None:
        """Time obj.attr from now on (an instance attribute over the method: this script's probe on its object)."""
        setattr(obj, attr, self.timed(getattr(obj, attr), name))

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.seconds)


class _TimedLayout:
    """An InputLayout whose build and advance are timed (the layout is a frozen dataclass: proxied, not patched)."""

    def __init__(self, layout, probe: Probe):
        self._layout = layout
        self.build = probe.timed(layout.build, "layout")
        if hasattr(layout, "advance"):  # an engine before issue 61's (the before figures) lays every step out anew
            self.advance = probe.timed(layout.advance, "layout")

    def __getattr__(self, name):
        return getattr(self._layout, name)


def _probe_leader(llm, probe: Probe) -> None:
    core, runner = llm.core, llm.executor
    worker = runner.worker
    for attr in ("plan", "plan_continuation", "update"):
        probe.wrap(core.scheduler, attr, "scheduler")
    runner.layout = _TimedLayout(runner.layout, probe)
    if worker.channel is not None:
        probe.wrap(worker.channel, "send", "send")
    probe.wrap(worker, "place", "launch")
    probe.wrap(worker, "run", "launch")
    reader = worker.reader
    worker.reader = lambda seq: probe.timed(reader(seq), "results_read")
    dispatch = runner.dispatch

    def dispatched(plan, **kwargs):
        start = time.perf_counter()
        inflight = dispatch(plan, **kwargs)
        probe.add("dispatch", time.perf_counter() - start)
        inflight.tokens = probe.timed(inflight.tokens, "wait_tokens")
        return inflight

    runner.dispatch = dispatched
    probe.wrap(core, "step", "core_step")


def leader_parts(seconds: dict[str, float], wall_s: float, tokens: int) -> dict[str, float]:
    """Process 0's engine-thread parts in ms a token, from the probes' sums over `tokens` tokens (the nested sums
    taken apart: layout and send are inside dispatch, dispatch, scheduler and wait_tokens inside core_step);
    `launch` (the launcher thread, beside them) and `results_read` (inside wait_tokens) are listed too."""
    s = lambda k: seconds.get(k, 0.0)  # noqa: E731
    parts = dict(scheduler=s("scheduler"), layout=s("layout"), send=s("send"),
                 dispatch_rest=s("dispatch") - s("layout") - s("send"), wait_tokens=s("wait_tokens"),
                 output=s("core_step") - s("scheduler") - s("dispatch") - s("wait_tokens"),
                 outside_step=wall_s - s("core_step"))
    out = {k: 1e3 * v / tokens for k, v in parts.items()}
    out.update(launch=1e3 * s("launch") / tokens, results_read=1e3 * s("results_read") / tokens)
    return out


# ----- the generate worker: one process of an arm -----

def _options(layout: str, n: int):
    from jaxllm import EngineOptions

    return EngineOptions(instances=n) if layout == "instances" else EngineOptions(tensor_parallel=n)


def _prompts(layout: str, n: int, prompt_tokens: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, 259, size=prompt_tokens).tolist() for _ in range(n if layout == "instances" else 1)]


def _step_ms(llm, seqs: int, context: int, repeats: int) -> float:
    """The decode step program alone: the bucket the load's decode steps run (`seqs` sequences spread over the
    instances, so an instance's rows), every row at `context` tokens, launched and waited for one at a time (median
    ms)."""
    import jax

    from jaxllm.contract import StepKind
    from jaxllm.executor.calls import Op, StepCall

    runner = llm.executor
    rows = -(-seqs // runner.layout.instances)  # the busiest instance's rows: the bucket's size
    inputs = runner.layout.inert(StepKind.DECODE, rows)
    inputs.kv_lens[:, :rows] = context  # each row's table points at rBlock 0: the same reads as a real context
    call = StepCall(Op.STEP, StepKind.DECODE, True, False, 0)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(runner.worker.launch(call, inputs, None).result().tokens)
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def _lead(args, config) -> dict:
    from jaxllm import LLM

    llm = LLM(config, progress=False)
    n = llm.engine.info().devices
    prompts = _prompts(args.layout, n, args.prompt_tokens)
    generate = dict(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    try:
        llm.generate(prompts, **generate)  # untimed: its compiles
        # The measurement: the second call without warm-up. Its prompts now hit the prefix cache, so its
        # prefill runs a smaller bucket, compiled in this call (on every process of a run).
        compiles = llm.compile_count
        start = time.perf_counter()
        llm.generate(prompts, **generate)
        unwarmed = dict(ms_per_token=1e3 * (time.perf_counter() - start) / args.new_tokens,
                        compiles=llm.compile_count - compiles)
        compiles = llm.compile_count  # every shape of this load is compiled now: what follows compiles nothing
        probe = Probe()
        _probe_leader(llm, probe)
        passes, tokens = [], None
        for _ in range(args.passes):
            before = probe.snapshot()
            t0 = time.monotonic_ns()
            start = time.perf_counter()
            completions = llm.generate(prompts, **generate)
            wall = time.perf_counter() - start
            t1 = time.monotonic_ns()
            after = probe.snapshot()
            got = [list(map(int, c.token_ids)) for c in completions]
            if tokens is not None and got != tokens:
                raise AssertionError("greedy tokens differ between passes of one arm")
            tokens = got
            seconds = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
            passes.append(dict(window_ns=[t0, t1], ms_per_token=1e3 * wall / args.new_tokens,
                               parts=leader_parts(seconds, wall, args.new_tokens)))
        compiles = llm.compile_count - compiles
        step_ms = _step_ms(llm, len(prompts), args.prompt_tokens + args.new_tokens // 2, args.step_repeats)
        return dict(role="leader", passes=passes, tokens=tokens, step_ms=step_ms, second_call_unwarmed=unwarmed,
                    compiles_while_timed=compiles)
    finally:
        llm.close()


def _follow(args, config) -> dict:
    """A follower: every call process 0 sends, its parts summed; a sample (time, sums) after each receive, which
    the driver cuts to process 0's timed windows."""
    from jaxllm import build_engine
    from sharding import multihost

    built = build_engine(config, progress=False)
    probe, samples = Probe(), []
    worker = built.executor.worker
    probe.wrap(worker, "place", "place")
    probe.wrap(worker, "run", "launch")
    results = multihost.step_results()
    probe.wrap(results, "send", "return_send")
    channel = worker.channel
    receive = probe.timed(channel.receive, "receive")

    def recording():
        got = receive()
        samples.append((time.monotonic_ns(), probe.snapshot()))
        return got

    channel.receive = recording
    calls = built.follow()
    return dict(role="follower", calls=calls, samples=samples)


def follower_parts(samples: list, window_ns: list[int], tokens: int) -> dict[str, float]:
    """A follower's parts in ms a token over process 0's timed window: its sums between the last sample before the
    window and the last one inside it."""
    times = [t for t, _ in samples]
    a = max(0, int(np.searchsorted(times, window_ns[0])) - 1)
    b = max(a, int(np.searchsorted(times, window_ns[1])) - 1)
    first, last = samples[a][1], samples[b][1]
    return {k: 1e3 * (last.get(k, 0.0) - first.get(k, 0.0)) / tokens for k in FOLLOWER_PARTS}


def worker(args) -> int:
    from jaxllm import EngineConfig, console
    from sharding import multihost

    if multihost.initialize(prog="bench_end_to_end"):  # the JAX_* variables launch.py sets, else one process
        console.library_stdout_to_stderr()  # gloo's connection lines stay off the result line
    import jax

    config = EngineConfig(args.model, max_context=args.max_context,
                          options=_options(args.layout, jax.device_count()))
    result = _lead(args, config) if multihost.is_leader() else _follow(args, config)
    result.update(process=jax.process_index(), processes=jax.process_count(), devices=jax.device_count())
    # A file, not a stdout line: a follower's samples pass 64 KiB, past what launch.py's line pump keeps whole.
    with open(os.path.join(args.result_dir, f"result-{jax.process_index()}.json"), "w") as f:
        json.dump(result, f)
    return 0


# ----- the driver: generate arms in turns -----

def _env(devices: int | None) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(name, None)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["JAX_PLATFORMS"] = "cpu"
    if devices:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def _launched(args, cmd: list[str], processes: int, flags: bool) -> tuple[list[str], dict]:
    """The command of an arm, one process or `processes` through launch.py, and its environment."""
    if processes == 1:
        return cmd, _env(args.cpu_devices)
    wrapper = [sys.executable, os.path.join(ROOT, "scripts", "launch.py"), "--num-processes", str(processes),
               "--cpu-devices", str(args.cpu_devices // processes), "--timeout", str(args.arm_timeout)]
    return wrapper + ([] if flags else ["--no-flags"]) + ["--", *cmd], _env(None)


def _run_generate_arm(args, layout: str, processes: int) -> list[dict]:
    result_dir = tempfile.mkdtemp(prefix="jaxllm-e2e-arm-")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--result-dir", result_dir, "--layout", layout,
           "--model", args.model,
           "--max-context", str(args.max_context), "--prompt-tokens", str(args.prompt_tokens), "--new-tokens",
           str(args.new_tokens), "--passes", str(args.passes), "--step-repeats", str(args.step_repeats)]
    cmd, env = _launched(args, cmd, processes, flags=False)
    start = time.monotonic()
    proc = run_arm(cmd, env, ROOT, args.arm_timeout + 60, f"the {layout} arm with {processes} process(es)")
    results = []
    for name in sorted(os.listdir(result_dir)):
        with open(os.path.join(result_dir, name)) as f:
            results.append(json.load(f))
    shutil.rmtree(result_dir, ignore_errors=True)
    if len(results) != processes:
        raise RuntimeError(f"the {layout} arm gave {len(results)} results of {processes}:\n{proc.stdout[-2000:]}")
    results.sort(key=lambda r: r["process"])
    best = min(p["ms_per_token"] for p in results[0]["passes"])
    _log(f"[generate {layout}] {processes} process(es): {best:.2f} ms a token at best "
         f"({time.monotonic() - start:.0f} s)")
    return results


def generate_arm(results: list[dict], new_tokens: int) -> dict:
    """An arm's figures: each timed call's time a token and process 0's parts, each follower's cut to its window."""
    lead = results[0]
    calls = []
    for p in lead["passes"]:
        call = dict(ms_per_token=p["ms_per_token"], parts=p["parts"], followers=[])
        for f in results[1:]:
            call["followers"].append(dict(process=f["process"],
                                          parts=follower_parts(f["samples"], p["window_ns"], new_tokens)))
        calls.append(call)
    return dict(processes=len(results), calls=calls, step_ms=lead["step_ms"], tokens=lead["tokens"],
                second_call_unwarmed=lead["second_call_unwarmed"], compiles_while_timed=lead["compiles_while_timed"])


def _mean_parts(dicts: list[dict]) -> dict:
    keys = sorted({k for d in dicts for k in d})
    return {k: float(np.median([d.get(k, 0.0) for d in dicts])) for k in keys}


def generate_summary(arms: dict[int, list[dict]]) -> dict:
    """Best and median time a token of each arm kind over all its timed calls, their ratios, the median parts."""
    one, many = arms[1], arms[max(arms)]
    times = lambda rows: [c["ms_per_token"] for r in rows for c in r["calls"]]  # noqa: E731
    out = dict(one_process_best_ms=min(times(one)), one_process_median_ms=float(np.median(times(one))),
               processes_best_ms=min(times(many)), processes_median_ms=float(np.median(times(many))),
               one_process_step_ms=float(np.median([r["step_ms"] for r in one])),
               processes_step_ms=float(np.median([r["step_ms"] for r in many])),
               one_process_parts=_mean_parts([c["parts"] for r in one for c in r["calls"]]),
               processes_parts=_mean_parts([c["parts"] for r in many for c in r["calls"]]),
               follower_parts=_mean_parts([f["parts"] for r in many for c in r["calls"] for f in c["followers"]]),
               one_process_unwarmed_ms=float(np.median([r["second_call_unwarmed"]["ms_per_token"] for r in one])),
               processes_unwarmed_ms=float(np.median([r["second_call_unwarmed"]["ms_per_token"] for r in many])),
               unwarmed_compiles=max(r["second_call_unwarmed"]["compiles"] for r in one + many),
               compiles_while_timed=sum(r["compiles_while_timed"] for r in one + many))
    out["best_ratio"] = out["processes_best_ms"] / out["one_process_best_ms"]
    out["median_ratio"] = out["processes_median_ms"] / out["one_process_median_ms"]
    out["one_process_token_over_step"] = out["one_process_median_ms"] / out["one_process_step_ms"]
    out["same_tokens"] = all(r["tokens"] == one[0]["tokens"] for r in one + many)
    return out


# ----- serve: the HTTP server on one process and on several -----

def chat_messages(count: int) -> list[list[dict]]:
    """The same chat prompts in every arm."""
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()
    return [[{"role": "user", "content": " ".join(words[i % len(words):] + words[:i % len(words)])}]
            for i in range(count)]


def stream_timings(start: float, arrivals: list[tuple[float, int]]) -> tuple[float, float | None]:
    """(TTFT s, TPOT s or None) of one stream: `arrivals` are (time, completion tokens so far) of its chunks, from
    the server's continuous usage stats (a random-weight model's first tokens may be bytes of no text yet, so a
    content chunk would come late). TTFT: to the first chunk with a token; TPOT: the time after it over the tokens
    after it."""
    counted = [(t, n) for t, n in arrivals if n > 0]
    (t0, n0), (t1, n1) = counted[0], counted[-1]
    return t0 - start, ((t1 - t0) / (n1 - n0) if n1 > n0 else None)


def _one_chat(client, messages, max_tokens: int) -> dict:
    start = time.perf_counter()
    arrivals = []
    usage = {"include_usage": True, "continuous_usage_stats": True}  # vLLM's: every chunk counts the tokens so far
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0.0,
                                            stream=True, extra_body={"ignore_eos": True, "stream_options": usage})
    for chunk in stream:
        if chunk.usage is not None:
            arrivals.append((time.perf_counter(), chunk.usage.completion_tokens))
    ttft, tpot = stream_timings(start, arrivals)
    return dict(ttft_s=ttft, tpot_s=tpot, chunks=max(n for _, n in arrivals))


def _drive(url: str, args) -> dict:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    prompts = chat_messages(args.requests)
    for _ in range(2):  # untimed, as generate's: the load's shapes compiled (the second: its prompts' cached prefix)
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(lambda m: _one_chat(client, m, args.max_tokens), prompts))
    compiles = load_report.read_metric(url + "/metrics", "jaxllm_compiles_total")
    runs = []
    for _ in range(args.passes):
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            runs.append(list(pool.map(lambda m: _one_chat(client, m, args.max_tokens), prompts)))
    figures = serve_figures(runs)
    # One stream at a time: TTFT without the admission's luck (in a concurrent batch the first request to arrive is
    # often admitted alone, and the others wait for its step: a bimodal TTFT on one process and on several alike).
    figures["single_ttft_ms"] = [1e3 * _one_chat(client, m, args.max_tokens)["ttft_s"]
                                 for _ in range(args.passes) for m in prompts]
    figures["compiles_while_timed"] = load_report.read_metric(url + "/metrics", "jaxllm_compiles_total") - compiles
    return figures


def serve_figures(runs: list[list[dict]]) -> dict:
    """A serve arm's figures over its passes: TTFT and TPOT medians (ms), and each pass's medians."""
    per_pass = [dict(ttft_ms=1e3 * float(np.median([r["ttft_s"] for r in run])),
                     tpot_ms=1e3 * float(np.median([r["tpot_s"] for r in run if r["tpot_s"] is not None])),
                     requests_ttft_tpot_ms=[(1e3 * r["ttft_s"], None if r["tpot_s"] is None else 1e3 * r["tpot_s"])
                                            for r in run])
                for run in runs]
    return dict(passes=per_pass, ttft_ms=float(np.median([p["ttft_ms"] for p in per_pass])),
                tpot_ms=float(np.median([p["tpot_ms"] for p in per_pass])),
                chunks=[r["chunks"] for run in runs for r in run])


def _run_serve_arm(args, layout: str, processes: int) -> dict:
    port = free_port()
    mesh = ["--instances", str(args.cpu_devices)] if layout == "instances" else ["--tensor-parallel",
                                                                                 str(args.cpu_devices)]
    cmd = [sys.executable, "-m", "jaxllm.serve", "--model", args.model, "--max-context", str(args.max_context),
           "--http-only", "--http-port", str(port), "--quiet", "--max-running", str(args.requests),
           "--max-tokens-per-step", str(args.serve_tokens_per_step), "--max-logprobs", "0",
           "--compile-cache", args.compile_cache, *mesh]
    cmd, env = _launched(args, cmd, processes, flags=True)
    start = time.monotonic()
    log = open(os.devnull, "w")
    server = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", server, args.arm_timeout)
        figures = _drive(f"http://127.0.0.1:{port}", args)
    except BaseException:
        server.send_signal(signal.SIGTERM)
        try:
            _, err = server.communicate(timeout=60)
            _log(err[-3000:])
        except subprocess.TimeoutExpired:
            server.kill()
        raise
    server.send_signal(signal.SIGTERM)
    try:
        server.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        server.kill()
        server.communicate()
    _log(f"[serve {layout}] {processes} process(es): TTFT {figures['ttft_ms']:.1f} ms, TPOT {figures['tpot_ms']:.2f} "
         f"ms ({time.monotonic() - start:.0f} s)")
    return dict(processes=processes, **figures)


def serve_summary(arms: dict[int, list[dict]]) -> dict:
    one, many = arms[1], arms[max(arms)]
    pick = lambda rows, k: [p[k] for r in rows for p in r["passes"]]  # noqa: E731
    out = dict(compiles_while_timed=sum(r.get("compiles_while_timed", 0) for r in one + many))
    single = lambda rows: [t for r in rows for t in r.get("single_ttft_ms", ())]  # noqa: E731
    if single(one) and single(many):
        out["one_process_single_ttft_ms_median"] = float(np.median(single(one)))
        out["processes_single_ttft_ms_median"] = float(np.median(single(many)))
        out["single_ttft_median_ratio"] = out["processes_single_ttft_ms_median"] / out["one_process_single_ttft_ms_median"]
    for k in ("ttft_ms", "tpot_ms"):
        out[f"one_process_{k}_best"], out[f"processes_{k}_best"] = min(pick(one, k)), min(pick(many, k))
        out[f"one_process_{k}_median"] = float(np.median(pick(one, k)))
        out[f"processes_{k}_median"] = float(np.median(pick(many, k)))
        out[f"{k}_best_ratio"] = out[f"processes_{k}_best"] / out[f"one_process_{k}_best"]
        out[f"{k}_median_ratio"] = out[f"processes_{k}_median"] / out[f"one_process_{k}_median"]
    return out


# ----- tables -----

def _table(result: dict) -> str:
    p = result["processes"]
    lines = []
    gen = result.get("generate", {})
    if gen:
        header = ["layout", "1 proc ms/token best / median", f"{p} procs ms/token best / median", "ratio best / median",
                  "1 proc step ms", "same tokens", "unwarmed 2nd call ms/token 1 / P (compiles)"]
        rows = [[name, f"{s['one_process_best_ms']:.2f} / {s['one_process_median_ms']:.2f}",
                 f"{s['processes_best_ms']:.2f} / {s['processes_median_ms']:.2f}",
                 f"{s['best_ratio']:.2f}x / {s['median_ratio']:.2f}x", f"{s['one_process_step_ms']:.2f}",
                 str(s["same_tokens"]),
                 f"{s['one_process_unwarmed_ms']:.2f} / {s['processes_unwarmed_ms']:.2f} ({s['unwarmed_compiles']})"]
                for name, s in ((n, g["summary"]) for n, g in gen.items())]
        lines.append(harness.markdown_table(header, rows))
        header = ["layout", "side"] + list(LEADER_PARTS) + ["launch (thread)", "results_read"]
        rows = []
        for name, g in gen.items():
            s = g["summary"]
            for side, parts in (("1 proc", s["one_process_parts"]), (f"{p} procs p0", s["processes_parts"])):
                rows.append([name, side] + [f"{parts.get(k, 0.0):.3f}" for k in LEADER_PARTS + ("launch", "results_read")])
            if s["follower_parts"]:
                rows.append([name, "follower"] + [f"{k} {s['follower_parts'].get(k, 0.0):.3f}" for k in FOLLOWER_PARTS]
                            + [""] * (len(LEADER_PARTS) + 2 - len(FOLLOWER_PARTS)))
        lines.append("ms a token by part (medians over timed calls)\n\n" + harness.markdown_table(header, rows))
    srv = result.get("serve", {})
    if srv:
        header = ["layout", "TTFT ms 1 / P (best)", "TTFT ratio best / median", "TPOT ms 1 / P (best)",
                  "TPOT ratio best / median", "one stream at a time: TTFT ms 1 / P (median)"]
        rows = [[name, f"{s['one_process_ttft_ms_best']:.1f} / {s['processes_ttft_ms_best']:.1f}",
                 f"{s['ttft_ms_best_ratio']:.2f}x / {s['ttft_ms_median_ratio']:.2f}x",
                 f"{s['one_process_tpot_ms_best']:.2f} / {s['processes_tpot_ms_best']:.2f}",
                 f"{s['tpot_ms_best_ratio']:.2f}x / {s['tpot_ms_median_ratio']:.2f}x",
                 (f"{s['one_process_single_ttft_ms_median']:.1f} / {s['processes_single_ttft_ms_median']:.1f} "
                  f"({s['single_ttft_median_ratio']:.2f}x)") if "single_ttft_median_ratio" in s else "-"]
                for name, s in ((n, v["summary"]) for n, v in srv.items())]
        lines.append(harness.markdown_table(header, rows))
    return "\n\n".join(lines)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _dry_run(args) -> dict:
    """Made-up worker results through the same arithmetic (no process started): the smoke test's path."""
    def lead(ms, step):
        parts = dict(scheduler=0.01, core_step=ms * 96e-3 * 0.9, dispatch=0.02, layout=0.005, wait_tokens=0.05)
        return dict(process=0, passes=[dict(window_ns=[10, 20], ms_per_token=ms,
                                            parts=leader_parts(parts, ms * 96e-3, 96))],
                    step_ms=step, tokens=[[1, 2]], compiles_while_timed=0,
                    second_call_unwarmed=dict(ms_per_token=5 * ms, compiles=2))
    follower = dict(process=1, samples=[(5, {"receive": 0.0}), (15, {"receive": 0.048}), (25, {"receive": 0.096})])
    arms = {1: [generate_arm([lead(1.0, 0.6)], 96)], 2: [generate_arm([lead(1.1, 0.7), follower], 96)]}
    runs = [[dict(ttft_s=0.05, tpot_s=0.002, chunks=3)]]
    serve = {n: [dict(processes=n, single_ttft_ms=[40.0 * n], **serve_figures(runs))] for n in (1, 2)}
    return dict(generate={"instances": dict(arms={str(k): v for k, v in arms.items()},
                                            summary=generate_summary(arms))},
                serve={"instances": dict(arms={str(k): v for k, v in serve.items()}, summary=serve_summary(serve))})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", default=["generate", "serve"], choices=["generate", "serve"])
    p.add_argument("--layouts", nargs="+", default=["instances", "tp"], choices=["instances", "tp"],
                   help="generate's layouts (serve runs instances only unless given tp too; default: both)")
    p.add_argument("--serve-layouts", nargs="+", default=["instances"], choices=["instances", "tp"])
    p.add_argument("--cpu-devices", type=int, default=4, help="N host devices in all (default: 4)")
    p.add_argument("--processes", type=int, default=2, help="P (default: 2)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--max-context", type=int, default=512)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--passes", type=int, default=3, help="timed calls (serve: timed batches) an arm (default: 3)")
    p.add_argument("--rounds", type=int, default=2, help="times each arm runs, in turns (default: 2)")
    p.add_argument("--step-repeats", type=int, default=30)
    p.add_argument("--requests", type=int, default=4, help="serve: chat completions a batch (default: 4)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96, help="serve: tokens a completion (default: 96)")
    p.add_argument("--serve-tokens-per-step", type=int, default=128,
                   help="serve: the server's --max-tokens-per-step (default: 128)")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="serve: the servers' persistent compile cache (default: a new temporary directory)")
    p.add_argument("--arm-timeout", type=int, default=900)
    p.add_argument("--out", default=harness.RESULTS_DIR)
    p.add_argument("--dry-run", action="store_true", help="made-up runs through the arithmetic; writes nothing")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", default="instances", help=argparse.SUPPRESS)
    p.add_argument("--result-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.processes < 2 or args.cpu_devices % args.processes:
        p.error(f"--processes must be at least 2 and divide the {args.cpu_devices} devices, got {args.processes}")
    result = dict(name="end-to-end", device="cpu", command="PYTHONPATH=$PWD python3 scripts/bench_end_to_end.py " +
                  shlex.join(argv if argv is not None else sys.argv[1:]), devices=args.cpu_devices,
                  processes=args.processes, model=args.model, max_context=args.max_context,
                  prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, passes=args.passes,
                  rounds=args.rounds, cpu_count=os.cpu_count())
    if args.dry_run:
        result.update(_dry_run(args))
        print(_table(result))
        return 0
    if "generate" in args.modes:
        result["generate"] = {}
        for layout in args.layouts:
            arms: dict[int, list[dict]] = {1: [], args.processes: []}
            for _ in range(args.rounds):
                for processes in (1, args.processes):
                    arms[processes].append(generate_arm(_run_generate_arm(args, layout, processes), args.new_tokens))
            result["generate"][layout] = dict(arms={str(k): v for k, v in arms.items()},
                                              summary=generate_summary(arms))
    if "serve" in args.modes:
        args.compile_cache = args.compile_cache or tempfile.mkdtemp(prefix="jaxllm-e2e-cache-")
        result["serve"] = {}
        for layout in args.serve_layouts:
            arms = {1: [], args.processes: []}
            for _ in range(args.rounds):
                for processes in (1, args.processes):
                    arms[processes].append(_run_serve_arm(args, layout, processes))
            result["serve"][layout] = dict(arms={str(k): v for k, v in arms.items()}, summary=serve_summary(arms))
    table = _table(result)
    path = harness.write_result_and_table(args.out, harness.result_stem("cpu", "end-to-end"), result, table)
    print(table)
    print(f"wrote {path}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
