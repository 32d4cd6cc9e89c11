"""Per op, the few schedules worth having: each a value of one `Kernels` field (or two), named and described
by numbers the cost model reads.

A candidate is a `Schedule`: a name (what the dataset records), the Kernels fields it replaces, and its
schedule features (numbers, the same length for every candidate of an op). Candidate 0 of each op is
"whatever the base Kernels says" (the fixed default), so a tuner that never predicts still runs today's
schedule. The sets are small on purpose: warm-up compiles every candidate once per bucket.

Decode attention (`ragged_decode`, DecodeBlockSizes): KV tile, how finely long KV is split across
programs (target_programs / short_target_programs / min_tokens_per_split), warps and stages.
Prefill attention: the Mosaic GPU kernel (Hopper) in three tilings vs the Triton kernel in three; the
Mosaic ones only where the base Kernels names Mosaic (a Hopper) and a step is long enough to take it.

Interaction features (`interaction_features`): numbers of one (step, candidate) pair that the kernel itself
derives, given to the model beside the shape and schedule features because a small MLP does not learn
them from a few hundred shapes: for decode, the KV split the kernel picks on the device
(`DecodeBlockSizes.split_for_work`), its tiles per work item, the longest sequence's items (more than one
means a merge) and the busy work items. Measured on both datasets (3 random splits each), they lift the
decode average and remove most of its shapes below 85% of the best; prefill has none (a trial with tile
counts changed nothing).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from pallas_kernels.dispatch import Kernels
from pallas_kernels.ragged_decode import DecodeBlockSizes
from pallas_kernels.ragged_prefill import PrefillBlockSizes
from pallas_kernels.ragged_prefill_mgpu import MosaicPrefillConfig

OPS = ("decode", "prefill")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One candidate schedule of one op.

    name: stable id (datasets and models name candidates by it). fields: Kernels field -> value it sets
    (empty: the base Kernels unchanged). features: numbers the cost model reads (same length per op).
    backend: "triton" | "mosaic" | "base" (prefill: which kernel it needs).
    """

    name: str
    fields: tuple[tuple[str, Any], ...]
    features: tuple[float, ...]
    backend: str = "triton"

    def __post_init__(self):
        if not self.name:
            raise ValueError("Schedule.name must be non-empty")
        if self.backend not in ("triton", "mosaic", "base"):
            raise ValueError(f"Schedule.backend {self.backend!r} is not one of ('triton', 'mosaic', 'base')")

    def apply(self, base: Kernels) -> Kernels:
        """base with this schedule's fields replaced."""
        return dataclasses.replace(base, **dict(self.fields)) if self.fields else base


def _decode(name: str, sizes: DecodeBlockSizes | None) -> Schedule:
    s = sizes or DecodeBlockSizes()
    feats = (math.log2(s.block_k), math.log2(s.target_programs), math.log2(s.short_target_programs),
             math.log2(s.min_tokens_per_split), math.log2(s.num_warps), float(s.num_stages))
    return Schedule(name, () if sizes is None else (("decode_block_sizes", sizes),), feats,
                    "base" if sizes is None else "triton")


def _triton_prefill(name: str, sizes: PrefillBlockSizes | None) -> Schedule:
    s = sizes or PrefillBlockSizes()
    fields = (("prefill_attention", "triton"), ("prefill_block_sizes", sizes))
    return Schedule(name, fields, (0.0, math.log2(s.block_q), math.log2(s.block_k), math.log2(s.num_warps),
                                   float(s.num_stages), 0.0, 0.0), "triton")


def _mosaic_prefill(name: str, config: MosaicPrefillConfig | None) -> Schedule:
    c = config or MosaicPrefillConfig()
    fields = (("prefill_attention", "mosaic"), ("mosaic_prefill", config))
    return Schedule(name, fields, (1.0, math.log2(2 * c.block_q), math.log2(c.block_kv), 3.0, float(c.steps),
                                   float(c.cluster_ctas), float(c.heaviest_first)), "mosaic")


# Decode: the default split heuristic (measured best on an H200 at a few shapes), coarser and finer
# splits (batch-1 long context wants many programs; big batches fewer, longer items), a longer tile
# and a shallower pipeline (fewer registers and shared memory: more programs resident per SM).
DECODE = (
    _decode("default", None),
    _decode("bk128", DecodeBlockSizes(block_k=128)),
    _decode("stages2", DecodeBlockSizes(num_stages=2)),
    _decode("split_fine", DecodeBlockSizes(target_programs=2048, short_target_programs=1024)),
    _decode("split_coarse", DecodeBlockSizes(target_programs=512, short_target_programs=256,
                                             min_tokens_per_split=1024)),
    _decode("bk128_w8", DecodeBlockSizes(block_k=128, num_warps=8, num_stages=3)),
)

