"""Exact merge of attention computed over parts of the KV, from each part's softmax statistics.

A partial result over a subset of the keys is `(out, row_max, row_sum)`: the output normalised
over that subset, the max score and the sum of `exp(score - row_max)`. For any split of the keys
into parts `i`, with `M = max_i row_max_i` and `w_i = row_sum_i * exp(row_max_i - M)`:

    out = sum_i w_i * out_i / sum_i w_i,   row_max = M,   row_sum = sum_i w_i.

The kernel's own split-K and DistAttention (parts on other devices) both merge with this one
function. An empty part (no keys: row_max -inf, row_sum 0, out anything, even NaN) has weight 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
      segment_ids: optional [P] int: merge parts per segment instead of all together (the
        kernel's split-K merges per sequence). Parts whose id is outside [0, num_segments) are
        ignored, whatever they hold.
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
