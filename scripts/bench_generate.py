"""End-to-end generation benchmark on one GPU: a preset's random weights in bf16 (--model: llama2-7b by default,
llama3-8b, qwen3-8b, qwen2.5-7b, mistral-7b, ...) or a checkpoint directory.

  XLA_PYTHON_CLIENT_MEM_FRACTION=0.94 PYTHONPATH=$PWD python3 scripts/bench_generate.py \
      --contexts 1024 32768 131072 --mixed 128 --hf 1024 32768

(a) batch-1 decode ms/token at each context, beside the floor (weights + KV bytes over HBM
bandwidth); (b) with --longest, the longest context that prefills and decodes with bf16 and/or
int8 KV; (c) with --mixed N, N requests with prompt lengths log-uniform in 128..32K and 256 new
tokens each, continuously batched, in tokens/s (prefix cache off: the timed pass repeats the
warm pass's prompts); (d) with --hf, HuggingFace transformers
(a Llama-2-7B, whatever --model is; fp16, sdpa) at the given contexts on the same device, and with --hf-mixed, on the same mixed
workload (same prompt lengths and new tokens; HF has no continuous batching, so requests run in
static batches of similar length, shortest first, up to --hf-batch-tokens padded tokens a batch),
in a subprocess run first so the two frameworks never hold GPU memory at once; (e) with
--shared-prefix N, N requests sharing one prompt prefix, with the prefix cache off and on.
Prints a table, writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from scripts.common import harness


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----- HuggingFace (runs in a child process) -----

def _hf_model(**extra):
    """HF transformers' Llama of the Llama-2-7B shape: random fp16 weights on the GPU, sdpa, eval mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=1 << 20, rms_norm_eps=1e-5,
                      attn_implementation="sdpa", **extra)
    torch.set_default_dtype(torch.float16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    model.eval()
    return model


def hf_decode(contexts: list[int], steps: int = 12) -> list[dict]:
    import torch

    model = _hf_model()
    rows = []
    with torch.inference_mode():
        for context in contexts:
            try:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                ids = torch.randint(0, 32000, (1, context), device="cuda")
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = model(ids, use_cache=True, logits_to_keep=1)
                torch.cuda.synchronize()
                prefill_s = time.perf_counter() - t0
                pkv, tok, times = out.past_key_values, out.logits[:, -1:].argmax(-1), []
                for _ in range(steps):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    out = model(tok, past_key_values=pkv, use_cache=True)
                    tok = out.logits[:, -1:].argmax(-1)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t)
                    pkv = out.past_key_values
                rows.append(dict(context=context, prefill_s=prefill_s, ms_per_token=1e3 * float(np.median(times[2:])),
                                 peak_gib=torch.cuda.max_memory_allocated() / 2**30))
            except torch.OutOfMemoryError:
                rows.append(dict(context=context, error="OOM", peak_gib=torch.cuda.max_memory_allocated() / 2**30))
            out = pkv = None
            _log(f"[hf] {json.dumps(rows[-1])}")
    return rows


def mixed_lengths(num_requests: int, max_prompt: int) -> np.ndarray:
    """Prompt lengths of the mixed workload, log-uniform in 128..max_prompt (the same for both frameworks)."""
    rng = np.random.default_rng(1)
    return np.exp(rng.uniform(np.log(128), np.log(max_prompt), size=num_requests)).astype(int)


def hf_mixed(num_requests: int, new_tokens: int, max_prompt: int, batch_tokens: int) -> dict:
    """The mixed workload through HF generate: static batches (left-padded), greedy, exactly new_tokens each."""
    import torch

    model = _hf_model(pad_token_id=0)
    lengths = sorted(mixed_lengths(num_requests, max_prompt).tolist())
    batches, current = [], []
    for n in lengths:  # sorted ascending: a batch's padded size is its last prompt + new tokens
        if current and (len(current) + 1) * (n + new_tokens) > batch_tokens:
            batches.append(current)
            current = []
        current.append(n)
    batches.append(current)
    generated = 0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            width = max(batch)
            ids = torch.randint(3, 32000, (len(batch), width), device="cuda")
            mask = torch.zeros((len(batch), width), dtype=torch.long, device="cuda")
            for i, n in enumerate(batch):
                mask[i, width - n:] = 1  # left padding
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            generated += (out.shape[1] - width) * len(batch)
            _log(f"[hf] mixed batch of {len(batch)} (prompts {batch[0]}..{width}) done at "
                 f"{time.perf_counter() - t0:.1f} s")
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return dict(requests=num_requests, prompt_tokens=int(sum(lengths)), generated_tokens=generated, wall_s=wall,
                batches=len(batches), batch_tokens=batch_tokens, generated_tokens_per_s=generated / wall,
                total_tokens_per_s=(generated + sum(lengths)) / wall,
                peak_gib=torch.cuda.max_memory_allocated() / 2**30)


