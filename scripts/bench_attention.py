"""Attention benchmark (issue 3): our ragged kernels beside cuDNN, XLA and JAX's own Pallas kernels, one run.

  XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONPATH=$PWD python3 scripts/bench_attention.py [--out DIR]
  PYTHONPATH=$PWD python scripts/bench_attention.py --smoke --out /tmp   # tiny sizes, CPU interpret mode

bf16 throughout, fresh random inputs, Llama-2-7B heads unless said otherwise:
 1. decode, 32 q / 32 kv heads x 128, batch 1 at 32K/128K/512K and batch 8 at 32K/128K: ragged_decode on
    consecutive rBlock tables vs cuDNN and XLA (`jax.nn.dot_product_attention` on seq-major [B, T, H, D]
    KV, one query token) and JAX's Pallas `decode_attention.gqa` (the same seq-major input, its layout).
 2. decode of a ragged batch: 16 sequences, 64 q / 8 kv heads, lengths log-uniform in 1K..256K (seed 0,
    the first at 256K): ours vs cuDNN given `key_value_seq_lengths` over a padded buffer, `gqa` given
    `kv_seq_len`, and JAX's Pallas decode kernel fed head-major padded KV (`decode_attn_unbatched`).
 3. decode on fragmented tables (rBlocks shuffled in the pool) vs consecutive tables, per rBlock size.
 4. causal ragged prefill, 32 x 128 heads: packed groups of sequences (some after a cached prefix) and
    single sequences, vs JAX's Pallas `attention.mha` and cuDNN, which run each group as a dense batch;
    a group after a prefix runs as two calls (non-causal over the prefix, causal over the new tokens)
    merged by log-sum-exp. TFLOP/s count the real causal work, 4 * H * D * visible (query, key) pairs,
    for every implementation.
Each timed function runs attention over up to 4 separate KV buffers inside one jit (like layers of a
model step), so dispatch is amortised and every buffer exceeds L2; time per call = median over reps of
(elapsed / calls / buffers). The implementations of one case are timed in turns (each rep runs every one
once, in rotated order), not one after another: on an H200 the same kernel measured 3-5% faster when it
ran first after a pause than after the others' runs, which favoured whichever went first; and each
timed batch follows an untimed batch of the same implementation, so none is timed in the clock and power
state another left behind (see harness.Bench.measure_interleaved). Writes `<device>-<date>-<HHMM>-attention[-sections].json`
and `.md` under --out
(default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import compat
from pallas_kernels.ragged_decode import DecodeBlockSizes, ragged_decode, ragged_decode_reference
from pallas_kernels.ragged_prefill import ragged_prefill
from scripts.common import harness
from scripts.common.attention_cases import (mha_part, peer_prefill, pool_from_dense, prefill_errors,
                                            prefill_problem, reference_rows, sdpa_part)
from scripts.common.harness import gpu_state_table, ratio as _ratio, row_value as _get

K, M = 1024, 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Plan:
    """Sizes of one run; SMOKE shrinks every case to CPU interpret-mode size."""

    decode_heads: tuple[int, int, int] = (32, 32, 128)  # (q heads, kv heads, head_dim)
    decode_cases: tuple[tuple[int, int], ...] = ((1, 32 * K), (1, 128 * K), (1, 512 * K), (8, 32 * K), (8, 128 * K))
    decode_block: int = 1024
    ragged_seqs: int = 16
    ragged_range: tuple[int, int] = (1 * K, 256 * K)
    ragged_heads: tuple[int, int, int] = (64, 8, 128)
    frag_batch: int = 1
    frag_context: int = 128 * K
    frag_blocks: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048)
    prefill_heads: tuple[int, int, int] = (32, 32, 128)
    prefill_block: int = 256
    # name -> groups of (sequences, query tokens each, cached prefix each); all multiples of 128 for mha.
    prefill_cases: tuple = (
        ("mixed 4K", ((1, 2048, 0), (2, 512, 1536), (4, 256, 0))),
        ("mixed 16K", ((1, 8192, 0), (2, 2048, 4096), (8, 512, 0))),
        ("single 4K", ((1, 4096, 0),)),
        ("single 16K", ((1, 16384, 0),)),
    )
    ref_rows: int = 256  # prefill rows checked against a float32 reference, per group
    layer_bytes: float = 4e9  # separate KV buffers per timed step while their K+V stay under this
    max_layers: int = 4
    reps: int = 7
    target_s: float = 0.35  # timed seconds per measurement, all reps together
    budget_s: float = 430.0  # skip what is left past this, so the run ends inside its device limit
    settle: bool = True  # an untimed batch before each timed one in measure_interleaved


SMOKE = Plan(
    decode_heads=(4, 4, 128), decode_cases=((1, 2 * K), (2, 1 * K)), decode_block=256,
    ragged_seqs=4, ragged_range=(64, 1 * K), ragged_heads=(8, 2, 128),
    frag_context=1 * K, frag_blocks=(16, 64, 256),
    prefill_heads=(2, 2, 128), prefill_block=64,
    prefill_cases=(("mixed 512", ((1, 256, 0), (2, 64, 128))), ("single 256", ((1, 256, 0),))),
    ref_rows=64, reps=1, target_s=0.0, budget_s=1e9,
)


class AttentionBench(harness.Bench):
    """harness.Bench with our decode kernel's schedule (None: its default) for the decode sections."""

    def __init__(self, plan: Plan, interpret: bool, hbm_tb_s: float | None, decode_sizes: DecodeBlockSizes | None = None):
        super().__init__(plan, interpret, hbm_tb_s=hbm_tb_s)
        self.decode_sizes = decode_sizes


