"""Tuning data for the AutoTuner (issue 22): every candidate schedule of each attention op, timed over shapes
drawn from serving, one dataset per device.

  XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONPATH=$PWD python3 scripts/collect_tuning_data.py --out $OUT
  PYTHONPATH=$PWD python scripts/collect_tuning_data.py --smoke --out /tmp   # tiny shapes, CPU interpret mode

What is timed is exactly what a step runs (jaxllm.tuner.collect does it; this script sets its plan and hands it
scripts/common/device_trace's kernel timer): `dispatch.ragged_attention` under each candidate's Kernels
(jaxllm.tuner.candidates), one jit per (head shape, op, bucket, candidate) compiled once, over a pool of
one layer's rBlocks (K+V ~ --pool-gb) for Llama-2-7B heads (32 q / 32 kv x 128) and Llama-3-8B heads
(32 / 8 x 128), or the head shapes --heads names (a tensor shard's: 10/10/128 for 13B over 4 GPUs), bf16,
rBlocks of 256. A bucket's static shapes are the engine's (decode: sequences padded
to a power of two; prefill: tokens padded to a power of two, cu_q_lens padded with the last count); the
lengths are data, so one compile serves every shape of a bucket, as in serving.
 - decode: 1..256 sequences, KV lengths 1..512K: equal, log-uniform ragged, or mostly short with a few
   long ones; total KV per shape capped by the pool.
 - prefill: chunks of 16..8192 tokens packed from 1..8 sequences, half of them after a cached prefix
   (log-uniform up to 128K).
What is recorded is device time: the GPU kernels one attention call runs (the kernel and its split merge),
summed from a jax.profiler trace (--timing kernel, the default). In a serving step the host runs ahead of
the device (~300 kernels a step), so a kernel's cost is its device time; timing back-to-back calls from
the host instead (--timing wall) floors every call at the host's launch cost (~50 us on an H200 for
a 6 us kernel), which made short shapes a coin toss in the first datasets. Consecutive calls read their
rBlocks from `placements` different places in the pool (like a step's layers), so a small shape is not
timed out of L2. Per shape every candidate is timed in turns (rep r starts at candidate r mod n: drift is
shared), each rep a batch of calls inside one trace annotation; the median per candidate is recorded,
and the wall time per call beside it (`wall_us`). The shape budget is spread over the (head shape, op,
bucket) groups so a run ends inside --budget-s whatever the compile times, and the dataset is rewritten
after every group (a killed run keeps what it measured).
Writes `<device-slug>.jsonl.gz` (format: benchmarks/tuning/README.md) and prints progress.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time

from scripts.common import harness


def _heads(text: str) -> tuple[int, int, int]:
    """'Q/KV/D' -> (q heads, kv heads, head_dim): KV heads dividing the query heads, all >= 1."""
    try:
        hq, hkv, d = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"head shape {text!r} is not Q/KV/D (three integers, e.g. 10/10/128)") \
            from None
    if min(hq, hkv, d) < 1 or hq % hkv:
        raise argparse.ArgumentTypeError(f"head shape {text!r}: all >= 1 and the KV heads must divide the query heads")
    return hq, hkv, d


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(harness.RESULTS_DIR), "tuning"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; on a CPU the kernels run interpreted")
    parser.add_argument("--budget-s", type=float, default=None, help="wall seconds for the whole run")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--ops", nargs="+", choices=("decode", "prefill"), default=["decode", "prefill"])
    parser.add_argument("--decode-buckets", type=int, nargs="+", default=None, help="default: the plan's")
    parser.add_argument("--prefill-buckets", type=int, nargs="+", default=None, help="default: the plan's")
    parser.add_argument("--min-prefix", type=int, default=None,
                        help="shortest cached prefix drawn for a prefill sequence that has one (default 1; up to "
                             "128K): a run over chunks after long prefixes")
    parser.add_argument("--max-len", type=int, default=None,
                        help="longest decode KV length drawn (default 512K; the tables keep their 512K width): a "
                             "run over short shapes only")
    parser.add_argument("--tag", default="", help="file name: <device>.<tag>.jsonl.gz (train_tuner reads every "
                                                  "<device>*.jsonl.gz)")
    parser.add_argument("--heads", nargs="+", type=_heads, default=None, metavar="Q/KV/D",
                        help="head shapes a device holds (default: Llama-2-7B's 32/32/128 and Llama-3-8B's 32/8/128); "
                             "a tensor shard's, e.g. 10/10/128 (13B over 4 GPUs) or 16/2/128 (70B over 4): the learned "
                             "tuner is used only at the head shapes its datasets measured")
    parser.add_argument("--timing", choices=("kernel", "wall"), default=None,
                        help="kernel: GPU kernel time from a profiler trace (default on a GPU); wall: host clock")
    args = parser.parse_args(argv)

    import jax

    from jaxllm.tuner import collect
    from jaxllm.tuner.features import device_slug
    from pallas_kernels import compat
    from scripts.common.device_trace import kernel_ns_per_batch

    compat.silence_triton_deprecation()
    plan = collect.SMOKE if args.smoke else collect.Plan()
    overrides = dict(budget_s=args.budget_s, timing=args.timing, max_draw=args.max_len,
                     heads=None if args.heads is None else tuple(args.heads),
                     decode_buckets=None if args.decode_buckets is None else tuple(args.decode_buckets),
                     prefill_buckets=None if args.prefill_buckets is None else tuple(args.prefill_buckets))
    if args.min_prefix is not None:
        if not 1 <= args.min_prefix <= plan.max_prefix:
            parser.error(f"--min-prefix {args.min_prefix} must be in 1..{plan.max_prefix} (the longest prefix drawn)")
        overrides["min_prefix"] = args.min_prefix
    plan = dataclasses.replace(plan, **{k: v for k, v in overrides.items() if v is not None})
    interpret = not compat.on_gpu()  # the CPU: every Triton candidate in interpret mode
    base = collect.base_kernels(interpret)
    device = harness.device_kind()
    seed = int(time.time()) if args.seed is None else args.seed
    print(f"jax {jax.__version__}, {jax.devices()}, interpret={interpret}, base {base}", flush=True)
    collector = collect.Collector(plan, base, seed, kernel_timer=kernel_ns_per_batch)
    header = dict(format="jaxllm-tuning-v1", script="scripts/collect_tuning_data.py", argv=sys.argv[1:],
                  device=device, date=harness.today(), jax=jax.__version__, python=platform.python_version(),
                  seed=seed, smoke=args.smoke, plan=dataclasses.asdict(plan), base=repr(base),
                  definitions=collect.DEFINITIONS)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, device_slug(device) + (".smoke" if args.smoke else "")
                        + (f".{args.tag}" if args.tag else "") + ".jsonl.gz")
    rows = collect.collect_dataset(collector, args.ops, path, header)
    print(f"wrote {path}: {len(rows)} shapes in {time.time() - collector.t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
