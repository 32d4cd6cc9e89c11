"""`LearnedTuner`: per bucket the candidate schedules the cost model says can win, per step the predicted fastest.

A StepTuner (jaxllm/tuner/protocol.py). `variants(kind, padded_size)` is the base Kernels first (the
fallback, today's schedule), then the candidates of the op (jaxllm/tuner/candidates.py) that the model
says the bucket needs (`keep_variants`): over shapes the bucket can hold (sampled over its range: sequence
counts, lengths equal, ragged or few-long up to max_context), each added candidate is the one that most
lowers the worst predicted shortfall of the kept set against the best of all, so a schedule that wins by
much on a narrow range of lengths (a 128-token tile at 65..128 tokens) is kept over one that wins by a
little on many; the rest are never compiled. `choose` computes the step's cache key (from the plan's
kv_extent: no pass over its arrays), returns the cached index on a hit, and otherwise ranks the bucket's
variants in one batched NumPy pass (shape, schedule and interaction features) and caches the result.
A verify step's bucket (speculative decoding) has the base Kernels alone: no verify schedules are learned yet.
Nothing here touches a device.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxllm.contract import StepKind
from jaxllm.tuner.candidates import NUM_INTERACTIONS, OPS, all_schedules, candidates, interaction_features
from jaxllm.tuner.cost_model import CostModel, OpRanker
from jaxllm.tuner.features import NUM_SHAPE_FEATURES, StepFeatures, length_stats, plan_key, shape_features
from jaxllm.tuner.train import schedule_matrix
from pallas_kernels.dispatch import Kernels

# Shapes sampled per bucket to decide which candidates it needs, the most variants kept, and the predicted
# shortfall (log time) below which a kept set needs nothing more.
PRUNE_SAMPLES = 256
MAX_VARIANTS = 4
ENOUGH = math.log(1.01)
# Cached choices kept before the cache starts over (keys are quantised: serving reaches far fewer).
MAX_CACHE = 1 << 16


@dataclasses.dataclass(frozen=True)
class _Bucket:
    """One bucket's compiled variants and the ranker over them (None: a single variant, nothing to rank)."""

    kernels: tuple[Kernels, ...]
    names: tuple[str, ...]
    ranker: OpRanker | None


def sample_shapes(kind: StepKind, bucket: int, *, heads: tuple[int, int, int], max_context: int, count: int,
                  seed: int = 0, dtype_bytes: int = 2) -> list[StepFeatures]:
    """count StepFeatures a bucket can hold, spread as the tuning data is (scripts/collect_tuning_data.py):
    decode: bucket / 2 + 1 .. bucket sequences, lengths equal, log-uniform or few-long up to max_context;
    prefill: bucket / 2 + 1 .. bucket tokens from 1..8 sequences, half after a cached prefix."""
    rng = np.random.default_rng(seed + bucket * 2 + int(kind is StepKind.DECODE))
    out = []
    for _ in range(count):
        lo = 1 if bucket == 1 else bucket // 2 + 1
        if kind is StepKind.DECODE:
            n = int(rng.integers(lo, bucket + 1))
            top = int(np.exp(rng.uniform(0, math.log(max_context))))
            spread = rng.integers(3)  # equal lengths, log-uniform, or few long beside short ones
            lens = (np.full(n, top) if spread == 0 else np.exp(rng.uniform(0, math.log(top), n)))
            if spread == 2:
                lens = np.exp(rng.uniform(0, math.log(min(top, 2048)), n))
            lens[0] = top
            kv = np.maximum(lens.astype(np.int64), 1)
            q = np.ones(n, np.int64)
        else:
            t = int(rng.integers(lo, bucket + 1))
            n = int(rng.integers(1, min(8, t) + 1))
            cuts = np.sort(rng.choice(np.arange(1, t), n - 1, replace=False)) if n > 1 else np.array([], np.int64)
            q = np.diff(np.concatenate([[0], cuts, [t]])).astype(np.int64)
            prefix = np.where(rng.random(n) < 0.5, 0, np.exp(rng.uniform(0, math.log(max_context), n)))
            kv = np.minimum(q + prefix.astype(np.int64), max_context)
            q = np.minimum(q, kv)
        out.append(StepFeatures(kind, bucket, kv, q, heads, dtype_bytes))
    return out


def keep_variants(log_us: np.ndarray, max_variants: int, enough: float = ENOUGH) -> list[int]:
    """Candidate indices to compile for a bucket, 0 (the base) first then ascending, at most max_variants, from
    predicted log times [samples, candidates]: greedily, the candidate that most lowers the worst shortfall
    over the samples (kept set's best minus the best of all; ties: the mean), until the worst is under enough."""
    pred = np.asarray(log_us, np.float64)
    best = pred.min(1)
    keep, current = [0], pred[:, 0].copy()
    while len(keep) < max_variants and (current - best).max() > enough:
        scores = []
        for c in range(pred.shape[1]):
            if c not in keep:
                short = np.minimum(current, pred[:, c]) - best
                scores.append((short.max(), short.mean(), c))
        if not scores:
            break
        c = min(scores)[2]
        keep.append(c)
        current = np.minimum(current, pred[:, c])
    return [0] + sorted(keep[1:])


