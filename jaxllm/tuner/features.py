"""A step's features for the cost model, and the key its choice is cached under.

The same code reads a StepPlan (serving) and a dataset row (training), so the model sees at run time
exactly the numbers it was trained on. Lengths enter in log2 (times scale with them over six decades);
the key quantises the few numbers that decide the choice to quarter octaves, so steps that differ by a
few tokens (a decode batch one step later) share one cached choice.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

# Quantisation of the cache key: steps of 2**(1/KEY_STEPS) in total and longest KV length.
KEY_STEPS = 4
NUM_SHAPE_FEATURES = 13


def device_slug(device_kind: str) -> str:
    """`NVIDIA H100 80GB HBM3` -> `nvidia-h100-80gb-hbm3`: the file name of a device's model and dataset."""
    s = re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-")
    if not s:
        raise ValueError(f"device kind {device_kind!r} has no letters or digits to name a model by")
    return s


@dataclasses.dataclass(frozen=True)
class StepFeatures:
    """What the cost model knows of one attention call of a step (one layer; every layer is alike).

    decode: one query token per sequence. bucket: padded sequences (decode) or tokens (prefill).
    kv_lens, q_lens: [num_seqs] int arrays of the real sequences (KV lengths include this step's
    tokens). heads: (q heads, kv heads, head_dim) on one device. dtype_bytes: bytes per KV element.
    """

    decode: bool
    bucket: int
    kv_lens: np.ndarray
    q_lens: np.ndarray
    heads: tuple[int, int, int]
    dtype_bytes: int = 2

    def __post_init__(self):
        if self.bucket < 1:
            raise ValueError(f"StepFeatures.bucket {self.bucket} must be >= 1")
        if len(self.kv_lens) != len(self.q_lens) or len(self.kv_lens) == 0:
            raise ValueError(f"StepFeatures: {len(self.kv_lens)} kv_lens and {len(self.q_lens)} q_lens; "
                             "want the same number, at least one")
        if len(self.heads) != 3 or min(self.heads) < 1:
            raise ValueError(f"StepFeatures.heads {self.heads} must be (q heads, kv heads, head_dim), all >= 1")

    @classmethod
    def from_plan(cls, plan, decode: bool, padded_size: int, *, heads: tuple[int, int, int],
                  dtype_bytes: int = 2) -> "StepFeatures":
        """The features of a jaxllm.engine.scheduler.StepPlan in a bucket of padded_size."""
        return cls(decode, padded_size, np.asarray(plan.kv_lens), np.diff(np.asarray(plan.cu_q_lens)), heads,
                   dtype_bytes)

    def key(self) -> tuple:
        """The cache key: op, bucket, sequences, and quarter-octave total KV, longest KV, query tokens
        and (prefill) causal work."""
        return feature_key(self.decode, self.bucket, self.kv_lens, self.q_lens, self.heads)

    def vector(self) -> np.ndarray:
        """[NUM_SHAPE_FEATURES] float32 shape features (log2 scale where a length)."""
        kv = self.kv_lens.astype(np.float64)
        q = self.q_lens.astype(np.float64)
        n = len(kv)
        mean = kv.sum() / n
        hq, hkv, d = self.heads
        # Causal work: query i of a sequence with L keys and Q new tokens sees L - Q + i + 1 keys.
        pairs = float(np.dot(q, kv - q) + np.dot(q, q + 1) / 2)
        return np.array([
            1.0 if self.decode else 0.0,
            math.log2(self.bucket),
            math.log2(n),
            math.log2(1 + q.sum()),
            math.log2(1 + q.max()),
            math.log2(1 + kv.sum()),
            math.log2(1 + kv.max()),
            math.log2(1 + mean),
            float(kv.std() / mean) if mean > 0 else 0.0,  # spread: coefficient of variation
            math.log2(1 + pairs),
            math.log2(hq / hkv),
            math.log2(hkv * d * self.dtype_bytes),  # bytes per token per K (or V) row
            math.log2(1 + kv.min()),
        ], np.float32)


def _q(x: float) -> int:
    return round(KEY_STEPS * math.log2(1 + x))


def feature_key(decode: bool, bucket: int, kv_lens: np.ndarray, q_lens: np.ndarray | None,
                heads: tuple[int, int, int]) -> tuple:
    """StepFeatures.key without building the features (the per-step fast path)."""
    kv_sum, kv_max = int(kv_lens.sum()), int(kv_lens.max())
    if decode:
        return (True, bucket, len(kv_lens), _q(kv_sum), _q(kv_max), heads)
    q_sum, q_max = int(q_lens.sum()), int(q_lens.max())
    return (False, bucket, len(kv_lens), _q(kv_sum), _q(kv_max), _q(q_sum), _q(q_max), heads)
