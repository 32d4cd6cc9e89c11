"""The host tier (issue 35) on one GPU: copy rates, a multi-turn workload, a preemption-heavy one, compiles.

  PYTHONPATH=$PWD python3 scripts/bench_host_tier.py --out $OUT

(a) link: the host link's bandwidth each way, measured by a plain large jax.device_put of --link-gib GiB to the
    device's host memory kind and back, against the engine's own copy of a run of rBlocks each way (the longest
    run the tier copies, through the executor: gather + copy to the host; copy back + scatter into the pool):
    its rate and its fraction of the link's; and a stream of --link-stream-gib GiB of rBlocks in one plan each way
    (runs queued back to back, as a conversation's history comes back).
(b) multi-turn: --conversations conversations, each a history of --history tokens, then --turns turns of
    --user-tokens new tokens and --reply-tokens generated; every turn submits every conversation's next prompt
    (its whole history so far) at once. The pool (--num-blocks) holds a fraction of the histories, so between
    turns the prefix cache must evict them: with the tier on they spill to the host and come back; off, they are
    prefilled again. Time to first token p50 / p90 over the turns after the first, and tokens/s, on and off.
(c) preemption: --preempt-seqs sequences of --preempt-prompt tokens generating --preempt-new tokens in a pool
    (--num-blocks) that holds about half of them at full length: tokens/s with swap (tier on) and with
    recompute (tier off), with the preemptions, swaps and fallbacks each saw.
(d) decode: batch-1 ms/token (median decode step) of one --decode-prompt token prompt generating --decode-new tokens,
    tier on and off: the tier must cost a batch-1 decode nothing (within 2%).
(e) compiles: program traces and XLA compiles after warm-up, over (a)-(d), with the tier on (must be 0).

Llama-2-7B shape, random bf16 weights. --smoke runs the same code with the tiny model and small sizes on the CPU
(the test suite does). Writes JSON to --out (benchmarks/results/ by default) named <device>-<date>-<HHMM>-host-tier
and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import numpy as np

from scripts.common import harness


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _engine(args, *, host_gib: float, num_blocks: int):
    from jaxllm import LLM, EngineOptions

    # The persistent compilation cache: the second engine (tier off) reads the first one's step programs.
    options = EngineOptions(block_size=args.block_size, num_blocks=num_blocks, max_seqs=args.max_seqs,
                            max_tokens_per_step=args.max_tokens_per_step, host_kv_bytes=int(host_gib * (1 << 30)),
                            tuner="fixed", compile_cache_dir=args.compile_cache)
    llm = LLM(args.model, dtype=None if args.smoke else "bfloat16", max_context=args.max_context,
              allow_long_context=True, options=options, progress=not args.smoke)
    llm.warm_up(progress=not args.smoke)
    return llm


def _compiles(llm) -> tuple[int, int]:
    return llm.compile_count, llm.executor.xla_compiles


def _median_rate(times: list[float], nbytes: int) -> float:
    return nbytes / float(np.median(times)) / 1e9


def _engine_copy_rates(llm, count: int, reps: int) -> tuple[float, float]:
    """GB/s of the engine's copies of `count` rBlocks in one plan, to the host and back (medians of `reps`), through
    the executor: slots the ledger has not handed out yet (the engine is idle), dropped after."""
    import jax

    from jaxllm.contract import HostCopies, StepPlan

    executor, store = llm.executor, llm.executor.worker.host_store
    ids, none = np.arange(count, dtype=np.int32), np.zeros(0, np.int32)
    outs, ins = [], []
    for _ in range(reps):
        t = time.perf_counter()
        executor.dispatch(StepPlan.copies_only(host_copies=HostCopies(ids, ids, none, none, none, none)))
        executor.worker.launcher.drain()
        store.sync()
        outs.append(time.perf_counter() - t)
        t = time.perf_counter()
        executor.dispatch(StepPlan.copies_only(host_copies=HostCopies(none, none, ids, ids, none, ids)))
        jax.block_until_ready(executor.worker.kv_cache)
        ins.append(time.perf_counter() - t)
    nbytes = count * store.block_bytes
    return _median_rate(outs, nbytes), _median_rate(ins, nbytes)


def link(args, llm) -> dict:
    """(a): the host link each way (a plain device_put) against the engine's copies of a run of rBlocks."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import compat

    device = jax.devices()[0]
    kind = compat.host_memory_kind(device)
    sharding = jax.sharding.SingleDeviceSharding(device)
    x = jnp.ones(int(args.link_gib * (1 << 30)) // 2, jnp.bfloat16)
    host_sharding = sharding.with_memory_kind(kind) if kind else None
    to_host, to_device = [], []
    for _ in range(args.reps):
        t = time.perf_counter()
        h = jax.device_put(x, host_sharding) if host_sharding else np.asarray(x)
        jax.block_until_ready(h)
        to_host.append(time.perf_counter() - t)
        t = time.perf_counter()
        jax.block_until_ready(jax.device_put(h, sharding))
        to_device.append(time.perf_counter() - t)
    link_out, link_in = _median_rate(to_host, x.nbytes), _median_rate(to_device, x.nbytes)
    del x, h
    executor, store = llm.executor, llm.executor.worker.host_store
    run = store.max_run  # the longest run the tier copies, alone
    out_rate, in_rate = _engine_copy_rates(llm, run, args.reps)
    # A stream: --link-stream-gib of rBlocks in one plan each way, as a conversation's history comes back: runs
    # queued back to back, two in flight each way (jaxllm.executor.host_store).
    count = max(1, min(int(args.link_stream_gib * (1 << 30)) // store.block_bytes, executor.worker.kv_cache.num_blocks))
    s_out, s_in = _engine_copy_rates(llm, count, args.reps)
    return dict(memory_kind=kind, link_gb_s={"to_host": link_out, "to_device": link_in},
                run_rblocks=run, run_bytes=run * store.block_bytes,
                copy_gb_s={"to_host": out_rate, "to_device": in_rate},
                fraction_of_link={"to_host": out_rate / link_out, "to_device": in_rate / link_in},
                stream_rblocks=count, stream_bytes=count * store.block_bytes,
                stream_gb_s={"to_host": s_out, "to_device": s_in},
                stream_fraction_of_link={"to_host": s_out / link_out, "to_device": s_in / link_in})


def _timed_run(llm, requests) -> tuple[dict, float]:
    start = time.perf_counter()
    outputs = llm.run(requests)
    return outputs, time.perf_counter() - start


def _engine_counts(llm) -> dict:
    s = llm.core.stats()
    queue, host, store = s.scheduler, s.scheduler.host, s.executor.host_store
    return dict(preemptions=queue.preemptions, swap_outs=host.swap_outs_total, swap_ins=host.swap_ins_total,
                swap_fallbacks=host.swap_fallbacks_total, host_cache_hit_blocks=host.hit_blocks_total,
                host_spilled_blocks=host.spilled_blocks_total, host_blocks_out=host.blocks_out_total,
                host_blocks_in=host.blocks_in_total, prefix_cache_hit_tokens=queue.cached_tokens,
                swap_cached_blocks=host.swap_cached_blocks_total, host_copy_out_s=store.copy_out_seconds,
                host_copy_in_s=store.copy_in_seconds)


def multi_turn(args, llm) -> dict:
    """(b): every conversation's next turn at once, --turns times; TTFT and tokens/s after the first turn."""
    from jaxllm.contract import SamplingParams
    from jaxllm.engine.core import Request

    rng = np.random.default_rng(35)
    vocab = llm.config.vocab_size
    histories = [rng.integers(3, vocab, size=args.history).tolist() for _ in range(args.conversations)]
    ttfts, generated, seconds, turn_seconds = [], 0, 0.0, []
    before = _engine_counts(llm)
    for turn in range(args.turns + 1):  # turn 0 reads every history once (cold): not counted
        prompts = [h + rng.integers(3, vocab, size=args.user_tokens).tolist() for h in histories]
        params = SamplingParams(max_new_tokens=args.reply_tokens, ignore_eos=True)
        outputs, wall = _timed_run(llm, [Request(p, params) for p in prompts])
        for i, outs in enumerate(outputs.values()):
            histories[i] = prompts[i] + [t for o in outs for t in o.token_ids]
            if turn:
                ttfts.append(outs[-1].timings.ttft_s)
        if turn:
            generated += sum(len(o.token_ids) for outs in outputs.values() for o in outs)
            seconds += wall
        turn_seconds.append(wall)
        _log(f"  turn {turn}: {wall:.2f} s")
    after = _engine_counts(llm)
    return dict(ttft_p50_s=float(np.percentile(ttfts, 50)), ttft_p90_s=float(np.percentile(ttfts, 90)),
                tokens_per_s=generated / seconds, seconds=seconds, turn_seconds=turn_seconds, generated=generated,
                history_tokens_total=sum(len(h) for h in histories),
                **{k: after[k] - before[k] for k in after})


def preemption(args, llm) -> dict:
    """(c): more sequences than the pool holds at full length: swap (tier on) or recompute (off)."""
    from jaxllm.contract import SamplingParams
    from jaxllm.engine.core import Request

    rng = np.random.default_rng(36)
    vocab = llm.config.vocab_size
    params = SamplingParams(max_new_tokens=args.preempt_new, ignore_eos=True)
    requests = [Request(rng.integers(3, vocab, size=args.preempt_prompt).tolist(), params)
                for _ in range(args.preempt_seqs)]
    before = _engine_counts(llm)
    outputs, wall = _timed_run(llm, requests)
    after = _engine_counts(llm)
    generated = sum(len(o.token_ids) for outs in outputs.values() for o in outs)
    return dict(tokens_per_s=generated / wall, seconds=wall, generated=generated,
                **{k: after[k] - before[k] for k in after})


def decode(args, llm) -> dict:
    """(d): batch-1 decode, ms a token: the median gap between decode steps' tokens, best of --reps runs."""
    from jaxllm.contract import SamplingParams
    from jaxllm.engine.core import Request

    rng = np.random.default_rng(37)
    prompt = rng.integers(3, llm.config.vocab_size, size=args.decode_prompt).tolist()
    params = SamplingParams(max_new_tokens=args.decode_new, ignore_eos=True)
    medians = []
    for _ in range(args.reps):
        gaps, last = [], [time.perf_counter()]

        def on_step(_outputs) -> None:
            now = time.perf_counter()
            if llm.core.last_plan is not None and llm.core.last_plan.kind.label == "decode":
                gaps.append(now - last[0])
            last[0] = now

        llm.run([Request(prompt, params)], on_step=on_step)
        medians.append(float(np.median(gaps)) * 1e3)
    return dict(ms_per_token=min(medians), runs_ms_per_token=medians)


def _table(result: dict) -> str:
    rows = []
    if "link" in result:
        a = result["link"]
        for way in ("to_host", "to_device"):
            rows.append([f"copy {way} ({a['run_rblocks']} rBlocks)", f"{a['copy_gb_s'][way]:.2f} GB/s",
                         f"link {a['link_gb_s'][way]:.2f} GB/s", f"{100 * a['fraction_of_link'][way]:.0f}%"])
            rows.append([f"stream {way} ({a['stream_rblocks']} rBlocks)", f"{a['stream_gb_s'][way]:.2f} GB/s",
                         f"link {a['link_gb_s'][way]:.2f} GB/s", f"{100 * a['stream_fraction_of_link'][way]:.0f}%"])
    for part, key, unit in (("multi_turn", "ttft_p50_s", "s TTFT p50"), ("multi_turn", "tokens_per_s", "tok/s"),
                            ("preemption", "tokens_per_s", "tok/s"), ("decode", "ms_per_token", "ms/token")):
        if part in result:
            on, off = result[part]["on"][key], result[part]["off"][key]
            rows.append([f"{part} {key}", f"on {on:.3g} {unit}", f"off {off:.3g} {unit}", harness.ratio(on, off)])
    if "compiles_after_warm_up" in result:
        rows.append(["compiles after warm-up (tier on)", str(result["compiles_after_warm_up"]), "", ""])
    return harness.markdown_table(["what", "host tier", "against", "ratio"], rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["link", "multi_turn", "preemption", "decode"],
                   choices=["link", "multi_turn", "preemption", "decode"])
    p.add_argument("--smoke", action="store_true", help="the tiny model on the CPU, small sizes (the test suite's)")
    p.add_argument("--model", default=None, help="default: llama2-7b (tiny with --smoke)")
    p.add_argument("--block-size", type=int, default=None, help="tokens an rBlock (default 256; 16 with --smoke)")
    p.add_argument("--max-context", type=int, default=None, help="default: the longest prompt of (b) and (c)")
    p.add_argument("--max-seqs", type=int, default=16)
    p.add_argument("--max-tokens-per-step", type=int, default=4096)
    p.add_argument("--host-gib", type=float, default=48.0, help="the host tier's size with the tier on")
    p.add_argument("--reps", type=int, default=5, help="(a): timed copies each way")
    p.add_argument("--link-gib", type=float, default=2.0, help="(a): the plain device_put's size")
    p.add_argument("--link-stream-gib", type=float, default=8.0,
                   help="(a): the engine's copies of this many GiB of rBlocks in one plan each way (at most the pool)")
    p.add_argument("--num-blocks", type=int, default=64,
                   help="the pool, rBlocks: a fraction of (b)'s histories, about half of (c)'s sequences")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--history", type=int, default=4096, help="(b): tokens of history a conversation starts with")
    p.add_argument("--turns", type=int, default=2, help="(b): timed turns after the first")
    p.add_argument("--user-tokens", type=int, default=64)
    p.add_argument("--reply-tokens", type=int, default=32)
    p.add_argument("--preempt-seqs", type=int, default=16)
    p.add_argument("--preempt-prompt", type=int, default=1536)
    p.add_argument("--preempt-new", type=int, default=512)
    p.add_argument("--decode-prompt", type=int, default=1024, help="(d): the prompt's tokens")
    p.add_argument("--decode-new", type=int, default=256, help="(d): tokens generated")
    p.add_argument("--compile-cache", default=os.environ.get("JAXLLM_COMPILE_CACHE") or None, metavar="DIR",
                   help="JAX's persistent compilation cache (default: $JAXLLM_COMPILE_CACHE; unset: off)")
    p.add_argument("--out", default=harness.RESULTS_DIR)
    args = p.parse_args(argv)
    if args.smoke:
        args.model = args.model or "tiny"
        args.block_size = args.block_size or 16
        args.host_gib = min(args.host_gib, 0.0625)
        args.reps, args.link_gib, args.link_stream_gib = min(args.reps, 2), min(args.link_gib, 0.01), 0.01
        args.num_blocks, args.conversations, args.history, args.turns = 12, 4, 80, 1
        args.user_tokens, args.reply_tokens = 8, 4
        args.preempt_seqs, args.preempt_prompt, args.preempt_new = 4, 40, 24
        args.max_seqs, args.max_tokens_per_step = 4, 32
        args.decode_prompt, args.decode_new = 20, 8
    args.model = args.model or "llama2-7b"
    args.block_size = args.block_size or 256
    longest = max(args.history + (args.turns + 1) * (args.user_tokens + args.reply_tokens),
                  args.preempt_prompt + args.preempt_new, args.decode_prompt + args.decode_new)
    args.max_context = args.max_context or longest + 1
    import jax

    device = harness.device_kind()
    result = dict(device=device, smoke=args.smoke, model=args.model, block_size=args.block_size,
                  host_gib=args.host_gib, devices=jax.device_count())
    compiles = 0
    stem = harness.result_stem(device, "host-tier" + ("-smoke" if args.smoke else ""))
    partial = os.path.join(args.out, stem + ".json")  # rewritten after each part: a run cut short keeps its parts
    for tier in ("on", "off"):  # one engine each (the same pool), its parts one after the other
        _log(f"host tier {tier}: {args.model}, {args.num_blocks} rBlocks of {args.block_size} tokens on {device}")
        started = time.perf_counter()
        llm = _engine(args, host_gib=args.host_gib if tier == "on" else 0.0, num_blocks=args.num_blocks)
        result.setdefault("start_s", {})[tier] = time.perf_counter() - started
        if tier == "on":  # warm-up's reservation of the tier's host memory (jaxllm.executor.host_store)
            result["host_reserved_s"] = llm.executor.worker.host_store.reserved_seconds
        warm = _compiles(llm)
        for part in ("decode", "link", "preemption", "multi_turn"):
            if part not in args.parts or (part == "link" and tier == "off"):
                continue
            measured = {"link": link, "multi_turn": multi_turn, "preemption": preemption, "decode": decode}[part](args,
                                                                                                              llm)
            _log(f"[{part}] {tier}: {measured}")
            if part == "link":
                result[part] = measured
            else:
                result.setdefault(part, {})[tier] = measured
            harness.write_json(partial, result)
        if tier == "on":
            traced, xla = (a - b for a, b in zip(_compiles(llm), warm))
            compiles = traced + xla
        del llm
        gc.collect()
    result["compiles_after_warm_up"] = compiles
    for part in ("multi_turn", "preemption", "decode"):
        if part in result and {"on", "off"} <= set(result[part]):
            on, off = result[part]["on"], result[part]["off"]
            if part == "decode":
                result[part]["on_over_off"] = on["ms_per_token"] / off["ms_per_token"]
                continue
            result[part]["tokens_per_s_on_over_off"] = on["tokens_per_s"] / off["tokens_per_s"]
            if part == "multi_turn":
                result[part]["ttft_p50_off_over_on"] = off["ttft_p50_s"] / on["ttft_p50_s"]
    table = _table(result)
    print(table)
    path = harness.write_result_and_table(args.out, stem, result, table)
    print(f"wrote {path}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
