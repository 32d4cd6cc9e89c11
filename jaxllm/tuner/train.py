"""Training the cost model (optax, jax on the CPU: seconds) and reading the tuning datasets it learns from.

A dataset (benchmarks/tuning/README.md) is a gzipped JSON-lines file: a header, then one row per
measured shape with every candidate's median time. Training sees all candidates of a shape together:
the loss is the squared error of log time plus (weighted more) the error of each candidate's log time
relative to its shape's mean, because what the tuner needs is the order of candidates within a step,
not the absolute time.
"""

from __future__ import annotations

import gzip
import json

import numpy as np

from jaxllm.contract import StepKind
from jaxllm.tuner.candidates import all_schedules, interaction_features
from jaxllm.tuner.cost_model import MlpWeights, forward_jnp
from jaxllm.tuner.features import StepFeatures, shape_vector

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "int8": 1}


def read_dataset(path: str) -> tuple[dict, list[dict]]:
    """(header, rows) of a .jsonl.gz tuning dataset."""
    with gzip.open(path, "rt") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if not lines or lines[0].get("format") != "jaxllm-tuning-v1":
        raise ValueError(f"{path} is not a jaxllm-tuning-v1 dataset (first line: {str(lines[:1])[:200]})")
    return lines[0], lines[1:]


def row_features(row: dict) -> StepFeatures:
    """A dataset row's StepFeatures (what a StepPlan of that shape would give)."""
    kv = np.asarray(row["kv_lens"], np.int64)
    kind = StepKind.from_label(row["op"])
    q = np.ones(len(kv), np.int64) if kind is StepKind.DECODE else np.asarray(row["q_lens"], np.int64)
    return StepFeatures(kind, int(row["bucket"]), kv, q, tuple(row["heads"]), _DTYPE_BYTES[row["dtype"]])


def schedule_matrix(op: str, names) -> np.ndarray:
    """[C, Fs] schedule features of the named candidates of op."""
    by_name = {s.name: s for s in all_schedules(op)}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise ValueError(f"candidates {missing} of op {op!r} are not in jaxllm.tuner.candidates "
                         f"({sorted(by_name)})")
    return np.array([by_name[n].features for n in names], np.float32)


def row_interactions(rows: list[dict], op: str, names, stats: list[tuple]) -> np.ndarray:
    """[S, C, NUM_INTERACTIONS[op]] interaction features of each row's step (its length stats) with each named
    candidate."""
    fns, out = {}, []
    for r, st in zip(rows, stats):
        key = (r["heads"][1], r["block"])
        if key not in fns:
            fns[key] = interaction_features(op, names, kv_heads=key[0], block_size=key[1])
        fn = fns[key]
        out.append(np.zeros((len(names), 0), np.float32) if fn is None
                   else np.reshape(np.asarray(fn(st), np.float32), (len(names), -1)))
    return np.stack(out)


def op_arrays(rows: list[dict], op: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[str, ...]]:
    """(x [S, C, F], log us [S, C], mask [S, C] where measured, candidate names [C]) over op's rows; x is
    [shape features, schedule features, interaction features] per (row, candidate)."""
    rows = [r for r in rows if r["op"] == op]
    if not rows:
        raise ValueError(f"the dataset has no rows of op {op!r}")
    names = tuple(s.name for s in all_schedules(op) if any(s.name in r["us"] for r in rows))
    sched = schedule_matrix(op, names)
    feats = [row_features(r) for r in rows]
    stats = [f.stats() for f in feats]
    shape = np.stack([shape_vector(f.kind, f.bucket, f.heads, f.dtype_bytes, st) for f, st in zip(feats, stats)])
    x = np.concatenate([np.repeat(shape[:, None], len(names), 1), np.repeat(sched[None], len(rows), 0),
                        row_interactions(rows, op, names, stats)], axis=2).astype(np.float32)  # [S, C, F]
    y = np.zeros((len(rows), len(names)), np.float32)
    mask = np.zeros_like(y)
    for i, r in enumerate(rows):
        for j, n in enumerate(names):
            if n in r["us"]:
                y[i, j], mask[i, j] = np.log(r["us"][n]), 1.0
    return x, y, mask, names


