"""Speculative decoding on one GPU (issue 53): the verify step against a decode step, and end-to-end tokens/s.

  XLA_PYTHON_CLIENT_MEM_FRACTION=0.94 PYTHONPATH=$PWD python3 scripts/bench_speculative.py \
      --contexts 1024 32768 131072 --k 4

(a) --attention: one layer's attention at the model's heads (Llama-2-7B: 32 / 32 / 128, bf16, rBlocks of 256), batch
1: a decode step's (one query) against a verify step's (k + 1 queries) through the decode kernel
(pallas_kernels.verify_attention, Kernels.verify_attention "decode") and through the prefill kernel ("prefill"),
each timed in turns; (b) the engine at batch 1 for each context: plain greedy decoding (num_speculative_tokens 0,
pipelined as always), then the same prompt with the replay draft (every draft is a token the plain run produced: all
accepted at no draft cost, the mechanism's ceiling), its tokens checked equal; step times from the gaps between
recorded steps, and the device time of one decode step and one verify step, their captured plans dispatched back to
back; prompt lookup (n-gram) on a copy-heavy prompt (a random passage twice: acceptance as measured, random weights
copy nothing on their own); (c) derived, not measured: the speedup the measured verify and decode times give at
acceptance rates 0.5, 0.7 and 0.9 (a verify step keeps (1 - a^(k+1)) / (1 - a) tokens on average when each draft is
accepted with probability a). --model tiny --contexts 64 200 runs it all on the CPU (interpret mode for (a)).

(d) --draft-model NAME (a run of its own: one engine with EngineOptions.speculative_model NAME): plain decoding
against drafts from that model, its cost included (a verify step's gap holds the draft's proposal), the tokens
checked equal; acceptance as measured (random weights: a random draft is rejected), and the speedups the measured
gaps give at acceptance rates 0.5, 0.7 and 0.9 (derived).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from scripts.common import harness


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----- (a) attention alone -----

def attention_rows(contexts: list[int], k: int, *, heads=(32, 32, 128), block_size: int = 256,
                   interpret: bool = False) -> list[dict]:
    """One layer's attention at batch 1: decode (1 query) and verify (k + 1 queries) by both paths, in turns."""
    import functools

    import jax
    import jax.numpy as jnp

    from pallas_kernels import dispatch

    hq, hkv, hd = heads
    group = hq // hkv
    on_gpu = not interpret
    base = dispatch.default_kernels("triton" if interpret else "auto", head_dim=hd, on_gpu=on_gpu)
    if interpret:
        base = dispatch.Kernels(decode_attention="triton", prefill_attention="triton", interpret=True)
    q_rows = k + 1
    rows = []
    for context in contexts:
        blocks = -(-(context + q_rows) // block_size)
        key = jax.random.key(context)
        kk, kv, kq = jax.random.split(key, 3)
        k_pool = jax.random.normal(kk, (blocks, hkv, block_size, hd), jnp.bfloat16)
        v_pool = jax.random.normal(kv, (blocks, hkv, block_size, hd), jnp.bfloat16)
        tables = jnp.arange(blocks, dtype=jnp.int32)[None]
        q = jax.random.normal(kq, (q_rows, hkv, group + 2, hd), jnp.bfloat16)  # rope_write_kv's grouped q

        def run(q, kernels, queries, lens):
            cu = jnp.arange(2, dtype=jnp.int32) * queries
            return dispatch.ragged_attention(q, k_pool, v_pool, tables, lens, cu, single_query=queries == 1,
                                             num_q_heads=hq, verify_queries=0 if queries == 1 else queries,
                                             kernels=kernels)

        cases = {
            "decode": (q[:1], base, 1, context + 1),
            "verify_decode_kernel": (q, dataclass_replace(base, verify_attention="decode"), q_rows, context + q_rows),
            "verify_prefill_kernel": (q, dataclass_replace(base, verify_attention="prefill"), q_rows,
                                      context + q_rows),
        }
        fns = {name: jax.jit(functools.partial(run, kernels=kern, queries=n, lens=jnp.array([lens], jnp.int32)))
               for name, (_, kern, n, lens) in cases.items()}
        outs = {name: np.asarray(fns[name](cases[name][0]), np.float32) for name in cases}
        err = float(np.max(np.abs(outs["verify_decode_kernel"] - outs["verify_prefill_kernel"])))
        times = {name: [] for name in cases}
        for r in range(5):  # in turns, so drift of the card's clock is shared
            for name in list(cases)[r % len(cases):] + list(cases)[:r % len(cases)]:
                times[name].append(harness.median_time(fns[name], cases[name][0], reps=3, target_s=0.2))
        row = dict(context=context, k=k, **{f"{name}_us": float(np.median(t)) * 1e6 for name, t in times.items()},
                   verify_paths_max_abs_diff=err)
        row["verify_decode_kernel_x_decode"] = row["verify_decode_kernel_us"] / row["decode_us"]
        row["verify_prefill_kernel_x_decode"] = row["verify_prefill_kernel_us"] / row["decode_us"]
        rows.append(row)
        _log(f"[attention] {json.dumps(row)}")
    return rows


def dataclass_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


# ----- (b) the engine -----

class BenchProposer:
    """The benchmark's draft source: the replay of a plain run's tokens for prompts it was told of (`expect`),
    prompt lookup for the rest."""

    name = "bench"

    def __init__(self):
        from jaxllm.engine.speculative import NgramProposer, ReplayProposer

        self.replay, self.ngram = ReplayProposer(), NgramProposer()
        self.replayed: set[tuple[int, ...]] = set()

    def expect(self, prompt, output) -> None:
        self.replay.expect(prompt, output)
        self.replayed.add(tuple(prompt))

    def propose(self, requests):
        drafts = [None] * len(requests)
        mine = [i for i, (seq, _) in enumerate(requests) if tuple(seq.prompt_ids) in self.replayed]
        rest = [i for i in range(len(requests)) if i not in set(mine)]
        for idx, source in ((mine, self.replay), (rest, self.ngram)):
            for i, d in zip(idx, source.propose([requests[i] for i in idx]) if idx else []):
                drafts[i] = d
        return drafts

    def forget(self, seq_id: int) -> None:
        self.ngram.forget(seq_id)


def _drive(llm, prompt: list[int], new_tokens: int, k: int | None) -> dict:
    """One request to its end: its tokens, the step gaps by kind after the first token, the plans of one decode
    and one verify step, the decode phase's wall time, the speculative counters it moved."""
    from jaxllm.contract import SamplingParams
    from jaxllm.engine.core import Request

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, num_speculative_tokens=k)
    gaps = {"decode": [], "verify": [], "prefill": []}
    plans, marks = {}, {}
    before = llm.stats().scheduler.speculative
    compiles = llm.compile_count
    last = time.perf_counter()

    def on_step(outputs) -> None:
        nonlocal last
        now = time.perf_counter()
        plan = llm.core.last_plan
        kind = plan.kind.label
        if any(o.token_ids for o in outputs):
            marks.setdefault("first", now)
            marks["last"] = now
        if "first" in marks and kind != "prefill":
            gaps[kind].append(now - last)
            plans.setdefault(kind, plan)
        last = now

    outputs = llm.run([Request(prompt, params)], on_step=on_step)
    tokens = [t for outs in outputs.values() for o in outs for t in o.token_ids]
    after = llm.stats().scheduler.speculative
    moved = {f: getattr(after, f) - getattr(before, f) for f in ("draft_tokens_total", "accepted_tokens_total",
                                                                    "drafts_total")}
    return dict(tokens=tokens, gaps=gaps, plans=plans, decode_wall_s=marks["last"] - marks["first"], moved=moved,
                compiles=llm.compile_count - compiles)


