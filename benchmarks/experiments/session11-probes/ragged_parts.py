"""Probe: which part of the benchmark's ragged prefill batch costs the Mosaic kernel its efficiency?

In `...-1513-mosaic-prefill.json` Mosaic ran the ragged batch at 559 TFLOP/s against 590 on a 16K single
(-5%) while Triton ran both at 436-440, so the ragged ratio to Triton (1.27) sat below the singles' (1.35).
The per-CTA start and end (session 7: ~2.3 us a CTA) explain ~1% of that. Here the ragged batch's groups are
timed in parts, with the same method as `scripts/bench_mosaic_prefill.py` (settled turns, Mosaic, cuDNN and
Triton in one measure_interleaved): the sequences after a cached prefix alone, those without one alone, the
short ones, the two 8K-after-8K sequences, and a 16K single beside them.

Run from the repository root on the GPU machine: python3 benchmarks/experiments/session11-probes/ragged_parts.py
(JSON to $OUT/ragged_parts.json).
"""
import json
import os
import sys

sys.path.insert(0, "scripts")
import jax  # noqa: E402

import bench_attention as ba  # noqa: E402
from bench_mosaic_prefill import K, RAGGED_GROUPS, run_case  # noqa: E402
from pallas_kernels import compat  # noqa: E402
from pallas_kernels.ragged_prefill_mgpu import MosaicPrefillConfig  # noqa: E402

CASES = (
    ("single 16K", ((1, 16 * K, 0),)),
    ("after a prefix (16 seqs)", tuple(g for g in RAGGED_GROUPS if g[2])),
    ("no prefix (16 seqs)", tuple(g for g in RAGGED_GROUPS if not g[2])),
    ("2 x 8K after 8K", ((2, 8 * K, 8 * K),)),
    ("short (17 seqs, <= 1K query tokens)", tuple(g for g in RAGGED_GROUPS if g[1] <= K)),
    ("ragged (all 32)", RAGGED_GROUPS),
)


def main():
    compat.silence_triton_deprecation()
    plan = ba.Plan(ref_rows=64, reps=5, target_s=0.4, budget_s=400.0)
    bench = ba.Bench(plan, interpret=False)
    for case, groups in CASES:
        run_case(bench, case, groups, (32, 32, 128), 256, MosaicPrefillConfig())
        rows = [r for r in bench.rows["prefill"] if r.get("case") == case and "tflops" in r]
        print(case, {r["impl"]: (r["tflops"], r.get("gpu", {}) and r["gpu"].get("sm_mhz")) for r in rows}, flush=True)
    out = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=bench.rows["prefill"])
    json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "ragged_parts.json"), "w"), indent=1,
              default=str)


if __name__ == "__main__":
    main()
