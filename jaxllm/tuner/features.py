"""A step's features for the cost model, and the key its choice is cached under.

The same code reads a StepPlan (serving) and a dataset row (training), so the model sees at run time
exactly the numbers it was trained on. Lengths enter in log2 (times scale with them over six decades);
the key quantises the few numbers that decide the choice to quarter octaves, so steps that differ by a
few tokens (a decode batch one step later) share one cached choice. The key reads the plan's kv_extent
(total and longest KV, which the scheduler carries forward for a continuation step without touching
its arrays), so a cached step costs a few float operations and a dictionary lookup. A tuner holds one
head shape, so keys leave it out.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from jaxllm.contract import StepKind

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

    kind: the step's StepKind (DECODE: one query token per sequence). bucket: padded sequences (decode) or tokens
    (prefill).
    kv_lens, q_lens: [num_seqs] int arrays of the real sequences (KV lengths include this step's
    tokens). heads: (q heads, kv heads, head_dim) on one device. dtype_bytes: bytes per KV element.
    """

    kind: StepKind
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
    def from_plan(cls, plan, kind: StepKind, padded_size: int, *, heads: tuple[int, int, int],
                  dtype_bytes: int = 2) -> "StepFeatures":
        """The features of a jaxllm.engine.scheduler.StepPlan in a bucket of padded_size."""
        return cls(kind, padded_size, np.asarray(plan.kv_lens), np.diff(np.asarray(plan.cu_q_lens)), heads,
                   dtype_bytes)

    def stats(self) -> tuple:
        """length_stats of this step's lengths."""
        return length_stats(self.kv_lens, None if self.kind is StepKind.DECODE else self.q_lens)

    def key(self) -> tuple:
        """The cache key: op, bucket, sequences, and quarter-octave total KV, longest KV and (prefill) query
        tokens: near-equal steps share one cached choice."""
        st = self.stats()
        return stats_key(self.kind, self.bucket, st[0], st[1], st[2], st[5])

    def vector(self) -> np.ndarray:
        """[NUM_SHAPE_FEATURES] float32 shape features (log2 scale where a length)."""
        return shape_vector(self.kind, self.bucket, self.heads, self.dtype_bytes, self.stats())


# Up to this many sequences, the stats are summed in Python over lists: NumPy's per-call cost (~1 us a
# reduction) is more than the arithmetic. Both paths give the same numbers (integer sums, exact in float64).
SMALL_STATS = 16


def length_stats(kv_lens: np.ndarray, q_lens: np.ndarray | None, kv_extent: tuple[int, int] | None = None) -> tuple:
    """(n, kv sum, kv max, kv min, sum kv^2, q sum, q max, sum q*kv, sum q^2) as Python numbers, in as few
    NumPy calls as give them (this runs on every new key); q_lens None: decode, one query token each.
    kv_extent: (kv sum, kv max) where known already (StepPlan.kv_extent): a decode batch then costs two
    reductions fewer."""
    n = len(kv_lens)
    if n <= SMALL_STATS:
        return _stats_small(kv_lens.tolist(), None if q_lens is None else q_lens.tolist())
    if q_lens is not None:
        lens = np.array((kv_lens, q_lens), np.float64)  # [2, n]: every sum in two products
        gram = lens @ lens.T  # [[sum kv^2, sum q*kv], [sum q*kv, sum q^2]]
        sums, tops = lens.sum(1), lens.max(1)
        return (n, float(sums[0]), float(tops[0]), float(lens[0].min()), float(gram[0, 0]), float(sums[1]),
                float(tops[1]), float(gram[0, 1]), float(gram[1, 1]))
    kv = kv_lens.astype(np.float64)  # int32 squares of 512K overflow
    if kv_extent is None:
        s, m = float(np.add.reduce(kv)), float(np.maximum.reduce(kv))
    else:
        s, m = float(kv_extent[0]), float(kv_extent[1])
    mn, sq = float(np.minimum.reduce(kv)), float(kv @ kv)
    return n, s, m, mn, sq, float(n), 1.0, s, float(n)


def _stats_small(kv: list[int], q: list[int] | None) -> tuple:
    """length_stats over Python lists (Python ints: no overflow)."""
    n, s = len(kv), sum(kv)
    sq = sum(k * k for k in kv)
    if q is None:
        return n, float(s), float(max(kv)), float(min(kv)), float(sq), float(n), 1.0, float(s), float(n)
    return (n, float(s), float(max(kv)), float(min(kv)), float(sq), float(sum(q)), float(max(q)),
            float(sum(a * b for a, b in zip(q, kv))), float(sum(b * b for b in q)))


def shape_vector(kind: StepKind, bucket: int, heads: tuple[int, int, int], dtype_bytes: int,
                 stats: tuple) -> np.ndarray:
    """[NUM_SHAPE_FEATURES] float32 from length_stats (StepFeatures.vector's numbers)."""
    return np.array(shape_features(kind, bucket, heads, dtype_bytes, stats), np.float32)


def shape_features(kind: StepKind, bucket: int, heads: tuple[int, int, int], dtype_bytes: int, stats: tuple
                   ) -> list[float]:
    """shape_vector as a Python list (OpRanker.best's input: it builds one array of these and the
    interaction features)."""
    n, s, m, mn, sq, qs, qm, qk, qq = stats
    mean = s / n
    cv = math.sqrt(max(sq / n - mean * mean, 0.0)) / mean if mean > 0 else 0.0  # spread of the lengths
    # Causal work: query i (of Q new tokens) of a sequence of L keys sees L - Q + i + 1 keys.
    pairs = qk - qq + (qq + qs) / 2
    hq, hkv, d = heads
    log2 = math.log2
    return [1.0 if kind is StepKind.DECODE else 0.0, log2(bucket), log2(n), log2(1 + qs), log2(1 + qm), log2(1 + s),
            log2(1 + m), log2(1 + mean), cv, log2(1 + pairs), log2(hq / hkv), log2(hkv * d * dtype_bytes), log2(1 + mn)]


def _q(x: float) -> int:
    return round(KEY_STEPS * math.log2(1 + x))


def stats_key(kind: StepKind, bucket: int, n: int, kv_sum: float, kv_max: float, q_sum: float = 0.0) -> tuple:
    """The cache key: near-equal steps (within a quarter octave of total and longest KV, and of query
    tokens for prefill) share it."""
    if kind is StepKind.DECODE:
        return (kind, bucket, n, _q(kv_sum), _q(kv_max))
    return (kind, bucket, n, _q(kv_sum), _q(kv_max), _q(q_sum))


def plan_key(plan, kind: StepKind, bucket: int) -> tuple:
    """stats_key of a StepPlan (the per-step path): its kv_extent and, for prefill, its token count; no pass
    over its arrays, and stats_key's arithmetic written out (a call costs as much as the rest)."""
    kv_sum, kv_max = plan.kv_extent
    log2 = math.log2
    if kind is StepKind.DECODE:
        return (kind, bucket, len(plan.kv_lens), round(KEY_STEPS * log2(1 + kv_sum)),
                round(KEY_STEPS * log2(1 + kv_max)))
    return (kind, bucket, len(plan.kv_lens), round(KEY_STEPS * log2(1 + kv_sum)), round(KEY_STEPS * log2(1 + kv_max)),
            round(KEY_STEPS * log2(1 + plan.num_tokens)))
