"""Quick GPU check of pallas_kernels.ragged_decode: compiles, matches the reference, first timings.

Usage (GPU machine, repo root): PYTHONPATH=$PWD python3 scripts/check_ragged_decode_gpu.py [--out DIR] [--sweep]

1. Correctness on the GPU (interpret=None) vs ragged_decode_reference: MHA/GQA, bf16/f16/f32/int8,
   head_dim 64/128, ragged lengths, shuffled tables.
2. Timing, batch 1, 32 q / 32 kv heads x 128, bf16, 128K context, vs cuDNN
   (jax.nn.dot_product_attention(implementation="cudnn")). Each timed function runs attention over
   NUM_LAYERS separate KV buffers inside one jit (as a model step would), so dispatch is amortised;
   time per call = total / NUM_LAYERS. TB/s counts K and V bytes read.
   Also times kv_lens all 0 (every program exits at once): the fixed cost of a call (launch, counters, prologue).
3. With --short-sweep: only kernel times from a trace at 1K..8K (batch 1, 32 heads, a table 128K wide
   as the engine's), per short-call split rule (DecodeBlockSizes.short_target_programs).
3b. With --split-sweep: only target_programs 768..1536 at 32K / 128K / batch 8 x 32K, and
   min_tokens_per_split 128..2048 at 1K / 4K (rBlock 256, as the engine), with cuDNN.
3d. With --wave-sweep: only target_programs x num_stages (few programs that all run at once vs several
   waves) at 32K / 128K / batch 8 x 32K, with cuDNN.
3c. With --stages-sweep: only num_stages / block_k, kernel times from a trace at 1K..8K, then 32K / 128K /
   batch 8 x 32K (with cuDNN) and the ragged 16.
4. With --sweep: DecodeBlockSizes variants (programs, stages, warps, block_k) on MHA batch 1 at 32K and
   128K, batch 8 at 32K, and a ragged batch (16 seqs, 64 q / 8 kv heads, 1K..256K).
Prints a table and writes `<device>-<date>-<HHMM>-ragged-decode-<check|...-sweep>.json` under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import compat
from pallas_kernels.ragged_decode import DecodeBlockSizes, default_block_sizes, ragged_decode, ragged_decode_reference
from pallas_kernels.kv_write import quantize_int8
from scripts.common import harness
from scripts.common.attention_cases import consecutive_tables

NUM_LAYERS = 4


def _pool(rng, num_blocks, heads, block_size, head_dim, dtype):
    x = jnp.asarray(rng.standard_normal((num_blocks, heads, block_size, head_dim), np.float32))
    if dtype == "int8":
        return quantize_int8(x)
    return x.astype(dtype), None


def correctness(rng) -> list[dict]:
    rows = []
    cases = [  # (hq, hkv, head_dim, kv dtype, block_size)
        (8, 8, 128, jnp.bfloat16, 64), (16, 4, 128, jnp.bfloat16, 256), (8, 1, 64, jnp.float16, 32),
        (8, 2, 128, jnp.float32, 64), (8, 2, 128, "int8", 128), (32, 4, 64, "int8", 16),
    ]
    lens = np.array([1, 63, 64, 65, 0, 1000, 4097, 300])
    for hq, hkv, d, dtype, bs in cases:
        width = -(-int(lens.max()) // bs)
        num_blocks = width * len(lens) + 3
        k, ks = _pool(rng, num_blocks, hkv, bs, d, dtype)
        v, vs = _pool(rng, num_blocks, hkv, bs, d, dtype)
        tables = jnp.asarray(rng.permutation(num_blocks)[: width * len(lens)].reshape(len(lens), width), jnp.int32)
        qdt = jnp.bfloat16 if dtype in ("int8", jnp.float32) else dtype
        q = jnp.asarray(rng.standard_normal((len(lens), hq, d)), qdt)
        kv = jnp.asarray(lens, jnp.int32)
        out, (m, l) = ragged_decode(q, k, v, tables, kv, k_scale=ks, v_scale=vs, return_residuals=True,
                                    interpret=None)
        with jax.default_matmul_precision("highest"):  # the reference in full f32, not TF32
            ref, (rm, rl) = ragged_decode_reference(q, k, v, tables, kv, k_scale=ks, v_scale=vs,
                                                    return_residuals=True)
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
        finite = np.isfinite(np.asarray(rm))
        merr = float(np.max(np.abs(np.asarray(m)[finite] - np.asarray(rm)[finite])))
        lerr = float(jnp.max(jnp.abs(l - rl) / jnp.maximum(rl, 1)))
        ok = err < 2e-2 and merr < 1e-2 and lerr < 1e-2 and bool(np.all(np.isfinite(np.asarray(out, np.float32))))
        row = dict(case=f"{hq}q/{hkv}kv d{d} {jnp.dtype(dtype) if dtype != 'int8' else 'int8'} bs{bs}",
                   out_err=err, max_err=merr, sum_rel_err=lerr, ok=ok)
        print(row, flush=True)
        rows.append(row)
    return rows


def _time(fn, *args) -> float:
    """Seconds per call of fn(*args): compiled, then the median of 5 reps of calls back to back."""
    return harness.median_time(fn, *args, reps=5, target_s=0.25)


def timing(rng, batch, hq, hkv, lens, block_size, configs, with_cudnn=True, overhead=False) -> list[dict]:
    """Time ragged_decode per config (and cuDNN) on bf16 KV; `overhead` also times kv_lens 0 (launch + merge)."""
    d = 128
    lens = np.asarray(lens)
    width = -(-int(lens.max()) // block_size)
    num_blocks = int(sum(-(-int(n) // block_size) for n in lens))
    # Consecutive rBlocks per sequence (the allocator's common case); len(lens) == batch.
    tables = jnp.asarray(consecutive_tables([-(-int(n) // block_size) for n in lens], width))
    kv = jnp.asarray(lens, jnp.int32)
    keys = jax.random.split(jax.random.key(0), 2 * NUM_LAYERS)
    shape = (num_blocks, hkv, block_size, d)
    ks = [jax.random.normal(keys[2 * i], shape, jnp.bfloat16) for i in range(NUM_LAYERS)]
    vs = [jax.random.normal(keys[2 * i + 1], shape, jnp.bfloat16) for i in range(NUM_LAYERS)]
    q = jnp.asarray(rng.standard_normal((batch, hq, d)), jnp.bfloat16)
    kv_bytes = 2 * int(lens.sum()) * hkv * d * 2
    rows = []
    case = f"batch {batch}, {hq}q/{hkv}kv x {d}, lens {lens.min()}..{lens.max()}, rBlock {block_size}"
    runs = [(bsz, kv) for bsz in configs]
    if overhead:
        runs.append((configs[0], jnp.zeros_like(kv)))
    for bsz, lengths in runs:
        try:
            @jax.jit
            def step(q, ks, vs, tables, kv):
                acc = jnp.zeros(q.shape, jnp.float32)
                for k, v in zip(ks, vs):
                    acc += ragged_decode(q, k, v, tables, kv, block_sizes=bsz, interpret=None).astype(jnp.float32)
                return acc
            t = _time(step, q, ks, vs, tables, lengths) / NUM_LAYERS
            split = int(bsz.split(block_size, kv, hkv))
            row = dict(case=case, kernel="ragged_decode" if lengths is kv else "ragged_decode, kv_lens 0 (overhead)",
                       config=str(bsz), split=split, us=round(t * 1e6, 1), tb_s=round(kv_bytes / t / 1e12, 3))
        except Exception as e:  # keep going: one bad config must not hide the others
            row = dict(case=case, kernel="ragged_decode", config=str(bsz), error=f"{type(e).__name__}: {str(e)[:300]}")
        print(row, flush=True)
        rows.append(row)
    if with_cudnn:
        del ks, vs
        try:
            # cuDNN wants [batch, seq, heads, head_dim]; built once outside the timed region.
            cap = width * block_size
            kd = [jax.random.normal(keys[2 * i], (batch, cap, hkv, d), jnp.bfloat16) for i in range(NUM_LAYERS)]
            vd = [jax.random.normal(keys[2 * i + 1], (batch, cap, hkv, d), jnp.bfloat16) for i in range(NUM_LAYERS)]

            @jax.jit
            def cudnn_step(q, kd, vd, kv):
                acc = jnp.zeros(q.shape, jnp.float32)
                for k, v in zip(kd, vd):
                    o = jax.nn.dot_product_attention(q[:, None], k, v, implementation="cudnn",
                                                     key_value_seq_lengths=kv)
                    acc += o[:, 0].astype(jnp.float32)
                return acc
            t = _time(cudnn_step, q, kd, vd, kv) / NUM_LAYERS
            row = dict(case=case, kernel="cudnn (key_value_seq_lengths)", us=round(t * 1e6, 1),
                       tb_s=round(kv_bytes / t / 1e12, 3))
            del kd, vd
        except Exception as e:
            row = dict(case=case, kernel="cudnn", error=f"{type(e).__name__}: {str(e)[:300]}")
        print(row, flush=True)
        rows.append(row)
    return rows


def int8_timing(configs, length: int = 131072, heads: int = 32, block_size: int = 1024) -> list[dict]:
    """Batch-1 MHA decode over int8 KV (with scales) per config; TB/s counts int8 K/V plus scales."""
    d = 128
    num_blocks = length // block_size
    tables = jnp.arange(num_blocks, dtype=jnp.int32)[None]
    kv = jnp.asarray([length], jnp.int32)
    keys = jax.random.split(jax.random.key(1), 2 * NUM_LAYERS)
    shape = (num_blocks, heads, block_size, d)
    pools = [jax.random.randint(keys[i], shape, -127, 128, jnp.int32).astype(jnp.int8) for i in range(2 * NUM_LAYERS)]
    scale = jnp.full(shape[:3], 0.01, jnp.float32)
    q = jax.random.normal(keys[0], (1, heads, d), jnp.bfloat16)
    kv_bytes = 2 * length * heads * (d + 4)
    rows = []
    for bsz in configs:
        try:
            @jax.jit
            def step(q, pools, scale):
                acc = jnp.zeros(q.shape, jnp.float32)
                for i in range(NUM_LAYERS):
                    acc += ragged_decode(q, pools[2 * i], pools[2 * i + 1], tables, kv, k_scale=scale, v_scale=scale,
                                         block_sizes=bsz, interpret=None).astype(jnp.float32)
                return acc
            t = _time(step, q, pools, scale) / NUM_LAYERS
            row = dict(case=f"int8 KV, batch 1, {heads}x{d}, {length}", config=str(bsz), us=round(t * 1e6, 1),
                       tb_s=round(kv_bytes / t / 1e12, 3))
        except Exception as e:
            row = dict(case="int8", config=str(bsz), error=f"{type(e).__name__}: {str(e)[:300]}")
        print(row, flush=True)
        rows.append(row)
    return rows


def short_trace_timing(configs: dict, cases=((1024, 131072), (2048, 131072), (4096, 131072), (8192, 131072)),
                       heads: int = 32, block_size: int = 256, layers: int = 32) -> list[dict]:
    """Kernel time (from a profiler trace, so no launch gaps or timer noise) of batch-1 MHA decode at short
    contexts, `layers` calls chained as in a model step, with a table `width` tokens wide as the engine
    sizes it (for its context limit) though only `length` tokens are real. configs: name -> DecodeBlockSizes."""
    from scripts.common.device_trace import kernel_times

    rows = []
    for length, width in cases:
        used = -(-length // block_size)
        keys = jax.random.split(jax.random.key(2), 2 * layers)
        shape = (used, heads, block_size, 128)
        pools = [(jax.random.normal(keys[2 * i], shape, jnp.bfloat16),
                  jax.random.normal(keys[2 * i + 1], shape, jnp.bfloat16)) for i in range(layers)]
        tables = jnp.zeros((1, width // block_size), jnp.int32).at[0, :used].set(jnp.arange(used, dtype=jnp.int32))
        lens = jnp.asarray([length], jnp.int32)
        q = jax.random.normal(keys[0], (1, heads, 128), jnp.bfloat16)
        for name, bsz in configs.items():
            try:
                @jax.jit
                def step(q, pools):
                    for k, v in pools:  # chained like layers: each call waits for the previous
                        q = ragged_decode(q, k, v, tables, lens, block_sizes=bsz, interpret=None).astype(q.dtype)
                    return q
                times = kernel_times(lambda: step(q, pools), 10)
                us = sum(t for n, t in times.items() if "ragged_decode" in n) / layers
                row = dict(case=f"batch 1, {heads}x128, {length} tokens, table {width} wide", config=name,
                           split=int(bsz.split(block_size, lens, heads)), kernel_us=round(us, 2),
                           tb_s=round(2 * length * heads * 128 * 2 / us / 1e6, 3))
            except Exception as e:
                row = dict(case=f"{length}", config=name, error=f"{type(e).__name__}: {str(e)[:300]}")
            print(row, flush=True)
            rows.append(row)
        del pools
    return rows


_LONG_MHA = (("mha_32k", 1, 32768), ("mha_128k", 1, 131072), ("mha_batch8_32k", 8, 32768))


def _long_mha(result: dict, rng, configs) -> None:
    """MHA batch 1 at 32K / 128K and batch 8 at 32K (rBlock 1024), per config, with cuDNN."""
    for name, batch, length in _LONG_MHA:
        result[name] = timing(rng, batch, 32, 32, [length] * batch, 1024, configs)


def _ragged_16_lens(rng) -> np.ndarray:
    """16 lengths: 15 log-uniform in 1K..256K, then one of 256K."""
    lens = np.sort(np.exp(rng.uniform(np.log(1024), np.log(262144), 15)).astype(int))
    return np.concatenate([lens, [262144]])


def _write(result: dict, out: str, kind: str) -> None:
    harness.write_json(os.path.join(out, harness.result_stem(result["device_kind"], kind) + ".json"), result)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--int8-sweep", action="store_true", help="only time int8-KV decode per block size")
    parser.add_argument("--split-sweep", action="store_true",
                        help="only time target_programs 768..1536 (MHA batch 1 at 32K / 128K, batch 8 at 32K) and "
                             "min_tokens_per_split 128..1024 (batch 1 at 1K / 4K), with cuDNN")
    parser.add_argument("--short-sweep", action="store_true",
                        help="only kernel times (trace) at 1K..8K, batch 1, table 128K wide: the short-call split rule")
    parser.add_argument("--wave-sweep", action="store_true",
                        help="only target_programs x num_stages at 32K / 128K / batch 8 x 32K, with cuDNN: programs "
                             "that all fit on the GPU at once (one wave) against several waves")
    parser.add_argument("--stages-sweep", action="store_true",
                        help="only num_stages / block_k: kernel times (trace) at 1K..8K, then 32K / 128K / batch 8 x "
                             "32K and the ragged 16, with cuDNN")
    args = parser.parse_args()
    compat.silence_triton_deprecation()
    print(jax.__version__, jax.devices(), flush=True)
    rng = np.random.default_rng(0)
    kind = harness.device_kind()
    result = {"device": str(jax.devices()[0]), "device_kind": kind, "jax": jax.__version__,
              "script": "scripts/check_ragged_decode_gpu.py", "argv": sys.argv[1:], "date": harness.today(),
              "hbm_floor_tb_s": harness.hbm_floor_tb_s(kind)}
    if args.int8_sweep:
        r = dataclasses.replace
        base = default_block_sizes(jnp.int8)  # int8 -> float16 by the integer trick, 128-token tiles, 4 stages
        result["correctness"] = correctness(rng)
        result["int8_128k"] = int8_timing([base, r(base, int8_via_fp16=False), r(base, block_k=64),
                                           r(base, num_stages=3)])
        _write(result, args.out, "ragged-decode-int8-sweep")
        return
    if args.short_sweep:
        r = dataclasses.replace
        base = DecodeBlockSizes()
        configs = {"default": base, "no short rule (256-token floor)": r(base, short_target_programs=1),
                   "64-token floor": r(base, min_tokens_per_split=64), "short target 1024": r(base, short_target_programs=1024),
                   "short target 256": r(base, short_target_programs=256)}
        result["short"] = short_trace_timing(configs)
        _write(result, args.out, "ragged-decode-short-sweep")
        return
    if args.wave_sweep:
        # With 2 stages a program holds 2 x 32 KB of K/V tiles, so ~3 share an SM: ~396 programs run at
        # once and a call of that many has no last partial wave; 4 stages fit one program an SM.
        r = dataclasses.replace
        base = DecodeBlockSizes()
        configs = [base] + [r(base, num_stages=st, target_programs=t) for st in (2, 3) for t in (264, 384, 528, 768, 1024)]
        _long_mha(result, rng, configs)
        _write(result, args.out, "ragged-decode-wave-sweep")
        return
    if args.stages_sweep:
        # Pipeline stages size each program's SMEM (K and V tiles per stage) and so how many programs
        # share an SM: at 1K every item is one tile, and the stages only cost occupancy.
        r = dataclasses.replace
        base = DecodeBlockSizes()
        variants = {f"{b}x{st}": r(base, block_k=b, num_stages=st)
                    for b, st in ((64, 4), (64, 3), (64, 2), (64, 1), (32, 2), (128, 2))}
        result["short"] = short_trace_timing(variants)
        configs = [variants[k] for k in ("64x4", "64x3", "64x2", "128x2")]
        _long_mha(result, rng, configs)
        result["ragged_16"] = timing(rng, 16, 64, 8, _ragged_16_lens(rng), 1024, configs, with_cudnn=False)
        _write(result, args.out, "ragged-decode-stages-sweep")
        return
    if args.split_sweep:
        base = DecodeBlockSizes()
        configs = [dataclasses.replace(base, target_programs=t) for t in (1024, 768, 896, 1152, 1280, 1536)]
        _long_mha(result, rng, configs)
        configs = [dataclasses.replace(base, min_tokens_per_split=t) for t in (128, 256, 512, 1024, 2048)]
        for name, length in (("mha_1k", 1024), ("mha_4k", 4096)):
            result[name] = timing(rng, 1, 32, 32, [length], 256, configs)
        _write(result, args.out, "ragged-decode-split-sweep")
        return
    try:
        result["correctness"] = correctness(rng)
    except Exception:
        traceback.print_exc()
        result["correctness"] = "failed"
    base = DecodeBlockSizes()
    t0 = time.time()
    if not args.sweep:
        result["mha_128k"] = timing(rng, 1, 32, 32, [131072], 1024, [base], overhead=True)
    else:
        r = dataclasses.replace
        configs = [base, r(base, target_programs=512), r(base, target_programs=2048), r(base, num_stages=3),
                   r(base, num_warps=8), r(base, num_warps=8, num_stages=3), r(base, target_programs=2048, num_stages=3)]
        for name, batch, length in _LONG_MHA:
            result[name] = timing(rng, batch, 32, 32, [length] * batch, 1024, configs, overhead=batch == 1)
            print(f"{time.time() - t0:.0f}s", flush=True)
        lens = _ragged_16_lens(rng)
        result["ragged_16"] = timing(rng, len(lens), 64, 8, lens, 1024, configs[:4], with_cudnn=False)
    print(f"timing {time.time() - t0:.0f}s", flush=True)
    path = os.path.join(args.out, harness.result_stem(result["device_kind"], "ragged-decode-check") + ".json")
    harness.write_json(path, result)
    print("wrote", path)
    ok = isinstance(result["correctness"], list) and all(r["ok"] for r in result["correctness"])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
