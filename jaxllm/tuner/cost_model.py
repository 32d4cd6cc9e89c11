"""The cost model: per op a small MLP from (shape features, schedule features) to log time, inferred in NumPy.

Training (jaxllm/tuner/train.py) runs the same network in jax (`forward_jnp`); serving runs `forward_np`
on one CPU core. The inputs are [shape features, schedule features, interaction features] (the last per
(step, candidate), jaxllm/tuner/candidates.py). A step ranks all its candidates in one batched pass, and
the schedule part of the first layer is constant per candidate set, so `OpRanker` folds it in once: per
step it is one [Fv + C x Fi + 1] x [Fv + C x Fi + 1, C x H] product (shape features shared, each
candidate's interaction features its own block), two [C, H] products and two tanh.
Weights live in one small .npz per device: `<op>/w1 ... <op>/y_std` plus `<op>/names` (candidate names in
the order the schedule features were taken) and `meta` (a JSON string: device, dataset, date).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable

import numpy as np

_FIELDS = ("w1", "b1", "w2", "b2", "w3", "b3", "x_mean", "x_std", "y_mean", "y_std")


@dataclasses.dataclass(frozen=True)
class MlpWeights:
    """x [F] -> tanh(x' W1 + b1) -> tanh(. W2 + b2) -> . W3 + b3, x' = (x - x_mean) / x_std; the output is
    normalised log time: log(us) = out * y_std + y_mean. w1 [F, H], w2 [H, H], w3 [H, 1]."""

    w1: np.ndarray
    b1: np.ndarray
    w2: np.ndarray
    b2: np.ndarray
    w3: np.ndarray
    b3: np.ndarray
    x_mean: np.ndarray
    x_std: np.ndarray
    y_mean: np.ndarray
    y_std: np.ndarray

    def __post_init__(self):
        f, h = self.w1.shape
        for name, shape in (("b1", (h,)), ("w2", (h, h)), ("b2", (h,)), ("w3", (h, 1)), ("b3", (1,)),
                            ("x_mean", (f,)), ("x_std", (f,)), ("y_mean", ()), ("y_std", ())):
            if np.shape(getattr(self, name)) != shape:
                raise ValueError(f"MlpWeights.{name} has shape {np.shape(getattr(self, name))}, want {shape} "
                                 f"(w1 {self.w1.shape})")

    @property
    def num_features(self) -> int:
        return self.w1.shape[0]

    def params(self) -> dict:
        """The trainable arrays, as forward_jnp takes them."""
        return {k: getattr(self, k) for k in ("w1", "b1", "w2", "b2", "w3", "b3")}


def forward_np(w: MlpWeights, x: np.ndarray) -> np.ndarray:
    """log(us) [N] for x [N, F] (float32 NumPy; the serving path's reference)."""
    xn = (x - w.x_mean) / w.x_std
    h = np.tanh(xn @ w.w1 + w.b1)
    h = np.tanh(h @ w.w2 + w.b2)
    return (h @ w.w3 + w.b3)[:, 0] * w.y_std + w.y_mean


def forward_jnp(params: dict, xn):
    """Normalised output [..., N] for normalised inputs xn [..., N, F] (jax; training)."""
    import jax.numpy as jnp

    h = jnp.tanh(xn @ params["w1"] + params["b1"])
    h = jnp.tanh(h @ params["w2"] + params["b2"])
    return (h @ params["w3"] + params["b3"])[..., 0]


@dataclasses.dataclass(frozen=True)
class OpRanker:
    """One op's model with its candidate set's schedule part of the first layer folded in.

    names: candidate names, in row order of sched [C, Fs]; pre [C, H] = normalised sched @ W1[sched rows] + b1
    (and the constant mean shifts of the shape and interaction features). interactions: the candidates'
    interaction features from a step's length stats (a flat list, C x Fi; candidates.interaction_features),
    None when the model takes none.
    """

    weights: MlpWeights
    names: tuple[str, ...]
    w1_shape: np.ndarray  # [Fv, H], rows of W1 for the shape features, scaled by 1 / x_std
    pre: np.ndarray  # [C, H]
    w3: np.ndarray  # [H], W3 as a vector
    m1: np.ndarray  # [Fv + C * Fi + 1, C * H]: w1_shape per candidate, w1_inter per candidate (block-diagonal), pre
    w2b: np.ndarray  # [H + 1, H]: W2, then b2 (for a hidden row ending in 1)
    hbuf: np.ndarray  # [C, H + 1] scratch, last column 1: best() writes the first layer here
    interactions: Callable[[tuple], list[float]] | None = None
    w1_inter: np.ndarray | None = None  # [Fi, H], rows of W1 for the interaction features, scaled by 1 / x_std

    @classmethod
    def build(cls, weights: MlpWeights, names, sched: np.ndarray,
              interactions: Callable[[tuple], list[float]] | None = None, num_interactions: int = 0) -> "OpRanker":
        sched = np.asarray(sched, np.float32)
        fs, fi = sched.shape[1], num_interactions
        fv = weights.num_features - fs - fi
        if fv <= 0 or sched.shape[0] != len(names) or (fi > 0) != (interactions is not None):
            raise ValueError(f"OpRanker: {len(names)} names, schedule features {sched.shape}, {fi} interaction "
                             f"features ({'with' if interactions else 'without'} their function); the model takes "
                             f"{weights.num_features} features")
        mean, std, w1 = weights.x_mean, weights.x_std, weights.w1
        xs = (sched - mean[fv:fv + fs]) / std[fv:fv + fs]
        w1_shape = (w1[:fv] / std[:fv, None]).astype(np.float32)
        # The shape and interaction features' mean shifts are constant rows: folded into pre with b1.
        shift = (mean[:fv] / std[:fv]) @ w1[:fv] + (mean[fv + fs:] / std[fv + fs:]) @ w1[fv + fs:]
        pre = xs @ w1[fv:fv + fs] + weights.b1 - shift
        c, h = pre.shape
        w1_inter = (w1[fv + fs:] / std[fv + fs:, None]).astype(np.float32)  # [Fi, H]
        inter_rows = np.zeros((c * fi, c * h), np.float32)
        for j in range(c):  # candidate j's interaction features feed only its own hidden units
            inter_rows[j * fi:(j + 1) * fi, j * h:(j + 1) * h] = w1_inter
        m1 = np.concatenate([np.tile(w1_shape, (1, c)), inter_rows, pre.reshape(1, -1)]).astype(np.float32)
        w2b = np.concatenate([weights.w2, weights.b2[None]]).astype(np.float32)
        hbuf = np.ones((c, h + 1), np.float32)
        return cls(weights, tuple(names), w1_shape, pre.astype(np.float32), weights.w3[:, 0].astype(np.float32),
                   m1, w2b, hbuf, interactions, w1_inter if fi else None)

    def _interactions(self, stats) -> list[float]:
        return [] if self.interactions is None else self.interactions(stats)

    def best(self, shape: list[float], stats: tuple | None = None) -> int:
        """Index of the candidate predicted fastest (predict's argmin, without its scaling: y_std > 0), for
        a step's shape features (a list, features.shape_features) and length stats (the interaction features
        are computed from them): one input array, the biases riding in the products, five NumPy calls in
        all. Uses a scratch buffer: one thread per ranker."""
        c, h = self.pre.shape
        x = np.array(shape + self._interactions(stats) + [1.0], np.float32)
        np.tanh((x @ self.m1).reshape(c, h), out=self.hbuf[:, :h])
        h2 = self.hbuf @ self.w2b
        np.tanh(h2, out=h2)
        return int((h2 @ self.w3).argmin())

    def predict(self, shape_vec: np.ndarray, stats: tuple | None = None) -> np.ndarray:
        """log(us) [C] of every candidate for one step's shape features [Fv] (and its length stats, for the
        interaction features): one batched pass."""
        w = self.weights
        first = self.pre + shape_vec @ self.w1_shape
        if self.interactions is not None:
            first = first + np.reshape(self.interactions(stats), (len(self.names), -1)) @ self.w1_inter
        h = np.tanh(first)
        h = np.tanh(h @ w.w2 + w.b2)
        return (h @ w.w3)[:, 0] * w.y_std + (w.b3[0] * w.y_std + w.y_mean)


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Per op (decode, prefill) its weights and the candidate names it was trained over; meta: provenance."""

    ops: dict
    names: dict
    meta: dict

    def save(self, path: str) -> None:
        arrays = {"meta": np.array(json.dumps(self.meta))}
        for op, w in self.ops.items():
            for k in _FIELDS:
                arrays[f"{op}/{k}"] = np.asarray(getattr(w, k), np.float32)
            arrays[f"{op}/names"] = np.array(self.names[op])
        np.savez_compressed(path, **arrays)

    @classmethod
    def load(cls, path: str) -> "CostModel":
        with np.load(path, allow_pickle=False) as z:
            ops = sorted({k.split("/")[0] for k in z.files if "/" in k})
            weights = {op: MlpWeights(**{k: z[f"{op}/{k}"] for k in _FIELDS}) for op in ops}
            names = {op: tuple(str(n) for n in z[f"{op}/names"]) for op in ops}
            meta = json.loads(str(z["meta"]))
        return cls(weights, names, meta)