# ----- jaxllm -----

def _drive(llm, requests) -> tuple[dict, dict]:
    """Run requests through the LLM's (pipelined) loop to their ends; per-step wall times by kind, and
    every request's outputs (LLM.run's).

    A step's time is the gap between the moments its tokens and the previous step's reached the
    host: with steps queued back to back, the device time per step plus whatever dispatch fails to hide.
    """
    times = {"decode": [], "prefill": []}
    last = time.perf_counter()

    def on_step(_outputs) -> None:
        nonlocal last
        now = time.perf_counter()
        times[llm.core.last_plan.kind.label].append(now - last)
        last = now

    outputs = llm.run(requests, on_step=on_step)
    return times, outputs


def _generated(outputs: dict) -> int:
    return sum(len(out.token_ids) for outs in outputs.values() for out in outs)


# --penalties: what every request then carries (vLLM's semantics; a penalized request runs the sampling
# variant, which applies them to the whole vocabulary each step).
PENALTIES = dict(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1)


def decode_latency(llm, context: int, new_tokens: int, kv_bytes_per_token: float, weight_bytes: int,
                   hbm_tb_s: float | None = None, sampling: dict | None = None) -> dict:
    """Batch-1 decode ms/token at context; the floor (weights + KV read at hbm_tb_s) is None without it."""
    from jaxllm.engine.core import Request
    from jaxllm.contract import SamplingParams

    prompt = np.random.default_rng(context).integers(3, 259, size=context).tolist()
    t0 = time.perf_counter()
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, **(sampling or {}))
    times, _ = _drive(llm, [Request(prompt, params)])
    decode = np.asarray(times["decode"][2:])  # the first decode steps may compile
    ms = float(np.median(decode) * 1e3)
    floor = None if hbm_tb_s is None else (weight_bytes + context * kv_bytes_per_token) / (hbm_tb_s * 1e12) * 1e3
    return dict(context=context, ms_per_token=ms, floor_ms=floor, ratio_to_floor=None if floor is None else ms / floor,
                prefill_s=float(sum(times["prefill"])), wall_s=time.perf_counter() - t0, decode_steps=int(decode.size))


def mixed_workload(llm, num_requests: int, new_tokens: int, max_prompt: int, warm: bool = True,
                   sampling: dict | None = None) -> dict:
    """The mixed workload; with `warm`, once untimed first, so the timed pass compiles nothing (checked)."""
    from jaxllm.engine.core import Request
    from jaxllm.contract import SamplingParams

    lengths = mixed_lengths(num_requests, max_prompt)
    # The timed pass repeats the warm pass's prompts: with the prefix cache it would skip their prefill.
    llm.scheduler.prefix_caching = False

    def run() -> tuple[dict, dict, float, int]:
        rng = np.random.default_rng(2)
        requests = [Request(rng.integers(3, 259, size=n).tolist(),
                            SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, **(sampling or {})))
                    for n in lengths]
        preempted = llm.core.stats().scheduler.preemptions
        t0 = time.perf_counter()
        times, outputs = _drive(llm, requests)
        return outputs, times, time.perf_counter() - t0, llm.core.stats().scheduler.preemptions - preempted

    if warm:
        _log(f"[jaxllm] mixed: untimed warm pass ({llm.compile_count} compiles so far)")
        run()
    compiles = llm.compile_count
    outputs, times, wall, preemptions = run()
    generated = _generated(outputs)
    llm.scheduler.prefix_caching = llm.options.prefix_caching
    return dict(requests=num_requests, prompt_tokens=int(lengths.sum()), generated_tokens=generated, wall_s=wall,
                generated_tokens_per_s=generated / wall, total_tokens_per_s=(generated + int(lengths.sum())) / wall,
                steps=len(times["decode"]) + len(times["prefill"]), preemptions=preemptions,
                warm_pass=warm, compiles_while_timed=llm.compile_count - compiles)


