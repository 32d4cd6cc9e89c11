"""Argument checks shared by every attention kernel over the rBlock pool, and the tile and launch
checks shared by the Triton-lowered kernels' block-size dataclasses.

Shape and dtype checks always run (they are static). Checks on values (table entries, lengths)
run only when the arrays are concrete; under jit the engine has already validated its plan.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.compat import is_tracer

SUPPORTED_HEAD_DIMS = (64, 128)
FLOAT_KV_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
INT8 = jnp.dtype(jnp.int8)
# tl.dot needs at least 16 rows and columns: tiles are at least this, and smaller operands are padded to it.
MIN_DOT_ROWS = 16


def is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def check_dot_tile(name: str, value: int) -> None:
    """A tile side fed to tl.dot: a power of two >= MIN_DOT_ROWS."""
    if not is_pow2(value) or value < MIN_DOT_ROWS:
        raise ValueError(f"{name} {value} must be a power of two >= {MIN_DOT_ROWS}")


def check_launch(num_warps: int, num_stages: int, *, max_warps: int = 16) -> None:
    """Triton launch parameters: num_warps a power of two <= max_warps, num_stages >= 1."""
    if not is_pow2(num_warps) or num_warps > max_warps:
        allowed = ", ".join(str(1 << i) for i in range(max_warps.bit_length()))
        raise ValueError(f"num_warps {num_warps} must be one of {allowed}")
    if num_stages < 1:
        raise ValueError(f"num_stages {num_stages} must be >= 1")


def check_pool(q, k_pool, v_pool, k_scale, v_scale, *, head_dims=SUPPORTED_HEAD_DIMS) -> None:
    """q [..., num_q_heads, head_dim]; k_pool, v_pool [num_blocks, num_kv_heads, block_size, head_dim]."""
    if k_pool.ndim != 4 or v_pool.shape != k_pool.shape:
        raise ValueError(f"k_pool and v_pool must both be [num_blocks, kv_heads, block_size, head_dim]; "
                         f"got {k_pool.shape} and {v_pool.shape}")
    _, num_kv_heads, _, head_dim = k_pool.shape
    num_q_heads = q.shape[-2]
    if q.shape[-1] != head_dim:
        raise ValueError(f"query head_dim {q.shape[-1]} != KV head_dim {head_dim}")
    if head_dims is not None and head_dim not in head_dims:
        raise ValueError(f"head_dim {head_dim} is not supported; supported: {head_dims}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if jnp.dtype(q.dtype) not in FLOAT_KV_DTYPES:
        raise ValueError(f"query dtype {q.dtype} is not supported; use one of {FLOAT_KV_DTYPES}")
    kv_dtype = jnp.dtype(k_pool.dtype)
    if kv_dtype != jnp.dtype(v_pool.dtype):
        raise ValueError(f"k_pool dtype {k_pool.dtype} != v_pool dtype {v_pool.dtype}")
    if kv_dtype == INT8:
        if k_scale is None or v_scale is None:
            raise ValueError("int8 KV needs k_scale and v_scale [num_blocks, kv_heads, block_size]")
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s.shape != k_pool.shape[:3]:
                raise ValueError(f"{name} shape {s.shape} != pool shape without head_dim {k_pool.shape[:3]}")
    elif kv_dtype not in FLOAT_KV_DTYPES:
        raise ValueError(f"KV dtype {kv_dtype} is not supported; use bfloat16, float16, float32 or int8")
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale/v_scale are only for int8 KV, not {kv_dtype}")


def check_tables(block_tables, kv_lens, num_blocks: int, block_size: int) -> None:
    """block_tables [num_seqs, max_blocks] int32 in [0, num_blocks); kv_lens [num_seqs] <= table capacity."""
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [num_seqs, max_blocks_per_seq], got shape {block_tables.shape}")
    if kv_lens.shape != block_tables.shape[:1]:
        raise ValueError(f"kv_lens shape {kv_lens.shape} != (num_seqs,) = ({block_tables.shape[0]},)")
    for name, a in (("block_tables", block_tables), ("kv_lens", kv_lens)):
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got {a.dtype}")
    capacity = block_tables.shape[1] * block_size
    if not is_tracer(kv_lens):
        lens = np.asarray(kv_lens)
        if lens.size and (lens.min() < 0 or lens.max() > capacity):
            bad = int(lens.max()) if lens.max() > capacity else int(lens.min())
            raise ValueError(f"kv_len {bad} is outside [0, {capacity}] (table width "
                             f"{block_tables.shape[1]} x block_size {block_size})")
        if not is_tracer(block_tables):
            tables = np.asarray(block_tables)
            # Only entries a sequence actually uses must be valid; the rest is padding.
            used = np.arange(tables.shape[1])[None, :] < -(-lens[:, None] // block_size)
            vals = tables[used]
            if vals.size and (vals.min() < 0 or vals.max() >= num_blocks):
                bad = int(vals.max()) if vals.max() >= num_blocks else int(vals.min())
                raise ValueError(f"block_tables entry {bad} is outside [0, {num_blocks}) (pool size)")


def check_cu_q_lens(cu_q_lens, num_seqs: int, num_tokens: int, kv_lens=None) -> None:
    """cu_q_lens [num_seqs + 1]: non-decreasing offsets of each sequence's query tokens, ending <= num_tokens."""
    if cu_q_lens.shape != (num_seqs + 1,):
        raise ValueError(f"cu_q_lens shape {cu_q_lens.shape} != (num_seqs + 1,) = ({num_seqs + 1},)")
    if is_tracer(cu_q_lens):
        return
    cu = np.asarray(cu_q_lens)
    if cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] > num_tokens:
        raise ValueError(f"cu_q_lens must start at 0, not decrease and end <= {num_tokens} query tokens; got {cu}")
    if kv_lens is not None and not is_tracer(kv_lens):
        q_lens, lens = np.diff(cu), np.asarray(kv_lens)
        if np.any(q_lens > lens):
            s = int(np.argmax(q_lens > lens))
            raise ValueError(f"sequence {s} has {q_lens[s]} query tokens but kv_len {lens[s]}: the KV of the "
                             "query tokens must already be written")


def check_ragged_prefill_args(q, k_pool, v_pool, block_tables, kv_lens, cu_q_lens, k_scale=None, v_scale=None,
                              head_dims=SUPPORTED_HEAD_DIMS) -> None:
    """Raise ValueError naming the value and the limit for malformed ragged-prefill arguments."""
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim], got shape {q.shape}")
    check_pool(q, k_pool, v_pool, k_scale, v_scale, head_dims=head_dims)
    check_tables(block_tables, kv_lens, k_pool.shape[0], k_pool.shape[2])
    check_cu_q_lens(cu_q_lens, block_tables.shape[0], q.shape[0], kv_lens)


def check_ragged_decode_args(q, k_pool, v_pool, block_tables, kv_lens, k_scale=None, v_scale=None) -> None:
    """Raise ValueError naming the value and the limit for malformed ragged-decode arguments."""
    if q.ndim != 3:
        raise ValueError(f"q must be [num_seqs, num_q_heads, head_dim], got shape {q.shape}")
    check_pool(q, k_pool, v_pool, k_scale, v_scale)
    block_size = k_pool.shape[2]
    if block_size % MIN_DOT_ROWS:
        raise ValueError(f"rBlock size {block_size} must be a multiple of {MIN_DOT_ROWS} for the decode kernel")
    check_tables(block_tables, kv_lens, k_pool.shape[0], block_size)
    if q.shape[0] != block_tables.shape[0]:
        raise ValueError(f"q has {q.shape[0]} sequences but block_tables has {block_tables.shape[0]} rows")
