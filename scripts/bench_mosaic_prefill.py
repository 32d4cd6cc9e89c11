"""Causal prefill, side by side in one run: our Mosaic GPU kernel vs cuDNN, our Triton kernel, JAX's attention_mgpu.

  XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONPATH=$PWD python3 scripts/bench_mosaic_prefill.py [--out DIR]

bf16, 32 x 128 heads (Llama-2-7B), rBlocks of 256 on consecutive tables, fresh random inputs:
 * one sequence of 4K, 16K, 64K and 128K tokens, no cached prefix;
 * a packed ragged batch of 32 sequences of 256..16K query tokens, half of them after a cached
   prefix of 1K..8K tokens (RAGGED_GROUPS).
Ours and Triton (`ragged_prefill.ragged_prefill`) take the packed batch over the pool in one call.
cuDNN (`jax.nn.dot_product_attention(implementation="cudnn")`) gets the same work as dense
per-sequence calls inside the same jit: causal over a fresh sequence; after a prefix, non-causal
over the prefix plus causal over the new tokens, merged by log-sum-exp. JAX's `attention_mgpu`
(block_q 64, block_kv 128, 2 steps) applies to the single sequences only (no lengths, no prefix).
TFLOP/s count the real causal work, 4 * heads * head_dim * visible (query, key) pairs, for all.
Timing is scripts/common/harness.py's (median of reps inside one jit), all implementations of a case
timed in turns. Writes
`<device>-<date>-<HHMM>-mosaic-prefill.json` under --out (default benchmarks/results/) and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp

from pallas_kernels import compat
from pallas_kernels.ragged_prefill import ragged_prefill
from pallas_kernels.ragged_prefill_mgpu import MosaicPrefillConfig, ragged_prefill_mgpu
from scripts.common import harness
from scripts.common.attention_cases import peer_prefill, prefill_errors, prefill_problem, reference_rows, sdpa_part

K = 1024


@dataclasses.dataclass(frozen=True)
class Plan:
    """Timing of one run (harness.Bench reads reps, target_s, budget_s, settle)."""

    ref_rows: int = 64  # query rows per sequence checked against a float32 reference
    reps: int = 5
    target_s: float = 0.4
    budget_s: float = 240.0
    settle: bool = True


IMPLS = ("mosaic", "cudnn", "triton", "attention_mgpu")


# The ragged batch: (sequences, query tokens each, cached prefix each). 32 sequences of 256..16K query
# tokens, 16 after a prefix. Lengths come from a few sizes so that cuDNN, which runs each group as a
# dense batch, compiles a handful of graphs rather than one per sequence (per-sequence lengths cost
# it over a minute of compiling in the first run).
RAGGED_GROUPS = ((3, 256, 0), (3, 512, 0), (3, 1 * K, 0), (2, 2 * K, 0), (2, 4 * K, 0), (2, 8 * K, 0), (1, 16 * K, 0),
                 (4, 256, 4 * K), (4, 1 * K, 1 * K), (3, 2 * K, 8 * K), (3, 4 * K, 2 * K), (2, 8 * K, 8 * K))


def _attention_mgpu(q, k, v):
    from jax.experimental.pallas.ops.gpu import attention_mgpu as am

    config = am.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
    return am.attention(q, k, v, config=config)


def run_case(bench, case, groups, heads, block, config, extra_configs=()):
    """Time every implementation on one problem; errors vs cuDNN's output (max |diff| over all tokens).

    extra_configs: more Mosaic schedules to time on the same inputs (rows `mosaic <block_kv>x<steps>`,
    kept out of the table), so a sweep and the peers share one run."""
    dense, packed, rows, flops = prefill_problem(bench.normal, groups, heads, block, bench.plan.ref_rows)
    bench.rows["prefill"].append(dict(case=case, query_tokens=sum(c * q for c, q, _ in groups), causal_flops=flops,
                                      groups=[list(g) for g in groups]))
    # The float32 reference on each sequence's last rows, an independent check of every impl.
    refs = [reference_rows(*r) for r in rows]
    packed_err, group_err = prefill_errors(groups, bench.plan.ref_rows)
    # Every implementation of the case is timed in turns (one measure_interleaved, each rep runs all of
    # them once), so a drift of the card's speed over the run favours none of them.
    entries = [dict(impl="mosaic", fn=lambda s, _: ragged_prefill_mgpu(*s, config=config), shared=packed, layers=[()],
                    ref=refs, err_of=packed_err, note=f"one call over the packed batch, rBlock {block}, {config}")]
    entries += [dict(impl=_config_label(extra), fn=lambda s, _, c=extra: ragged_prefill_mgpu(*s, config=c),
                     shared=packed, layers=[()], ref=refs, err_of=packed_err, note=f"schedule sweep: {extra}")
                for extra in extra_configs]
    entries.append(dict(impl="cudnn", fn=peer_prefill(sdpa_part("cudnn")), shared=dense, layers=[()], ref=refs,
                        err_of=group_err, note="dense batch per group of equal lengths; after a prefix 2 calls merged by lse"))
    entries.append(dict(impl="triton", fn=lambda s, _: ragged_prefill(*s), shared=packed, layers=[()], ref=refs,
                        err_of=packed_err, note=f"one call over the packed batch, rBlock {block}"))
    if len(groups) == 1 and groups[0][2] == 0 and groups[0][1] % 128 == 0:
        # Its SMEM is declared float16 (jax 0.11.2 rejects bf16 inputs): same work in fp16. It applies no
        # 1/sqrt(head_dim) to the scores, so its error against the reference is large; timing only.
        dense16 = [tuple(None if x is None else x.astype(jnp.float16) for x in g) for g in dense]
        entries.append(dict(impl="attention_mgpu", fn=lambda s, _: [_attention_mgpu(q, k, v) for q, _, _, k, v in s],
                            shared=dense16, layers=[()], ref=refs, err_of=group_err,
                            note="JAX's fixed-length kernel, fp16, block_q 64, block_kv 128, 2 steps; no 1/sqrt(d) "
                                 "score scale (timing only)"))
    else:
        bench.skip("prefill", case, "attention_mgpu", "no variable lengths or cached prefix")
    bench.measure_interleaved("prefill", case, entries, flops=flops)
    del entries, dense, packed


_CONFIG_FLAGS = ("inorder", "unpaired")  # --extra-configs words after BLOCK_KV:STEPS


def _parse_config(text: str) -> MosaicPrefillConfig:
    """BLOCK_KV:STEPS[:FLAG...], FLAG one of _CONFIG_FLAGS: e.g. 128:2:inorder, 128:2:unpaired (one CTA a
    tile, no K/V multicast)."""
    parts = text.split(":")
    flags = parts[2:]
    if len(parts) < 2 or not all(p.isdigit() for p in parts[:2]) or any(f not in _CONFIG_FLAGS for f in flags):
        raise SystemExit(f"--extra-configs entry {text!r} is not BLOCK_KV:STEPS[:FLAG...], FLAG in {_CONFIG_FLAGS}")
    return MosaicPrefillConfig(block_kv=int(parts[0]), steps=int(parts[1]), heaviest_first="inorder" not in flags,
                               cluster_ctas=1 if "unpaired" in flags else 2)


def _config_label(c: MosaicPrefillConfig) -> str:
    """Row name of an extra config: `mosaic 128x2`, then ` in order` / ` unpaired` where set."""
    return (f"mosaic {c.block_kv}x{c.steps}" + ("" if c.heaviest_first else " in order")
            + ("" if c.cluster_ctas > 1 else " unpaired"))


def table(rows) -> str:
    lines = ["| case | " + " | ".join(f"{i} TFLOP/s (ms)" for i in IMPLS) + " | x cuDNN | x Triton | x attention_mgpu |",
             "| --- " * (len(IMPLS) + 4) + "|"]
    for case in dict.fromkeys(r["case"] for r in rows):
        cells, ms = [], {}
        for impl in IMPLS:
            tf, t = harness.row_value(rows, case, impl, "tflops"), harness.row_value(rows, case, impl, "ms")
            ms[impl] = t
            cells.append("-" if tf is None else f"{tf:.0f} ({t:.2f})")
        ratios = [harness.ratio(ms[i], ms["mosaic"]) for i in ("cudnn", "triton", "attention_mgpu")]
        lines.append(f"| {case} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=harness.RESULTS_DIR)
    parser.add_argument("--singles", type=int, nargs="*", default=[4 * K, 16 * K, 64 * K, 128 * K])
    parser.add_argument("--no-ragged", action="store_true")
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--extra-configs", nargs="*", default=[], metavar="BLOCK_KV:STEPS[:FLAG...]",
                        help="more Mosaic schedules to time beside the default, e.g. 64:4 128:2:inorder")
    args = parser.parse_args(argv)
    extra_configs = [_parse_config(c) for c in args.extra_configs]
    compat.silence_triton_deprecation()
    plan = Plan(budget_s=args.budget_s)
    device = harness.device_kind()
    bench = harness.Bench(plan, interpret=False, sections=("prefill",), hbm_tb_s=harness.hbm_floor_tb_s(device))
    heads, block, config = (32, 32, 128), 256, MosaicPrefillConfig()
    date = harness.today()
    print(f"jax {jax.__version__}, {device}, seed {bench.seed}", flush=True)
    cases = [(f"single {n // K}K" if n % K == 0 else f"single {n}", ((1, n, 0),)) for n in args.singles]
    if not args.no_ragged:  # before the longest singles, so a tight time budget still reaches it
        groups = RAGGED_GROUPS
        at = sum(n <= 16 * K for n in args.singles)
        cases.insert(at, (f"ragged {sum(c for c, _, _ in groups)} seqs, {sum(c * q for c, q, _ in groups)} query "
                          f"tokens, {sum(c for c, _, p in groups if p)} after a prefix", groups))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, harness.result_stem(device, "mosaic-prefill.json", date))
    rows = bench.rows["prefill"]
    for case, groups in cases:
        if bench.over_budget():
            bench.skip("prefill", case, "all", "time budget")
        else:
            run_case(bench, case, groups, heads, block, config, extra_configs)
        # After each case, so a killed run still leaves its numbers.
        harness.write_json(path, dict(
                           script="scripts/bench_mosaic_prefill.py", argv=sys.argv[1:], device=device, date=date,
                           hbm_floor_tb_s=bench.hbm_tb_s, jax=jax.__version__, python=platform.python_version(), seed=bench.seed, heads=heads,
                           rblock=block, config=dataclasses.asdict(config), plan=dataclasses.asdict(plan), rows=rows,
                           table=table(rows), gpu_state=harness.gpu_state_table(rows),
                           elapsed_s=round(time.time() - bench.t0, 1), definitions=dict(
                               tflops="4 * heads * head_dim * visible causal (query, key) pairs / time, same for all",
                               us="median over reps of elapsed / calls inside one jit (scripts/common/harness.py)",
                               max_abs_err="vs a float32 reference on each sequence's last 64 query rows",
                               x_cudnn="cuDNN time / Mosaic time (> 1: ours faster)")))
    print("\n" + table(rows), flush=True)
    print(harness.gpu_state_table(rows), flush=True)
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
