"""The distributed design at full size, on every GPU the machine has (issue: run on several GPUs).

  XLA_PYTHON_CLIENT_MEM_FRACTION=0.94 PYTHONPATH=$PWD python3 scripts/bench_mesh.py --out $OUT

(a) longest: Llama-2-7B shape, random bf16 weights, the `instance` axis over every device: the longest single
    sequence that prefills and decodes with its KV spread over every device by lending (DistKV), with the
    time to prefill it, ms/token at that length and the floor beside it (each device reads the weights and its
    share of the KV at the HBM bandwidth; the step is as slow as the device holding the most), against the
    longest one device's pool holds.
(b) tensor: Llama-2-13B shape at tensor parallel 1, 2 and 4 (--tp-sizes) at --tp-sweep-contexts, then the
    Llama-2-70B shape over every device at --tp-contexts (its random weights drawn straight into their shards):
    batch-1 ms/token against the floor; then a mixed load on that engine (--tp-mixed-requests requests, prompts
    log-uniform in --tp-mixed-prompts, --tp-mixed-new tokens each, all at once): tokens/s, timed after an
    untimed pass of the same load (its compiles). Skipped (with the reason in the JSON) where the weights do not
    fit.
(c) skew: --skew-instances x (devices / instances) tensor parallel, a skewed load (every other request
    generates --skew-long tokens, the rest --skew-short; routing balances prompt tokens, so the long ones
    share instances), each instance's pool --skew-blocks rBlocks: throughput and preemptions with lending
    on and off, each timed after an untimed pass of the same load (--skew-warm: compiles stay out).
(d) step: the decode step of every device as an instance, each with --step-seqs sequences of --step-context
    tokens (nothing borrowed: no collective), against one device's step with --step-seqs sequences, in one run
    (the same executor; the ratio is what lending instances cost when they lend nothing).

--dry-run runs the same code on the CPU's host devices with the tiny model and small pools (the test suite
does, on 8 devices), to keep the script working where no GPU is.
Writes JSON to --out (benchmarks/results/ by default) and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time

import numpy as np

from scripts.common import harness


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _weight_bytes(llm) -> int:
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(llm.executor.worker.state))


def _drive(llm, requests, on_decode=None) -> tuple[dict, list[float], list[float]]:
    """Run requests to their ends (LLM.run); (outputs by id, prefill step times, decode step times): a step's
    time is the gap between its tokens and the previous step's reaching the host. on_decode(n), if given, is
    called after the n-th decode step's tokens (from 1)."""
    prefill, decode = [], []
    last = time.perf_counter()

    def on_step(_outputs) -> None:
        nonlocal last
        now = time.perf_counter()
        (decode if llm.core.last_plan.kind.label == "decode" else prefill).append(now - last)
        last = now
        if on_decode is not None and llm.core.last_plan.kind.label == "decode":
            on_decode(len(decode))

    outputs = llm.run(requests, on_step=on_step)
    return outputs, prefill, decode


def _generated(outputs) -> int:
    return sum(len(o.token_ids) for outs in outputs.values() for o in outs)


def _engine(model: str, *, dry_run: bool, max_context: int | None, tuner: str, **options):
    from jaxllm import LLM, EngineOptions

    dtype = None if dry_run else "bfloat16"
    # Random-weight presets: contexts past the model's window are what this measures.
    return LLM(model, dtype=dtype, max_context=max_context, allow_long_context=True,
               options=EngineOptions(tuner=tuner, **options),
               progress=not dry_run)


# Decode steps before a --trace-decode window opens (the first ones compile).
_TRACE_AFTER = 4


def _attention_kernels(events: list[tuple[str, int, int]], steps: int) -> dict[str, float]:
    """Attention kernels of a device's traced steps by name -> calls a step (which implementation ran)."""
    from scripts.common.device_trace import kernel_kind

    calls: dict[str, int] = {}
    for name, _, _ in events:
        if kernel_kind(name) == "attention":
            calls[name[:80]] = calls.get(name[:80], 0) + 1
    return {name: n / steps for name, n in sorted(calls.items())}


