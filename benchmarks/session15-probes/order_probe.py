"""Probe: does the order of sequences in a bucket-16 prefill chunk decide q64_k64_w4 vs default?"""
import json, os, sys, dataclasses
import numpy as np
sys.path.insert(0, "scripts")
import collect_tuning_data as collect
from jaxllm.tuner.candidates import candidates, PREFILL_TRITON
from pallas_kernels.dispatch import default_kernels
import jax

shapes = json.load(open("benchmarks/session15-probes/shapes.json"))
base = default_kernels("auto", head_dim=128)
plan = collect.Plan()
out = []
for heads in ([32, 8, 128], [32, 32, 128]):
    mine = [s for s in shapes if s["heads"] == heads]
    queue = [(np.array(s["q"], np.int64), np.array(s["kv"], np.int64) - np.array(s["q"], np.int64)) for s in mine]
    it = iter(queue)
    collect._prefill_shape = lambda rng, bucket, plan, cap: next(it)
    p = dataclasses.replace(plan, max_shapes=len(queue), budget_s=1e9)
    hq, hkv, d = heads
    per_block = 2 * hkv * p.block * d * 2
    nb = max(int(p.pool_gb * 1e9 // per_block), p.max_len // p.block)
    pools = (collect._pool(jax.numpy, jax, nb, hkv, p.block, d, 0), collect._pool(jax.numpy, jax, nb, hkv, p.block, d, 1))
    c = collect.Collector(p, base, False, 0)
    rows = c.group("prefill", tuple(heads), 16, pools, PREFILL_TRITON, 1, 0.0)
    for s, r in zip(mine, rows):
        s["now"] = r["us"]
        s["now_ratio"] = round(r["us"]["triton_q64_k64_w4"] / r["us"]["triton_default"], 3)
        print(s["src"], heads[1], s["ratio"], s["perm"], s["now_ratio"], round(r["us"]["triton_default"]), flush=True)
        out.append(s)
    del pools
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "order_probe.json"), "w"))
