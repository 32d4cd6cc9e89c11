"""Prediction latency of the AutoTuner on one CPU core (issue 22): per new feature key, and cached.

  PYTHONPATH=$PWD taskset -c 0 python scripts/bench_tuner_latency.py --device nvidia-h100-80gb-hbm3

Times LearnedTuner.choose, the call the runner makes per step, on StepPlan-like inputs (kv_lens, cu_q_lens,
kv_extent, num_tokens) of decode and prefill buckets drawn as the tuning data is (learned.sample_shapes):
 - new key: a fresh tuner per pass over distinct shapes, so every call misses the cache: the features,
   one batched forward pass of the MLP over the bucket's variants, the argmin and the cache insert;
 - cached: the same shapes again on the warm tuner: the key (from the plan's kv_extent) and a dict hit.
Also the bare forward pass (OpRanker.best), the key alone, and `extent`: what a plan the scheduler builds
afresh pays once, whatever the tuner, for its kv_extent (two reductions over kv_lens; a decode continuation,
the steady state of serving, carries its source's forward for free). Median over passes of (elapsed / calls),
microseconds. Writes `<host>-<date>-<HHMM>-tuner-latency.json` under --out (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import types

import numpy as np

from scripts.common import harness


def _plans(kind, bucket: int, heads, count: int):
    from jaxllm.contract import kv_extent_of
    from jaxllm.tuner.learned import sample_shapes

    out = []
    for f in sample_shapes(kind, bucket, heads=heads, max_context=512 * 1024, count=count, seed=7):
        kv = f.kv_lens.astype(np.int32)
        cu = np.concatenate([[0], np.cumsum(f.q_lens)]).astype(np.int32)
        out.append(types.SimpleNamespace(kv_lens=kv, cu_q_lens=cu,
                                         kv_extent=kv_extent_of(kv), num_tokens=int(f.q_lens.sum())))
    return out


def _per_call_us(fn, items, passes: int) -> float:
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        for it in items:
            fn(it)
        times.append((time.perf_counter() - start) / len(items))
    return float(np.median(times)) * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", required=True, help="device slug of the model, e.g. nvidia-h100-80gb-hbm3")
    parser.add_argument("--out", default=harness.RESULTS_DIR)
    parser.add_argument("--shapes", type=int, default=200, help="distinct shapes per bucket")
    parser.add_argument("--passes", type=int, default=15)
    args = parser.parse_args(argv)

    from jaxllm.tuner import LearnedTuner, model_path
    from jaxllm.tuner.cost_model import CostModel
    from jaxllm.contract import StepKind, kv_extent_of
    from jaxllm.tuner.features import StepFeatures, plan_key
    from jaxllm.tuner.learned import op_ranker
    from pallas_kernels.dispatch import Kernels

    path = model_path(args.device) if not args.device.endswith(".npz") else args.device
    model = CostModel.load(path)
    base = Kernels(decode_attention="triton", prefill_attention="mosaic", rope_kv_write="pallas", decode_layer="pallas")
    heads = (32, 8, 128)
    rows = []
    D, P = StepKind.DECODE, StepKind.PREFILL
    for decode, bucket in ((D, 1), (D, 16), (D, 256), (P, 16), (P, 512), (P, 8192)):  # decode: the step's kind
        plans, seen = [], set()
        for p in _plans(decode, bucket, heads, args.shapes):  # distinct keys only: every first call misses
            k = plan_key(p, decode, bucket)
            if k not in seen:
                seen.add(k)
                plans.append(p)
        tuner = LearnedTuner(base, model, heads=heads, block_size=256)
        variants = len(tuner.variants(decode, bucket))

        def new_key(passes):
            times = []
            for _ in range(passes):
                fresh = LearnedTuner(base, model, heads=heads, block_size=256)
                fresh.variants(decode, bucket)  # warm-up builds the bucket; not per step
                start = time.perf_counter()
                for p in plans:
                    fresh.choose(p, decode, bucket)
                times.append((time.perf_counter() - start) / len(plans))
                distinct = fresh.stats()["predictions"]
            return float(np.median(times)) * 1e6, distinct

        miss_us, distinct = new_key(args.passes)
        for p in plans:
            tuner.choose(p, decode, bucket)
        hit_us = _per_call_us(lambda p: tuner.choose(p, decode, bucket), plans, args.passes)
        key_us = _per_call_us(lambda p: plan_key(p, decode, bucket), plans, args.passes)
        extent_us = _per_call_us(lambda p: kv_extent_of(p.kv_lens), plans, args.passes)
        feats = [StepFeatures(decode, bucket, p.kv_lens, np.diff(p.cu_q_lens), heads) for p in plans]
        feats = [(f.vector().tolist(), f.stats()) for f in feats]
        names = tuner.variant_names(decode, bucket)
        op = decode.label
        ranker = op_ranker(model, op, names, kv_heads=heads[1], block_size=256)
        fwd_us = _per_call_us(lambda f: ranker.best(*f), feats, args.passes)
        row = dict(op=op, bucket=bucket, variants=variants, shapes=len(plans), distinct_keys=distinct,
                   new_key_us=round(miss_us, 2), cached_us=round(hit_us, 2), key_only_us=round(key_us, 2),
                   forward_us=round(fwd_us, 2), fresh_plan_extent_us=round(extent_us, 2))
        rows.append(row)
        print(row, flush=True)
    md = harness.markdown_table(["op", "bucket", "variants", "new key us", "cached us", "key alone us", "MLP forward us",
                                 "fresh plan's extent us"],
                                [[r["op"], r["bucket"], r["variants"], r["new_key_us"], r["cached_us"], r["key_only_us"],
                                  r["forward_us"], r["fresh_plan_extent_us"]] for r in rows])
    print(md, flush=True)
    cpu = platform.processor() or platform.machine()
    stem = harness.result_stem("cpu", "tuner-latency")
    result = dict(script="scripts/bench_tuner_latency.py", argv=sys.argv[1:], device="cpu", cpu=cpu,
                  python=platform.python_version(), numpy=np.__version__, model=os.path.relpath(path),
                  affinity=sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                  cpu_count=os.cpu_count(), load_average_1_5_15=[round(x, 2) for x in os.getloadavg()],
                  rows=rows, definitions=dict(
                      new_key_us="LearnedTuner.choose on a shape whose key is not cached: features, one batched "
                                 "MLP pass over the bucket's variants, argmin, cache insert",
                      cached_us="LearnedTuner.choose on a cached key: the key (from the plan's kv_extent) and a dict "
                                "lookup",
                      key_only_us="features.plan_key alone",
                      forward_us="OpRanker.best alone (interaction features, the batched MLP pass and argmin)",
                      fresh_plan_extent_us="scheduler.kv_extent_of: paid once by every plan built afresh (StepPlan "
                                           "computes its kv_extent), not by a decode continuation, whatever the tuner"))
    harness.write_json(os.path.join(args.out, stem + ".json"), result)
    print(f"wrote {os.path.join(args.out, stem)}.json", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
