"""Exact merge of attention computed over parts of the KV, from each part's softmax statistics.

A partial result over a subset of the keys is `(out, row_max, row_sum)`: the output normalised
over that subset, the max score and the sum of `exp(score - row_max)`. For any split of the keys
into parts `i`, with `M = max_i row_max_i` and `w_i = row_sum_i * exp(row_max_i - M)`:

    out = sum_i w_i * out_i / sum_i w_i,   row_max = M,   row_sum = sum_i w_i.

DistAttention (parts on other devices) merges with `merge_partials`; the decode kernel's split-K
merges inside the kernel with `merge_run` (the last program of a sequence to finish merges its
consecutive parts), the same formula. An empty part (no keys: row_max -inf, row_sum 0, out
anything, even NaN) has weight 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import compat


def merge_partials(
    outs: jax.Array,
    row_max: jax.Array,
    row_sum: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    num_segments: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Merge partial attention results over the leading axis, in float32.

    Args:
      outs: [P, ..., head_dim] normalised partial outputs (any float dtype).
      row_max: [P, ...] max score of each part (-inf for an empty part).
      row_sum: [P, ...] sum of exp(score - row_max) of each part (0 for an empty part).
      segment_ids: optional [P] int: merge parts per segment instead of all together (e.g. per
        sequence). Parts whose id is outside [0, num_segments) are ignored, whatever they hold.
      num_segments: static number of segments; required with segment_ids.

    Returns:
      (out [..., head_dim] or [num_segments, ..., head_dim] float32, row_max, row_sum): the
      result over the union of the parts; where every part is empty: out 0, row_max -inf, row_sum 0.
    """
    if outs.shape[:-1] != row_max.shape or row_sum.shape != row_max.shape:
        raise ValueError(f"outs {outs.shape} must be row_max/row_sum {row_max.shape} plus head_dim; "
                         f"row_sum is {row_sum.shape}")
    row_max = row_max.astype(jnp.float32)
    row_sum = row_sum.astype(jnp.float32)
    outs = outs.astype(jnp.float32)
    if segment_ids is None:
        live = row_sum > 0
        total_max = jnp.max(jnp.where(live, row_max, -jnp.inf), axis=0)
        part_max = total_max[None]
    else:
        if num_segments is None:
            raise ValueError("merge_partials needs num_segments with segment_ids")
        if segment_ids.shape != row_max.shape[:1]:
            raise ValueError(f"segment_ids shape {segment_ids.shape} != (parts,) = ({row_max.shape[0]},)")
        in_range = (segment_ids >= 0) & (segment_ids < num_segments)
        live = (row_sum > 0) & in_range.reshape((-1,) + (1,) * (row_max.ndim - 1))
        # Out-of-range ids point past the end; mode="drop" discards them.
        ids = jnp.where(in_range, segment_ids, num_segments)
        total_max = jnp.full((num_segments,) + row_max.shape[1:], -jnp.inf, jnp.float32)
        total_max = total_max.at[ids].max(jnp.where(live, row_max, -jnp.inf), mode="drop")
        part_max = total_max[jnp.clip(ids, 0, num_segments - 1)]
    # A finite stand-in keeps exp(-inf - -inf) from making NaN where every part is empty.
    safe_max = jnp.where(jnp.isfinite(part_max), part_max, 0.0)
    weight = jnp.where(live, row_sum * jnp.exp(jnp.where(live, row_max, 0.0) - safe_max), 0.0)
    weighted = jnp.where(live[..., None], outs, 0.0) * weight[..., None]
    if segment_ids is None:
        total_sum = jnp.sum(weight, axis=0)
        total_out = jnp.sum(weighted, axis=0)
    else:
        total_sum = jnp.zeros(total_max.shape, jnp.float32).at[ids].add(weight, mode="drop")
        total_out = jnp.zeros(total_max.shape + outs.shape[-1:], jnp.float32).at[ids].add(weighted, mode="drop")
    out = total_out / jnp.where(total_sum > 0, total_sum, 1.0)[..., None]
    return out, total_max, total_sum


# Parts merge_run loads at once: one dependent load per part would leave a long run (a 32K
# sequence split 32 ways) waiting on memory latency 32 times over.
MERGE_VALUES_PER_LOAD = 32


def parts_per_merge_load(rows: int) -> int:
    """How many consecutive parts merge_run loads at once for `rows` rows (a power of two)."""
    return max(1, MERGE_VALUES_PER_LOAD // rows)


def merge_run(outs_ref, max_ref, sum_ref, first, num, head, *, rows: int, real_rows: int, coherent: bool = False):
    """Inside a Triton-lowered kernel: merge parts first .. first + num - 1 of `head` (refs [P, H, R(, D)]).

    Rows >= real_rows and parts outside the run are never read (masked loads), so they may hold anything
    and the run may end at the arrays' end. coherent=True reads past L1, for parts other programs of the
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
        part_sum = compat.triton_masked_load(sum_ref.at[parts, head, pl.ds(0, rows)], mask, 0.0,
                                             coherent=coherent)
        live = mask & (part_sum > 0)
        part_max = compat.triton_masked_load(max_ref.at[parts, head, pl.ds(0, rows)], live, -jnp.inf,
                                             coherent=coherent)
        new_max = jnp.maximum(total_max, jnp.max(part_max, axis=0))
        safe_max = jnp.where(new_max > -jnp.inf, new_max, 0.0)
        rescale = jnp.exp(total_max - safe_max)  # 0 while total_max is still -inf
        weight = jnp.where(live, part_sum * jnp.exp(jnp.where(live, part_max, 0.0) - safe_max[None, :]), 0.0)
        part_out = compat.triton_masked_load(outs_ref.at[parts, head, pl.ds(0, rows), :], live[:, :, None], 0.0,
                                             coherent=coherent)  # [chunk, rows, D]
        acc = acc * rescale[:, None] + jnp.sum(part_out * weight[:, :, None], axis=0)
        return acc, new_max, total_sum * rescale + jnp.sum(weight, axis=0)

    init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    acc, total_max, total_sum = jax.lax.fori_loop(0, pl.cdiv(num, chunk), body, init)
    return acc / jnp.where(total_sum > 0, total_sum, 1.0)[:, None], total_max, total_sum
