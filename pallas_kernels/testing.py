"""Inputs for checking the kernels: random ragged batches whose unused memory is poisoned (NaN), so a kernel
that reads what no sequence owns fails. The kernel tests (tests/pallas_kernels/test_ragged_prefill_mgpu.py) and
the GPU check (scripts/check_ragged_prefill_mgpu_gpu.py) draw from it, the same batch for the same seed."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def poisoned_ragged_batch(rng: np.random.Generator, *, q_lens, cached, block_size: int, head_dim: int,
                          num_kv_heads: int, num_q_heads: int, dtype, padding: int, spare_blocks: int) -> tuple:
    """Ragged prefill inputs over a shuffled rBlock pool; unowned pool rows and padding query tokens are NaN.

    Sequence s has q_lens[s] query tokens after cached[s] cached ones (kv_lens = q_lens + cached). Its
    rBlocks are a random subset of the pool, so tables are fragmented; the pool holds spare_blocks more
    than the tables name. NaN wherever no sequence owns a row lets any read of stale KV show in a result.
    Draws from rng in a fixed order (pool permutation, K, V, q): one seed always gives one batch.

    Returns (q [tokens, num_q_heads, head_dim], k_pool, v_pool [blocks, num_kv_heads, block_size, head_dim],
    block_tables [seqs, width] int32, kv_lens [seqs] int32, cu_q_lens [seqs + 1] int32), q and the pools in
    dtype, tokens = sum(q_lens) + padding.
    """
    q_lens, cached = np.asarray(q_lens), np.asarray(cached)
    kv_lens = q_lens + cached
    num_seqs = len(q_lens)
    width = max(1, int(max(-(-kv_lens // block_size))))
    num_blocks = num_seqs * width + spare_blocks
    tables = rng.permutation(num_blocks)[: num_seqs * width].reshape(num_seqs, width).astype(np.int32)
    owned = np.zeros((num_blocks, block_size), bool)
    for s in range(num_seqs):
        pos = np.arange(kv_lens[s])
        owned[tables[s, pos // block_size], pos % block_size] = True
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    pools = [np.where(owned[:, None, :, None], rng.standard_normal(shape, np.float32), np.nan) for _ in range(2)]
    num_tokens = int(q_lens.sum()) + padding
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim), np.float32)
    q[q_lens.sum():] = np.nan
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return (jnp.asarray(q, dtype), jnp.asarray(pools[0], dtype), jnp.asarray(pools[1], dtype), jnp.asarray(tables),
            jnp.asarray(kv_lens, jnp.int32), jnp.asarray(cu))
