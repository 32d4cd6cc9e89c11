"""Tensor-parallel layout: one table of rules from parameter paths to the axis split over `tensor`.

Applied to a built model's nnx state from outside (gpt-fast's tp.py): the model code knows nothing of
the mesh. With the rules below every matmul is either column-parallel (q/k/v, gate/up: each device
computes its own heads / MLP columns, no communication) or row-parallel (o, down: each device's partial
sum, added across the tensor axis where the next RMSNorm adds it to the residual stream), Megatron's
pairing, so a layer costs two all-reduces of [tokens, hidden]. Under `jax.jit` XLA inserts them from
the shardings; the Pallas kernels, which XLA cannot partition, run per device (tensor_parallel.py).

KV heads fewer than the tensor axis (Llama-2-70B: 8 KV heads, TP 16). Each device needs the K/V of its
own query heads, so some KV heads must live on several devices. We pre-expand them at load time
(`repeat_kv_heads`): every KV head becomes tensor_parallel / num_kv_heads copies, each paired with an
equal share of its group's query heads, and the model then runs as plain GQA with num_kv_heads ==
tensor_parallel. The layout stays uniform (one rule, one kernel, one pool shape; each device holds
exactly one KV head), and the query heads keep their order, so o does not change. The cost is the
replication itself, no more: per device the k/v weights and the KV pool are what any scheme must hold
there (one KV head's weights, one KV head's [tokens, head_dim] per layer); across the mesh the k/v
weights and the pool are stored tensor_parallel / num_kv_heads times (70B at TP 16: 2x the KV bytes,
the k/v part of qkv 2x, i.e. +1.6% of the model's weights).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sharding.mesh import INSTANCE, TENSOR, check_tensor_parallel, tensor_size

# The axis of the fused q/k/v weight that holds whole KV-head groups. In the per-KV-head layout
# [hidden, kv_heads, G + 2, head_dim] (each KV head's G query heads, then its k, then its v) it is the
# KV-head axis, so a split keeps every group on one device. The older fused layout
# [hidden, q_heads + 2 kv_heads, head_dim] splits on the same axis index: XLA's partitioner still computes
# the right values, but a device's slice then mixes q, k and v heads (fine under jit, not for a kernel
# run per device).
QKV_HEAD_AXIS = 1
_QKV = r"^layers/\d+/attention/qkv$"
_QKV_BIAS = r"^layers/\d+/attention/qkv_bias$"  # Qwen2's, [Hkv, G + 2, hd]: grouped as the weight is


@dataclasses.dataclass(frozen=True)
class Rule:
    """Parameters whose '/'-joined state path matches `pattern` are split on the tensor axis along the
    first of `axes` that it divides; no axes: replicated. required: raise when none divides (a weight
    that must be split for the step to be tensor-parallel), else replicate."""

    pattern: str
    axes: tuple[int, ...]
    required: bool = True

    def __post_init__(self):
        re.compile(self.pattern)  # a malformed pattern fails at import, not at the first lookup
        if any(not isinstance(a, int) for a in self.axes):
            raise ValueError(f"rule {self.pattern!r}: axes must be integers, got {self.axes!r}")


RULES: tuple[Rule, ...] = (
    Rule(_QKV, (QKV_HEAD_AXIS,)),  # column-parallel: whole KV-head groups
    Rule(_QKV_BIAS, (0,)),  # with its KV heads' q/k/v columns
    Rule(r"^layers/\d+/attention/o$", (0,)),  # [Hq, hd, D]: row-parallel on query heads
    Rule(r"^layers/\d+/mlp/gate_up$", (2,)),  # [D, 2, F]: column-parallel on F
    Rule(r"^layers/\d+/mlp/down$", (0,)),  # [F, D]: row-parallel on F
    # [V, D]: replicated. Split over the vocabulary, XLA on GPUs runs the lookup through an NCCL all-gather
    # (a sync point costing 0.66-0.8 ms of a 13B TP decode step on H100s: benchmarks/NOTES.md); split over
    # hidden, the looked-up rows would leave the residual stream split over hidden and XLA would keep it so
    # (an all-gather before every column-parallel matmul, an all-reduce in every RMSNorm). A decode step
    # reads one row a token, and the copies cost V x D per device (0.33 GB for 32000 x 5120 bf16).
    Rule(r"^embedding$", ()),
    # [D, V]: vocabulary (each device its logits' columns), else replicated: split over hidden, its contraction
    # would pull the hidden split back through the final norm into the whole residual stream (as above).
    Rule(r"^lm_head$", (1,), required=False),
    Rule(r"(^|/)\w*norm/weight$", ()),  # [D]: tiny, read whole by every device
    Rule(r"^inv_freq$", ()),
)


def _path_name(path) -> str:
    """('layers', 0, 'attention', 'qkv', .value) -> 'layers/0/attention/qkv'."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.GetAttrKey) and key.name != "value":  # nnx.Variable's payload
            parts.append(key.name)
    return "/".join(parts)


