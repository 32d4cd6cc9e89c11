"""`python -m jaxllm.serve [--model M] [--host H] [--port P] ...`: serve a model over gRPC.

With no arguments it serves the embedded `tiny` model on 127.0.0.1:50051 (metrics on :50052).
The port is bound first and answers health checks with NOT_SERVING while the model loads and
warms up; it turns SERVING, and "jaxllm serving <model> on <host>:<port>" is printed, only when
the first requests will not wait for compiles. SIGTERM or SIGINT stops accepting, lets in-flight
streams finish for --grace-period seconds, cancels what is left, and exits 0 (while the model is
still loading, it simply exits 0).

--http-port P also serves the OpenAI-compatible HTTP API (serve/http) on the same engine;
--http-only serves that alone. SIGTERM drains both together.

A multi-process run: SIGTERM or SIGINT to any process stops the whole run as above (a follower passes it
to process 0). When another process dies, process 0 stops serving at once: health NOT_SERVING and HTTP
503, every request in flight ends with an error naming the dead process (gRPC INTERNAL, HTTP 500), and it
exits with status 1 after one line saying which process died. A closed stdout or stderr is no failure:
the messages are dropped and serving goes on.

This entry point is the one place `jaxllm` reaches up into `serve` (the gRPC layer), and only
inside `main`, so importing jaxllm never imports grpc.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from jaxllm import console
from jaxllm.engine.threaded import Engine
from jaxllm.model.kv_cache import KV_DTYPES
from jaxllm.builder import BuiltEngine, build_engine
from jaxllm.engine_config import EngineConfig, EngineOptions
from jaxllm.mesh_flags import (add_compile_flags, add_host_tier_flag, add_mesh_flags, add_speculative_flags,
                               host_kv_bytes, is_leader, speculative_options, start_processes)
from jaxllm.model.checkpoints import MODEL_DTYPES
from jaxllm.model.config import PRESETS
from sharding import multihost
from sharding.xla_flags import add_tensor_parallel_flags


def check_model_name(model: str) -> None:
    """A preset name or an existing directory; anything else is refused before the port is announced
    (loading happens after, and reports a bad checkpoint directory in full)."""
    if model not in PRESETS and not os.path.isdir(model):
        raise ValueError(f"--model {model!r} is neither a preset ({', '.join(sorted(PRESETS))}) "
                         f"nor a checkpoint directory")

def build_parser() -> argparse.ArgumentParser:
    # Defaults are written into each help text (no ArgumentDefaultsHelpFormatter, which would add a
    # second, raw "(default: None)" to flags whose default is computed).
    p = argparse.ArgumentParser(prog="python -m jaxllm.serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="preset name (tiny, llama2-7b, ...; random weights) "
                   "or a HuggingFace / Orbax checkpoint directory (default: tiny)")
    p.add_argument("--dtype", choices=sorted(MODEL_DTYPES), default=None, help="parameter dtype (default: the "
                   "checkpoint's; float32 for presets)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 or :: for every interface; default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port; 0 picks a free one (printed) (default: 50051)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="Prometheus /metrics HTTP port (default: --port + 1, or a free one when --port is 0)")
    p.add_argument("--no-metrics", action="store_true", help="no metrics endpoint")
    p.add_argument("--max-context", type=int, default=None, help="longest prompt + output, at most the model's "
                   "context window (default: the window)")
    p.add_argument("--allow-long-context", action="store_true", help="accept a --max-context past the model's "
                   "window (positions it was never trained on: random-weight benchmarks)")
    p.add_argument("--max-queue", type=int, default=256, help="waiting requests before RESOURCE_EXHAUSTED (default: 256)")
    p.add_argument("--max-running", type=int, default=256, help="sequences batched together (default: 256)")
    p.add_argument("--max-tokens-per-step", type=int, default=None, help="token budget of one step (default: 4096 on a GPU, 512 on the CPU)")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV rBlock (default: 256 on a GPU, 16 on the CPU)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV rBlocks per layer (default: planned from memory)")
    p.add_argument("--kv-memory-fraction", type=float, default=None,
                   help="GPU: the KV pool's share of the memory left after the weights (default: planned, README "
                        "\"Performance\")")
    p.add_argument("--kv-dtype", choices=sorted(KV_DTYPES), default=None, help="KV pool dtype (default: the model's)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="recompute every prompt instead of reusing the KV of identical prompt prefixes")
    p.add_argument("--max-logprobs", type=int, default=20, help="top tokens a request may ask log-probabilities of "
                   "(OpenAI logprobs / top_logprobs); 0 refuses logprobs and compiles no logprob step variants "
                   "(default: 20)")
    p.add_argument("--no-penalties", action="store_true", help="refuse frequency / presence / repetition penalties "
                   "and logit_bias, and keep no penalty state on the device (5 bytes x vocabulary x --max-running per "
                   "instance: 41 MB for a 32K vocabulary at 256)")
    p.add_argument("--max-logit-bias", type=int, default=64,
                   help="logit_bias entries one request may give (default: 64)")
    p.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens of a request that sets none (default: 256)")
    p.add_argument("--max-stop-strings", type=int, default=16, help="stop strings one request may give (default: 16)")
    p.add_argument("--max-stop-length", type=int, default=256, help="characters per stop string (default: 256)")
    p.add_argument("--max-message-bytes", type=int, default=4 << 20, help="largest request accepted, in bytes (default: 4 MiB)")
    p.add_argument("--grace-period", type=float, default=10.0, help="seconds in-flight streams get on SIGTERM (default: 10)")
    p.add_argument("--no-warm-up", action="store_true", help="skip compiling every step shape before SERVING "
                   "(shapes then compile on first use)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--http-port", type=int, default=None, help="also serve the OpenAI-compatible HTTP API "
                   "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics) on this port; 0 picks "
                   "a free one (printed)")
    p.add_argument("--http-only", action="store_true", help="serve the HTTP API only, no gRPC (needs --http-port)")
    p.add_argument("--api-key", default=os.environ.get("JAXLLM_API_KEY"),
                   help="require the key on HTTP (header 'Authorization: Bearer KEY') and gRPC (metadata "
                   "'authorization: Bearer KEY'); health, metrics and reflection stay open (default: $JAXLLM_API_KEY; "
                   "unset: no key)")
    add_compile_flags(p)
    add_host_tier_flag(p)
    add_speculative_flags(p)
    add_mesh_flags(p)
    return p


def engine_options(args: argparse.Namespace) -> EngineOptions:
    """The engine these flags ask for (README's start-up example is checked against the defaults')."""
    return EngineOptions(kv_dtype=args.kv_dtype, block_size=args.block_size, num_blocks=args.num_blocks,
                         kv_memory_fraction=args.kv_memory_fraction,
                         max_tokens_per_step=args.max_tokens_per_step, max_seqs=args.max_running,
                         prefix_caching=not args.no_prefix_caching, tensor_parallel=args.tensor_parallel,
                         lending=not args.no_lending, spread_prompts=not args.no_spread_prompts,
                         instances=args.instances, max_logprobs=args.max_logprobs,
                         tuner=args.tuner, compile_cache_dir=args.compile_cache, penalties=not args.no_penalties,
                         max_logit_bias=args.max_logit_bias, host_kv_bytes=host_kv_bytes(args),
                         default_max_tokens=args.default_max_tokens, max_stop_strings=args.max_stop_strings,
                         max_stop_length=args.max_stop_length, **speculative_options(args))


def engine_config(args: argparse.Namespace, options: EngineOptions) -> EngineConfig:
    """The engine to build: the model flags and the options (engine_options)."""
    return EngineConfig(args.model, dtype=args.dtype, max_context=args.max_context,
                        allow_long_context=args.allow_long_context, options=options)


def main(argv: list[str] | None = None) -> int:
    console.guard()  # a closed stdout or stderr never raises from here on (a launcher that died, a pipe closed)
    parser = build_parser()
    args = parser.parse_args(argv)
    from serve.server import Server, ServerConfig  # the one upward import; see the module docstring

    if args.http_only and args.http_port is None:
        parser.error("--http-only needs --http-port")
    try:
        check_model_name(args.model)
        options = engine_options(args)
        # before JAX's backend starts (it reads XLA_FLAGS then)
        add_tensor_parallel_flags(args.tensor_parallel, host_tier=bool(options.host_kv_bytes))
        start_processes(args, parser.prog)  # before anything touches a device
    except ValueError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    if not is_leader():
        return _follow(args, options)
    metrics_port = None
    if not args.no_metrics and not args.http_only:  # an HTTP-only server has /metrics on its HTTP port
        metrics_port = args.metrics_port if args.metrics_port is not None else (args.port + 1 if args.port else 0)
    try:
        config = ServerConfig(host=args.host, port=args.port, metrics_port=metrics_port,
                              max_running=args.max_running, max_queue=args.max_queue,
                              max_message_bytes=args.max_message_bytes, grace_period_s=args.grace_period,
                              api_key=args.api_key or None)
        server = None if args.http_only else Server(config)
    except (ValueError, OSError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    try:
        http = _http_server(args, server)
    except (ValueError, OSError) as e:  # e.g. the HTTP port is in use: give the gRPC port back too
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        if server:
            server.shutdown(0.0)
        return 2

    stop = threading.Event()
    loading = True
    engine = None

    def on_signal(signum, frame):
        if loading:
            # Nothing is in flight yet, and an exception raised here could land in any callback
            # (even a GC hook) and be swallowed: leave at once instead.
            print(f"jaxllm: {signal.Signals(signum).name} while loading; exiting", file=sys.stderr, flush=True)
            sys.stdout.flush()
            multihost.stopping()  # the other processes of a run leave too, as on a stop
            os._exit(0)
        stop.set()

    def on_run_end(message: str, status: int) -> None:
        """Another process of the run died (sharding.liveness, on its thread): no step can run any more."""
        print(f"{parser.prog}: error: {message}; stopping", file=sys.stderr, flush=True)
        if engine is not None:
            engine.fail(message)  # every request in flight ends with this error; new ones are refused
        if http:
            http.stop_accepting()
        if server:
            server.stop_now(1.0)  # health NOT_SERVING; streams send their error
        if http:
            http.shutdown(2.0)
        sys.stdout.flush()
        os._exit(status)  # the main thread may wait for a step that never ends

    multihost.on_end(on_run_end)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    where = f"{args.host}:{server.port}" if server else http.url
    if server:
        metrics_at = f"; metrics on http://{args.host}:{server.metrics_port}/metrics" if server.metrics_port else ""
        print(f"jaxllm listening on {where} (NOT_SERVING until {args.model} is loaded and warm){metrics_at}",
              flush=True)
    if http:
        print(f"jaxllm HTTP listening on {http.url} (OpenAI API; 503 until {args.model} is loaded and warm)",
              flush=True)
    if http and server:
        where += f"; OpenAI API on {http.url}"
    built: BuiltEngine | None = None
    try:
        started = time.monotonic()
        if not args.quiet:
            print(f"loading {args.model} ...", file=sys.stderr, flush=True)
        built = build_engine(engine_config(args, options), progress=not args.quiet)
        if not args.quiet:
            print(f"loaded {built.model_config.name} ({built.model_config.num_layers} layers, max_context "
                  f"{built.max_context}, {built.num_blocks} rBlocks of {built.executor.block_size} tokens) in "
                  f"{time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
            if built.host_blocks:
                host_gib = built.host_blocks * built.executor.block_bytes / 2**30
                print(f"host tier: {built.host_blocks} rBlocks ({host_gib:.1f} GiB of pinned host memory) an instance: preempted sequences swap, the prefix cache spills",
                      file=sys.stderr, flush=True)
        if not args.no_warm_up:
            # Every bucket of the runner: after this, serving compiles nothing (jaxllm_compiles_total stays flat).
            built.warm_up(progress=not args.quiet)
        engine = Engine(built.core, built.tokenizer, built.info(), max_waiting=args.max_queue, step_error=_step_error)
        for front in (server, http):
            if front is not None:
                front.attach(engine, args.model)
        loading = False
    except ValueError as e:  # unknown model, bad checkpoint, bad option: the user's to fix
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        if built is not None:
            built.close()
        if server:
            server.shutdown(0.0)
        if http:
            http.shutdown(1.0)
        return 2
    except BaseException:
        if built is not None:
            built.close()  # a multi-process run: the other processes stop and exit too
        raise
    print(f"jaxllm serving {args.model} on {where}", flush=True)
    stop.wait()
    print(f"jaxllm: shutting down (grace period {config.grace_period_s:g} s)", file=sys.stderr, flush=True)
    try:
        if http:
            http.stop_accepting()  # 503 from now; its streams drain with the engine below
        if server:
            server.shutdown()  # drains the engine (HTTP streams too) within the grace period
        else:
            engine.shutdown(config.grace_period_s)
        if http:
            http.shutdown()
    finally:
        built.close()  # no step runs any more: the other processes of a multi-process run stop following and exit
    print("jaxllm: stopped", file=sys.stderr, flush=True)
    return 0


def _step_error(e: Exception) -> str:
    """What a failed step's requests are told: on a multi-process run a collective fails when a process dies
    (gloo may raise before the watch reports it), so the watch's message naming that process wins."""
    return multihost.peer_lost(2.0) or f"{type(e).__name__}: {e}"


def _follow(args, options: EngineOptions) -> int:
    """A process other than 0: the same model on this process's devices, running every step process 0
    sends on the step channel (sharding.step_channel) until it stops; no port, no scheduler."""
    import jax

    try:
        built = build_engine(engine_config(args, options), progress=False)
    except ValueError as e:
        print(f"python -m jaxllm.serve: error: {e}", file=sys.stderr)
        return 2
    calls = built.follow()
    if not args.quiet:
        print(f"jaxllm process {jax.process_index()}: process 0 stopped after {calls} steps; exiting",
              file=sys.stderr, flush=True)
    return 0


def _http_server(args, server):
    """The OpenAI API server beside gRPC (sharing its metrics registry), or None without --http-port."""
    if args.http_port is None:
        return None
    from serve.http import HttpConfig, HttpServer  # upward, like serve.server above

    config = HttpConfig(host=args.host, port=args.http_port, api_key=args.api_key or None,
                        max_body_bytes=args.max_message_bytes, max_running=args.max_running,
                        max_queue=args.max_queue)
    if server is None:
        return HttpServer(config, engine_metrics=True)
    return HttpServer(config, server.registry)


if __name__ == "__main__":
    sys.exit(main())
