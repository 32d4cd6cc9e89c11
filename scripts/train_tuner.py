"""Trains the AutoTuner's cost model for a device and evaluates it on held-out shapes (issue 22), on the CPU.

  PYTHONPATH=$PWD python scripts/train_tuner.py --device nvidia-h100-80gb-hbm3

Reads every `benchmarks/tuning/<device>*.jsonl.gz` (scripts/collect_tuning_data.py; with --decode-datasets, decode
rows only from the files it names, when the others' were measured on an older decode kernel), splits the measured
shapes of each op at random into training and held-out shapes (a held-out shape is never trained on),
trains the per-op MLP (jaxllm.tuner.train: optax, a few seconds) on the training shapes and writes it to
`jaxllm/tuner/models/<device>.npz`, the model that ships (the one evaluated). On each held-out shape the
choice is made as in serving: a LearnedTuner (pruned variants per bucket, cached choices per feature key)
over the base Kernels of a Hopper (decode on Triton, prefill on Mosaic); its measured time is compared
with the exhaustively measured best over every candidate of that shape. Also reported: the fixed default
(variants()[0]); top-1 (the chosen one is the measured best) and top-3 (the measured best is among the
model's three fastest of all candidates) accuracy. Writes `<device>-<date>-<HHMM>-tuner.json` and `.md`
under --out (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time
import types

import numpy as np

from scripts.common import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _split(n: int, holdout: float, rng) -> tuple[np.ndarray, np.ndarray]:
    idx = rng.permutation(n)
    k = max(1, int(round(n * holdout)))
    return np.sort(idx[k:]), np.sort(idx[:k])


def _plan_of(row):
    """The parts of a StepPlan the tuner reads, for a dataset row."""
    from jaxllm.contract import kv_extent_of

    q = np.ones(len(row["kv_lens"]), np.int64) if row["op"] == "decode" else np.asarray(row["q_lens"], np.int64)
    kv = np.asarray(row["kv_lens"], np.int64)
    return types.SimpleNamespace(kv_lens=kv, cu_q_lens=np.concatenate([[0], np.cumsum(q)]), kv_extent=kv_extent_of(kv),
                                 num_tokens=int(q.sum()))


def _train_split(rows: list[dict], args, seed: int) -> tuple[dict, dict, list[dict]]:
    """(weights per op, candidate names per op, held-out rows): each op's rows split at random by seed, the
    model trained on the rest."""
    from jaxllm.tuner.train import op_arrays, train_ensemble

    rng = np.random.default_rng(seed)
    weights, names, held, t0 = {}, {}, [], time.time()
    for op in ("decode", "prefill"):
        op_rows = [r for r in rows if r["op"] == op]
        if not op_rows:
            continue
        train_idx, test_idx = _split(len(op_rows), args.holdout, rng)
        x, y, mask, names[op] = op_arrays([op_rows[i] for i in train_idx], op)
        weights[op] = train_ensemble(x, y, mask, members=args.members, hidden=args.hidden, steps=args.steps,
                                     listwise_weight=args.listwise, seed=seed)
        held += [op_rows[i] for i in test_idx]
        print(f"{op}: trained on {len(train_idx)} shapes, {len(test_idx)} held out ({time.time() - t0:.1f} s)",
              flush=True)
    return weights, names, held


def evaluate(model, rows, base, block: int) -> list[dict]:
    """Per held-out row: chosen, default and best candidate with their measured times, and model ranks."""
    from jaxllm.contract import StepKind
    from jaxllm.tuner import LearnedTuner
    from jaxllm.tuner.learned import op_ranker
    from jaxllm.tuner.train import row_features

    tuners, rankers, out = {}, {}, []
    for r in rows:
        heads = tuple(r["heads"])
        if heads not in tuners:
            tuners[heads] = LearnedTuner(base, model, heads=heads, block_size=block)
        tuner = tuners[heads]
        kind = StepKind.from_label(r["op"])
        names = tuner.variant_names(kind, r["bucket"])
        chosen = names[tuner.choose(_plan_of(r), kind, r["bucket"])]
        us = r["us"]
        measured = tuple(n for n in model.names[r["op"]] if n in us)
        key = (r["op"], measured, heads[1], r["block"])
        if key not in rankers:  # one ranker per candidate set and pool shape, not per row
            rankers[key] = op_ranker(model, r["op"], measured, kv_heads=heads[1], block_size=r["block"])
        ranker = rankers[key]
        f = row_features(r)
        pred = ranker.predict(f.vector(), f.stats())
        order = [measured[i] for i in np.argsort(pred)]
        best = min(us, key=us.get)
        out.append(dict(op=r["op"], bucket=r["bucket"], heads=list(heads), kind=r["kind"], kv_lens=r["kv_lens"],
                        q_lens=r["q_lens"], block=r["block"], variants=list(names),
                        chosen=chosen, default=names[0], best=best, chosen_us=us.get(chosen),
                        default_us=us[names[0]], best_us=us[best], top1=chosen == best, top3=best in order[:3],
                        unpruned_choice=order[0]))
    return out


def summarize(ev: list[dict]) -> dict:
    """Fractions of the measured best (best time / time) for the tuner's choice and the default."""
    if not ev:
        return {}
    tuned = np.array([e["best_us"] / e["chosen_us"] for e in ev])
    fixed = np.array([e["best_us"] / e["default_us"] for e in ev])
    return dict(shapes=len(ev), tuned_avg=float(tuned.mean()), tuned_worst=float(tuned.min()),
                fixed_avg=float(fixed.mean()), fixed_worst=float(fixed.min()),
                tuned_below_85=int((tuned < 0.85).sum()), top1=float(np.mean([e["top1"] for e in ev])),
                top3=float(np.mean([e["top3"] for e in ev])),
                mean_variants=float(np.mean([len(e["variants"]) for e in ev])))