def longest(args, devices: int, floor_tb_s: float | None) -> dict:
    """(a): one sequence as long as the whole mesh's pools allow, prefilled and decoded."""
    from jaxllm.contract import SamplingParams, StepKind
    from jaxllm.engine.core import Request
    from jaxllm.model.kv_cache import kv_bytes_per_block
    from scripts.common.device_trace import TraceWindow, device_summary, events_by_device

    tp = args.longest_tp
    if devices % tp:
        return dict(skipped=f"tensor parallel {tp} does not divide {devices} devices")
    instances = devices // tp
    options = dict(dry_run=args.dry_run, tuner=args.tuner, max_context=args.max_context, instances=instances,
                   tensor_parallel=tp, max_seqs=1, max_tokens_per_step=args.chunk, num_blocks=args.num_blocks,
                   block_size=args.block_size, kv_dtype=args.kv_dtype)
    llm = _engine(args.model, **options)
    info = llm.info()
    per_instance_tokens = info.num_blocks // instances * info.block_size
    length = llm.context_limit - args.new_tokens
    _log(f"[longest] {instances} instance(s) x TP {tp}, {per_instance_tokens} tokens of KV an instance: a prompt of "
         f"{length} tokens")
    prompt = np.random.default_rng(0).integers(3, 259, size=length).tolist()
    window, traced = TraceWindow(), {}

    def on_decode(n: int) -> None:  # a window of --trace-decode steps after the first few
        if n == _TRACE_AFTER:
            window.start()
        elif n == _TRACE_AFTER + args.trace_decode and window.running:
            traced.update(events_by_device(window.stop()))

    t0 = time.perf_counter()
    outputs, prefill, decode = _drive(llm, [Request(prompt, SamplingParams(max_new_tokens=args.new_tokens,
                                                                             ignore_eos=True))],
                                      on_decode=on_decode if args.trace_decode else None)
    wall = time.perf_counter() - t0
    if window.running:
        traced.update(events_by_device(window.stop()))
    stats = llm.core.stats()
    # The first decode steps compile; the traced ones (and the trace's start and stop) run slower: both left out.
    traced_steps = range(_TRACE_AFTER, _TRACE_AFTER + args.trace_decode + 1) if args.trace_decode else range(0)
    ms = ([1e3 * t for n, t in enumerate(decode) if n >= 2 and n not in traced_steps]
          or [1e3 * t for t in decode])
    kv_token = kv_bytes_per_block(llm.executor.worker.config, info.block_size, info.kv_dtype) / info.block_size
    context = length + args.new_tokens
    # The device holding the most KV sets the step: its home pool is full, the rest is spread by lending; each
    # device of an instance holds 1/tp of its weights and KV heads.
    most_kv = min(context, per_instance_tokens) * kv_token
    weights = _weight_bytes(llm)
    floor_ms = 1e3 * (weights + most_kv) / tp / (floor_tb_s * 1e12) if floor_tb_s else None
    borrowed = llm.executor.variants.kernels_for(StepKind.DECODE, 1, borrowed=True)  # the batch-1 decode bucket
    result = dict(instances=instances, tensor_parallel=tp, kv_dtype=info.kv_dtype, block_size=info.block_size,
                  per_instance_pool_tokens=per_instance_tokens, context_tokens=context, prompt_tokens=length,
                  ratio_to_one_pool=context / per_instance_tokens, prefill_s=sum(prefill), wall_s=wall,
                  decode_ms_per_token=float(np.median(ms)) if ms else None, decode_spread=harness.spread(ms) if ms else None,
                  floor_ms=floor_ms, fraction_of_floor=(floor_ms / float(np.median(ms))) if floor_ms and ms else None,
                  generated=_generated(outputs), rblocks_lent=stats.scheduler.lending.loans_total,
                  dist_steps=stats.executor.dist_steps_total, steps=stats.core.steps_total,
                  preemptions=stats.scheduler.preemptions, compiles=llm.compile_count,
                  borrowed_decode_kernels=dict(decode_attention=borrowed.decode_attention,
                                               rope_kv_write=borrowed.rope_kv_write, decode_layer=borrowed.decode_layer,
                                               per_shard=type(borrowed.per_shard).__name__ if borrowed.per_shard else None),
                  memory_plan=None if llm.memory_plan is None else dataclasses.asdict(llm.memory_plan))
    if args.trace_decode:
        result["decode_trace"] = {name: dict(device_summary(events, args.trace_decode),
                                             attention_kernels=_attention_kernels(events, args.trace_decode))
                                  for name, events in sorted(traced.items())}
    spread = _prefill_report(llm)
    llm.close()
    del llm
    gc.collect()
    if spread is not None:
        result["prefill_balance"] = dict(attention=spread.attention_balance, matmul_tokens=spread.matmul_balance,
                                         steps=spread.steps, spread=spread.spread,
                                         attention_by_instance=list(spread.attention),
                                         matmul_tokens_by_instance=list(spread.matmul_tokens))
        if args.spread_baseline:
            result["prefill_balance"].update(_one_instance_prefill(args, options, prompt))
    return result


