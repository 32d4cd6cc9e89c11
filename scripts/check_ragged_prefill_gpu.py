"""GPU check and sweep of pallas_kernels.ragged_prefill against cuDNN and JAX's Triton Pallas `mha`.

Usage (GPU machine, repo root):
  PYTHONPATH=$PWD python3 scripts/check_ragged_prefill_gpu.py [--out DIR] [--tokens 4096,16384]
      [--budget-s 300] [--baseline PATH/TO/old_ragged_prefill.py] [--quick]
  ... --profile-only   (run our default kernel and mha once each at 16K, e.g. under ncu)
  ... --dump-ttir DIR  (save the Triton IR of our default kernel and mha at 4K, for offline compiles)
  ... --ab --baseline PATH (only: the A/B below, the parts check, then section 2)

1. Causal prefill of one sequence (each of --tokens), 32 x 128 heads (MHA), bf16, rBlocks of 256
   laid out consecutively: cuDNN (jax.nn.dot_product_attention(implementation="cudnn")), JAX's
   Pallas `attention.mha` (its defaults, 128/64/4/2, and the same on head-major K/V), an optional
   baseline copy of the kernel module (--baseline), our default block sizes and a sweep of
   PrefillBlockSizes, all on the same values; output error against cuDNN.
2. Our default on smaller rBlocks (64, 16), a shuffled rBlock table, GQA (32 q / 8 kv heads), and a
   ragged batch of 8 sequences with cached prefixes (TFLOP/s of the real causal work), with the
   output and residual error against ragged_prefill_reference on the first sequence's first tokens.
3. Parts (query_starts): a sequence's rBlock table cut into runs placed on "instances" of one pool,
   each instance's past row (sharding.prefill_parts) and the chunk's own keys through the kernel with
   residuals, merged with merge_partials, against the unsplit kernel: a fresh 16K prompt and a 4K chunk
   after 12K cached.
4. --ab: our default kernel against --baseline's (an older ragged_prefill.py, its own defaults) on the
   same inputs, alternating, --ab-rounds rounds of best-of-3 each: median ms and ours / baseline.
TFLOP/s counts causal FLOPs: 4 * H * D * sum over query tokens of (position + 1). Prints a table
(ratios to mha's defaults and to cuDNN at the same token count), writes
`<device>-<date>-<HHMM>-ragged-prefill-check.json` under --out (default benchmarks/results/): the
run's device, date and HBM floor beside `rows`, one dict per entry.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import inspect
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import ragged_prefill as rp
from pallas_kernels.residuals import merge_partials
from sharding.prefill_parts import prefill_parts
from scripts.common import harness

SWEEP = [(128, 64, 4, 2), (128, 128, 8, 2), (64, 64, 4, 2), (128, 64, 4, 3)]  # (block_q, block_k, warps, stages)
MHA_CONFIG = (128, 64, 4, 2)
BASELINE_SWEEP = [(128, 64, 4, 3)]
H, D = 32, 128


def _time(fn, *args, min_s=0.15) -> float:
    """Best of 3 repetitions of enough calls to take min_s each (harness.time_calls), per call in seconds."""
    jax.block_until_ready(fn(*args))  # compile
    times, _ = harness.time_calls(fn, args, reps=3, target_s=3 * min_s, max_calls=50, per=1)
    return min(times)


def _problem(rng, q_lens, cached, num_kv_heads, block_size, shuffle=False, dtype=jnp.bfloat16):
    """Consecutive rBlocks per sequence (the allocator's preferred layout), or a shuffled pool."""
    kv_lens = np.asarray(q_lens) + np.asarray(cached)
    width = int(max(-(-kv_lens // block_size)))
    num_blocks = width * len(q_lens)
    order = rng.permutation(num_blocks) if shuffle else np.arange(num_blocks)
    tables = jnp.asarray(order.reshape(len(q_lens), width), jnp.int32)
    shape = (num_blocks, num_kv_heads, block_size, D)
    k = jax.random.normal(jax.random.key(int(rng.integers(1 << 30))), shape, dtype)
    v = jax.random.normal(jax.random.key(int(rng.integers(1 << 30))), shape, dtype)
    q = jax.random.normal(jax.random.key(int(rng.integers(1 << 30))), (int(sum(q_lens)), H, D), dtype)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    positions = np.concatenate([np.arange(c, c + n) for n, c in zip(q_lens, cached)])
    flops = 4.0 * H * D * float(np.sum(positions + 1))
    return (q, k, v, tables, jnp.asarray(kv_lens, jnp.int32), cu), flops


def _ours(bs=None, residuals=False):
    """The public entry point; bs None = its default block sizes."""
    block_sizes = None if bs is None else rp.PrefillBlockSizes(*bs)
    return jax.jit(functools.partial(rp.ragged_prefill, interpret=False, block_sizes=block_sizes,
                                     return_residuals=residuals))


def _mha(fa, config=None):
    """JAX's Pallas mha on [batch, T, heads, D]; config None = its defaults."""
    if config is None:
        return jax.jit(lambda q, k, v: fa.mha(q, k, v, None, sm_scale=D ** -0.5, causal=True))
    bq, bk, warps, stages = config
    return jax.jit(lambda q, k, v: fa.mha(q, k, v, None, sm_scale=D ** -0.5, causal=True,
                                          block_sizes=fa.BlockSizes(block_q=bq, block_k=bk),
                                          num_warps=warps, num_stages=stages))


def _seq_major(pool, tables, length):
    """[blocks, H, B, D] pool -> [1, length, H, D] of the first sequence, for cuDNN / mha."""
    blocks = pool[tables[0]]  # [W, H, B, D]
    w, h, b, d = blocks.shape
    return blocks.transpose(0, 2, 1, 3).reshape(1, w * b, h, d)[:, :length]


def _load_baseline(path):
    spec = importlib.util.spec_from_file_location("ragged_prefill_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def _dump_ttir(out_dir):
    """Save the Triton IR of every Pallas Triton kernel lowered from here on (for offline compiles)."""
    from jax._src.pallas.triton import pallas_call_registration as reg
    original = reg.lowering.lower_jaxpr_to_triton_module
    count = [0]

    def hooked(*a, **k):
        result = original(*a, **k)
        count[0] += 1
        with open(os.path.join(out_dir, f"kernel{count[0]}.ttir"), "w") as f:
            f.write(result.module.operation.get_asm(enable_debug_info=False))
        return result

    reg.lowering.lower_jaxpr_to_triton_module = hooked


def _parts_check(rng, q_len, cached, parts, block=256):
    """One sequence's table cut at random rBlock boundaries into `parts` runs on as many instances (one
    pool: global ids); as DistAttention runs a prefill step: each instance's past row (sharding.prefill_parts:
    the keys before the chunk it holds, unmasked) and the chunk's own keys (causal, from the rBlock where the
    chunk starts: `cached` is a multiple of `block`) through the kernel with residuals, merged per token, against
    the unsplit kernel. Returns a dict of errors and times (ms)."""
    if cached % block:
        raise ValueError(f"the parts check starts its chunk at an rBlock: cached {cached} is not a multiple of {block}")
    (q, k, v, tables, kv_lens, cu), flops = _problem(rng, [q_len], [cached], H, block)
    width = int(tables.shape[1])
    cuts = np.sort(rng.choice(np.arange(1, width), parts - 1, replace=False))
    owner = np.searchsorted(cuts, np.arange(width), side="right")  # run index = instance
    placements = [[(int(owner[e]), int(tables[0, e])) for e in range(width)]]
    pp = prefill_parts(placements, [q_len + cached], [q_len], block_size=block, instances=parts)
    fn = _ours(residuals=True)
    chunk_table = np.zeros_like(np.asarray(tables))
    chunk_blocks = np.asarray(tables)[0, cached // block:]
    chunk_table[0, :len(chunk_blocks)] = chunk_blocks
    args = [(q[jnp.asarray(np.clip(pp.token_index[i], 0, q_len - 1))], k, v, jnp.asarray(pp.tables[i]),
             jnp.asarray(pp.kv_lens[i]), jnp.asarray(pp.cu_q_lens[i]), jnp.asarray(pp.query_starts[i]))
            for i in range(parts)]
    args.append((q, k, v, jnp.asarray(chunk_table), jnp.asarray([q_len], jnp.int32), cu, jnp.zeros(1, jnp.int32)))
    part_fn = lambda qq, kk, vv, t, n, c, qs: fn(qq, kk, vv, t, n, c, query_starts=qs)
    merge = jax.jit(lambda outs, ms, ls, ids: merge_partials(outs, ms, ls, segment_ids=ids, num_segments=q_len))
    ids = jnp.asarray(np.concatenate([pp.token_index.reshape(-1), np.arange(q_len)]))

    def split(*flat):
        res = [part_fn(*flat[7 * i:7 * i + 7]) for i in range(len(args))]
        outs = jnp.concatenate([r[0] for r in res])
        ms, ls = jnp.concatenate([r[1][0] for r in res]), jnp.concatenate([r[1][1] for r in res])
        return merge(outs, ms, ls, ids)

    flat = [x for a in args for x in a]
    got, gm, gl = split(*flat)
    want, (wm, wl) = fn(q, k, v, tables, kv_lens, cu)
    finite = bool(jnp.all(jnp.isfinite(got)))
    err = float(jnp.max(jnp.abs(got - want.astype(jnp.float32))))
    res_err = max(float(jnp.max(jnp.abs(gm - wm))), float(jnp.max(jnp.abs(gl / wl - 1))))
    t_split, t_whole = _time(split, *flat), _time(fn, q, k, v, tables, kv_lens, cu)
    return dict(parts=parts, cuts=[int(c) for c in cuts], rows=int((pp.seq >= 0).sum()), max_err=err,
                residual_err=res_err, finite=finite, ms_split=t_split * 1e3, ms_whole=t_whole * 1e3,
                TFLOPs_whole=flops / t_whole / 1e12)


def _ab(baseline, tokens, rounds, rec):
    """Our default against the baseline's default on the same inputs, alternating rounds."""
    rng = np.random.default_rng(1)
    for T in tokens:
        (q, k, v, tables, kv_lens, cu), flops = _problem(rng, [T], [0], H, 256)
        inputs = (q, k, v, tables, kv_lens, cu)
        base = jax.jit(functools.partial(baseline.ragged_prefill, interpret=False))
        ours = _ours()
        err = float(jnp.max(jnp.abs(ours(*inputs).astype(jnp.float32) - base(*inputs).astype(jnp.float32))))
        times = {"baseline": [], "ours": []}
        for _ in range(rounds):
            for name, fn in (("baseline", base), ("ours", ours)):
                times[name].append(_time(fn, *inputs) * 1e3)
        med = {n: float(np.median(t)) for n, t in times.items()}
        rec(what=f"ab_prefill{T // 1024}k", impl="ours_vs_baseline", config="defaults", ms_ours=med["ours"],
            ms_baseline=med["baseline"], ratio=med["ours"] / med["baseline"], ms_ours_all=times["ours"],
            ms_baseline_all=times["baseline"], TFLOPs=flops / (med["ours"] / 1e3) / 1e12,
            max_diff_vs_baseline=err)
        del inputs, q, k, v


def _run_once(fa, tokens):
    """Our default kernel, then mha at MHA_CONFIG, once each (for a profiler or an IR dump)."""
    (q, k, v, tables, kv_lens, cu), _ = _problem(np.random.default_rng(0), [tokens], [0], H, 256)
    jax.block_until_ready(_ours()(q, k, v, tables, kv_lens, cu))
    ks, vs = _seq_major(k, tables, tokens), _seq_major(v, tables, tokens)
    jax.block_until_ready(_mha(fa, MHA_CONFIG)(q[None], ks, vs))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", harness.RESULTS_DIR))
    parser.add_argument("--tokens", default="4096,16384")
    parser.add_argument("--budget-s", type=float, default=300.0, help="skip remaining entries after this")
    parser.add_argument("--baseline", default=None, help="an older ragged_prefill.py to time beside this one")
    parser.add_argument("--quick", action="store_true", help="our default only, no sweep")
    parser.add_argument("--profile-only", action="store_true", help="run ours and mha once each at 16K, stop")
    parser.add_argument("--dump-ttir", default=None, help="save the Triton IR of ours and mha at 4K here, stop")
    parser.add_argument("--ab", action="store_true", help="only the A/B against --baseline, parts, section 2")
    parser.add_argument("--ab-rounds", type=int, default=5)
    args = parser.parse_args()
    from jax.experimental.pallas.ops.gpu import attention as fa
    if args.profile_only:
        _run_once(fa, 16384)
        return []
    if args.dump_ttir:
        os.makedirs(args.dump_ttir, exist_ok=True)
        _dump_ttir(args.dump_ttir)
        _run_once(fa, 4096)
        print("dumped", sorted(os.listdir(args.dump_ttir)), flush=True)
        return []
    t_start = time.perf_counter()
    rows = []

    def rec(**kw):
        rows.append(kw)
        print(json.dumps(kw), flush=True)

    def attempt(what, impl, config, fn, inputs, flops, ref=None, **extra):
        if time.perf_counter() - t_start > args.budget_s:
            rec(what=what, impl=impl, config=config, error="skipped: time budget")
            return None
        try:
            out = fn(*inputs)
            err = None if ref is None else float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
            t = _time(fn, *inputs)
            rec(what=what, impl=impl, config=config, ms=t * 1e3, TFLOPs=flops / t / 1e12, max_err=err, **extra)
            return flops / t / 1e12
        except Exception as e:  # one failing entry must not hide the others
            rec(what=what, impl=impl, config=config, error=(type(e).__name__ + ": " + str(e))[:300])
            return None

    print("jax", jax.__version__, jax.devices(), flush=True)
    print("mha defaults:", inspect.signature(fa.mha), flush=True)
    baseline = _load_baseline(args.baseline) if args.baseline and os.path.exists(args.baseline) else None
    cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.ab:
        if baseline is None:
            raise SystemExit(f"--ab needs --baseline (an older ragged_prefill.py); got {args.baseline!r}")
        _ab(baseline, tokens, args.ab_rounds, rec)
    for q_len, cached, parts in [(16384, 0, 4), (4096, 12288, 3)]:
        if time.perf_counter() - t_start > args.budget_s:
            break
        try:
            rec(what=f"parts_q{q_len // 1024}k_cached{cached // 1024}k", impl="ours", config="default",
                **_parts_check(rng, q_len, cached, parts))
        except Exception as e:
            rec(what=f"parts_q{q_len // 1024}k", impl="ours", config="default",
                error=(type(e).__name__ + ": " + str(e))[:300])
    for T in [] if args.ab else tokens:
        what = f"prefill{T // 1024}k"
        (q, k, v, tables, kv_lens, cu), flops = _problem(rng, [T], [0], H, 256)
        ks, vs = _seq_major(k, tables, T), _seq_major(v, tables, T)
        ref = cudnn(q[None], ks, vs)[0].astype(jnp.float32)
        attempt(what, "cudnn", "", lambda q, k, v: cudnn(q[None], k, v), (q, ks, vs), flops)
        attempt(what, "mha", "default", lambda q, k, v: _mha(fa)(q[None], k, v)[0], (q, ks, vs), flops, ref)
        attempt(what, "mha", MHA_CONFIG, lambda q, k, v: _mha(fa, MHA_CONFIG)(q[None], k, v)[0], (q, ks, vs),
                flops, ref)
        # The same mha on head-major K/V (heads as batch: one contiguous run of keys per head, the
        # pool's layout inside an rBlock), to separate layout effects from kernel code.
        qh, kh, vh = (x.reshape(T, H, D).transpose(1, 0, 2)[:, :, None, :] for x in (q, ks, vs))
        attempt(what, "mha", f"head-major {MHA_CONFIG}", _mha(fa, MHA_CONFIG), (qh, kh, vh), flops)
        del qh, kh, vh
        inputs = (q, k, v, tables, kv_lens, cu)
        if baseline is not None:
            for bs in BASELINE_SWEEP:
                fn = jax.jit(functools.partial(baseline.ragged_prefill, interpret=False,
                                               block_sizes=baseline.PrefillBlockSizes(*bs)))
                attempt(what, "baseline", bs, fn, inputs, flops, ref)
        default = rp.default_block_sizes(jnp.bfloat16)
        attempt(what, "ours", f"default {dataclasses.astuple(default)}", _ours(), inputs, flops, ref)
        for bs in [] if args.quick else SWEEP:
            attempt(what, "ours", bs, _ours(bs), inputs, flops, ref)
        del q, k, v, ks, vs, ref, inputs
    for name, q_lens, cached, hkv, block, shuffle in [
        ("prefill16k_rblock64", [16384], [0], H, 64, False),
        ("prefill16k_rblock16", [16384], [0], H, 16, False),
        ("prefill16k_shuffled_rblock256", [16384], [0], H, 256, True),
        ("prefill16k_gqa_32q_8kv", [16384], [0], 8, 256, False),
        ("ragged8_cached", [4096, 2048, 3000, 1, 1000, 5000, 1235, 15], [0, 1000, 4096, 8000, 0, 2000, 0, 300],
         H, 256, False),
    ]:
        inputs, flops = _problem(rng, q_lens, cached, hkv, block, shuffle)
        # The reference on the first sequence's first n0 query tokens only (same positions).
        n0 = int(min(256, q_lens[0]))
        q_all, k_pool, v_pool, tabs = inputs[:4]
        with jax.default_matmul_precision("highest"):  # XLA would use TF32 for the f32 reference
            ref_out, (ref_m, ref_l) = rp.ragged_prefill_reference(
                q_all[:n0], k_pool, v_pool, tabs[:1], jnp.asarray([cached[0] + n0], jnp.int32),
                jnp.asarray([0, n0], jnp.int32), return_residuals=True)
        try:
            out, (m, l) = _ours(residuals=True)(*inputs)
            extra = dict(
                max_err_vs_reference=float(jnp.max(jnp.abs(out[:n0].astype(jnp.float32) - ref_out.astype(jnp.float32)))),
                residual_err=max(float(jnp.max(jnp.abs(m[:n0] - ref_m))), float(jnp.max(jnp.abs(l[:n0] / ref_l - 1)))),
                finite=bool(jnp.all(jnp.isfinite(out.astype(jnp.float32)))))
        except Exception as e:
            rec(what=name, impl="ours", config="default", error=(type(e).__name__ + ": " + str(e))[:300])
            continue
        attempt(name, "ours", "default", _ours(), inputs, flops, **extra)
        if name == "prefill16k_gqa_32q_8kv":
            qq, kk, vv = inputs[0][None], _seq_major(inputs[1], inputs[3], 16384), _seq_major(inputs[2], inputs[3], 16384)
            attempt(name, "cudnn", "", cudnn, (qq, kk, vv), flops)
            attempt(name, "mha", "default", jax.jit(lambda q, k, v: fa.mha(
                q, jnp.repeat(k, H // 8, axis=2), jnp.repeat(v, H // 8, axis=2), None, sm_scale=D ** -0.5,
                causal=True)), (qq, kk, vv), flops)
        del inputs
    device = harness.device_kind()
    path = os.path.join(args.out, harness.result_stem(device, "ragged-prefill-check") + ".json")
    harness.write_json(path, dict(script="scripts/check_ragged_prefill_gpu.py", argv=sys.argv[1:], device=device,
                                  date=harness.today(), hbm_floor_tb_s=harness.hbm_floor_tb_s(device), rows=rows))
    print("wrote", path, flush=True)
    _print_table(rows)
    return rows


def _print_table(rows):
    """One line per entry; ratios to mha's defaults and to cuDNN on the same case where both exist."""
    base = {}
    for r in rows:
        if "TFLOPs" in r and r["impl"] in ("mha", "cudnn") and r.get("config") in ("default", ""):
            base[(r["what"], r["impl"])] = r["TFLOPs"]
    print(f"\n{'case':32} {'impl':9} {'config':34} {'ms':>8} {'TFLOP/s':>8} {'x mha':>6} {'x cudnn':>7} {'err':>8}")
    for r in rows:
        if "ratio" in r:
            print(f"{r['what']:32} A/B median ms: ours {r['ms_ours']:.3f}, baseline {r['ms_baseline']:.3f}, "
                  f"ours / baseline {r['ratio']:.3f}, max diff {r['max_diff_vs_baseline']:.4f}")
            continue
        if "ms_split" in r:
            print(f"{r['what']:32} {r['parts']} parts ({r['rows']} rows) merged vs unsplit: "
                  f"max err {r['max_err']:.4f}, residual err {r['residual_err']:.2e}, finite {r['finite']}; ms split {r['ms_split']:.3f} "
                  f"whole {r['ms_whole']:.3f}")
            continue
        if "TFLOPs" not in r:
            print(f"{r['what']:32} {r['impl']:9} {str(r.get('config', '')):34} {r.get('error', '')[:60]}")
            continue
        key = r["what"] if (r["what"], "mha") in base else ("prefill16k" if r["what"] != "prefill4k" else r["what"])
        mha, cud = base.get((key, "mha")), base.get((r["what"], "cudnn"), base.get((key, "cudnn")))
        err = r.get("max_err", r.get("max_err_vs_reference"))
        print(f"{r['what']:32} {r['impl']:9} {str(r.get('config', '')):34} {r['ms']:8.3f} {r['TFLOPs']:8.1f} "
              f"{(r['TFLOPs'] / mha if mha else float('nan')):6.2f} {(r['TFLOPs'] / cud if cud else float('nan')):7.2f} "
              f"{(err if err is not None else float('nan')):8.4f}")


if __name__ == "__main__":
    main()