def table(summary: dict) -> str:
    rows = []
    for name, s in summary.items():
        rows.append([name, s["shapes"], f"{s['tuned_avg']:.1%}", f"{s['tuned_worst']:.1%}", f"{s['fixed_avg']:.1%}",
                     f"{s['fixed_worst']:.1%}", f"{s['top1']:.0%}", f"{s['top3']:.0%}", f"{s['mean_variants']:.1f}",
                     s["tuned_below_85"]])
    return harness.markdown_table(["held-out shapes", "n", "tuned avg", "tuned worst", "fixed avg", "fixed worst",
                                   "top-1", "top-3", "variants/bucket", "tuned < 85%"], rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", required=True, help="device slug, e.g. nvidia-h100-80gb-hbm3")
    parser.add_argument("--datasets", nargs="*", default=None, help="default: benchmarks/tuning/<device>*.jsonl.gz")
    parser.add_argument("--model-out", default=None, help="default: jaxllm/tuner/models/<device>.npz")
    parser.add_argument("--out", default=harness.RESULTS_DIR)
    parser.add_argument("--holdout", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--members", type=int, default=3, help="ensemble members (merged into one MLP)")
    parser.add_argument("--listwise", type=float, default=0.0, help="weight of a listwise (soft choice) loss term")
    parser.add_argument("--decode-datasets", nargs="*", default=None,
                        help="train decode on these datasets only: the others' decode rows (measured on an older "
                             "decode kernel) are left out, their prefill rows kept; default: every dataset's")
    parser.add_argument("--cv", type=int, default=0, help="also train and evaluate on this many other random splits "
                                                          "(seeds after --seed; their models are not saved)")
    args = parser.parse_args(argv)

    from jaxllm.tuner.cost_model import CostModel
    from jaxllm.tuner.train import read_dataset
    from pallas_kernels.dispatch import Kernels

    paths = args.datasets or sorted(glob.glob(os.path.join(ROOT, "benchmarks", "tuning", args.device + "*.jsonl.gz")))
    paths = [p for p in paths if ".smoke." not in p]
    if not paths:
        parser.error(f"no dataset for {args.device!r} under benchmarks/tuning/")
    decode_from = None if args.decode_datasets is None else {os.path.realpath(p) for p in args.decode_datasets}
    if decode_from is not None and not decode_from <= {os.path.realpath(p) for p in paths}:
        parser.error(f"--decode-datasets {sorted(decode_from)} are not all among the datasets read {paths}")
    headers, rows = [], []
    for p in paths:
        h, r = read_dataset(p)
        if decode_from is not None and os.path.realpath(p) not in decode_from:
            r = [row for row in r if row["op"] != "decode"]
        headers.append(dict(path=os.path.relpath(p, ROOT), device=h["device"], date=h["date"], shapes=len(r),
                            jax=h["jax"], ops=sorted({row["op"] for row in r})))
        rows += r
    device = headers[0]["device"]
    t0 = time.time()
    weights, names, held = _train_split(rows, args, args.seed)
    train_s = time.time() - t0
    # The head shapes measured: load_tuner uses the model only at these (elsewhere it would extrapolate).
    heads = sorted({tuple(r["heads"]) for r in rows})
    meta = dict(device=device, datasets=headers, heads=heads, trained=harness.today(), holdout=args.holdout,
                seed=args.seed, hidden=args.hidden, steps=args.steps, members=args.members, listwise=args.listwise,
                script="scripts/train_tuner.py")
    model = CostModel(weights, names, meta)
    model_out = args.model_out or os.path.join(ROOT, "jaxllm", "tuner", "models", args.device + ".npz")
    os.makedirs(os.path.dirname(model_out), exist_ok=True)
    model.save(model_out)
    model = CostModel.load(model_out)  # evaluate exactly what ships
    base = Kernels(decode_attention="triton", prefill_attention="mosaic", rope_kv_write="pallas",
                   decode_layer="pallas")
    ev = evaluate(model, held, base, block=int(rows[0]["block"]))
    splits = []
    for seed in range(args.seed + 1, args.seed + 1 + args.cv):  # other random splits: the held-out figures' spread
        w, n, h = _train_split(rows, args, seed)
        s = {k: summarize([e for e in evaluate(CostModel(w, n, meta), h, base, block=int(rows[0]["block"]))
                           if k == "all" or e["op"] == k]) for k in ("all", "decode", "prefill")}
        splits.append(dict(seed=seed, **{k: v for k, v in s.items() if v}))
        print(f"split seed {seed}: " + ", ".join(f"{k} avg {v['tuned_avg']:.1%} worst {v['tuned_worst']:.1%} "
                                                  f"< 85%: {v['tuned_below_85']}" for k, v in s.items() if v), flush=True)
    summary = {"all": summarize(ev)}
    for op in ("decode", "prefill"):
        summary[op] = summarize([e for e in ev if e["op"] == op])
        for b in sorted({e["bucket"] for e in ev if e["op"] == op}):
            summary[f"{op} bucket {b}"] = summarize([e for e in ev if e["op"] == op and e["bucket"] == b])
        for hs in sorted({tuple(e["heads"]) for e in ev if e["op"] == op}):
            summary[f"{op} heads {'/'.join(map(str, hs))}"] = summarize(
                [e for e in ev if e["op"] == op and tuple(e["heads"]) == hs])
    summary = {k: v for k, v in summary.items() if v}
    md = table(summary)
    if splits:
        md += "\nOther random splits (a model trained on each; not shipped):\n\n" + harness.markdown_table(
            ["split seed", "all avg", "all worst", "all < 85%", "decode avg", "decode worst", "prefill avg",
             "prefill worst"],
            [[sp["seed"]] + [f"{sp[k][m]:.1%}" if m != "tuned_below_85" else sp[k][m]
                             for k, m in (("all", "tuned_avg"), ("all", "tuned_worst"), ("all", "tuned_below_85"),
                                          ("decode", "tuned_avg"), ("decode", "tuned_worst"),
                                          ("prefill", "tuned_avg"), ("prefill", "tuned_worst"))] for sp in splits])
    print(md, flush=True)
    date = max(h["date"] for h in headers)  # the newest measurement trained on
    stem = harness.result_stem(device, "tuner", date)
    result = dict(script="scripts/train_tuner.py", argv=sys.argv[1:], device=device, date=date,
                  command="PYTHONPATH=$PWD python scripts/train_tuner.py " + " ".join(sys.argv[1:]),
                  datasets=headers, model=os.path.relpath(model_out, ROOT), model_bytes=os.path.getsize(model_out),
                  train_s=round(train_s, 1), meta=meta, summary=summary, held_out=ev, other_splits=splits,
                  definitions=dict(tuned="measured best time / measured time of the tuner's choice (LearnedTuner."
                                         "choose over its pruned variants, cached per feature key)",
                                   fixed="measured best time / measured time of variants()[0] (today's default)",
                                   top1="the tuner's choice is the measured best",
                                   top3="the measured best is among the model's three fastest of all candidates"))
    path = harness.write_result_and_table(args.out, stem, result, md)
    print(f"wrote {model_out} ({os.path.getsize(model_out)} bytes) and {path}.json", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