def _prefill_report(llm):
    """The engine's report of its last finished prefill (jaxllm.engine.spread.PrefillReport), None on one instance."""
    reports = getattr(llm.core.scheduler, "prefill_reports", None)
    return reports.finished[-1] if reports is not None and reports.finished else None


def _one_instance_prefill(args, options: dict, prompt: list[int]) -> dict:
    """The same prompt prefilled chunk by chunk on its home instance (spreading off; one token generated): its steps
    and its balance."""
    from jaxllm.contract import SamplingParams
    from jaxllm.engine.core import Request

    llm = _engine(args.model, spread_prompts=False, **options)
    _drive(llm, [Request(prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))])
    alone = _prefill_report(llm)
    llm.close()
    del llm
    gc.collect()
    return dict(steps_one_instance=alone.steps, one_instance_attention=alone.attention_balance,
                one_instance_matmul_tokens=alone.matmul_balance)


def _splits(config, n: int) -> bool:
    from sharding.mesh import check_tensor_parallel

    try:
        check_tensor_parallel(config, n)
        return True
    except ValueError:
        return False


def _tp_decode(args, model: str, tp: int, contexts: list[int], floor_tb_s: float | None, *, mixed: bool = False,
               on_row=lambda partial: None) -> dict:
    """Batch-1 decode of `model` split `tp` ways at each context, with the floor (each device reads its share of
    the weights and the KV at the HBM bandwidth), then (mixed) the mixed load on the same engine; skipped (with
    why) where the weights do not fit. on_row(what is measured so far) after each row (the script saves it: a
    run cut short keeps its rows)."""
    from jaxllm.engine.core import Request
    from jaxllm.contract import SamplingParams
    from jaxllm.model.config import preset
    from jaxllm.model.kv_cache import kv_bytes_per_block

    c = preset(model)
    if not _splits(c, tp):
        return dict(model=model, tensor_parallel=tp, skipped=f"{model} cannot be split {tp} ways")
    weights = 2 * (2 * c.vocab_size * c.hidden_size + c.num_layers * (  # bf16: embedding, head, attention, MLP
        c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * c.hidden_size
        + 3 * c.hidden_size * c.intermediate_size))
    if not args.dry_run:
        import jax

        limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit", 0)
        need = weights / tp * 1.15
        if limit and need > limit:  # no limit reported (XLA's VMM allocator keeps none): try it
            return dict(model=model, tensor_parallel=tp,
                        skipped=f"{model} needs about {need / 2**30:.0f} GiB of weights a device over {tp} "
                                f"device(s); a device has {limit / 2**30:.0f} GiB")
    _log(f"[tensor] {model} at tensor parallel {tp}: contexts {contexts}")
    mixed = mixed and args.tp_mixed_requests > 0
    # The mixed load's second pass must not find the first one's prompts in the prefix cache.
    longest = max(contexts) + args.new_tokens
    if mixed:
        longest = max(longest, args.tp_mixed_prompts[1] + args.tp_mixed_new)
    llm = _engine(model, dry_run=args.dry_run, tuner=args.tuner, max_context=longest + 1, tensor_parallel=tp,
                  max_tokens_per_step=args.chunk, max_seqs=args.tp_mixed_requests if mixed else 1,
                  prefix_caching=not mixed, block_size=args.block_size, num_blocks=args.tp_num_blocks)
    info = llm.info()
    kv_token = kv_bytes_per_block(llm.executor.worker.config, info.block_size, info.kv_dtype) / info.block_size
    rows = []
    for context in contexts:
        prompt = np.random.default_rng(1).integers(3, 259, size=context).tolist()
        _, _, decode = _drive(llm, [Request(prompt, SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True))])
        ms = [1e3 * t for t in decode[2:]] or [1e3 * t for t in decode]
        floor_ms = 1e3 * (_weight_bytes(llm) + context * kv_token) / tp / (floor_tb_s * 1e12) if floor_tb_s else None
        rows.append(dict(context=context, decode_ms_per_token=float(np.median(ms)), spread=harness.spread(ms),
                         floor_ms=floor_ms, x_floor=float(np.median(ms)) / floor_ms if floor_ms else None))
        _log(f"[tensor] {model} TP {tp} at {context}: {rows[-1]['decode_ms_per_token']:.2f} ms/token")
        on_row(dict(model=model, tensor_parallel=tp, rows=rows))
    load = _mixed_load(args, llm) if mixed else None
    llm.close()
    del llm
    gc.collect()
    return dict(model=model, tensor_parallel=tp, rows=rows, **({"mixed": load} if load else {}))