def train_op(x: np.ndarray, y: np.ndarray, mask: np.ndarray, *, hidden: int = 32, steps: int = 3000,
             lr: float = 3e-3, weight_decay: float = 1e-4, relative_weight: float = 4.0, listwise_weight: float = 0.0,
             temperature: float = 0.05, seed: int = 0) -> MlpWeights:
    """Fits MlpWeights to x [S, C, F] -> log us y [S, C] (mask [S, C]: measured cells), full batch, AdamW."""
    import jax
    import jax.numpy as jnp
    import optax

    if x.ndim != 3 or y.shape != x.shape[:2] or mask.shape != y.shape:
        raise ValueError(f"train_op: x {x.shape}, y {y.shape}, mask {mask.shape}; want [S, C, F], [S, C], [S, C]")
    flat = x.reshape(-1, x.shape[-1])[mask.reshape(-1) > 0]
    x_mean = flat.mean(0)
    x_std = np.maximum(flat.std(0), 1e-3).astype(np.float32)
    y_mean = float((y * mask).sum() / mask.sum())
    y_std = float(max(np.sqrt((((y - y_mean) * mask) ** 2).sum() / mask.sum()), 1e-3))
    xn = jnp.asarray((x - x_mean) / x_std)
    yn = jnp.asarray((y - y_mean) / y_std)
    m = jnp.asarray(mask)
    f = x.shape[-1]
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    params = {"w1": jax.random.normal(k1, (f, hidden)) * np.sqrt(1.0 / f), "b1": jnp.zeros(hidden),
              "w2": jax.random.normal(k2, (hidden, hidden)) * np.sqrt(1.0 / hidden), "b2": jnp.zeros(hidden),
              "w3": jax.random.normal(k3, (hidden, 1)) * np.sqrt(1.0 / hidden), "b3": jnp.zeros(1)}
    opt = optax.adamw(optax.cosine_decay_schedule(lr, steps), weight_decay=weight_decay)
    state = opt.init(params)

    def loss_fn(p):
        pred = forward_jnp(p, xn)  # [S, C]
        err = (pred - yn) * m
        n = jnp.maximum(m.sum(1, keepdims=True), 1.0)
        rel = err - err.sum(1, keepdims=True) / n  # the part that changes the order within a shape
        loss = ((err ** 2).sum() + relative_weight * ((rel * m) ** 2).sum()) / m.sum()
        if listwise_weight:
            # Cross-entropy between the measured and the predicted soft choice (softmax of -log time /
            # temperature, in log-time units: 0.05 ~ 5%): it weighs the near-best candidates' order most.
            t = temperature / y_std
            neg = jnp.where(m > 0, 0.0, -1e9)
            target = jax.nn.softmax(-yn / t + neg, axis=1)
            logp = jax.nn.log_softmax(-pred / t + neg, axis=1)
            loss = loss + listwise_weight * -(target * jnp.where(m > 0, logp, 0.0)).sum() / x.shape[0]
        return loss

    @jax.jit
    def update(p, s):
        loss, g = jax.value_and_grad(loss_fn)(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    for _ in range(steps):
        params, state, _ = update(params, state)
    p = {k: np.asarray(v, np.float32) for k, v in params.items()}
    return MlpWeights(**p, x_mean=x_mean.astype(np.float32), x_std=x_std, y_mean=np.float32(y_mean),
                      y_std=np.float32(y_std))


def ensemble(members: list[MlpWeights]) -> MlpWeights:
    """One MLP computing the mean of members' outputs exactly (block-diagonal hidden layers), so an
    ensemble costs one forward pass. Members must share their normalisation (trained on the same data)."""
    if not members:
        raise ValueError("ensemble of no members")
    first = members[0]
    for m in members[1:]:
        if not (np.array_equal(m.x_mean, first.x_mean) and np.array_equal(m.x_std, first.x_std)
                and m.y_mean == first.y_mean and m.y_std == first.y_std):
            raise ValueError("ensemble members were normalised differently (trained on different data)")
    h = [m.w1.shape[1] for m in members]
    w2 = np.zeros((sum(h), sum(h)), np.float32)
    at = 0
    for m, n in zip(members, h):
        w2[at:at + n, at:at + n] = m.w2
        at += n
    k = len(members)
    return MlpWeights(w1=np.concatenate([m.w1 for m in members], 1), b1=np.concatenate([m.b1 for m in members]),
                      w2=w2, b2=np.concatenate([m.b2 for m in members]),
                      w3=np.concatenate([m.w3 for m in members], 0) / k,
                      b3=np.array([sum(float(m.b3[0]) for m in members) / k], np.float32),
                      x_mean=first.x_mean, x_std=first.x_std, y_mean=first.y_mean, y_std=first.y_std)


def train_ensemble(x, y, mask, *, members: int = 3, **kw) -> MlpWeights:
    """train_op `members` times (seeds 0..members-1), merged by ensemble()."""
    seed = kw.pop("seed", 0)
    return ensemble([train_op(x, y, mask, seed=seed + i, **kw) for i in range(members)])
