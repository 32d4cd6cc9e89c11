"""Probe (issue 32): XLA / NCCL settings against the product's, through the engine, each variant in its own process.

  XLA_PYTHON_CLIENT_MEM_FRACTION=0.94 PYTHONPATH=$PWD python3 scripts/probe_tp_variants.py --model llama2-13b \\
      --context 4096 --order base symmetric base userbuf blocknorm base --out $OUT

Each variant runs `scripts/bench_mesh.py --parts tensor --tp-sizes --tp-model MODEL --tp-contexts CONTEXT` (one
engine over every device, batch 1, no mixed load) with its environment added: XLA_FLAGS it names are kept and the
product's tensor-parallel flags are added beside them (sharding.xla_flags). Listing `base` several times measures the
spread between processes, which at 13B TP 4 was 0.4 ms. Writes one JSON with every run's ms/token, its XLA_FLAGS,
and the end of its log where it failed. NCCL's NVLink multicast stays off: the device image sets
NCCL_NVLS_ENABLE=0 and no variant touches it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

from common import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VARIANTS: dict[str, dict[str, str]] = {  # name: environment added to the run's
    "base": {},
    "symmetric": {"XLA_FLAGS": "--xla_gpu_experimental_enable_nccl_symmetric_buffers=true"},
    "userbuf": {"XLA_FLAGS": "--xla_gpu_enable_nccl_user_buffers=true"},
    "blocknorm": {"XLA_FLAGS": "--xla_gpu_experimental_enable_fusion_block_level_rewriter=true"},
    "oneshot": {"XLA_FLAGS": "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true"},
    "nccl_ll": {"NCCL_PROTO": "LL"},
    "tree": {"NCCL_ALGO": "allreduce:tree"},  # per-collective: the engine's int8 all-gather has no tree
}


def run_variant(name: str, args, out_dir: str) -> dict:
    env = dict(os.environ)
    extra = VARIANTS[name]
    for key, value in extra.items():
        env[key] = " ".join([env.get(key, ""), value]).strip() if key == "XLA_FLAGS" else value
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    command = [sys.executable, os.path.join(ROOT, "scripts/bench_mesh.py"), "--parts", "tensor", "--tp-sizes",
               "--tp-model", args.model, "--tp-contexts", str(args.context), "--tp-mixed-requests", "0",
               "--tp-num-blocks", str(args.num_blocks), "--new-tokens", str(args.new_tokens), "--tp-xla-flags",
               "--out", out_dir, *(["--dry-run"] if args.dry_run else [])]
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
        code, log = proc.returncode, proc.stderr + proc.stdout
    except subprocess.TimeoutExpired as e:
        code, log = "timeout", (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else str(e)
    row = {"variant": name, "env": extra, "returncode": code, "wall_s": time.perf_counter() - start}
    paths = sorted(glob.glob(os.path.join(out_dir, "*mesh-x*.json")))
    if paths:
        result = json.loads(open(paths[-1]).read())
        tensor = result.get("tensor", {})
        row.update(device=result.get("device"), devices=result.get("devices"), xla_flags=result.get("xla_flags"))
        row["rows"] = [{k: r[k] for k in ("context", "decode_ms_per_token", "spread", "floor_ms", "x_floor")}
                       for r in tensor.get("rows", [])]
        row["tensor_parallel"] = tensor.get("tensor_parallel")
    if code != 0 or not row.get("rows"):
        row["log_tail"] = log[-3000:]
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama2-13b")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--order", nargs="+", default=["base", "symmetric", "base", "userbuf", "blocknorm", "base"],
                   choices=list(VARIANTS), help="variants in the order they run (repeat base for the spread)")
    p.add_argument("--num-blocks", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a variant may take")
    p.add_argument("--dry-run", action="store_true", help="bench_mesh's dry run (tiny model, CPU host devices)")
    p.add_argument("--out", default=harness.RESULTS_DIR)
    args = p.parse_args(argv)
    # This process never starts JAX: its backend would take the GPUs' memory from the variants' processes. The
    # device is named by the first run that reports one.
    result = {"script": "scripts/probe_tp_variants.py (git history)", "argv": sys.argv[1:], "device": None,
              "date": harness.today(), "model": args.model, "context": args.context, "variants": VARIANTS, "runs": []}
    stamp = time.strftime("%H%M", time.gmtime())
    for name in args.order:
        with tempfile.TemporaryDirectory() as out_dir:
            row = run_variant(name, args, out_dir)
        result["runs"].append(row)
        result["device"] = result["device"] or row.get("device")
        device = (result["device"] or "unknown").lower().replace(" ", "-")
        path = os.path.join(args.out, f"{device}-{result['date']}-{stamp}-probe-tp-variants.json")
        harness.write_json(path, result)  # after each run: a call cut short keeps what it measured
        ms = ", ".join(f"{r['context']}: {r['decode_ms_per_token']:.2f} ms ({r['x_floor'] or 0:.2f}x)"
                       for r in row.get("rows", [])) or f"no row (exit {row['returncode']})"
        print(f"{name:10} {ms}  [{row['wall_s']:.0f} s]", flush=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