def _mixed_load(args, llm) -> dict:
    """--tp-mixed-requests requests at once, prompts log-uniform in --tp-mixed-prompts, --tp-mixed-new tokens
    each: run once untimed (it compiles the buckets the load meets), then timed."""
    from jaxllm.contract import SamplingParams
    from jaxllm.engine.core import Request

    rng = np.random.default_rng(3)
    low, high = args.tp_mixed_prompts
    lengths = np.exp(rng.uniform(np.log(low), np.log(high), size=args.tp_mixed_requests)).astype(int)
    prompts = [rng.integers(3, 259, size=int(n)).tolist() for n in lengths]

    def requests():
        return [Request(p, SamplingParams(max_new_tokens=args.tp_mixed_new, ignore_eos=True)) for p in prompts]

    _log(f"[tensor] mixed load: {len(prompts)} requests of {int(lengths.sum())} prompt tokens, the untimed pass")
    _drive(llm, requests())
    compiles = llm.compile_count
    start = time.perf_counter()
    outputs, _, decode = _drive(llm, requests())
    wall = time.perf_counter() - start
    generated = _generated(outputs)
    result = dict(requests=len(prompts), prompt_tokens=int(lengths.sum()), new_tokens=args.tp_mixed_new,
                  generated=generated, wall_s=wall, tokens_per_s=generated / wall,
                  total_tokens_per_s=(generated + int(lengths.sum())) / wall,
                  decode_ms_per_step=float(np.median(decode)) * 1e3 if decode else None,
                  compiles_timed=llm.compile_count - compiles)
    _log(f"[tensor] mixed load: {result['tokens_per_s']:.1f} tokens/s generated, "
         f"{result['total_tokens_per_s']:.0f} tokens/s with the prompts, {wall:.1f} s")
    return result


def tensor(args, devices: int, floor_tb_s: float | None, save=lambda partial: None) -> dict:
    """(b): --tp-sweep-model at each of --tp-sizes (TP 1/2/4 of one machine, in one run), then --tp-model over
    every device at --tp-contexts. save(the part so far) after each row."""
    from jaxllm.model.config import preset

    sweep: list[dict] = []
    for n in (n for n in args.tp_sizes if n <= devices):
        sweep.append(_tp_decode(args, args.tp_sweep_model, n, args.tp_sweep_contexts, floor_tb_s,
                                on_row=lambda rows: save(dict(sweep=[*sweep, rows]))))
    if args.dry_run:  # the tiny model splits fewer ways than 8 host devices: the most it can
        devices = max(n for n in range(1, devices + 1) if devices % n == 0 and _splits(preset(args.tp_model), n))
    return dict(_tp_decode(args, args.tp_model, devices, args.tp_contexts, floor_tb_s, mixed=True,
                           on_row=lambda rows: save(dict(rows, sweep=sweep))), sweep=sweep)