def _sdpa(impl, with_lengths):
    def fn(shared, layer):
        q, lens = shared
        kw = dict(key_value_seq_lengths=lens) if with_lengths else {}
        return jax.nn.dot_product_attention(q[:, None], *layer, implementation=impl, **kw)[:, 0]
    return fn


def _decode_peers(bench: AttentionBench, section, case, with_lengths) -> list[dict]:
    """Entries for measure_interleaved: cuDNN (the reference on a GPU; a skip row elsewhere), XLA and
    Pallas gqa on seq-major KV, shared = (q, lens), layers = [(k, v)] seq-major. The first entry's
    output is the others' reference."""
    from jax.experimental.pallas.ops.gpu import decode_attention as da

    entries = []
    if compat.on_gpu():
        entries.append(dict(impl="cudnn", fn=_sdpa("cudnn", with_lengths)))
    else:
        bench.skip(section, case, "cudnn", "needs a GPU")
    entries.append(dict(impl="xla", fn=_sdpa("xla", with_lengths)))
    gqa = lambda s, l: da.gqa(s[0], *l, kv_seq_len=s[1], interpret=bench.interpret)
    entries.append(dict(impl="pallas_gqa", fn=gqa,
                        note="seq-major KV; the wrapper transposes it to head-major on every call"))
    for i, e in enumerate(entries):
        if i:
            e["ref"] = "first"
    return entries


