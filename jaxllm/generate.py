"""`python -m jaxllm.generate [--model M] "prompt"`: print a completion.

With no --model it runs the embedded `tiny` default (deterministic random weights, byte-level
tokenizer), offline.

Exit status: 0 done; 2 a usage error (flags, model, prompt) or a multi-process run that did not start in
time; 1 a process of the run died; 141 a write to stdout failed because its reader left (`... | head -c 1`:
it stops at once, as a program killed by SIGPIPE would, and says so on stderr); 143 SIGTERM, 130 SIGINT. SIGTERM or SIGINT
to any process of a multi-process run stops the run (a follower passes it to process 0), and process 0
stops the others whichever way it ends.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from jaxllm import console
from jaxllm.mesh_flags import (add_compile_flags, add_host_tier_flag, add_mesh_flags, add_speculative_flags,
                               host_kv_bytes, is_leader, speculative_options, start_processes)
from sharding.xla_flags import add_tensor_parallel_flags

_STDOUT_CLOSED = 141  # 128 + SIGPIPE: what a shell shows for a writer whose reader left


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxllm.generate", description=__doc__.splitlines()[0])
    p.add_argument("prompt", nargs="+", help="prompt text (several prompts run as one batch)")
    p.add_argument("--model", default="tiny", help="preset name, HuggingFace directory or Orbax directory (default: tiny)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the checkpoint's)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="new tokens per prompt (default: 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    p.add_argument("--top-k", type=int, default=0, help="0 disables it (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="(default: 1.0)")
    p.add_argument("--seed", type=int, default=0, help="(default: 0)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--max-context", type=int, default=None, help="longest prompt + output, at most the model's "
                   "context window (default: the window)")
    p.add_argument("--allow-long-context", action="store_true", help="accept a --max-context past the model's "
                   "window (positions it was never trained on: random-weight benchmarks)")
    p.add_argument("--no-stream", action="store_true", help="print each completion when done instead of streaming")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV rBlock (default: 256 on a GPU, 16 on the CPU)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV rBlocks per layer of each instance's pool (default: planned from memory)")
    p.add_argument("--kv-memory-fraction", type=float, default=None,
                   help="GPU: the KV pool's share of the memory left after the weights (default: planned)")
    add_compile_flags(p)
    add_host_tier_flag(p)
    add_speculative_flags(p)
    add_mesh_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    console.guard()  # a closed stdout or stderr never raises from here on
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        # before JAX's backend starts (it reads XLA_FLAGS then)
        add_tensor_parallel_flags(args.tensor_parallel, host_tier=bool(host_kv_bytes(args)))
        start_processes(args, parser.prog)  # before anything touches a device
    except ValueError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    handlers = {}
    if is_leader():
        # SIGTERM and SIGINT unwind like an error (once: a second one must not cut that unwinding short), so
        # the finally below still stops the other processes.
        handlers = {signum: signal.signal(signum, _terminate) for signum in (signal.SIGTERM, signal.SIGINT)}
    from jaxllm import EngineConfig, EngineOptions, LLM, build_engine  # after argument parsing: --help is instant
    from sharding import multihost

    llm = None
    try:
        options = EngineOptions(tensor_parallel=args.tensor_parallel, instances=args.instances,
                                lending=not args.no_lending, spread_prompts=not args.no_spread_prompts,
                                block_size=args.block_size, num_blocks=args.num_blocks,
                                kv_memory_fraction=args.kv_memory_fraction,
                                tuner=args.tuner, compile_cache_dir=args.compile_cache,
                                host_kv_bytes=host_kv_bytes(args), **speculative_options(args))
        config = EngineConfig(args.model, dtype=args.dtype, max_context=args.max_context,
                              allow_long_context=args.allow_long_context, options=options)
        if not is_leader():  # the same steps as process 0, on this process's devices; no output
            build_engine(config, progress=False).follow()
            return 0
        llm = LLM(config)
        sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p, seed=args.seed, stop=args.stop)
        start = time.perf_counter()
        if len(args.prompt) == 1 and not args.no_stream:
            pieces = llm.stream(args.prompt[0], **sampling)  # checks the arguments before the prompt is echoed
            sys.stdout.write(args.prompt[0])
            for piece in pieces:
                if console.closed():
                    break  # leaving the stream cancels the request
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n")
            sys.stdout.flush()
        else:
            for prompt, completion in zip(args.prompt, llm.generate(args.prompt, **sampling)):
                print(f"{prompt}{completion.text}\n[{len(completion.token_ids)} tokens, {completion.finish_reason}]",
                      flush=True)
        if console.closed():
            print(f"{parser.prog}: stdout closed; stopped", file=sys.stderr)
            return _STDOUT_CLOSED
        queue = llm.stats().scheduler
        lending = (f", {queue.lending.loans_total} rBlocks lent between instances, {queue.preemptions} preemptions"
                   if args.instances > 1 else "")
        if queue.host.blocks:
            lending += (f", host tier: {queue.host.swap_outs_total} swaps out / {queue.host.swap_ins_total} in, "
                        f"{queue.host.hit_blocks_total} host-cache rBlocks hit")
        spec = queue.speculative
        if spec.drafts_total:
            lending += (f", speculative: {spec.accepted_tokens_total} of {spec.draft_tokens_total} draft tokens "
                        f"accepted ({spec.mean_acceptance_length:.2f} tokens a verify step)")
        print(f"[{time.perf_counter() - start:.2f} s, model {args.model}, {llm.compile_count} step compiles, "
              f"{llm.executor.xla_compiles} by XLA{lending}]",
              file=sys.stderr)
    except (ValueError, FileNotFoundError, MemoryError) as e:
        if multihost.peer_lost(2.0):  # a collective failed because a process died: the watch ends this process
            return 1                  # with the line naming it (sharding.liveness)
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    finally:
        if llm is not None and not multihost.peer_lost():
            llm.close()  # a multi-process run: the other processes stop following and exit
        for signum, handler in handlers.items():  # main() may run inside another program (tests)
            signal.signal(signum, handler)
    return 0


def _terminate(signum, frame):
    signal.signal(signum, signal.SIG_IGN)
    sys.exit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