def skew(args, devices: int) -> dict:
    """(c): instances x tensor parallel with a skewed load, lending on and off."""
    from jaxllm.engine.core import Request
    from jaxllm.contract import SamplingParams

    instances = args.skew_instances or devices
    if devices % instances:
        return dict(skipped=f"{instances} instances do not divide {devices} devices")
    tp = devices // instances
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 259, size=args.skew_prompt).tolist() for _ in range(args.skew_requests)]
    out = {}
    for lending in [mode == "on" for mode in args.skew_lending]:
        llm = _engine(args.model, dry_run=args.dry_run, tuner=args.tuner, max_context=args.max_context,
                      instances=instances, tensor_parallel=tp, lending=lending, num_blocks=args.skew_blocks,
                      block_size=args.block_size, max_tokens_per_step=args.chunk, prefix_caching=False)
        requests = [Request(p, SamplingParams(max_new_tokens=args.skew_long if i % 2 == 0 else args.skew_short,
                                              ignore_eos=True)) for i, p in enumerate(prompts)]
        mode = "on" if lending else "off"
        before, compiles_before = None, 0
        if args.skew_warm:  # the same load once, untimed: it compiles the programs the timed pass runs
            _log(f"[skew] {instances} instances x TP {tp}, lending {mode}: the untimed pass")
            _drive(llm, requests)
            before, compiles_before = llm.core.stats(), llm.compile_count
        _log(f"[skew] {instances} instances x TP {tp}, lending {mode}")
        t0 = time.perf_counter()
        outputs, _, _ = _drive(llm, requests)
        wall = time.perf_counter() - t0
        stats = _stats_since(llm.core.stats(), before)
        generated = _generated(outputs)
        ledger = stats.scheduler.lending
        out["on" if lending else "off"] = dict(wall_s=wall, generated=generated, tokens_per_s=generated / wall,
                                               preemptions=stats.scheduler.preemptions, rblocks_lent=ledger.loans_total,
                                               recalled=ledger.recalled_blocks_total,
                                               dist_steps=stats.executor.dist_steps_total, steps=stats.core.steps_total,
                                               compiles=llm.compile_count - compiles_before, warm=args.skew_warm)
        llm.close()
        del llm
        gc.collect()
    return dict(instances=instances, tensor_parallel=tp, requests=args.skew_requests, prompt=args.skew_prompt,
                long=args.skew_long, short=args.skew_short, pool_blocks=args.skew_blocks, **out)


def _stats_since(stats, before):
    """The engine's counters (its stats tree) since `before` (the same tree earlier; None: since the start)."""
    from jaxllm.contract.stats import since

    return stats if before is None else since(stats, before)


