"""Probe: per-CTA timelines (Mosaic on-device profiler) of our prefill kernel vs attention_mgpu."""
import glob, json, os, subprocess, sys, time
sys.path.insert(0, "scripts"); sys.path.insert(0, "benchmarks/experiments/session7-probes")
import numpy as np
import jax, jax.numpy as jnp

OUT = os.environ.get("OUT", "/tmp")
F_GHZ = 1.98
summary = {}

def analyse(path, label):
    ev = json.load(open(path))["traceEvents"]
    by_tid = {}
    for e in ev:
        by_tid.setdefault(e["tid"], []).append(e)
    blocks = {}
    for tid, es in by_tid.items():
        b, wg = (tid - 1) // 3, (tid - 1) % 3
        t0 = es[0]["ts"]  # entry globaltimer (us); later events: cycles since the first event
        ent = {"pid": es[0]["pid"], "entry_us": t0}
        for e in es:
            rel_us = (e["ts"] - t0) * 1e3 / F_GHZ / 1e3
            ent.setdefault(e["name"], []).append(rel_us)
        ent["last_us"] = (es[-1]["ts"] - t0) * 1e3 / F_GHZ / 1e3
        blocks.setdefault(b, {})[wg] = ent
    rows = []
    for b, wgs in blocks.items():
        entry = min(w["entry_us"] for w in wgs.values())
        end = max(w["entry_us"] + w["last_us"] for w in wgs.values())
        r = dict(b=b, sm=next(iter(wgs.values()))["pid"], entry=entry, end=end, dur=end - entry)
        for wg in (0, 1):
            if wg in wgs and "c_loop" in wgs[wg]:
                cl, ca = wgs[wg]["c_loop"], wgs[wg]["c_all"]
                r[f"pre{wg}"] = cl[0] - ca[0] + (wgs[wg]["entry_us"] - entry)
                r[f"loop{wg}"] = cl[1] - cl[0]
                r[f"post{wg}"] = ca[1] - cl[1]
        rows.append(r)
    by_sm = {}
    for r in rows:
        by_sm.setdefault(r["sm"], []).append(r)
    gaps = []
    for sm, rs in by_sm.items():
        rs.sort(key=lambda r: r["entry"])
        gaps += [b["entry"] - a["end"] for a, b in zip(rs, rs[1:])]
    def stat(xs):
        xs = np.asarray(xs, float)
        return dict(n=len(xs), mean=round(float(xs.mean()), 3), median=round(float(np.median(xs)), 3),
                    p10=round(float(np.percentile(xs, 10)), 3), p90=round(float(np.percentile(xs, 90)), 3)) if len(xs) else None
    s = dict(ctas=len(rows), dur=stat([r["dur"] for r in rows]), gap=stat(gaps),
             span_us=max(r["end"] for r in rows) - min(r["entry"] for r in rows))
    for k in ("pre0", "loop0", "post0", "pre1", "loop1", "post1"):
        vals = [r[k] for r in rows if k in r]
        if vals:
            s[k] = stat(vals)
    summary[label] = s
    print(label, json.dumps(s), flush=True)

def run(label, fn, *args):
    d = os.path.join("/tmp/prof", label)
    os.makedirs(d, exist_ok=True)
    os.environ["PROF_DIR"] = d
    jax.block_until_ready(fn(*args))
    time.sleep(0.5)
    jax.block_until_ready(fn(*args))
    time.sleep(0.5)
    files = sorted(glob.glob(os.path.join(d, "*.json")), key=os.path.getmtime)
    analyse(files[-1], label)

import prof_mgpu, am_prof
key = jax.random.key(0)
S, H, D, BS = 132, 32, 128, 256
for n in (1, 16):
    P = (n - 1) * 128; L = P + 128; nb = -(-L // BS)
    q = jax.random.normal(key, (S * 128, H, D), jnp.bfloat16)
    kp = jax.random.normal(jax.random.fold_in(key, 1), (S * nb, 1, BS, D), jnp.bfloat16)
    tables = jnp.arange(S * nb, dtype=jnp.int32).reshape(S, nb)
    kv_lens = jnp.full((S,), L, jnp.int32); cu = jnp.arange(S + 1, dtype=jnp.int32) * 128
    run(f"ours_gqa_n{n}", jax.jit(prof_mgpu.ragged_prefill_mgpu), q, kp, kp, tables, kv_lens, cu)
    q16 = q.reshape(S, 128, H, D).astype(jnp.float16)
    k16 = jax.random.normal(jax.random.fold_in(key, 2), (S, L, 1, D), jnp.float16)
    cfg = am_prof.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=False)
    run(f"mgpu_gqa_n{n}", jax.jit(lambda a, b, c: am_prof.attention(a, b, c, config=cfg)), q16, k16, k16)
# Single 16K causal, both.
T = 16384
q = jax.random.normal(key, (T, H, D), jnp.bfloat16)
kp = jax.random.normal(jax.random.fold_in(key, 3), (T // BS, H, BS, D), jnp.bfloat16)
tables = jnp.arange(T // BS, dtype=jnp.int32)[None]
run("ours_16K", jax.jit(prof_mgpu.ragged_prefill_mgpu), q, kp, kp, tables, jnp.array([T], jnp.int32), jnp.array([0, T], jnp.int32))
x = jax.random.normal(key, (1, T, H, D), jnp.float16)
cfg = am_prof.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
run("mgpu_16K", jax.jit(lambda a, b, c: am_prof.attention(a, b, c, config=cfg)), x, x, x)
# The bench's ragged batch, ours.
import bench_attention as ba, bench_mosaic_prefill as bmp
bench = ba.Bench(ba.Plan(ref_rows=64, reps=5, target_s=0.4, budget_s=600), interpret=False)
dense, packed, rows, flops = ba._prefill_problem(bench, bmp.RAGGED_GROUPS, (H, H, D), BS)
run("ours_ragged", jax.jit(prof_mgpu.ragged_prefill_mgpu), *packed)
json.dump(summary, open(os.path.join(OUT, "profile_cta.json"), "w"), indent=1)
print(subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv"], capture_output=True, text=True).stdout)
