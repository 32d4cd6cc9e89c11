"""Exact merge of attention computed over parts of the KV, from each part's softmax statistics.

A partial result over a subset of the keys is `(out, row_max, row_sum)`: the output normalised
over that subset, the max score and the sum of `exp(score - row_max)`. For any split of the keys
into parts `i`, with `M = max_i row_max_i` and `w_i = row_sum_i * exp(row_max_i - M)`:

    out = sum_i w_i * out_i / sum_i w_i,   row_max = M,   row_sum = sum_i w_i.

DistAttention (parts on other devices) merges with `merge_partials` (the parts' reductions can be
collectives over a mesh axis: sharding.dist_attention); the decode kernel's split-K
merges inside the kernel with `merge_run` (the last program of a sequence to finish merges its
consecutive parts), the same formula. An empty part (no keys: row_max -inf, row_sum 0, out
anything, even NaN) has weight 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import compat


class LeadingParts:
    """Parts stacked on the leading axis [P, ...], merged into one [...]."""

    def live(self, row_sum: jax.Array) -> jax.Array:
        return row_sum > 0

    def max(self, x: jax.Array) -> jax.Array:
        return jnp.max(x, axis=0)

    def expand(self, reduced: jax.Array) -> jax.Array:
        return reduced[None]

    def sum(self, x: jax.Array) -> jax.Array:
        return jnp.sum(x, axis=0)

    def result(self, reduced: jax.Array) -> jax.Array:
        return reduced


class SegmentParts:
    """Parts [P, ...] merged per segment: part p into segment segment_ids[p] of num_segments ([num_segments,
    ...]); parts whose id is outside [0, num_segments) are ignored, whatever they hold."""

    def __init__(self, segment_ids: jax.Array, num_segments: int):
        self.num_segments = num_segments
        self.in_range = (segment_ids >= 0) & (segment_ids < num_segments)
        self.ids = jnp.where(self.in_range, segment_ids, num_segments)  # past the end: mode="drop" drops them

    def live(self, row_sum: jax.Array) -> jax.Array:
        return (row_sum > 0) & self.in_range.reshape((-1,) + (1,) * (row_sum.ndim - 1))

    def max(self, x: jax.Array) -> jax.Array:
        return jnp.full((self.num_segments,) + x.shape[1:], -jnp.inf, x.dtype).at[self.ids].max(x, mode="drop")

    def expand(self, reduced: jax.Array) -> jax.Array:
        return reduced[jnp.clip(self.ids, 0, self.num_segments - 1)]

    def sum(self, x: jax.Array) -> jax.Array:
        return jnp.zeros((self.num_segments,) + x.shape[1:], x.dtype).at[self.ids].add(x, mode="drop")

    def result(self, reduced: jax.Array) -> jax.Array:
        return reduced


def merge_partials(
    outs: jax.Array,
    row_max: jax.Array,
    row_sum: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    num_segments: int | None = None,
    parts=None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Merge partial attention results, in float32: the one merge (the module docstring's formula).

    Args:
      outs: [P, ..., head_dim] normalised partial outputs (any float dtype).
      row_max: [P, ...] max score of each part (-inf for an empty part).
      row_sum: [P, ...] sum of exp(score - row_max) of each part (0 for an empty part).
      segment_ids: optional [P] int: merge parts per segment instead of all together (e.g. per
        sequence). Parts whose id is outside [0, num_segments) are ignored, whatever they hold.
      num_segments: static number of segments; required with segment_ids.
      parts: how the parts are laid out and reduced, instead of the two above: an object with `live(row_sum)`,
        `max(x)`, `expand(reduced)`, `sum(x)` and `result(reduced_max)` (LeadingParts, SegmentParts, or
        sharding's parts spread over a mesh axis, whose reductions are collectives).

    Returns:
      (out [..., head_dim] or [num_segments, ..., head_dim] float32, row_max, row_sum): the
      result over the union of the parts; where every part is empty: out 0, row_max -inf, row_sum 0.
    """
    if outs.shape[:-1] != row_max.shape or row_sum.shape != row_max.shape:
        raise ValueError(f"outs {outs.shape} must be row_max/row_sum {row_max.shape} plus head_dim; "
                         f"row_sum is {row_sum.shape}")
    if parts is None:
        if segment_ids is None:
            parts = LeadingParts()
        else:
            if num_segments is None:
                raise ValueError("merge_partials needs num_segments with segment_ids")
            if segment_ids.shape != row_max.shape[:1]:
                raise ValueError(f"segment_ids shape {segment_ids.shape} != (parts,) = ({row_max.shape[0]},)")
            parts = SegmentParts(segment_ids, num_segments)
    row_max = row_max.astype(jnp.float32)
    row_sum = row_sum.astype(jnp.float32)
    live = parts.live(row_sum)
    total_max = parts.max(jnp.where(live, row_max, -jnp.inf))
    part_max = parts.expand(total_max)
    # A finite stand-in keeps exp(-inf - -inf) from making NaN where every part is empty.
    safe_max = jnp.where(jnp.isfinite(part_max), part_max, 0.0)
    weight = jnp.where(live, row_sum * jnp.exp(jnp.where(live, row_max, 0.0) - safe_max), 0.0)
    # A part with no key contributes nothing, whatever its (unread) output holds, NaN included.
    weighted = jnp.where(live[..., None], outs.astype(jnp.float32), 0.0) * weight[..., None]
    total_sum = parts.sum(weight)
    total_out = parts.sum(weighted)
    out = total_out / jnp.where(total_sum > 0, total_sum, 1.0)[..., None]
    return out, parts.result(total_max), total_sum