def step(args, devices: int) -> dict:
    """(d): the decode step of `devices` instances with --step-seqs sequences each, against one instance's."""
    from jaxllm.engine.core import Request
    from jaxllm.contract import SamplingParams

    rng = np.random.default_rng(3)
    rows = []
    for instances in sorted({1, devices}):
        llm = _engine(args.model, dry_run=args.dry_run, tuner=args.tuner,
                      max_context=args.step_context + args.new_tokens + 64, instances=instances,
                      max_seqs=args.step_seqs, num_blocks=args.step_blocks, block_size=args.block_size,
                      max_tokens_per_step=args.step_seqs * args.step_context, prefix_caching=False)
        requests = [Request(rng.integers(3, 259, size=args.step_context).tolist(),
                            SamplingParams(max_new_tokens=args.step_new_tokens, ignore_eos=True))
                    for _ in range(instances * args.step_seqs)]
        _log(f"[step] {instances} instance(s) x {args.step_seqs} sequences of {args.step_context} tokens")
        outputs, _, decode = _drive(llm, requests)
        ms = [1e3 * t for t in decode[4:]]  # the first decode steps compile
        stats = llm.core.stats()
        rows.append(dict(instances=instances, sequences=instances * args.step_seqs,
                         decode_ms_per_step=float(np.median(ms)), spread=harness.spread(ms), steps=len(ms),
                         generated=_generated(outputs), dist_steps=stats.executor.dist_steps_total,
                         compiles=llm.compile_count))
        llm.close()
        del llm
        gc.collect()
    one = rows[0]["decode_ms_per_step"]
    for row in rows:
        row["ratio_to_one_instance"] = row["decode_ms_per_step"] / one
    return dict(context=args.step_context, sequences_per_instance=args.step_seqs, rows=rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["longest", "tensor", "skew", "step"],
                   choices=["longest", "tensor", "skew", "step"])
    p.add_argument("--dry-run", action="store_true", help="the tiny model on the CPU's host devices, small pools")
    p.add_argument("--model", default=None, help="(a) and (c)'s model (default: llama2-7b; tiny with --dry-run)")
    p.add_argument("--tp-model", default=None, help="(b)'s model (default: llama2-70b; tiny with --dry-run)")
    p.add_argument("--kv-dtype", default=None, help="KV pool dtype for (a) (default: the model's)")
    p.add_argument("--max-context", type=int, default=1 << 22, help="context limit (the pools bind first)")
    p.add_argument("--num-blocks", type=int, default=None, help="(a): rBlocks an instance (default: from memory)")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--chunk", type=int, default=8192, help="prefill tokens a step")
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--longest-tp", type=int, default=1, help="(a): tensor parallel of each instance (instances: "
                   "devices / this)")
    p.add_argument("--trace-decode", type=int, default=0, help=f"(a): trace this many decode steps (after the first "
                   f"{_TRACE_AFTER}) and record each GPU's kernels, idle time and attention kernels")
    p.add_argument("--spread-baseline", action=argparse.BooleanOptionalAction, default=None,
                   help="(a): prefill the prompt again chunk by chunk on one instance, for prefill_balance's "
                        "steps_one_instance (default: on with --dry-run)")
    p.add_argument("--note", default=None, help="a note the result records (e.g. that the machine was shared)")
    p.add_argument("--name", default=None, help="the result file's name after its date (default: mesh-x<devices>...)")
    p.add_argument("--tp-contexts", type=int, nargs="+", default=[4096, 131072])
    p.add_argument("--tp-sweep-model", default=None, help="(b)'s sweep model (default: llama2-13b; tiny with --dry-run)")
    p.add_argument("--tp-sizes", type=int, nargs="*", default=[1, 2, 4], help="(b)'s sweep: tensor-parallel sizes "
                   "(none: no sweep)")
    p.add_argument("--tp-num-blocks", type=int, default=None, help="(b): rBlocks of each engine's pool (default: "
                   "planned from free memory, which compiles the largest steps once more)")
    p.add_argument("--tp-xla-flags", action=argparse.BooleanOptionalAction, default=None,
                   help="set the tensor-parallel XLA flags (sharding.xla_flags), as the entry points do for "
                        "--tensor-parallel > 1; they hold for the whole process (default: on when (b) is the only "
                        "part, whose TP 1 row then runs with them too; off otherwise, as the other parts' one-device "
                        "instances run in the product)")
    p.add_argument("--tp-sweep-contexts", type=int, nargs="+", default=[4096])
    p.add_argument("--tp-mixed-requests", type=int, default=32, help="(b): the mixed load's requests (0: none)")
    p.add_argument("--tp-mixed-prompts", type=int, nargs=2, default=[128, 8192], metavar=("MIN", "MAX"),
                   help="(b): the mixed load's prompt lengths, log-uniform between")
    p.add_argument("--tp-mixed-new", type=int, default=64, help="(b): tokens each mixed-load request generates")
    p.add_argument("--skew-instances", type=int, default=None, help="(c): instances (default: every device)")
    p.add_argument("--skew-requests", type=int, default=8)
    p.add_argument("--skew-prompt", type=int, default=1024)
    p.add_argument("--skew-long", type=int, default=1536)
    p.add_argument("--skew-short", type=int, default=64)
    p.add_argument("--skew-blocks", type=int, default=32, help="(c): rBlocks an instance")
    p.add_argument("--skew-warm", action=argparse.BooleanOptionalAction, default=None,
                   help="(c): run the load once untimed first, so its compiles stay out of the timed pass (default: "
                        "on, off with --dry-run)")
    p.add_argument("--skew-lending", nargs="+", default=["on", "off"], choices=["on", "off"],
                   help="(c): lending modes to run (one a process keeps two engines' memory apart)")
    p.add_argument("--step-seqs", type=int, default=2, help="(d): sequences an instance")
    p.add_argument("--step-context", type=int, default=1024, help="(d): prompt tokens a sequence")
    p.add_argument("--step-new-tokens", type=int, default=64, help="(d): tokens each sequence generates")
    p.add_argument("--step-blocks", type=int, default=64, help="(d): rBlocks an instance")
    p.add_argument("--tuner", choices=("auto", "fixed"), default="auto",
                   help="every engine's kernel schedules: the learned tuner where one was trained (auto), or the "
                        "defaults (fixed)")
    p.add_argument("--out", default=harness.RESULTS_DIR)
    args = p.parse_args(argv)
    if args.trace_decode < 0 or (args.trace_decode and args.new_tokens < _TRACE_AFTER + args.trace_decode + 1):
        p.error(f"--trace-decode {args.trace_decode} needs --new-tokens >= {_TRACE_AFTER + args.trace_decode + 1} "
                f"(the window opens after {_TRACE_AFTER} decode steps), got {args.new_tokens}")
    if args.longest_tp < 1:
        p.error(f"--longest-tp must be >= 1, got {args.longest_tp}")
    if args.tp_mixed_requests < 0 or not 1 <= args.tp_mixed_prompts[0] <= args.tp_mixed_prompts[1] or \
            args.tp_mixed_new < 1:
        p.error(f"--tp-mixed-requests must be >= 0, --tp-mixed-prompts 1 <= MIN <= MAX and --tp-mixed-new >= 1; got "
                f"{args.tp_mixed_requests}, {args.tp_mixed_prompts}, {args.tp_mixed_new}")
    if args.dry_run:
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
        args.model = args.model or "tiny"
        args.tp_model = args.tp_model or "tiny"
        args.num_blocks = args.num_blocks or 4
        args.block_size = args.block_size or 16
        args.chunk = min(args.chunk, 128)
        args.new_tokens = min(args.new_tokens, _TRACE_AFTER + args.trace_decode + 1 if args.trace_decode else 4)
        args.max_context = min(args.max_context, 1024)  # above 8 pools of 4 x 16: the tables no wider than needed
        args.tp_contexts = [min(c, 48) for c in args.tp_contexts][:1]
        args.tp_sweep_contexts = [min(c, 48) for c in args.tp_sweep_contexts][:1]
        args.tp_sweep_model = args.tp_sweep_model or "tiny"
        args.tp_sizes = [n for n in args.tp_sizes if n < 4]  # the tiny model's TP 4 is (b)'s main row already
        args.tp_mixed_requests, args.tp_mixed_new = min(args.tp_mixed_requests, 2), min(args.tp_mixed_new, 4)
        args.tp_mixed_prompts = [min(args.tp_mixed_prompts[0], 8), min(args.tp_mixed_prompts[1], 40)]
        args.skew_requests, args.skew_prompt = min(args.skew_requests, 4), min(args.skew_prompt, 40)
        args.skew_long, args.skew_short, args.skew_blocks = min(args.skew_long, 40), min(args.skew_short, 4), 6
        args.skew_instances = args.skew_instances or 2
        args.step_context, args.step_new_tokens, args.step_blocks = 40, 8, 8
    if args.skew_warm is None:
        args.skew_warm = not args.dry_run
    if args.spread_baseline is None:
        args.spread_baseline = args.dry_run
    args.model = args.model or "llama2-7b"
    args.tp_model = args.tp_model or "llama2-70b"
    args.tp_sweep_model = args.tp_sweep_model or "llama2-13b"
    if args.tp_xla_flags is None:
        args.tp_xla_flags = set(args.parts) == {"tensor"}
    if args.tp_xla_flags:
        from sharding.xla_flags import add_tensor_parallel_flags

        add_tensor_parallel_flags(2)  # (b) runs tensor-parallel engines; before JAX's backend starts
    import jax

    devices = jax.device_count()
    device = harness.device_kind()
    floor = None if args.dry_run else harness.hbm_floor_tb_s(device)
    result = dict(devices=devices, device=device, dry_run=args.dry_run, model=args.model, tuner=args.tuner,
                  xla_flags=os.environ.get("XLA_FLAGS", ""), **({"note": args.note} if args.note else {}))
    name = (f"mesh-x{devices}" + (f"-{args.kv_dtype}" if args.kv_dtype else "")
            + (f"-tp{args.longest_tp}" if args.longest_tp > 1 and "longest" in args.parts else "")
            + ("-dry-run" if args.dry_run else ""))
    path = os.path.join(args.out, harness.result_stem(device, args.name or name) + ".json")

    def save(part: str, partial: dict) -> None:  # each row as it is measured: a run cut short keeps what it got
        harness.write_json(path, dict(result, **{part: dict(partial, unfinished=True)}))

    for part, run in (("longest", lambda: longest(args, devices, floor)),
                      ("tensor", lambda: tensor(args, devices, floor, save=lambda partial: save("tensor", partial))),
                      ("skew", lambda: skew(args, devices)), ("step", lambda: step(args, devices))):
        if part in args.parts:
            _log(f"[{part}] on {devices} x {device}")
            result[part] = run()
            _log(f"[{part}] {result[part]}")
            harness.write_json(path, result)  # after each part (--parts names at least one)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
