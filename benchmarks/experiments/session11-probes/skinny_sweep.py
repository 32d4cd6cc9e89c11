"""Probe: the skinny matmul's schedule per weight shape, timed inside the real batch-1 decode step.

Runs scripts/profile_decode_step.py with `pallas_kernels.skinny_matmul.default_block_sizes` replaced
for the shapes named in SKINNY (the others keep the default), e.g.

  SKINNY='4096x4096:128,64,8,4,3;11008x4096:128,64,8,4,3' PROBE_TAG=b \
    python3 benchmarks/experiments/session11-probes/skinny_sweep.py --contexts 1024

(block_n, block_k, k_splits, num_warps, num_stages per K x N). The JSON (profile_decode_step's, with
the SKINNY spec added) goes to $OUT/skinny_sweep-<tag>.json. Session 2's isolated sweep
(benchmarks/results/nvidia-h200-2026-11-22-0158-skinny-matmul.json) had differences of up to 10% between
runs of one config; the step's trace times each matmul where the engine runs it.
"""
import json
import os
import sys

sys.path.insert(0, "scripts")
import pallas_kernels.skinny_matmul as sm  # noqa: E402

_default = sm.default_block_sizes


def _parse(spec: str) -> dict:
    out = {}
    for part in filter(None, spec.split(";")):
        shape, cfg = part.split(":")
        k, n = (int(v) for v in shape.split("x"))
        bn, bk, splits, warps, stages = (int(v) for v in cfg.split(","))
        out[(k, n)] = sm.SkinnyBlockSizes(block_n=bn, block_k=bk, k_splits=splits, num_warps=warps,
                                         num_stages=stages)
    return out


SPEC = _parse(os.environ.get("SKINNY", ""))


def _patched(m, k, n, **kwargs):
    return SPEC.get((k, n)) or _default(m, k, n, **kwargs)


sm.default_block_sizes = _patched

if __name__ == "__main__":
    import profile_decode_step

    tag = os.environ.get("PROBE_TAG", "default")
    out_dir = os.environ.get("OUT", "/tmp")
    tmp = os.path.join(out_dir, f"_profile_{tag}")
    os.makedirs(tmp, exist_ok=True)
    rc = profile_decode_step.main(sys.argv[1:] + ["--out", tmp])
    for name in os.listdir(tmp):
        if name.endswith(".json"):
            data = json.load(open(os.path.join(tmp, name)))
            data["skinny_spec"] = os.environ.get("SKINNY", "")
            json.dump(data, open(os.path.join(out_dir, f"skinny_sweep-{tag}.json"), "w"), indent=1)
            rows = data["rows"][0]
            top = {t["name"]: round(t["us_per_step"] / t["calls_per_step"], 2) for t in rows["trace"]["top"][:9]}
            print(tag, os.environ.get("SKINNY", ""), "kernel ms/step", round(rows["trace"]["kernel_ms_per_step"], 4),
                  "pipelined ms", round(rows["pipelined_ms"], 4), top, flush=True)
    sys.exit(rc)
