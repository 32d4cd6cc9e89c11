"""The device KV pool (per layer, rBlocks) as a pytree; the per-step attention metadata is
pallas_kernels.dispatch.AttentionBatch.

The pool is passed into every step and returned from it, donated, never kept in a module
(docs/ARCHITECTURE.md, decision 5). Each layer has its own arrays so a kernel reads a layer's
pool without slicing (a slice of a stacked pool would be copied before a custom call).
"""

from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp

from jaxllm.model.config import LlamaConfig

KV_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32, "int8": jnp.int8}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerKV:
    """One layer's pool: k, v [num_blocks, kv_heads, block_size, head_dim]; scales [num_blocks, kv_heads, block_size] for int8."""

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    layers: list[LayerKV]

    @property
    def num_blocks(self) -> int:
        return self.layers[0].k.shape[0]

    @property
    def block_size(self) -> int:
        return self.layers[0].k.shape[2]


def kv_dtype(name_or_dtype) -> jnp.dtype:
    if isinstance(name_or_dtype, str):
        if name_or_dtype not in KV_DTYPES:
            raise ValueError(f"KV dtype {name_or_dtype!r} is not supported; use one of {sorted(KV_DTYPES)}")
        return jnp.dtype(KV_DTYPES[name_or_dtype])
    return jnp.dtype(name_or_dtype)


def kv_bytes_per_block(config: LlamaConfig, block_size: int, dtype) -> int:
    """Device bytes one rBlock takes across all layers (K and V, with int8 scales)."""
    dtype = kv_dtype(dtype)
    per_token_head = config.head_dim * dtype.itemsize + (4 if dtype == jnp.int8 else 0)
    return 2 * config.num_layers * config.num_kv_heads * block_size * per_token_head


def init_kv_cache(config: LlamaConfig, num_blocks: int, block_size: int, dtype="bfloat16") -> KVCache:
    """A zeroed pool of `num_blocks` rBlocks of `block_size` tokens in every layer."""
    dtype = kv_dtype(dtype)
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
    shape = (num_blocks, config.num_kv_heads, block_size, config.head_dim)
    layers = []
    for _ in range(config.num_layers):
        if dtype == jnp.int8:
            layers.append(LayerKV(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                                  jnp.ones(shape[:3], jnp.float32), jnp.ones(shape[:3], jnp.float32)))
        else:
            layers.append(LayerKV(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)))
    return KVCache(layers)