def spec_for(name: str, shape: tuple[int, ...], tensor_parallel: int, rules: tuple[Rule, ...] = RULES) -> P:
    """The PartitionSpec of one parameter `name` (a '/'-joined state path) of `shape`."""
    for rule in rules:
        if not re.search(rule.pattern, name):
            continue
        if tensor_parallel == 1 or not rule.axes:
            return P()
        for axis in rule.axes:
            if shape[axis] % tensor_parallel == 0:
                spec = [None] * len(shape)
                spec[axis] = TENSOR
                return P(*spec)
        if rule.required:
            raise ValueError(f"parameter {name} {tuple(shape)}: tensor_parallel {tensor_parallel} divides none of "
                             f"its axes {rule.axes} (sizes {[shape[a] for a in rule.axes]})")
        return P()
    raise ValueError(f"parameter {name} {tuple(shape)} matches no sharding rule; add one to sharding.rules.RULES")


def param_specs(state, tensor_parallel: int, rules: tuple[Rule, ...] = RULES):
    """A pytree like `state` (an nnx State, or any pytree of arrays / ShapeDtypeStructs) of PartitionSpecs."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: spec_for(_path_name(path), x.shape, tensor_parallel, rules), state)


def param_shardings(state, mesh: Mesh, rules: tuple[Rule, ...] = RULES):
    """NamedShardings for `state` on `mesh` (replicated over `instance`): jit's in/out shardings."""
    specs = param_specs(state, tensor_size(mesh), rules)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))


def shard_params(state, mesh: Mesh, rules: tuple[Rule, ...] = RULES):
    """`state` placed on `mesh` by the rules: each device receives only its slices."""
    return jax.device_put(state, param_shardings(state, mesh, rules))


# ----- KV heads fewer than the tensor axis -----