def shared_prefix_workload(llm, num_requests: int, prefix_len: int, suffix_len: int, new_tokens: int) -> dict:
    """num_requests prompts of one shared prefix (a system prompt) + a distinct suffix each, submitted
    together; timed with the prefix cache off, then on with the prefix cached by an earlier request
    (as a server sees a system prompt it has served before). Each mode runs once untimed first, so
    no timed pass compiles. Time to first token per request, wall time, prefill tokens computed."""
    from jaxllm.engine.core import Request
    from jaxllm.contract import SamplingParams

    rng = np.random.default_rng(3)
    prefix = rng.integers(3, 259, size=prefix_len).tolist()
    suffixes = [rng.integers(3, 259, size=suffix_len).tolist() for _ in range(num_requests)]
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)

    def run(tag: int) -> tuple[list, float, int]:
        # Distinct first suffix token per pass: a pass never finds the previous pass's suffixes cached.
        requests = [Request(prefix + [3 + tag] + s, params) for s in suffixes]
        preempted = llm.core.stats().scheduler.preemptions
        t0 = time.perf_counter()
        first = {}

        def on_step(outputs) -> None:
            now = time.perf_counter() - t0
            for out in outputs:
                if out.token_ids and out.request_id not in first:
                    first[out.request_id] = now

        llm.run(requests, on_step=on_step)
        return list(first.values()), time.perf_counter() - t0, llm.core.stats().scheduler.preemptions - preempted

    rows = {}
    scheduler = llm.scheduler
    prompt_tokens = num_requests * (prefix_len + 1 + suffix_len)
    # Untimed passes first: they compile every shape the timed pass runs (with the cache on, the
    # first also leaves the prefix cached and the second runs the timed pass's shapes).
    for caching, untimed, timed in ((False, (0,), 1), (True, (2, 3), 4)):
        scheduler.prefix_caching = caching
        for tag in untimed:
            run(tag)
        compiles, cached_before = llm.compile_count, llm.core.stats().scheduler.cached_tokens
        ttft, wall, preemptions = run(timed)
        reused = llm.core.stats().scheduler.cached_tokens - cached_before
        rows["cache_on" if caching else "cache_off"] = dict(
            wall_s=wall, ttft_mean_s=float(np.mean(ttft)), ttft_max_s=float(np.max(ttft)),
            prompt_tokens=prompt_tokens, prefill_tokens_computed=prompt_tokens - reused,
            preemptions=preemptions, compiles_while_timed=llm.compile_count - compiles)
    scheduler.prefix_caching = llm.options.prefix_caching
    return dict(requests=num_requests, prefix_tokens=prefix_len, suffix_tokens=suffix_len + 1, new_tokens=new_tokens,
                **rows, speedup_wall=rows["cache_off"]["wall_s"] / rows["cache_on"]["wall_s"],
                speedup_ttft_mean=rows["cache_off"]["ttft_mean_s"] / rows["cache_on"]["ttft_mean_s"])


def _weight_bytes(llm) -> int:
    """Bytes of the model's weights on the device (what a decode step reads besides the KV)."""
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(llm.executor.worker.state))


