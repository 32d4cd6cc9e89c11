"""Probe: kernels of one ragged/single prefill call (Mosaic and Triton) from a trace, and HLO copies."""
import collections, json, os, re, sys
sys.path.insert(0, "scripts")
import jax, jax.numpy as jnp
import bench_attention as ba
import bench_mosaic_prefill as bmp
from device_trace import gpu_kernel_events
from pallas_kernels import compat
from pallas_kernels.ragged_prefill import ragged_prefill
from pallas_kernels.ragged_prefill_mgpu import ragged_prefill_mgpu

compat.silence_triton_deprecation()
out_dir = os.environ.get("OUT", "/tmp")
plan = ba.Plan(ref_rows=64, reps=5, target_s=0.4, budget_s=600)
bench = ba.Bench(plan, interpret=False)
K = 1024
cases = {"ragged": bmp.RAGGED_GROUPS, "single16K": ((1, 16 * K, 0),)}
res = {}
for name, groups in cases.items():
    dense, packed, rows, flops = ba._prefill_problem(bench, groups, (32, 32, 128), 256)
    for impl, fn in (("mosaic", ragged_prefill_mgpu), ("triton", ragged_prefill)):
        f = jax.jit(lambda *a, fn=fn: fn(*a))
        hlo = f.lower(*packed).compile().as_text()
        with open(os.path.join(out_dir, f"hlo-{name}-{impl}.txt"), "w") as fh:
            fh.write(hlo)
        ev = gpu_kernel_events(lambda: f(*packed), reps=4)
        agg = collections.defaultdict(lambda: [0, 0])
        for k, s, d in ev:
            agg[k][0] += 1
            agg[k][1] += d
        span = (max(s + d for _, s, d in ev) - min(s for _, s, _ in ev)) / 4e3 if ev else None
        top = sorted(agg.items(), key=lambda kv: -kv[1][1])
        res[f"{name}/{impl}"] = dict(span_us_per_call=span, kernels=[(k[:80], c / 4, d / 4e3) for k, (c, d) in top])
        print(name, impl, "span/call us", span, flush=True)
        for k, (c, d) in top[:12]:
            print(f"   {c/4:5.1f} x {d/4e3:10.1f} us  {k[:100]}", flush=True)
        copies = [l.strip()[:160] for l in hlo.splitlines() if re.search(r"\bcopy\(|copy-start|= .*scatter", l)]
        print("   copy/scatter lines:", len(copies), flush=True)
        for l in copies[:8]:
            print("     ", l, flush=True)
    del dense, packed
json.dump(res, open(os.path.join(out_dir, "trace_prefill.json"), "w"), indent=1)
