"""Probe: per-CTA cost vs KV steps (one 128-row tile per sequence), ours vs attention_mgpu vs Triton;
then sustained loops with clocks/power sampled."""
import json, os, subprocess, sys, time
sys.path.insert(0, "scripts")
import numpy as np
import jax, jax.numpy as jnp
from device_trace import gpu_kernel_events
from pallas_kernels import compat
from pallas_kernels.ragged_prefill import ragged_prefill
from pallas_kernels.ragged_prefill_mgpu import ragged_prefill_mgpu
from jax.experimental.pallas.ops.gpu import attention_mgpu as am

compat.silence_triton_deprecation()
OUT = os.environ.get("OUT", "/tmp")
H, D, BS, S = 32, 128, 256, 132
HKV = 1  # GQA 32:1: the 32 CTAs of a sequence share its K/V through L2 (compute-bound, as real prefill)
key = jax.random.key(int(time.time()))
res = dict(fit={}, lines={}, sustained={})
from pallas_kernels.ragged_prefill_mgpu import MosaicPrefillConfig

def kernel_us(fn, reps=6, main=None):
    ev = gpu_kernel_events(fn, reps)
    by = {}
    for k, s, d in ev:
        by.setdefault(k, []).append(d / 1e3)
    k = max(by, key=lambda k: sum(by[k]))
    return float(np.median(by[k])), k

for n in (1, 2, 4, 8, 16, 32, 64):
    P = (n - 1) * 128
    L = P + 128
    nb = -(-L // BS)
    q = jax.random.normal(jax.random.fold_in(key, n), (S * 128, H, D), jnp.bfloat16)
    kp = jax.random.normal(jax.random.fold_in(key, 100 + n), (S * nb, HKV, BS, D), jnp.bfloat16)
    vp = jax.random.normal(jax.random.fold_in(key, 200 + n), (S * nb, HKV, BS, D), jnp.bfloat16)
    tables = jnp.arange(S * nb, dtype=jnp.int32).reshape(S, nb)
    kv_lens = jnp.full((S,), L, jnp.int32)
    cu = jnp.arange(S + 1, dtype=jnp.int32) * 128
    row = {}
    f = jax.jit(lambda *a: ragged_prefill_mgpu(*a))
    row["mosaic"] = kernel_us(lambda: f(q, kp, vp, tables, kv_lens, cu))[0]
    f2 = jax.jit(lambda *a: ragged_prefill_mgpu(*a, config=MosaicPrefillConfig(skip_unused=False)))
    row["mosaic_noskip"] = kernel_us(lambda: f2(q, kp, vp, tables, kv_lens, cu))[0]
    g = jax.jit(lambda *a: ragged_prefill(*a))
    row["triton"] = kernel_us(lambda: g(q, kp, vp, tables, kv_lens, cu))[0]
    # attention_mgpu, non-causal, q 128 rows, kv n*128: one CTA per (head, seq), n steps each.
    q16 = q.reshape(S, 128, H, D).astype(jnp.float16)
    k16 = jax.random.normal(jax.random.fold_in(key, 300 + n), (S, L, HKV, D), jnp.float16)
    v16 = jax.random.normal(jax.random.fold_in(key, 400 + n), (S, L, HKV, D), jnp.float16)
    cfg = am.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=False)
    h = jax.jit(lambda a, b, c: am.attention(a, b, c, config=cfg))
    row["attention_mgpu_noncausal"] = kernel_us(lambda: h(q16, k16, v16))[0]
    for kk in list(row):
        row[kk + "_per_cta_us"] = row[kk] * 132 / (S * H)
    res["fit"][n] = row
    print(n, {k: round(v, 2) for k, v in row.items()}, flush=True)
    del q, kp, vp, k16, v16, q16

for impl in ("mosaic", "mosaic_noskip", "triton", "attention_mgpu_noncausal"):
    ns = np.array(sorted(res["fit"]), float)
    ys = np.array([res["fit"][n][impl + "_per_cta_us"] for n in sorted(res["fit"])])
    b, a = np.polyfit(ns[2:], ys[2:], 1)
    res["lines"][impl] = dict(per_step_us=b, per_cta_us=a, overhead_steps=a / b)
    print(impl, "per step", round(b, 3), "per CTA", round(a, 2), "overhead steps", round(a / b, 2), flush=True)
json.dump(res, open(os.path.join(OUT, "overhead.json"), "w"), indent=1)

# Sustained: the bench's ragged batch, ~3 s of back-to-back calls each, clocks and power sampled.
import bench_attention as ba, bench_mosaic_prefill as bmp
plan = ba.Plan(ref_rows=64, reps=5, target_s=0.4, budget_s=600)
bench = ba.Bench(plan, interpret=False)
dense, packed, rows, flops = ba._prefill_problem(bench, bmp.RAGGED_GROUPS, (H, H, D), BS)
res['fit'] = {str(k): v for k, v in res['fit'].items()}
for impl, fn in (("mosaic", ragged_prefill_mgpu), ("triton", ragged_prefill), ("mosaic2", ragged_prefill_mgpu)):
    f = jax.jit(lambda *a, fn=fn: fn(*a))
    jax.block_until_ready(f(*packed))
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active",
                            "--format=csv,noheader", "-lms", "100"], stdout=subprocess.PIPE, text=True)
    t0 = time.time(); n = 0; times = []
    while time.time() - t0 < 4.0:
        t = time.perf_counter(); jax.block_until_ready(f(*packed)); times.append(time.perf_counter() - t); n += 1
    smi.terminate(); lines = smi.communicate()[0].strip().splitlines()
    res["sustained"][impl] = dict(calls=n, ms_first5=[round(x * 1e3, 2) for x in times[:5]],
                                  ms_last5=[round(x * 1e3, 2) for x in times[-5:]], smi=lines)
    print(impl, n, "first", res["sustained"][impl]["ms_first5"], "last", res["sustained"][impl]["ms_last5"], flush=True)
    for l in lines[::5]:
        print("   ", l, flush=True)
    time.sleep(2)
json.dump(res, open(os.path.join(OUT, "overhead.json"), "w"), indent=1)