def build_llm(model: str, kv_dtype: str, max_context: int, fraction: float, max_seqs: int = 256,
              pipeline: bool = True, tuner: str = "auto"):
    from jaxllm import LLM, EngineOptions

    options = EngineOptions(kv_dtype=kv_dtype, kv_memory_fraction=fraction, max_seqs=max_seqs, pipeline=pipeline,
                            tuner=tuner)
    # Random-weight presets: contexts past the model's window are what this measures.
    return LLM(model, dtype="bfloat16", max_context=max_context, allow_long_context=True, options=options)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama2-7b", help="preset or checkpoint (tiny for a CPU dry run)")
    p.add_argument("--contexts", type=int, nargs="*", default=[1024, 32768, 131072])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--longest", nargs="*", default=[], choices=["bfloat16", "int8"])
    p.add_argument("--mixed", type=int, default=0, help="requests in the mixed workload (0: skip)")
    p.add_argument("--mixed-max-prompt", type=int, default=32768)
    p.add_argument("--mixed-new-tokens", type=int, default=256)
    p.add_argument("--mixed-cold", action="store_true", help="time the mixed workload's first pass (compiles included)")
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="requests sharing one prompt prefix, timed with the prefix cache off and on (0: skip)")
    p.add_argument("--shared-prefix-tokens", type=int, default=8192)
    p.add_argument("--shared-suffix-tokens", type=int, default=511)
    p.add_argument("--shared-new-tokens", type=int, default=64)
    p.add_argument("--hf", type=int, nargs="*", default=[], help="contexts for HuggingFace transformers")
    p.add_argument("--hf-mixed", action="store_true", help="also run the mixed workload through HuggingFace")
    p.add_argument("--hf-batch-tokens", type=int, default=65536, help="padded tokens per HF static batch")
    p.add_argument("--hf-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sync", action="store_true", help="wait for every step's tokens before the next dispatch "
                                                        "(no pipelining), for comparison")
    p.add_argument("--tuner", choices=("auto", "fixed"), default="auto",
                   help="each step's kernels: the learned tuner where a model exists for the GPU, or the fixed defaults "
                        "(run both, one after the other, for the tuner's end-to-end A/B)")
    p.add_argument("--penalties", action="store_true",
                   help=f"every decode and mixed request carries penalties ({PENALTIES})")
    p.add_argument("--out", default=harness.RESULTS_DIR)
    args = p.parse_args(argv)

    if args.hf_child:
        child = {"decode": hf_decode(args.hf)}
        if args.hf_mixed:
            child["mixed"] = hf_mixed(args.mixed, args.mixed_new_tokens, args.mixed_max_prompt, args.hf_batch_tokens)
        print(json.dumps(child))
        return 0
    result = {"script": "scripts/bench_generate.py", "argv": sys.argv[1:], "date": harness.today(),
              "pipeline": not args.sync, "tuner": args.tuner}
    if args.hf or (args.hf_mixed and args.mixed):
        _log(f"[hf] transformers at {args.hf}{' and on the mixed workload' if args.hf_mixed else ''} in a child process")
        command = [sys.executable, __file__, "--hf-child", "--hf", *map(str, args.hf)]
        if args.hf_mixed and args.mixed:
            command += ["--hf-mixed", "--mixed", str(args.mixed), "--mixed-max-prompt", str(args.mixed_max_prompt),
                        "--mixed-new-tokens", str(args.mixed_new_tokens), "--hf-batch-tokens", str(args.hf_batch_tokens)]
        child = subprocess.run(command, capture_output=True, text=True)
        sys.stderr.write(child.stderr[-4000:])
        try:
            child_result = json.loads(child.stdout.strip().splitlines()[-1])
            result["hf"] = child_result["decode"]
            if "mixed" in child_result:
                result["hf_mixed"] = child_result["mixed"]
        except (IndexError, KeyError, json.JSONDecodeError):
            result["hf"] = {"error": child.stderr[-2000:]}

    import gc

    import jax

    from jaxllm.model.kv_cache import kv_bytes_per_block

    result["device"] = harness.device_kind()
    hbm = result["hbm_floor_tb_s"] = harness.hbm_floor_tb_s(result["device"])
    result["hbm_bytes_per_s_for_floor"] = None if hbm is None else hbm * 1e12
    path = os.path.join(args.out, harness.result_stem(result["device"], "generate.json", result["date"]))

    def save():  # after every section, so a run stopped at its time limit keeps what it measured
        harness.write_json(path, result)

    result["jax"] = jax.__version__
    sampling = PENALTIES if args.penalties else None
    result["penalties"] = sampling
    shared_len = args.shared_prefix_tokens + args.shared_suffix_tokens + 1 if args.shared_prefix else 0
    max_context = max(args.contexts + [args.mixed_max_prompt if args.mixed else 0, shared_len]) + max(
        args.mixed_new_tokens, args.shared_new_tokens) + 64
    if args.contexts or args.mixed or args.shared_prefix:
        llm = build_llm(args.model, "bfloat16", max_context, 0.9, pipeline=not args.sync, tuner=args.tuner)
        result["tuner_class"] = type(llm.executor.tuner).__name__
        config = llm.config
        weight_bytes = _weight_bytes(llm)
        kv_per_token = kv_bytes_per_block(config, 1, "bfloat16")
        result["pool_tokens"] = llm.pool_tokens
        result["weight_bytes"] = weight_bytes
        _log(f"[jaxllm] pool {result['pool_tokens']} tokens; weights {weight_bytes / 1e9:.2f} GB")
        result["decode"] = []
        for context in args.contexts:
            row = decode_latency(llm, context, args.new_tokens, kv_per_token, weight_bytes, hbm, sampling)
            result["decode"].append(row)
            _log(f"[jaxllm] {json.dumps(row)}")
            save()
        if args.mixed:
            result["mixed"] = mixed_workload(llm, args.mixed, args.mixed_new_tokens, args.mixed_max_prompt,
                                             warm=not args.mixed_cold, sampling=sampling)
            _log(f"[jaxllm] mixed {json.dumps(result['mixed'])}")
        if args.shared_prefix:
            result["shared_prefix"] = shared_prefix_workload(llm, args.shared_prefix, args.shared_prefix_tokens,
                                                             args.shared_suffix_tokens, args.shared_new_tokens)
            _log(f"[jaxllm] shared prefix {json.dumps(result['shared_prefix'])}")
            save()
        result["compiles"] = llm.compile_count
        result["tuner_stats"] = {str(k): int(v) for k, v in llm.executor.tuner.stats().items()}
        del llm
        gc.collect()  # the next pool is sized from free memory: this one must be gone first
        save()
    result["longest"] = []
    for kv_dtype in args.longest:
        llm = build_llm(args.model, kv_dtype, 1 << 22, 0.97, max_seqs=8, pipeline=not args.sync)
        pool = llm.pool_tokens
        context = pool - args.new_tokens - 1
        kv_per_token = kv_bytes_per_block(llm.config, 1, kv_dtype)
        weight_bytes = _weight_bytes(llm)
        _log(f"[jaxllm] longest with {kv_dtype} KV: pool {pool} tokens, prompt {context}")
        try:
            row = {"kv_dtype": kv_dtype, **decode_latency(llm, context, args.new_tokens, kv_per_token, weight_bytes, hbm)}
        except Exception as e:  # record, keep the rest of the run
            row = {"kv_dtype": kv_dtype, "context": context, "error": f"{type(e).__name__}: {e}"[:1000]}
        result["longest"].append(row)
        _log(f"[jaxllm] {json.dumps(row)}")
        del llm
        gc.collect()
        save()

    hf = {r["context"]: r for r in result.get("hf", []) if isinstance(r, dict)} if isinstance(result.get("hf"), list) else {}
    print(f"{'context':>8} {'ms/token':>9} {'floor':>7} {'x floor':>8} {'HF ms/token':>12} {'vs HF':>7}")
    for r in result.get("decode", []):
        h = hf.get(r["context"], {}).get("ms_per_token")
        h = "" if h is None else round(h, 1)
        floor, ratio = ("-", "-") if r["floor_ms"] is None else (f"{r['floor_ms']:.2f}", f"{r['ratio_to_floor']:.2f}")
        print(f"{r['context']:>8} {r['ms_per_token']:>9.2f} {floor:>7} {ratio:>8} "
              f"{h:>12} {'' if h == '' else round(h / r['ms_per_token'], 1):>7}")
    for r in result["longest"]:
        print(f"longest {r['kv_dtype']}: {r.get('context')} tokens, {r.get('ms_per_token', r.get('error'))}")
    if "mixed" in result:
        m = result["mixed"]
        print(f"mixed: {m['requests']} requests, {m['generated_tokens_per_s']:.0f} generated tok/s, "
              f"{m['total_tokens_per_s']:.0f} total tok/s, {m['wall_s']:.1f} s")
        if "hf_mixed" in result:
            h = result["hf_mixed"]
            print(f"HF mixed: {h['generated_tokens_per_s']:.0f} generated tok/s, {h['total_tokens_per_s']:.0f} total "
                  f"tok/s, {h['wall_s']:.1f} s; jaxllm x HF: {m['total_tokens_per_s'] / h['total_tokens_per_s']:.2f}")
    if "shared_prefix" in result:
        sp = result["shared_prefix"]
        for mode in ("cache_off", "cache_on"):
            r = sp[mode]
            print(f"shared prefix ({sp['requests']} x {sp['prefix_tokens']} + {sp['suffix_tokens']} tokens), {mode}: "
                  f"wall {r['wall_s']:.2f} s, TTFT mean {r['ttft_mean_s']:.2f} s, prefill computed "
                  f"{r['prefill_tokens_computed']} of {r['prompt_tokens']} tokens")
    save()
    _log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
