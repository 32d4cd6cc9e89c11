"""GPU correctness sweep of the Mosaic GPU ragged prefill kernel against ragged_prefill_reference.

  PYTHONPATH=$PWD python3 scripts/check_ragged_prefill_mgpu_gpu.py [--out DIR] [--seed N]

Random ragged batches (fresh seed each run, printed and saved): mixed query lengths (decode rows,
block edges, long prompts), cached prefixes of random sizes, fragmented block tables (rBlocks
shuffled in the pool), padding tokens past cu_q_lens[-1] filled with NaN, bf16 and fp16, GQA
1/4/8, head_dim 64/128, rBlocks of 128..512. Every pool row no sequence owns is NaN, so a kernel
that lets stale KV into a result fails. Output, row max and row sum are all checked; exit 1 on any
failure. Writes `<device>-<date>-<HHMM>-check-mosaic-prefill.json` under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_prefill import ragged_prefill_reference
from pallas_kernels.ragged_prefill_mgpu import MosaicPrefillConfig, mgpu_supported, ragged_prefill_mgpu
from pallas_kernels.testing import poisoned_ragged_batch
from scripts.common import harness

# |out - ref| per dtype (approximate exp2 on the GPU, p rounded to the input dtype for P @ V).
_OUT_TOL = {"bfloat16": 4e-2, "float16": 8e-3}
_MAX_TOL = 2e-3  # row max, relative to 1 + |ref|
_SUM_TOL = 5e-3  # row sum, relative


def make_batch(rng, *, q_lens, cached, heads, kv_heads, head_dim, block_size, dtype, padding=7):
    """Kernel inputs over a shuffled pool whose unowned rows (and padding query tokens) are NaN."""
    return poisoned_ragged_batch(rng, q_lens=q_lens, cached=cached, block_size=block_size, head_dim=head_dim,
                                 num_kv_heads=kv_heads, num_q_heads=heads, dtype=dtype, padding=padding,
                                 spare_blocks=5)


def cases(rng):
    """(name, batch kwargs, config) with random lengths; the fixed ones hit the edges."""
    def rand_lens(n, lo, hi):
        return rng.integers(lo, hi + 1, n).tolist()

    out = []
    for i, (dtype, heads, kv_heads, d, bs) in enumerate([
            (jnp.bfloat16, 8, 8, 128, 256), (jnp.float16, 16, 4, 128, 128), (jnp.bfloat16, 32, 4, 64, 512),
            (jnp.float16, 8, 1, 128, 256), (jnp.bfloat16, 16, 2, 128, 128), (jnp.float16, 8, 8, 64, 256)]):
        n = int(rng.integers(3, 9))
        q_lens = rand_lens(n, 1, 900)
        cached = [int(c) if rng.random() < 0.5 else 0 for c in rng.integers(0, 2000, n)]
        q_lens[0], cached[0] = 1, int(rng.integers(1, 3000))  # a decode row after a long prefix
        if i == 0:
            q_lens[1:4], cached[1:4] = [64, 65, 128], [0, 63, 128]  # block and tile edges
        out.append((f"random {i}", dict(q_lens=q_lens, cached=cached, heads=heads, kv_heads=kv_heads, head_dim=d,
                                        block_size=bs, dtype=dtype)))
    out.append(("single 2048 fresh", dict(q_lens=[2048], cached=[0], heads=8, kv_heads=8, head_dim=128,
                                          block_size=256, dtype=jnp.bfloat16)))
    out.append(("chunk 1000 after 3333", dict(q_lens=[1000], cached=[3333], heads=32, kv_heads=4, head_dim=128,
                                              block_size=256, dtype=jnp.float16)))
    return out


def check(name, args, config=None, residuals=True):
    q, *_ = args
    n = int(args[5][-1])
    t0 = time.perf_counter()
    res = jax.block_until_ready(ragged_prefill_mgpu(*args, return_residuals=residuals, config=config))
    secs = time.perf_counter() - t0
    ref_out, (ref_m, ref_l) = ragged_prefill_reference(*args, return_residuals=True)
    out, (m, l) = res if residuals else (res, (ref_m, ref_l))
    f32 = lambda x: np.asarray(x, np.float32)
    err = float(np.abs(f32(out[:n]) - f32(ref_out[:n])).max(initial=0))
    m_err = float((np.abs(f32(m[:n]) - f32(ref_m[:n])) / (1 + np.abs(f32(ref_m[:n])))).max(initial=0))
    l_err = float((np.abs(f32(l[:n]) / f32(ref_l[:n]) - 1)).max(initial=0))
    pad_ok = bool(np.all(f32(out[n:]) == 0) and (not residuals or (np.all(np.isneginf(f32(m[n:])))
                                                                 and np.all(f32(l[n:]) == 0))))
    tol = _OUT_TOL[jnp.dtype(q.dtype).name]
    ok = err <= tol and m_err <= _MAX_TOL and l_err <= _SUM_TOL and pad_ok and np.isfinite(err)
    row = dict(case=name, tokens=n, heads=f"{q.shape[1]}/{args[1].shape[1]}x{q.shape[2]}", dtype=str(q.dtype),
               block_size=int(args[1].shape[2]), residuals=residuals, max_abs_err=err, row_max_err=m_err,
               row_sum_rel_err=l_err, padding_ok=pad_ok, tol=tol, first_call_s=round(secs, 2), ok=bool(ok))
    print(("PASS " if ok else "FAIL ") + json.dumps(row), flush=True)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      "benchmarks", "results"))
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--case", default="", help="only cases whose name contains this (a quick probe)")
    parser.add_argument("--no-residuals", action="store_true", help="check without residuals only")
    args = parser.parse_args(argv)
    seed = int(time.time()) if args.seed is None else args.seed
    rng = np.random.default_rng(seed)
    device = harness.device_kind()
    print(f"jax {jax.__version__}, {device}, seed {seed}", flush=True)
    probe = jnp.zeros((1, 1, 128), jnp.bfloat16)
    if not mgpu_supported(probe, jnp.zeros((1, 1, 128, 128), jnp.bfloat16)):
        print("the Mosaic GPU kernel does not apply on this device (needs a Hopper GPU)")
        return 1
    rows = []
    for name, kw in cases(rng):
        if args.case not in name:
            continue
        batch = make_batch(rng, **kw)
        modes = (True, False) if name == "random 0" else (True,)
        for residuals in ((False,) if args.no_residuals else modes):
            try:
                rows.append(check(name, batch, residuals=residuals))
            except Exception as e:  # keep checking the other cases
                traceback.print_exc()
                rows.append(dict(case=name, ok=False, error=f"{type(e).__name__}: {str(e)[:2000]}"))
                print("FAIL", name, rows[-1]["error"][:2000], flush=True)
    if args.case:
        print(json.dumps(rows), flush=True)
        return 0 if all(r["ok"] for r in rows) else 1
    try:  # block_kv 64 and arrival order
        batch = make_batch(rng, **cases(rng)[1][1])
        rows.append(check("random 1, block_kv 64, packed order",
                          batch, config=MosaicPrefillConfig(block_kv=64, heaviest_first=False)))
    except Exception as e:
        traceback.print_exc()
        rows.append(dict(case="block_kv 64", ok=False, error=f"{type(e).__name__}: {str(e)[:2000]}"))
    passed = sum(r["ok"] for r in rows)
    print(f"{passed}/{len(rows)} passed", flush=True)
    harness.write_json(os.path.join(args.out, harness.result_stem(device, "check-mosaic-prefill.json")),
                       dict(script="scripts/check_ragged_prefill_mgpu_gpu.py", device=device, jax=jax.__version__,
                            seed=seed, rows=rows))
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
