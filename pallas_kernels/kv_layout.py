"""The rBlock pool layout every kernel shares, and reading it back for references.

Per layer, K and V each live in a pool `[num_blocks, num_kv_heads, block_size, head_dim]`:
head-major inside each rBlock, so one (rBlock, head) is a contiguous `[block_size, head_dim]`
tile and a decode kernel streams it without a transpose. A sequence owns the rBlocks its
`block_tables` row lists; token `p` of the sequence lives in rBlock `table[p // block_size]`
at row `p % block_size`. int8 pools carry float32 scales `[num_blocks, num_kv_heads, block_size]`
(one per token per head: x = q * scale).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dequantize(pool: jax.Array, scale: jax.Array | None) -> jax.Array:
    """float32 values of a pool (or a gathered part of one): int8 * scale, or a plain upcast."""
    if scale is None:
        return pool.astype(jnp.float32)
    return pool.astype(jnp.float32) * scale[..., None].astype(jnp.float32)


def gather_sequences(pool: jax.Array, scale: jax.Array | None, block_tables: jax.Array) -> jax.Array:
    """Each sequence's KV in order, as float32 `[num_seqs, num_kv_heads, max_blocks * block_size, head_dim]`.

    For references only: this copies the KV, which no kernel may do.
    """
    num_seqs, max_blocks = block_tables.shape
    _, num_kv_heads, block_size, head_dim = pool.shape
    blocks = pool[block_tables]  # [S, W, Hkv, B, D]
    scales = None if scale is None else scale[block_tables]  # [S, W, Hkv, B]
    values = dequantize(blocks, scales)
    values = values.transpose(0, 2, 1, 3, 4)  # [S, Hkv, W, B, D]
    return values.reshape(num_seqs, num_kv_heads, max_blocks * block_size, head_dim)
