"""Probe (issue 22): does timing L attention layers per jit call remove the host-dispatch floor that made short
tuning shapes noisy, and what does L cost in compile time? Per-layer time from back-to-back calls (as
collect_tuning_data does) vs the profiler's kernel time, for L in 1, 4, 16, nested and plain jit.

  PYTHONPATH=$PWD python3 scripts/probe_tuning_floor.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

import device_trace
import harness


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp")
    args = p.parse_args(argv)
    import jax
    import jax.numpy as jnp

    from jaxllm.tuner.candidates import candidates
    from pallas_kernels import compat
    from pallas_kernels.dispatch import default_kernels, ragged_attention

    compat.silence_triton_deprecation()
    base = default_kernels("auto", head_dim=128)
    hq, hkv, d, block, width = 32, 8, 128, 256, 2048
    nblocks = 12000
    kp = jax.random.normal(jax.random.key(0), (nblocks, hkv, block, d), jnp.bfloat16)
    vp = jax.random.normal(jax.random.key(1), (nblocks, hkv, block, d), jnp.bfloat16)
    out = []

    def tables_for(kv_lens, layers, seq_pad):
        nb = -(-np.asarray(kv_lens, np.int64) // block)
        t = np.zeros((layers, seq_pad, width), np.int32)
        at = 0
        for layer in range(layers):
            for s, n in enumerate(nb):
                t[layer, s, :n] = (np.arange(at, at + n)) % nblocks
                at += n
        return t

    cases = [
        ("decode", 1, [1000], None), ("decode", 1, [14983], None), ("decode", 4, [15] * 4, None),
        ("decode", 4, [4096] * 4, None), ("decode", 16, [55, 5, 4, 38, 8, 1, 11, 12, 9, 9, 9, 9, 9, 9], None),
        ("decode", 64, [165] * 49, None),
        ("prefill", 16, [8, 1, 1], [8, 1, 1]), ("prefill", 128, [123], [123]), ("prefill", 128, [205], [117]),
        ("prefill", 128, [30123], [123]),
    ]
    for op, bucket, kv_lens, q_lens in cases:
        decode = op == "decode"
        scheds = candidates(op, base, bucket, block_size=block)
        names = [s.name for s in scheds]
        pick = [s for s in scheds if s.name in ("default", "split_fine", "split_coarse", "mosaic_default",
                                                "triton_default", "triton_q64_k64_w4")]
        n = len(kv_lens)
        seq_pad = bucket if decode else min(bucket, 256)
        lens = np.zeros(seq_pad, np.int32)
        lens[:n] = kv_lens
        if decode:
            cu = np.arange(seq_pad + 1, dtype=np.int32)
        else:
            cu = np.full(seq_pad + 1, sum(q_lens), np.int32)
            cu[: n + 1] = np.concatenate([[0], np.cumsum(q_lens)])
        q = jax.random.normal(jax.random.key(bucket), (bucket, hq, d), jnp.bfloat16)
        for sched in pick:
            kernels = sched.apply(base)
            one = jax.jit(lambda q, kp, vp, t, l, c, k=kernels: ragged_attention(q, kp, vp, t, l, c, decode=decode,
                                                                                  kernels=k))
            for layers, nested in ((1, True), (4, True), (16, True), (16, False), (32, True)):
                if not nested and (op, bucket) not in (("decode", 4), ("prefill", 128)):
                    continue
                if nested:
                    fn = jax.jit(lambda q, kp, vp, t, l, c, L=layers, one=one: [one(q, kp, vp, t[i], l, c)
                                                                                 for i in range(L)])
                else:
                    fn = jax.jit(lambda q, kp, vp, t, l, c, L=layers, k=kernels: [
                        ragged_attention(q, kp, vp, t[i], l, c, decode=decode, kernels=k) for i in range(L)])
                a = (q, kp, vp, jnp.asarray(tables_for(kv_lens, layers, seq_pad)), jnp.asarray(lens), jnp.asarray(cu))
                t0 = time.perf_counter()
                try:
                    compiled = fn.lower(*a).compile()
                    jax.block_until_ready(compiled(*a))
                except Exception as e:  # noqa: BLE001 - record and go on
                    out.append(dict(op=op, bucket=bucket, kv=kv_lens[:4], cand=sched.name, L=layers, error=str(e)[:200]))
                    continue
                comp = time.perf_counter() - t0
                once = harness.time_batch(compiled, a, calls=1, per=1)
                calls = int(np.clip(0.02 / max(once, 1e-6), 1, 200))
                reps = [harness.time_batch(compiled, a, calls=calls, per=layers) * 1e6 for _ in range(7)]
                ktimes = device_trace.kernel_times(lambda: compiled(*a), reps=5)
                row = dict(op=op, bucket=bucket, kv=kv_lens[:4], n=n, cand=sched.name, L=layers, nested=nested,
                           compile_s=round(comp, 2), wall_us=round(float(np.median(reps)), 2),
                           wall_spread=round(float(np.max(reps) - np.min(reps)), 2),
                           kernel_us=round(sum(ktimes.values()) / layers, 2), kernels=len(ktimes))
                out.append(row)
                print(json.dumps(row), flush=True)
    harness.write_json(os.path.join(args.out, "probe-tuning-floor.json"), dict(rows=out, device=harness.device_kind()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