def decode_section(bench: AttentionBench):
    hq, hkv, d = bench.plan.decode_heads
    block = bench.plan.decode_block
    for batch, ctx in bench.plan.decode_cases:
        case = f"batch {batch}, {ctx // K}K"
        if bench.over_budget():
            bench.skip("decode", case, "all", "time budget")
            continue
        kv_bytes = 2 * batch * ctx * hkv * d * 2
        layers = int(np.clip(bench.plan.layer_bytes // kv_bytes, 1, bench.plan.max_layers))
        q = bench.normal((batch, hq, d))
        lens = jnp.full((batch,), ctx, jnp.int32)
        dense = [(bench.normal((batch, ctx, hkv, d)), bench.normal((batch, ctx, hkv, d))) for _ in range(layers)]
        pools = []
        for k, v in dense:
            kp, tables = pool_from_dense(k, lens, block)
            pools.append((kp, pool_from_dense(v, lens, block)[0]))
        entries = [dict(e, shared=(q, lens), layers=dense) for e in _decode_peers(bench, "decode", case, False)]
        ours = lambda s, l: ragged_decode(s[0], *l, s[1], s[2], block_sizes=bench.decode_sizes,
                                          interpret=bench.interpret)
        entries.append(dict(impl="ours", fn=ours, shared=(q, tables, lens), layers=pools, ref="first",
                            note=f"rBlock {block}, consecutive tables, {bench.decode_sizes or DecodeBlockSizes()}"))
        bench.measure_interleaved("decode", case, entries, kv_bytes=kv_bytes)
        del dense, pools, entries


def ragged_section(bench: AttentionBench):
    from jax.experimental.pallas.ops.gpu import decode_attention as da

    plan = bench.plan
    hq, hkv, d = plan.ragged_heads
    n, (lo, hi) = plan.ragged_seqs, plan.ragged_range
    rng = np.random.default_rng(0)  # the baseline's lengths (shared/baselines/scripts/ragged_and_prefill.py)
    lens_np = np.exp(rng.uniform(np.log(lo), np.log(hi), n)).astype(np.int32)
    lens_np[0] = hi
    case = f"{n} seqs, {hq}q/{hkv}kv, {lo // K or lo}..{hi // K}K"
    if bench.over_budget():
        bench.skip("ragged", case, "all", "time budget")
        return
    real_bytes = 2 * int(lens_np.sum()) * hkv * d * 2
    bench.rows["ragged"].append(dict(case=case, lengths=lens_np.tolist(), real_kv_gb=real_bytes / 1e9,
                                     padded_kv_gb=2 * n * hi * hkv * d * 2 / 1e9))
    q = bench.normal((n, hq, d))
    lens = jnp.asarray(lens_np)
    k, v = bench.normal((n, hi, hkv, d)), bench.normal((n, hi, hkv, d))  # padded; rows past a length are random
    entries = [dict(e, shared=(q, lens), layers=[(k, v)]) for e in _decode_peers(bench, "ragged", case, True)]

    def head_major(s, l, k_splits=32):
        inner = functools.partial(da.decode_attn_unbatched, sm_scale=1 / math.sqrt(d), block_h=16, block_k=128,
                                  k_splits=k_splits, num_warps=4, num_stages=2, grid=None,
                                  interpret=bench.interpret, debug=False, return_residuals=False,
                                  normalize_output=True)
        qg = s[0].reshape(n, hkv, hq // hkv, d)
        out = jax.vmap(jax.vmap(inner))(qg, *l, None, jnp.broadcast_to(s[1][:, None], (n, hkv)))
        return out.reshape(n, hq, d)

    hm = [(jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2))]  # [B, Hkv, S, D], built outside the timing
    entries.append(dict(impl="pallas_headmajor", fn=head_major, shared=(q, lens), layers=hm, ref="first",
                        note="JAX's decode kernel vmapped over padded head-major KV (block_k 128, k_splits 32)"))
    kp, tables = pool_from_dense(k, lens_np, plan.decode_block)
    vp = pool_from_dense(v, lens_np, plan.decode_block)[0]
    ours = lambda s, l: ragged_decode(s[0], *l, s[1], s[2], block_sizes=bench.decode_sizes, interpret=bench.interpret)
    entries.append(dict(impl="ours", fn=ours, shared=(q, tables, lens), layers=[(kp, vp)], ref="first",
                        note=f"rBlock {plan.decode_block}, consecutive tables; real KV only in the pool"))
    bench.measure_interleaved("ragged", case, entries, kv_bytes=real_bytes)
    del entries, hm, k, v, kp, vp


def fragmented_section(bench: AttentionBench):
    plan = bench.plan
    hq, hkv, d = plan.decode_heads
    batch, ctx = plan.frag_batch, plan.frag_context
    kv_bytes = 2 * batch * ctx * hkv * d * 2
    rng = np.random.default_rng(1)
    q = bench.normal((batch, hq, d))
    lens = jnp.full((batch,), ctx, jnp.int32)
    for block in plan.frag_blocks:
        case = f"batch {batch}, {ctx // K}K, rBlock {block}"
        if bench.over_budget():
            bench.skip("fragmented", case, "all", "time budget")
            continue
        nb = batch * ctx // block
        pool = (bench.normal((nb, hkv, block, d)), bench.normal((nb, hkv, block, d)))
        ours = lambda s, l: ragged_decode(s[0], *l, s[1], s[2], block_sizes=bench.decode_sizes, interpret=bench.interpret)
        entries = []
        for name, ids in (("consecutive", np.arange(nb)), ("fragmented", rng.permutation(nb))):
            tables = jnp.asarray(ids.reshape(batch, -1), jnp.int32)
            entries.append(dict(impl=name, fn=ours, shared=(q, tables, lens), layers=[pool],
                                ref=ragged_decode_reference(q, *pool, tables, lens),
                                note="error vs ragged_decode_reference (float32 gather through the table)"))
        bench.measure_interleaved("fragmented", case, entries, kv_bytes=kv_bytes)
        del entries


def prefill_section(bench: AttentionBench):
    plan = bench.plan
    for name, groups in plan.prefill_cases:
        tokens = sum(c * q for c, q, _ in groups)
        case = f"{name}: " + " + ".join(f"{c}x({q}" + (f" after {p})" if p else ")") for c, q, p in groups)
        if bench.over_budget():
            bench.skip("prefill", case, "all", "time budget")
            continue
        dense, packed, rows, flops = prefill_problem(bench.normal, groups, plan.prefill_heads, plan.prefill_block,
                                                     plan.ref_rows)
        refs = [reference_rows(*r) for r in rows]
        bench.rows["prefill"].append(dict(case=case, query_tokens=tokens, causal_flops=flops, groups=groups))
        packed_err, group_err = prefill_errors(groups, plan.ref_rows)
        peer_note = "dense causal batch per group; after a prefix: 2 calls merged by log-sum-exp"
        ours = lambda s, _: ragged_prefill(*s, interpret=bench.interpret)
        entries = [dict(impl="ours", fn=ours, shared=packed, layers=[()], ref=refs, err_of=packed_err,
                        note=f"one call over the packed batch, rBlock {plan.prefill_block}, consecutive tables"),
                   dict(impl="pallas_mha", fn=peer_prefill(mha_part(bench.interpret)), shared=dense, layers=[()],
                        ref=refs, err_of=group_err, note=peer_note)]
        if compat.on_gpu():
            entries.append(dict(impl="cudnn", fn=peer_prefill(sdpa_part("cudnn")), shared=dense, layers=[()],
                                ref=refs, err_of=group_err, note=peer_note + " (cuDNN returns the lse in bf16)"))
        else:  # the same code path through XLA, so the merge is checked without a GPU
            bench.skip("prefill", case, "cudnn", "needs a GPU")
            entries.append(dict(impl="xla", fn=peer_prefill(sdpa_part("xla")), shared=dense, layers=[()],
                                ref=refs, err_of=group_err, note=peer_note + "; stands in for cuDNN on a CPU"))
        bench.measure_interleaved("prefill", case, entries, flops=flops)
        del dense, packed, entries


def _cell(rows, case, impl, main, extra, fmt):
    value, other = _get(rows, case, impl, main), _get(rows, case, impl, extra)
    return "-" if value is None else fmt.format(value, other)


def summarize(result: dict) -> tuple[str, dict]:
    """Markdown tables for BENCHMARKS.md and the issue-3 target verdicts."""
    rows, lines, targets = result["sections"], [], {}
    f_us = "{:,.0f} ({:.2f})"
    hbm = result.get("hbm_floor_tb_s")  # None on a card without a known datasheet bandwidth

    def of_hbm(tb):
        return "-" if tb is None or hbm is None else f"{tb / hbm:.0%}"

    lines += [f"Device {result['device']}, jax {result['jax']}, {result['date']}; `{result['command']}`.", "",
              "Decode, 32 x 128 heads (MHA), bf16: us per call (TB/s of K+V read); x cuDNN = cuDNN time / ours.", "",
              f"| case | ours | cuDNN | XLA | Pallas gqa | ours x cuDNN | ours / {hbm or '?'} TB/s |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    dec = rows["decode"]
    for case in dict.fromkeys(r["case"] for r in dec):
        ours, cud = _get(dec, case, "ours", "us"), _get(dec, case, "cudnn", "us")
        tb = _get(dec, case, "ours", "tbps")
        lines.append(f"| {case} | " + " | ".join(_cell(dec, case, i, "us", "tbps", f_us)
                                                for i in ("ours", "cudnn", "xla", "pallas_gqa"))
                     + f" | {_ratio(cud, ours)} | {of_hbm(tb)} |")
        targets[f"decode {case}: >= 4.0 TB/s and >= 1.0x cuDNN"] = (
            None if tb is None or cud is None else bool(tb >= 4.0 and cud / ours >= 1.0))
    rag = rows["ragged"]
    if rag:
        info = rag[0]
        lines += ["", f"Ragged decode batch: {info['case']}, {info.get('real_kv_gb', 0):.2f} GB of real KV "
                  f"({info.get('padded_kv_gb', 0):.2f} GB padded for the dense kernels); TB/s of real KV.", "",
                  f"| kernel | us | TB/s (real KV) | ours x it | / {hbm or '?'} TB/s |", "| --- | --- | --- | --- | --- |"]
        ours = _get(rag, info["case"], "ours", "us")
        for impl in ("ours", "cudnn", "xla", "pallas_headmajor", "pallas_gqa"):
            us, tb = _get(rag, info["case"], impl, "us"), _get(rag, info["case"], impl, "tbps")
            if us is not None:
                lines.append(f"| {impl} | {us:,.0f} | {tb:.2f} | {_ratio(us, ours)} | {of_hbm(tb)} |")
        tb = _get(rag, info["case"], "ours", "tbps")
        targets["ragged 16: >= 3.5 TB/s of real KV"] = None if tb is None else bool(tb >= 3.5)
    frag = rows["fragmented"]
    if frag:
        lines += ["", "Fragmented (rBlocks shuffled in the pool) vs consecutive tables, ours, bf16, us (TB/s).", "",
                  "| case | consecutive | fragmented | fragmented / consecutive |", "| --- | --- | --- | --- |"]
        for case in dict.fromkeys(r["case"] for r in frag):
            c, f = _get(frag, case, "consecutive", "us"), _get(frag, case, "fragmented", "us")
            lines.append(f"| {case} | {_cell(frag, case, 'consecutive', 'us', 'tbps', f_us)} | "
                         f"{_cell(frag, case, 'fragmented', 'us', 'tbps', f_us)} | {_ratio(f, c)} |")
            block = int(case.rsplit(" ", 1)[1])
            if block >= 256:
                targets[f"fragmented within 5% of consecutive, {case}"] = None if c is None or f is None else bool(
                    f / c <= 1.05)
    pre = rows["prefill"]
    if pre:
        lines += ["", "Causal prefill, 32 x 128 heads, bf16: TFLOP/s of real causal work (ms); peers run each "
                  "group as a dense batch (after a cached prefix: non-causal over the prefix + causal over the new "
                  "tokens, merged).", "",
                  "| case | ours | Pallas mha | cuDNN | ours x mha | ours x cuDNN |", "| --- | --- | --- | --- | --- | --- |"]
        f_tf = "{:.0f} ({:.2f})"
        for case in dict.fromkeys(r["case"] for r in pre):
            ours, mha, cud = (_get(pre, case, i, "ms") for i in ("ours", "pallas_mha", "cudnn"))
            lines.append(f"| {case} | " + " | ".join(_cell(pre, case, i, "tflops", "ms", f_tf)
                                                    for i in ("ours", "pallas_mha", "cudnn"))
                         + f" | {_ratio(mha, ours)} | {_ratio(cud, ours)} |")
            targets[f"prefill {case.split(':')[0]}: >= 1.0x Pallas mha"] = (
                None if ours is None or mha is None else bool(mha / ours >= 1.0))
    lines += ["", "| issue-3 target | met |", "| --- | --- |"]
    lines += [f"| {k} | {'-' if v is None else ('yes' if v else 'NO')} |" for k, v in targets.items()]
    return "\n".join(lines) + "\n", targets


SECTIONS = {"decode": decode_section, "ragged": ragged_section, "prefill": prefill_section,
            "fragmented": fragmented_section}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=harness.RESULTS_DIR)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; on a CPU the kernels run interpreted")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS),
                        help="run only these parts (the file name then says which)")
    parser.add_argument("--decode-option", action="append", default=[], metavar="FIELD=INT",
                        help="a DecodeBlockSizes field for our decode kernel, e.g. num_stages=3 (repeatable)")
    args = parser.parse_args(argv)
    try:
        decode_sizes = dataclasses.replace(DecodeBlockSizes(), **{
            field: type(getattr(DecodeBlockSizes(), field))(int(value))
            for field, value in (o.split("=", 1) for o in args.decode_option)}) if args.decode_option else None
    except (AttributeError, TypeError, ValueError) as e:
        parser.error(f"--decode-option {args.decode_option}: {e}")
    compat.silence_triton_deprecation()
    plan = SMOKE if args.smoke else Plan()
    interpret = not compat.on_gpu()
    device = harness.device_kind()
    hbm = harness.hbm_floor_tb_s(device)
    print(f"jax {jax.__version__}, {jax.devices()}, interpret={interpret}, smoke={args.smoke}", flush=True)
    date = harness.today()
    stem = harness.result_stem(device, "attention" + ("-smoke" if args.smoke else ""), date)
    if set(args.sections) != set(SECTIONS):
        stem += "-" + "-".join(args.sections)
    os.makedirs(args.out, exist_ok=True)
    bench = AttentionBench(plan, interpret, hbm, decode_sizes)
    result = dict(script="scripts/bench_attention.py", argv=sys.argv[1:], device=device, date=date,
                  jax=jax.__version__, python=platform.python_version(), smoke=args.smoke, seed=bench.seed,
                  command="XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONPATH=$PWD python3 scripts/bench_attention.py"
                          + (" --smoke" if args.smoke else ""),
                  plan=dataclasses.asdict(plan), hbm_tbps_datasheet=hbm, hbm_floor_tb_s=hbm,
                  sections=bench.rows, definitions=dict(
                      us="median over reps of elapsed / calls / KV buffers, inside one jit per step",
                      tbps="bytes of K and V the call needs (real lengths only) / time",
                      x_cudnn="cuDNN time / this time (> 1: faster than cuDNN)",
                      tflops="4 * heads * head_dim * visible causal (query, key) pairs / time, same for every impl",
                      prefill_peers="each group of equal (query tokens, cached prefix) sequences runs as one dense "
                                    "[seqs, tokens, heads, head_dim] batch; after a cached prefix, as a non-causal "
                                    "call over the prefix plus a causal call over the new tokens, merged by "
                                    "log-sum-exp (residuals.merge_partials) inside the timed step",
                      max_abs_err="decode: vs cuDNN (XLA on a CPU); fragmented: vs ragged_decode_reference; "
                                  "prefill: vs a float32 reference on each group's first sequence's last rows"))
    path = os.path.join(args.out, stem)
    for name in args.sections:
        SECTIONS[name](bench)
        result["elapsed_s"] = round(time.time() - bench.t0, 1)
        harness.write_json(path + ".json", result)  # after each section, so a killed run still leaves its numbers
    table, targets = summarize(result)
    gpu = gpu_state_table([r for section in bench.rows.values() for r in section])
    if gpu:
        table += "\nClock and power during each implementation's timed batches (nvidia-smi):\n\n" + gpu
    result["targets"] = targets
    harness.write_json(path + ".json", result)
    with open(path + ".md", "w") as f:
        f.write(table)
    print("\n" + table, flush=True)
    print(f"wrote {path}.json and {path}.md ({result['elapsed_s']} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