def _replay_to_fixed_point(llm, proposer: BenchProposer, prompt: list[int], tokens: list[int], new_tokens: int,
                           max_passes: int = 6) -> tuple[dict, int]:
    """The replay run whose drafts are its own greedy tokens. In float32 (the CPU) those are the plain run's; in
    bfloat16 a verify step's logits (k + 1 rows a matmul) round unlike a decode step's (one row), so at a near tie
    its argmax may differ: from there the replay of the plain run is off track and decodes without drafts. Each pass
    replays the last pass's tokens, which the verify steps agree with up to their next such tie: a few passes reach
    the tokens every verify step accepts (the mechanism's ceiling). Returns the last pass and the passes run."""
    for passes in range(1, max_passes + 1):
        proposer.expect(prompt, tokens)
        run = _drive(llm, prompt, new_tokens, None)
        if run["tokens"] == tokens:
            break
        tokens = run["tokens"]
    return run, passes


def _random_prompt(llm, context: int) -> tuple[np.random.Generator, list[int]]:
    """The context's prompt (random ids, seeded by the context) and the generator that drew it."""
    rng = np.random.default_rng(context)
    return rng, rng.integers(3, llm.config.vocab_size, size=context).tolist()


def _first_difference(want: list[int], got: list[int]) -> int | None:
    """The first place two runs' tokens part (bf16 near ties), None where they agree."""
    return next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)