# Parts merge_run loads at once: one dependent load per part would leave a long run (a 32K
# sequence split 32 ways) waiting on memory latency 32 times over.
MERGE_VALUES_PER_LOAD = 32


def parts_per_merge_load(rows: int) -> int:
    """How many consecutive parts merge_run loads at once for `rows` rows (a power of two)."""
    return max(1, MERGE_VALUES_PER_LOAD // rows)


def merge_run(outs_ref, max_ref, sum_ref, first, num, head, *, rows: int, real_rows: int, coherent: bool = False):
    """Inside a Triton-lowered kernel: merge parts first .. first + num - 1 of `head` (refs [P, H, R(, D)]).

    Rows >= real_rows and parts outside the run are never read (masked loads), so they may hold anything
    and the run may end at the arrays' end; a part of the run with no key (row sum 0) is read but adds
    nothing, whatever its max and output hold. coherent=True reads past L1, for parts other programs of the
    running kernel wrote (the decode kernel's last program of a sequence merges them).

    Returns (out [rows, D] float32 normalised, row_max [rows], row_sum [rows]); out 0, max -inf, sum 0 where
    no part has a key.
    """
    chunk = parts_per_merge_load(rows)
    head_dim = outs_ref.shape[-1]
    offsets = jnp.arange(chunk, dtype=jnp.int32)
    row_ok = jnp.arange(rows, dtype=jnp.int32) < real_rows

    def body(c, carry):
        acc, total_max, total_sum = carry
        parts = pl.ds(first + c * chunk, chunk)
        # Later parts belong to other runs (or lie past the arrays' end).
        mask = (c * chunk + offsets < num)[:, None] & row_ok[None, :]  # [chunk, rows]
        # The three loads depend on nothing loaded, so they wait on memory once, not three times in turn
        # (a long run merges one chunk after another: its latency is the merge's).
        part_sum = compat.triton_masked_load(sum_ref.at[parts, head, pl.ds(0, rows)], mask, 0.0,
                                             coherent=coherent)
        part_max = compat.triton_masked_load(max_ref.at[parts, head, pl.ds(0, rows)], mask, -jnp.inf,
                                             coherent=coherent)
        part_out = compat.triton_masked_load(outs_ref.at[parts, head, pl.ds(0, rows), :], mask[:, :, None], 0.0,
                                             coherent=coherent)  # [chunk, rows, D]
        live = mask & (part_sum > 0)
        part_max = jnp.where(live, part_max, -jnp.inf)
        new_max = jnp.maximum(total_max, jnp.max(part_max, axis=0))
        safe_max = jnp.where(new_max > -jnp.inf, new_max, 0.0)
        rescale = jnp.exp(total_max - safe_max)  # 0 while total_max is still -inf
        weight = jnp.where(live, part_sum * jnp.exp(jnp.where(live, part_max, 0.0) - safe_max[None, :]), 0.0)
        # A part with no key adds nothing, whatever its output holds (NaN included): selected, not multiplied.
        part_out = jnp.where(live[:, :, None], part_out, 0.0)
        acc = acc * rescale[:, None] + jnp.sum(part_out * weight[:, :, None], axis=0)
        return acc, new_max, total_sum * rescale + jnp.sum(weight, axis=0)

    init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    acc, total_max, total_sum = jax.lax.fori_loop(0, pl.cdiv(num, chunk), body, init)
    return acc / jnp.where(total_sum > 0, total_sum, 1.0)[:, None], total_max, total_sum
