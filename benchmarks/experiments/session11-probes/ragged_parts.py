"""Probe: which part of the benchmark's ragged prefill batch costs the Mosaic kernel its efficiency?

In `...-1513-mosaic-prefill.json` Mosaic ran the ragged batch at 559 TFLOP/s against 590 on a 16K single
(-5%) while Triton ran both at 436-440, so the ragged ratio to Triton (1.27) sat below the singles' (1.35).
The per-CTA start and end (session 7: ~2.3 us a CTA) explain ~1% of that. Here the ragged batch's groups are
timed in parts, with the same method as `scripts/bench_mosaic_prefill.py` (settled turns, Mosaic, cuDNN and
Triton in one measure_interleaved): the sequences after a cached prefix alone, those without one alone, the
short ones, the two 8K-after-8K sequences, and a 16K single beside them.

Run from the repository root on the GPU machine: python3 benchmarks/experiments/session11-probes/ragged_parts.py
(JSON to $OUT/ragged_parts.json). With --order (the second run): the no-prefix group, the whole batch and
the 16K single, twice, each also with the work list in packed (sequence-major) order instead of heaviest
first (row `mosaic 128x2 in order`; JSON to $OUT/ragged_parts-order.json).
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
    cases, extra, tag = CASES, (), ""
    if "--order" in sys.argv:  # the second run: packed (sequence-major) order beside heaviest-first, twice
        keep = ("no prefix (16 seqs)", "ragged (all 32)", "single 16K")
        cases = [c for c in CASES if c[0] in keep] * 2
        extra, tag = (MosaicPrefillConfig(heaviest_first=False),), "-order"
    for i, (case, groups) in enumerate(cases):
        if extra:
            case = f"{case} #{i // 3 + 1}"
        run_case(bench, case, groups, (32, 32, 128), 256, MosaicPrefillConfig(), extra)
        rows = [r for r in bench.rows["prefill"] if r.get("case") == case and "tflops" in r]
        print(case, {r["impl"]: (r["tflops"], r.get("gpu", {}) and r["gpu"].get("sm_mhz")) for r in rows}, flush=True)
    out = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=bench.rows["prefill"])
    json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), f"ragged_parts{tag}.json"), "w"), indent=1,
              default=str)


if __name__ == "__main__":
    main()