def _warm(llm, prompt: list[int], proposer: BenchProposer | None = None, new_tokens: int = 8) -> None:
    """Untimed: this context's shapes compiled (a plain run, then a speculative one) before the timed runs, which
    then find the prompt's KV in the prefix cache."""
    plain = _drive(llm, prompt, new_tokens, 0)
    if proposer is not None:
        proposer.expect(prompt, plain["tokens"])
    _drive(llm, prompt, new_tokens, None)


def device_step_ms(llm, plans: dict, calls: int = 20, rounds: int = 5) -> dict:
    """Each captured plan dispatched `calls` times back to back (one wait at the end), kinds in turns: ms a step."""
    times = {kind: [] for kind in plans}
    for r in range(rounds):
        for kind in list(plans)[r % len(plans):] + list(plans)[:r % len(plans)]:
            llm.executor.dispatch(plans[kind]).tokens()  # untimed: the card's state after the other kind
            start = time.perf_counter()
            for _ in range(calls):
                step = llm.executor.dispatch(plans[kind])
            step.tokens()
            times[kind].append((time.perf_counter() - start) / calls * 1e3)
    return {kind: float(np.median(t)) for kind, t in times.items()}


def derived_speedups(decode_ms: float, verify_ms: float, k: int, rates=(0.5, 0.7, 0.9)) -> list[dict]:
    """Derived, not measured: tokens/s over plain decoding when each draft is accepted with probability a."""
    rows = []
    for a in rates:
        kept = (1 - a ** (k + 1)) / (1 - a)
        rows.append(dict(acceptance_rate=a, tokens_per_verify=kept, speedup=kept * decode_ms / verify_ms))
    return rows


