"""Probe (issue 32): ragged_decode's time at a tensor shard's few KV heads, by work items a head.

  XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONPATH=$PWD python3 scripts/probe_decode_merge.py --out $OUT

Batch 1, rBlocks of 256, bf16, head_dim 128, for (query heads, KV heads) of a shard: 70B at TP 1/2/4/8 (64/8,
32/4, 16/2, 8/1), 13B at TP 4 (10/10), 8B (32/8), 7B (32/32); contexts 4K, 32K, 128K. Each DecodeBlockSizes
variant (target_programs / short_target_programs) is timed from a trace (kernel time only), over 8 KV buffers
in turn so a short context is not read from L2. Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

from common import harness
from common.attention_cases import consecutive_tables
from common.device_trace import kernel_times
from pallas_kernels.ragged_decode import DecodeBlockSizes, ragged_decode, ragged_decode_reference

SHAPES = {"70b-tp1": (64, 8), "70b-tp2": (32, 4), "70b-tp4": (16, 2), "70b-tp8": (8, 1), "13b-tp4": (10, 10),
          "8b": (32, 8), "7b": (32, 32)}
BLOCK = 256
BUFFERS = 8


def variants(extra: list[str], targets: list[int]) -> dict[str, DecodeBlockSizes]:
    out = {"default": DecodeBlockSizes()}
    for t in targets:
        out[f"tp{t}"] = DecodeBlockSizes(target_programs=t, short_target_programs=min(t, 512))
    for spec in extra:  # name=field:value,field:value
        name, fields = spec.split("=")
        kw = {k: int(v) for k, v in (f.split(":") for f in fields.split(","))}
        out[name] = DecodeBlockSizes(**kw)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    p.add_argument("--extra", nargs="*", default=[], help="more variants: name=field:value,...")
    p.add_argument("--targets", type=int, nargs="*", default=[64, 128, 256, 512], help="target_programs variants")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=harness.RESULTS_DIR)
    args = p.parse_args(argv)
    device = harness.device_kind()
    result = {"script": "scripts/probe_decode_merge.py (git history)", "device": device, "date": harness.today(),
              "jax": jax.__version__, "argv": sys.argv[1:], "rows": []}
    path = f"{args.out}/{harness.result_stem(device, 'probe-decode-merge.json', result['date'])}"
    rng = np.random.default_rng(0)
    for shape in args.shapes:
        hq, hkv = SHAPES[shape]
        for context in args.contexts:
            blocks = -(-context // BLOCK)
            table = jnp.asarray(consecutive_tables([blocks], 131072 // BLOCK + 4))
            lens = jnp.asarray([context], jnp.int32)
            pools = [(jnp.asarray(rng.standard_normal((blocks, hkv, BLOCK, 128), np.float32), jnp.bfloat16),
                      jnp.asarray(rng.standard_normal((blocks, hkv, BLOCK, 128), np.float32), jnp.bfloat16))
                     for _ in range(BUFFERS)]
            q = jnp.asarray(rng.standard_normal((1, hq, 128), np.float32), jnp.bfloat16)
            with jax.default_matmul_precision("highest"):
                ref = np.asarray(ragged_decode_reference(q.astype(jnp.float32), *pools[0], table, lens), np.float32)
            row = {"shape": shape, "q_heads": hq, "kv_heads": hkv, "context": context, "us": {}, "max_err": {}}
            for name, sizes in variants(args.extra, args.targets).items():
                fn = jax.jit(lambda q, pools, s=sizes: [ragged_decode(q, k, v, table, lens, block_sizes=s)
                                                        for k, v in pools])
                outs = fn(q, pools)
                row["max_err"][name] = float(np.max(np.abs(np.asarray(outs[0], np.float32) - ref)))
                times = kernel_times(lambda: fn(q, pools), args.reps)
                us = sum(t for k, t in times.items() if "ragged_decode" in k) / BUFFERS
                row["us"][name] = us
            kv_bytes = 2 * context * hkv * 128 * 2
            row["floor_us"] = kv_bytes / 4.8e6
            best = min(row["us"], key=row["us"].get)
            print(f"{shape:8} {context:>7}: floor {row['floor_us']:6.1f} us; " +
                  " ".join(f"{k} {v:6.1f}" for k, v in row["us"].items()) + f"  best {best}; max err vs the reference "
                  f"{max(row['max_err'].values()):.3g}", flush=True)
            result["rows"].append(row)
            harness.write_json(path, result)
            del pools
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
