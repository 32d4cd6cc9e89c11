"""A/B of source trees in one run on one GPU: batch-1 decode ms/token, the mixed workload, decode attention.

  git archive <old-commit> jaxllm pallas_kernels sharding serve scripts | (mkdir -p .ab/old && tar -x -C .ab/old)
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.94 PYTHONPATH=$PWD python3 scripts/ab_trees.py \
      --tree old=.ab/old --tree new=. --contexts 1024 32768 --attention 131072 --repeats 2

More arms compare with the first: `--tree new-penalties=. --tree-args new-penalties=--penalties` runs the
new tree again with extra `bench_generate.py` arguments. `--mixed N` adds the mixed workload
(`--mixed-max-prompt`, `--mixed-new-tokens` as in bench_generate.py).

Each measurement runs in a child process whose working directory and PYTHONPATH are one tree, so each
tree's own code (and its own benchmark script) does the work; the trees take turns (A B, then B A, ...)
so drift in the card's clocks or temperature falls on both alike. End to end: each tree's
`scripts/bench_generate.py --contexts ...` (Llama-2-7B shape, random bf16 weights). Attention: each
tree's `pallas_kernels.ragged_decode` on one 32-head x 128 MHA sequence at the given length over
consecutive rBlocks of 1024 tokens, timed over 4 separate KV buffers (each past L2) per call.
Writes `<device>-<date>-<HHMM>-ab-trees.json` with every run and the ratios B / A (median over repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from scripts.common.harness import device_kind, result_stem

# Runs inside a tree (its own pallas_kernels): prints one JSON line with the median microseconds a call.
_ATTENTION_CHILD = r"""
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from pallas_kernels.ragged_decode import ragged_decode
context, buffers, reps = int(sys.argv[1]), 4, 30
heads, head_dim, block = 32, 128, 1024
blocks = -(-context // block)
keys = jax.random.split(jax.random.key(0), 2 * buffers + 1)
q = jax.random.normal(keys[0], (1, heads, head_dim), jnp.bfloat16)
pools = [(jax.random.normal(keys[1 + 2 * i], (blocks, heads, block, head_dim), jnp.bfloat16),
          jax.random.normal(keys[2 + 2 * i], (blocks, heads, block, head_dim), jnp.bfloat16)) for i in range(buffers)]
tables = jnp.arange(blocks, dtype=jnp.int32)[None]
lens = jnp.array([context], jnp.int32)
run = jax.jit(lambda q, pools: [ragged_decode(q, k, v, tables, lens) for k, v in pools])
jax.block_until_ready(run(q, pools))
times = []
for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(run(q, pools))
    times.append((time.perf_counter() - start) / buffers * 1e6)
kv_bytes = 2 * context * heads * head_dim * 2
us = float(np.median(times))
print(json.dumps({"context": context, "us": us, "tb_s": kv_bytes / us / 1e6, "spread": (max(times) - min(times)) / us}))
"""


def _run(tree: str, argv: list[str], timeout_s: float) -> tuple[int, str, float]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
    return proc.returncode, proc.stdout, time.perf_counter() - start


def _generate(tree: str, contexts: list[int], new_tokens: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        rc, _, wall = _run(tree, [sys.executable, "scripts/bench_generate.py", "--contexts", *map(str, contexts),
                                  "--new-tokens", str(new_tokens), "--out", out, *extra], timeout_s=900)
        files = [f for f in os.listdir(out) if f.endswith(".json")]
        result = json.load(open(os.path.join(out, files[0]))) if rc == 0 and files else None
    decode = {row["context"]: row["ms_per_token"] for row in (result or {}).get("decode", [])}
    mixed = (result or {}).get("mixed")
    return {"rc": rc, "wall_s": wall, "ms_per_token": decode, "mixed": mixed}


def _attention(tree: str, context: int) -> dict:
    rc, stdout, wall = _run(tree, [sys.executable, "-c", _ATTENTION_CHILD, str(context)], timeout_s=600)
    row = json.loads(stdout.strip().splitlines()[-1]) if rc == 0 else {}
    return {"rc": rc, "wall_s": wall, **row}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", required=True, metavar="NAME=DIR",
                   help="two or more: A first, each other compared with A")
    p.add_argument("--tree-args", action="append", default=[], metavar="NAME=ARGS",
                   help="extra bench_generate.py arguments for the arm NAME (space-separated)")
    p.add_argument("--mixed", type=int, default=0, help="requests in the mixed workload (0: skip)")
    p.add_argument("--mixed-max-prompt", type=int, default=8192)
    p.add_argument("--mixed-new-tokens", type=int, default=128)
    p.add_argument("--contexts", type=int, nargs="*", default=[1024, 32768])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--attention", type=int, nargs="*", default=[131072], help="decode attention contexts")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    trees = [t.split("=", 1) for t in args.tree]
    if len(trees) < 2 or any(len(t) != 2 for t in trees) or len({n for n, _ in trees}) != len(trees):
        p.error(f"--tree must be given at least twice as NAME=DIR with distinct names, got {args.tree}")
    extra = {name: [] for name, _ in trees}
    for item in args.tree_args:
        name, _, text = item.partition("=")
        if name not in extra:
            p.error(f"--tree-args names {name!r}, which no --tree names (trees: {sorted(extra)})")
        extra[name] += text.split()
    if args.mixed:
        mixed_args = ["--mixed", str(args.mixed), "--mixed-max-prompt", str(args.mixed_max_prompt),
                      "--mixed-new-tokens", str(args.mixed_new_tokens)]
        extra = {name: mixed_args + more for name, more in extra.items()}
    device = device_kind()
    runs = []
    for rep in range(args.repeats):
        order = trees if rep % 2 == 0 else trees[::-1]
        for name, tree in order:
            row = {"tree": name, "rep": rep, "extra_args": extra[name]}
            if args.contexts or args.mixed:
                row["generate"] = _generate(tree, args.contexts, args.new_tokens, extra[name])
            row["attention"] = [_attention(tree, c) for c in args.attention]
            runs.append(row)
            print(f"rep {rep} {name}: {json.dumps(row)}", file=sys.stderr, flush=True)

    a_name, others = trees[0][0], [name for name, _ in trees[1:]]
    summary = []

    def median_of(name, pick):
        values = [v for r in runs if r["tree"] == name for v in [pick(r)] if v is not None]
        return statistics.median(values) if values else None

    def add(measure, pick):
        row = {"measure": measure, **{name: median_of(name, pick) for name, _ in trees}}
        a = row[a_name]
        row["ratio_to_a"] = {name: row[name] / a if a and row[name] else None for name in others}
        summary.append(row)

    for c in args.contexts:
        add(f"batch-1 decode ms/token at {c}",
            lambda r, c=c: r.get("generate", {}).get("ms_per_token", {}).get(c))
    if args.mixed:
        add(f"mixed ({args.mixed} requests, prompts 128..{args.mixed_max_prompt}) generated tok/s",
            lambda r: ((r.get("generate") or {}).get("mixed") or {}).get("generated_tokens_per_s"))
    for i, c in enumerate(args.attention):
        add(f"decode attention us at {c} (32 x 128 MHA, batch 1)", lambda r, i=i: r["attention"][i].get("us"))
    print(f"\n{'measure':60s} " + " ".join(f"{name:>14s}" for name, _ in trees)
          + " " + " ".join(f"{name + '/' + a_name:>18s}" for name in others))
    for row in summary:
        fmt = lambda v: f"{v:14.3f}" if v is not None else f"{'failed':>14s}"  # noqa: E731
        ratios = " ".join(f"{row['ratio_to_a'][n]:18.3f}" if row["ratio_to_a"][n] else f"{'-':>18s}" for n in others)
        print(f"{row['measure']:60s} " + " ".join(fmt(row[name]) for name, _ in trees) + " " + ratios)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, result_stem(device, "ab-trees") + ".json")
    with open(path, "w") as f:
        json.dump({"script": "scripts/ab_trees.py", "argv": sys.argv[1:], "device": device,
                   "date": time.strftime("%Y-%m-%d"), "trees": dict(trees), "runs": runs, "summary": summary}, f, indent=1)
    print(f"wrote {path}")
    ok = all(r.get("generate", {"rc": 0})["rc"] == 0 and all(a["rc"] == 0 for a in r["attention"]) for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