class LearnedTuner:
    """A StepTuner choosing each step's schedule with a trained CostModel.

    base: the engine's Kernels (variants()[0] of every bucket; unwrapped for the mesh: the runner wraps
    each variant). heads: (q heads, kv heads, head_dim) on one device. block_size: the rBlock size (the
    Mosaic candidates need it a multiple of their KV tile; None: not checked). max_context: the longest
    sequence the engine admits (the range pruning samples). prune: False compiles every candidate.
    """

    def __init__(self, base: Kernels, model: CostModel, *, heads: tuple[int, int, int], dtype_bytes: int = 2,
                 block_size: int | None = None, max_context: int = 512 * 1024, prune: bool = True,
                 max_variants: int = MAX_VARIANTS):
        if not isinstance(base, Kernels):
            raise ValueError(f"LearnedTuner needs a pallas_kernels.dispatch.Kernels, got {type(base).__name__}")
        if len(heads) != 3 or min(heads) < 1:
            raise ValueError(f"LearnedTuner heads {heads} must be (q heads, kv heads, head_dim), all >= 1")
        if max_variants < 1:
            raise ValueError(f"LearnedTuner max_variants {max_variants} must be >= 1")
        for op, w in model.ops.items():
            want = NUM_SHAPE_FEATURES + len(all_schedules(op)[0].features) + NUM_INTERACTIONS[op]
            if w.num_features != want:
                raise ValueError(f"the {op} cost model ({model.meta.get('device', '?')}) takes {w.num_features} "
                                 f"features, this version computes {want}: retrain it (scripts/train_tuner.py)")
        self.base, self.model, self.heads = base, model, tuple(heads)
        self.dtype_bytes, self.block_size, self.max_context = dtype_bytes, block_size, max_context
        self.prune, self.max_variants = prune, max_variants
        self._buckets: dict[tuple[StepKind, int], _Bucket] = {}
        self._cache: dict[tuple, int] = {}
        self._predictions = 0
        self._hits = 0

    # ---- StepTuner ----

    def variants(self, kind: StepKind, padded_size: int) -> tuple[Kernels, ...]:
        """The base Kernels, then the candidates the model says can win in this bucket (at most max_variants)."""
        return self._bucket(kind, padded_size).kernels

    def choose(self, plan, kind: StepKind, padded_size: int) -> int:
        """Index into variants(kind, padded_size): the cached choice for the step's key, else the model's."""
        b = self._buckets.get((kind, padded_size)) or self._bucket(kind, padded_size)
        if b.ranker is None:
            return 0
        key = plan_key(plan, kind, padded_size)
        index = self._cache.get(key)
        if index is not None:
            self._hits += 1
            return index
        cu = plan.cu_q_lens
        q_lens = None if kind is StepKind.DECODE else cu[1:] - cu[:-1]  # np.diff: 3x slower
        stats = length_stats(plan.kv_lens, q_lens, plan.kv_extent)
        index = b.ranker.best(shape_features(kind, padded_size, self.heads, self.dtype_bytes, stats), stats)
        self._predictions += 1
        if len(self._cache) >= MAX_CACHE:
            self._cache.clear()
        self._cache[key] = index
        return index

    def stats(self) -> dict[str, int]:
        """predictions (model runs), cache_hits, cache_keys (distinct keys held)."""
        return {"predictions": self._predictions, "cache_hits": self._hits, "cache_keys": len(self._cache)}

    # ---- buckets ----

    def variant_names(self, kind: StepKind, padded_size: int) -> tuple[str, ...]:
        """Candidate names of variants(kind, padded_size), in the same order."""
        return self._bucket(kind, padded_size).names

    def _bucket(self, kind: StepKind, padded_size: int) -> _Bucket:
        if padded_size < 1:
            raise ValueError(f"padded_size {padded_size} must be >= 1")
        key = (kind, padded_size)
        if key not in self._buckets:
            self._buckets[key] = self._build(kind, padded_size)
        return self._buckets[key]

    def _build(self, kind: StepKind, padded_size: int) -> _Bucket:
        op = kind.label
        if op not in OPS:  # a verify step: no learned schedules of its own yet, it runs the base Kernels
            return _Bucket((self.base,), ("base",), None)
        known = set(self.model.names.get(op, ()))
        scheds = [s for s in candidates(op, self.base, padded_size, block_size=self.block_size) if s.name in known]
        default = candidates(op, self.base, padded_size, block_size=self.block_size)[0]
        if op not in self.model.ops or len(scheds) <= 1 or default.name not in known:
            return _Bucket((self.base,), (default.name,), None)
        names = [s.name for s in scheds]
        if self.prune and len(scheds) > 1:
            ranker = self._ranker(op, names)
            pred = [ranker.predict(f.vector(), f.stats())
                    for f in sample_shapes(kind, padded_size, heads=self.heads, max_context=self.max_context,
                                           count=PRUNE_SAMPLES, dtype_bytes=self.dtype_bytes)]
            scheds = [scheds[i] for i in keep_variants(np.stack(pred), self.max_variants)]
        names = tuple(s.name for s in scheds)
        kernels = (self.base,) + tuple(s.apply(self.base) for s in scheds[1:])
        return _Bucket(kernels, names, self._ranker(op, names) if len(names) > 1 else None)

    def _ranker(self, op: str, names) -> OpRanker:
        return op_ranker(self.model, op, names, kv_heads=self.heads[1], block_size=self.block_size)


def op_ranker(model: CostModel, op: str, names, *, kv_heads: int, block_size: int | None) -> OpRanker:
    """model's OpRanker over the named candidates of op, with their interaction features for a pool of
    kv_heads (on one device) and rBlocks of block_size."""
    inter = interaction_features(op, names, kv_heads=kv_heads, block_size=block_size)
    return OpRanker.build(model.ops[op], names, schedule_matrix(op, names), inter, NUM_INTERACTIONS[op])