def kv_head_replication(config, tensor_parallel: int) -> int:
    """How many copies of each KV head the mesh needs: tensor_parallel / num_kv_heads, at least 1."""
    check_tensor_parallel(config, tensor_parallel)
    return max(1, tensor_parallel // config.num_kv_heads)


def _repeat_qkv(w: jax.Array, num_heads: int, num_kv_heads: int, factor: int) -> jax.Array:
    """One layer's fused q/k/v weight with each KV head repeated `factor` times (see repeat_kv_heads)."""
    if w.ndim == 4:  # per-KV-head layout [D, Hkv, G + 2, hd]
        d, hkv, g2, hd = w.shape
        g = g2 - 2
        q = w[:, :, :g].reshape(d, hkv, factor, g // factor, hd)  # each group's query heads, cut in `factor`
        kv = jnp.broadcast_to(w[:, :, None, g:], (d, hkv, factor, 2, hd))
        return jnp.concatenate([q, kv], axis=3).reshape(d, hkv * factor, g // factor + 2, hd)
    # fused layout [D, Hq + 2 Hkv, hd]: q heads unchanged, KV head h -> copies h*f .. h*f + f - 1
    q, k, v = jnp.split(w, [num_heads, num_heads + num_kv_heads], axis=1)
    return jnp.concatenate([q, jnp.repeat(k, factor, axis=1), jnp.repeat(v, factor, axis=1)], axis=1)


def repeat_kv_heads(config, state, factor: int):
    """(config, state) of the same model with every KV head stored `factor` times.

    Query head i keeps its index; in the new model it reads KV head i // (G / factor), a copy of its
    original KV head i // G, so the model computes the same function. Build the KV pool and the graphdef
    from the returned config (num_kv_heads multiplied by `factor`). factor must divide the group size G.
    """
    g = config.num_heads // config.num_kv_heads
    if not isinstance(factor, int) or factor <= 0 or g % factor:
        raise ValueError(f"KV-head replication factor {factor!r} must be a positive divisor of the group size "
                         f"{g} ({config.num_heads} query / {config.num_kv_heads} KV heads)")
    if factor == 1:
        return config, state

    def expand(path, x):
        name = _path_name(path)
        if re.search(_QKV, name):
            return _repeat_qkv(x, config.num_heads, config.num_kv_heads, factor)
        if re.search(_QKV_BIAS, name):  # the bias [Hkv, G + 2, hd] as a weight of hidden size 1
            return _repeat_qkv(x[None], config.num_heads, config.num_kv_heads, factor)[0]
        return x

    new_config = config.replace(num_kv_heads=config.num_kv_heads * factor)
    return new_config, jax.tree_util.tree_map_with_path(expand, state)


def load_sharding(config, mesh: Mesh):
    """path (an nnx state path tuple) , shape -> the NamedSharding a checkpoint's parameter of `config` is
    loaded with, each device reading only its slice.

    As the rules say, except the fused q/k/v when its KV heads are to be replicated
    (prepare_tensor_parallel, after loading): it is loaded split on hidden (replicated if that does not
    divide), so no device holds a whole layer's q/k/v until the replication reshards it on KV heads; its
    bias, where it has one, is loaded whole.
    """
    n = tensor_size(mesh)
    factor = kv_head_replication(config, n)

    def sharding(path: tuple, shape: tuple[int, ...]) -> NamedSharding:
        name = "/".join(str(p) for p in path)
        if factor > 1 and re.search(_QKV, name):
            return NamedSharding(mesh, P(TENSOR) if shape[0] % n == 0 else P())
        if factor > 1 and re.search(_QKV_BIAS, name):
            return NamedSharding(mesh, P())  # a q/k/v bias: small, whole until the replication splits it
        return NamedSharding(mesh, spec_for(name, shape, n))

    return sharding


def prepare_tensor_parallel(config, state, tensor_parallel: int):
    """(config, state) ready to be split `tensor_parallel` ways: checked, KV heads replicated if needed."""
    return repeat_kv_heads(config, state, kv_head_replication(config, tensor_parallel))


# ----- the KV pool -----

def kv_pool_specs(kv_cache, mesh: Mesh):
    """PartitionSpecs for a KV pool pytree (kv_cache.KVCache: per layer k, v [blocks, kv_heads, block, hd],
    int8 scales [blocks, kv_heads, block]).

    KV heads are split over `tensor` (each device holds its query heads' KV: no collective in attention)
    and rBlocks over `instance` (each instance owns its own range of rBlock ids: DistKV-LLM's local pool).
    """
    n, m = tensor_size(mesh), int(mesh.shape.get(INSTANCE, 1))

    def spec(x):
        blocks, heads = x.shape[0], x.shape[1]
        if heads % n:
            raise ValueError(f"KV pool of {heads} KV heads cannot be split tensor_parallel {n} ways; replicate KV "
                             "heads first (prepare_tensor_parallel) and build the pool from its config")
        if blocks % m:
            raise ValueError(f"KV pool of {blocks} rBlocks cannot be split among {m} instances")
        return P(INSTANCE if m > 1 else None, TENSOR if n > 1 else None)

    return jax.tree.map(spec, kv_cache)


def kv_pool_shardings(kv_cache, mesh: Mesh):
    """NamedShardings for the KV pool (jit's in/out shardings; out must equal in for donation)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), kv_pool_specs(kv_cache, mesh),
                        is_leaf=lambda x: isinstance(x, P))


def abstract_kv_pool(kv_cache, mesh: Mesh):
    """The pool as kv_pool_shardings would place it, as jax.ShapeDtypeStruct leaves (kv_cache: a pool, or
    jax.eval_shape of one): its shapes, dtypes and shardings, nothing allocated (memory planning compiles over it)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), kv_cache,
                        kv_pool_shardings(kv_cache, mesh))


def shard_kv_pool(kv_cache, mesh: Mesh):
    """The KV pool placed on `mesh` by kv_pool_specs."""
    return jax.device_put(kv_cache, kv_pool_shardings(kv_cache, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds all of it: the step's inputs (token ids, positions, tables) and its sampled tokens."""
    return NamedSharding(mesh, P())