def engine_rows(llm, proposer: BenchProposer, contexts: list[int], new_tokens: int, k: int,
                ngram_contexts: list[int]) -> list[dict]:
    rows = []
    for context in contexts:
        rng, prompt = _random_prompt(llm, context)
        t0 = time.perf_counter()
        _warm(llm, prompt, proposer)
        plain = _drive(llm, prompt, new_tokens, 0)
        replay, passes = _replay_to_fixed_point(llm, proposer, prompt, plain["tokens"], new_tokens)
        plans = {"decode": plain["plans"]["decode"], "verify": replay["plans"]["verify"]}
        device = device_step_ms(llm, plans)
        decode_ms = float(np.median(plain["gaps"]["decode"][2:])) * 1e3
        verify_ms = float(np.median(replay["gaps"]["verify"][1:])) * 1e3
        first_difference = _first_difference(plain["tokens"], replay["tokens"])
        row = dict(context=context, k=k, new_tokens=new_tokens, same_tokens=plain["tokens"] == replay["tokens"],
                   first_difference=first_difference, replay_passes=passes,
                   compiles_timed=dict(plain=plain["compiles"], replay=replay["compiles"]),
                   plain_ms_per_token=decode_ms, plain_tokens_per_s=(len(plain["tokens"]) - 1) / plain["decode_wall_s"],
                   replay_verify_step_ms=verify_ms,
                   replay_tokens_per_s=(len(replay["tokens"]) - 1) / replay["decode_wall_s"],
                   replay_accepted=replay["moved"], device_decode_step_ms=device["decode"],
                   device_verify_step_ms=device["verify"],
                   device_verify_x_decode=device["verify"] / device["decode"])
        row["replay_speedup"] = row["replay_tokens_per_s"] / row["plain_tokens_per_s"]
        row["derived"] = derived_speedups(device["decode"], device["verify"], k)
        if context in ngram_contexts:
            passage = rng.integers(3, llm.config.vocab_size, size=context // 2).tolist()
            copy = passage + passage[:context - len(passage)]
            lookup = _drive(llm, copy, new_tokens, None)
            moved = lookup["moved"]
            row["ngram"] = dict(tokens_per_s=(len(lookup["tokens"]) - 1) / lookup["decode_wall_s"], **moved,
                                acceptance_rate=moved["accepted_tokens_total"] / max(moved["draft_tokens_total"], 1),
                                verify_steps=len(lookup["gaps"]["verify"]), decode_steps=len(lookup["gaps"]["decode"]))
            row["ngram"]["speedup"] = row["ngram"]["tokens_per_s"] / row["plain_tokens_per_s"]
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
        _log(f"[engine] {json.dumps(row)}")
    return rows


def draft_model_rows(llm, contexts: list[int], new_tokens: int, k: int) -> list[dict]:
    """(d): at each context, plain decoding then the draft model's drafts, the same prompt."""
    rows = []
    for context in contexts:
        _, prompt = _random_prompt(llm, context)
        t0 = time.perf_counter()
        _warm(llm, prompt)
        plain = _drive(llm, prompt, new_tokens, 0)
        drafted = _drive(llm, prompt, new_tokens, None)
        first_difference = _first_difference(plain["tokens"], drafted["tokens"])
        decode_ms = float(np.median(plain["gaps"]["decode"][2:])) * 1e3
        verify_ms = float(np.median(drafted["gaps"]["verify"][1:])) * 1e3  # the draft's proposal included
        moved = drafted["moved"]
        row = dict(context=context, k=k, new_tokens=new_tokens, same_tokens=plain["tokens"] == drafted["tokens"],
                   first_difference=first_difference,
                   compiles_timed=dict(plain=plain["compiles"], drafted=drafted["compiles"]),
                   plain_ms_per_token=decode_ms, plain_tokens_per_s=(len(plain["tokens"]) - 1) / plain["decode_wall_s"],
                   draft_verify_gap_ms=verify_ms,
                   draft_tokens_per_s=(len(drafted["tokens"]) - 1) / drafted["decode_wall_s"], **moved,
                   acceptance_rate=moved["accepted_tokens_total"] / max(moved["draft_tokens_total"], 1),
                   verify_steps=len(drafted["gaps"]["verify"]), decode_steps=len(drafted["gaps"]["decode"]))
        row["draft_speedup"] = row["draft_tokens_per_s"] / row["plain_tokens_per_s"]
        row["derived"] = derived_speedups(decode_ms, verify_ms, k)
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
        _log(f"[draft-model] {json.dumps(row)}")
    return rows


def build_llm(model: str, k: int, max_context: int, tuner: str):
    from jaxllm import LLM, EngineOptions

    proposer = BenchProposer()
    options = EngineOptions(num_speculative_tokens=k, max_seqs=1, tuner=tuner)
    llm = LLM(model, dtype="bfloat16", max_context=max_context, allow_long_context=True, options=options,
              proposer=proposer)
    return llm, proposer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama2-7b", help="preset or checkpoint (tiny for a CPU dry run)")
    p.add_argument("--contexts", type=int, nargs="*", default=[1024, 32768, 131072])
    p.add_argument("--k", type=int, default=4, help="draft tokens a verify step checks")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--attention", action="store_true", help="(a): attention alone at the contexts")
    p.add_argument("--attention-only", action="store_true", help="(a) and nothing else")
    p.add_argument("--ngram-contexts", type=int, nargs="*", default=None,
                   help="contexts of the copy-heavy prompt-lookup run (default: every context)")
    p.add_argument("--tuner", choices=("auto", "fixed"), default="fixed",
                   help="the steps' kernels (fixed: the same defaults for decode and verify)")
    p.add_argument("--draft-model", default=None,
                   help="(d) only: drafts from this preset or checkpoint (e.g. llama-68m), its cost included")
    p.add_argument("--out", default=harness.RESULTS_DIR)
    args = p.parse_args(argv)

    import jax

    device = harness.device_kind()
    result = {"script": "scripts/bench_speculative.py", "argv": sys.argv[1:], "date": harness.today(),
              "device": device, "jax": jax.__version__, "model": args.model, "k": args.k, "batch": 1,
              "tuner": args.tuner}
    name = "speculative-draft-model.json" if args.draft_model else "speculative.json"
    path = os.path.join(args.out, harness.result_stem(device, name, result["date"]))

    def save():
        harness.write_json(path, result)

    interpret = jax.default_backend() != "gpu"
    if args.attention or args.attention_only:
        heads = (4, 4, 64) if args.model == "tiny" else (32, 32, 128)
        result["attention"] = attention_rows(args.contexts, args.k, heads=heads,
                                             block_size=16 if interpret else 256, interpret=interpret)
        save()
    if args.draft_model:
        from jaxllm import LLM, EngineOptions

        result["draft_model"] = args.draft_model
        options = EngineOptions(speculative_model=args.draft_model, num_speculative_tokens=args.k, max_seqs=1,
                                tuner=args.tuner, draft_pool_seqs=1)
        llm = LLM(args.model, dtype="bfloat16", max_context=max(args.contexts) + args.new_tokens + 64,
                  allow_long_context=True, options=options)
        llm.engine.draft.warm_up()  # every bucket of the draft's: its prompts grow by a few tokens a proposal
        compiles = llm.compile_count
        result["draft_rows"] = draft_model_rows(llm, args.contexts, args.new_tokens, args.k)
        result["compiles_in_run"] = llm.compile_count - compiles
        save()
    elif not args.attention_only:
        llm, proposer = build_llm(args.model, args.k, max(args.contexts) + args.new_tokens + 64, args.tuner)
        result["pool_tokens"] = llm.pool_tokens
        ngram = args.contexts if args.ngram_contexts is None else args.ngram_contexts
        compiles = llm.compile_count
        result["engine"] = engine_rows(llm, proposer, args.contexts, args.new_tokens, args.k, ngram)
        result["compiles_in_run"] = llm.compile_count - compiles
        save()
    for r in result.get("attention", []):
        print(f"attention {r['context']:>7}: decode {r['decode_us']:.1f} us, verify via decode kernel "
              f"{r['verify_decode_kernel_us']:.1f} ({r['verify_decode_kernel_x_decode']:.2f}x), via prefill kernel "
              f"{r['verify_prefill_kernel_us']:.1f} ({r['verify_prefill_kernel_x_decode']:.2f}x)")
    for r in result.get("engine", []):
        print(f"engine {r['context']:>7}: decode {r['device_decode_step_ms']:.2f} ms, verify "
              f"{r['device_verify_step_ms']:.2f} ms ({r['device_verify_x_decode']:.2f}x); plain "
              f"{r['plain_tokens_per_s']:.1f} tok/s, replay {r['replay_tokens_per_s']:.1f} tok/s "
              f"({r['replay_speedup']:.2f}x), same tokens {r['same_tokens']}"
              + (f"; ngram {r['ngram']['speedup']:.2f}x at acceptance {r['ngram']['acceptance_rate']:.2f}"
                 if "ngram" in r else ""))
    for r in result.get("draft_rows", []):
        print(f"draft {args.draft_model} {r['context']:>7}: plain {r['plain_tokens_per_s']:.1f} tok/s, with drafts "
              f"{r['draft_tokens_per_s']:.1f} tok/s ({r['draft_speedup']:.2f}x) at acceptance "
              f"{r['acceptance_rate']:.2f}; verify + draft {r['draft_verify_gap_ms']:.2f} ms against decode "
              f"{r['plain_ms_per_token']:.2f} ms; same tokens {r['same_tokens']}")
    save()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