# Prefill: index 0 is the base Kernels (Mosaic default on a Hopper, Triton default elsewhere); the others
# name their kernel explicitly so a choice never depends on mosaic_min_tokens.
PREFILL_TRITON = (
    _triton_prefill("triton_default", None),
    _triton_prefill("triton_q64_k64_w4", PrefillBlockSizes(block_q=64, block_k=64, num_warps=4, num_stages=3)),
    _triton_prefill("triton_q128_k64_w8", PrefillBlockSizes(block_q=128, block_k=64, num_warps=8, num_stages=3)),
)
PREFILL_MOSAIC = (
    _mosaic_prefill("mosaic_default", None),
    _mosaic_prefill("mosaic_cluster1", MosaicPrefillConfig(cluster_ctas=1)),
    _mosaic_prefill("mosaic_kv64_steps3", MosaicPrefillConfig(block_kv=64, steps=3)),
)


def decode_candidates(base: Kernels) -> tuple[Schedule, ...]:
    """The decode schedules a step under base may take: DECODE where base runs the Triton decode
    kernel (DECODE[0] keeps base's own decode_block_sizes), else only the base."""
    if base.decode_attention != "triton":
        return DECODE[:1]
    return DECODE


def prefill_candidates(base: Kernels, padded_tokens: int, *, block_size: int | None = None) -> tuple[Schedule, ...]:
    """The prefill schedules worth compiling for a bucket of padded_tokens under base (first: base's own).

    Mosaic candidates only where base names Mosaic (a Hopper) and the bucket reaches mosaic_min_tokens
    (below it the Mosaic variants would run the Triton kernel: duplicates), and where block_size (the
    rBlock, if given) is a multiple of the candidate's KV tile. Triton candidates where base runs a
    Pallas prefill at all.
    """
    if base.prefill_attention == "reference":
        return (Schedule("base", (), PREFILL_TRITON[0].features, "base"),)
    out = []
    if base.prefill_attention == "mosaic" and padded_tokens >= base.mosaic_min_tokens:
        for s in PREFILL_MOSAIC:
            kv = dict(s.fields)["mosaic_prefill"] or MosaicPrefillConfig()
            if block_size is None or block_size % kv.block_kv == 0:
                out.append(s)
    out += PREFILL_TRITON
    return tuple(out)


def candidates(op: str, base: Kernels, padded_size: int, *, block_size: int | None = None) -> tuple[Schedule, ...]:
    """decode_candidates or prefill_candidates by op name."""
    if op == "decode":
        return decode_candidates(base)
    if op == "prefill":
        return prefill_candidates(base, padded_size, block_size=block_size)
    raise ValueError(f"op {op!r} is not one of {OPS}")


def all_schedules(op: str) -> tuple[Schedule, ...]:
    """Every candidate an op has anywhere (the cost model's and the dataset's universe), in a fixed order."""
    if op == "decode":
        return DECODE
    if op == "prefill":
        return PREFILL_MOSAIC + PREFILL_TRITON
    raise ValueError(f"op {op!r} is not one of {OPS}")


# Interaction features per candidate, by op (the model's inputs: shape, then schedule, then these).
NUM_INTERACTIONS = {"decode": 4, "prefill": 0}


def interaction_features(op: str, names, *, kv_heads: int, block_size: int | None
                         ) -> Callable[[tuple], list[float]] | None:
    """For the named candidates of op, a function from a step's features.length_stats to the flat list of
    their interaction features (C x NUM_INTERACTIONS[op], candidate-major, in names order); None where the
    op has none. block_size None: the rBlock is taken as long as each candidate's KV tile. Plain Python: it
    runs on every new cache key."""
    if op not in OPS:
        raise ValueError(f"op {op!r} is not one of {OPS}")
    if NUM_INTERACTIONS[op] == 0:
        return None
    by_name = {s.name: s for s in all_schedules(op)}
    sizes = [dict(by_name[n].fields).get("decode_block_sizes") or DecodeBlockSizes() for n in names]
    # Candidates that differ only in warps or stages split alike: each distinct split rule is computed once.
    rules = [(s.target_programs, s.short_target_programs, s.min_tokens_per_split, s.tile(block_size or s.block_k))
             for s in sizes]
    distinct = list(dict.fromkeys(rules))
    reps = [(sizes[rules.index(rule)], rule[3]) for rule in distinct]
    which = [distinct.index(rule) for rule in rules]
    log2 = math.log2

    def features(stats: tuple) -> list[float]:
        n, total, longest = stats[0], int(stats[1]), stats[2]
        work, rows = total * kv_heads, []
        for s, tile in reps:
            split = s.split_for_work(work, tile, kv_heads)
            rows.append((log2(split), log2(split / tile), log2(1 + -(-longest // split)), log2(total / split + n)))
        return [x for i in which for x in rows[i]]

    return features
