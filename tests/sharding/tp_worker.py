"""Tensor-parallel checks on 8 CPU host devices, run in a subprocess by test_tensor_parallel.py.

The device count must be set before jax is imported, which a pytest process (shared with every other
test) cannot do; this script does it and prints one JSON line of results for the tests to assert on.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxllm.model.kv_cache import init_kv_cache

from pallas_kernels.dispatch import AttentionBatch  # noqa: E402
from jaxllm.model import llama  # noqa: E402
from jaxllm.model.config import LlamaConfig  # noqa: E402
from pallas_kernels import dispatch, kv_write  # noqa: E402
from sharding import rules  # noqa: E402
from sharding.mesh import TENSOR, make_mesh  # noqa: E402
from sharding.tensor_parallel import tensor_parallel_attention, tensor_parallel_rope_write_kv  # noqa: E402

BLOCK, BLOCKS = 4, 8
CONFIGS = {
    "mha": LlamaConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=8,
                       intermediate_size=128, name="mha"),
    "gqa": LlamaConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=4,
                       intermediate_size=128, name="gqa"),
    "gqa_wide": LlamaConfig(vocab_size=259, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=2,
                            intermediate_size=128, name="gqa_wide"),  # 259: the embedding splits on hidden
    # llama2-70b's head counts (64 query / 8 KV heads) at a small width
    "70b": LlamaConfig.llama2_70b(vocab_size=512, hidden_size=256, num_layers=2, intermediate_size=256),
}


def _steps():
    """A prefill of two sequences (5 and 3 tokens), then a decode step of both padded to the same shapes
    (one compile serves both), as (tokens, positions, batch)."""
    a, b = [0, 1], [2]  # rBlocks of each sequence
    slots = [a[p // BLOCK] * BLOCK + p % BLOCK for p in range(5)] + [b[p // BLOCK] * BLOCK + p % BLOCK for p in range(3)]
    tables = jnp.array([[0, 1], [2, 0]], jnp.int32)
    prefill = (jnp.array([3, 17, 42, 7, 99, 5, 250, 11], jnp.int32), jnp.array([0, 1, 2, 3, 4, 0, 1, 2], jnp.int32),
               AttentionBatch(tables, jnp.array([5, 3], jnp.int32), jnp.array([0, 5, 8], jnp.int32),
                              jnp.array(slots, jnp.int32)))
    # one token each, then 6 padding tokens (no sequence, written nowhere), as the runner pads a step
    decode = (jnp.array([60, 61, 0, 0, 0, 0, 0, 0], jnp.int32), jnp.array([5, 3, 0, 0, 0, 0, 0, 0], jnp.int32),
              AttentionBatch(tables, jnp.array([6, 4], jnp.int32), jnp.array([0, 1, 2], jnp.int32),
                             jnp.array([1 * BLOCK + 1, 2 * BLOCK + 3, -1, -1, -1, -1, -1, -1], jnp.int32)))
    return prefill, decode


def _run(graphdef, state, kv, out_shardings=None):
    """Logits [tokens, vocab] of the prefill then the decode step (real tokens only), and the final pool."""
    def forward(state, kv, tokens, positions, batch):
        model = nnx.merge(graphdef, state)
        hidden, kv = model(tokens, positions, kv, batch)
        return model.logits(hidden), kv

    step = jax.jit(forward, out_shardings=out_shardings)
    logits = []
    for (tokens, positions, batch), real in zip(_steps(), (8, 2)):
        out, kv = step(state, kv, tokens, positions, batch)
        logits.append(out[:real])
    return logits, kv


def _split_fraction(arrays, tensor_parallel):
    """For each array: (fraction of it one device holds, number of distinct devices holding shards)."""
    out = {}
    for name, x in arrays.items():
        shards = x.addressable_shards
        sizes = {int(np.prod(s.data.shape)) for s in shards}
        out[name] = dict(fraction=max(sizes) / x.size, devices=len({s.device for s in shards}),
                         spec=str(x.sharding.spec))
    return out


def _named_leaves(tree):
    return {rules._path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


_UNSHARDED = {}


def _unsharded(config):
    """The model's state and its single-device logits (computed once per config)."""
    if config not in _UNSHARDED:
        graphdef, state = nnx.split(llama.init_model(config, seed=1))
        _UNSHARDED[config] = state, _run(graphdef, state, init_kv_cache(config, BLOCKS, BLOCK, "float32"))[0]
    return _UNSHARDED[config]


def tp_case(config, tensor_parallel, instances=1, attention_in_shard_map=False):
    state, want = _unsharded(config)

    tp_config, tp_state = rules.prepare_tensor_parallel(config, state, tensor_parallel)
    tp_graphdef = nnx.graphdef(llama.abstract_model(tp_config))
    mesh = make_mesh(tensor_parallel, instances)
    sharded = rules.shard_params(tp_state, mesh)
    kv = rules.shard_kv_pool(init_kv_cache(tp_config, BLOCKS, BLOCK, "float32"), mesh)
    kv_shardings = rules.kv_pool_shardings(kv, mesh)
    original = llama.ragged_attention
    if attention_in_shard_map:  # the per-device path a Pallas kernel takes, here over the reference
        llama.ragged_attention = tensor_parallel_attention(dispatch.ragged_attention, mesh)
    try:
        got, kv = _run(tp_graphdef, sharded, kv, out_shardings=(rules.replicated(mesh), kv_shardings))
    finally:
        llama.ragged_attention = original
    error = max(float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w))) for g, w in zip(got, want))
    params = _split_fraction(_named_leaves(sharded), tensor_parallel)
    pool = _split_fraction({f"pool/{k}": v for k, v in _named_leaves(kv).items()}, tensor_parallel)
    return dict(error=error, kv_heads=tp_config.num_kv_heads, params=params, pool=pool,
                devices=mesh.devices.size)


def _pool_and_tables(rng, config, lens, block):
    k = jnp.asarray(rng.standard_normal((BLOCKS * 2, config.num_kv_heads, block, config.head_dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal(k.shape), jnp.float32)
    tables = jnp.array([[0, 1, 2, 3], [4, 5, 6, 7]], jnp.int32)
    return k, v, tables, jnp.array(lens, jnp.int32)


def kernel_case(tensor_parallel):
    """The Triton-lowered Pallas attention (interpret mode) per shard vs the reference unsharded."""
    block = 16  # the decode kernel's smallest rBlock
    config = LlamaConfig(vocab_size=256, hidden_size=512, num_layers=1, num_heads=8, num_kv_heads=2,
                         intermediate_size=128)  # head_dim 64: a size the kernels take; TP 4 replicates KV heads
    config, _ = rules.repeat_kv_heads(config, {}, rules.kv_head_replication(config, tensor_parallel))
    rng = np.random.default_rng(0)
    mesh = make_mesh(tensor_parallel)
    attention = jax.jit(tensor_parallel_attention(dispatch.ragged_attention, mesh),
                        static_argnames=("decode", "num_q_heads", "kernels"))
    triton = dispatch.Kernels(decode_attention="triton", prefill_attention="triton", interpret=True)
    errors = {}
    for decode, lens, cu in ((True, [37, 6], [0, 1, 2]), (False, [37, 6], [0, 5, 8])):
        k, v, tables, kv_lens = _pool_and_tables(rng, config, lens, block)
        q = jnp.asarray(rng.standard_normal((cu[-1], config.num_heads, config.head_dim)), jnp.float32)
        cu = jnp.array(cu, jnp.int32)
        want = dispatch.ragged_attention(q, k, v, tables, kv_lens, cu, decode=decode)
        got = attention(q, k, v, tables, kv_lens, cu, decode=decode, kernels=triton)
        errors["decode" if decode else "prefill"] = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
        errors["out_spec_" + ("decode" if decode else "prefill")] = str(got.sharding.spec)
    return errors


def rope_write_case(tensor_parallel):
    """RoPE + KV write per shard over the per-KV-head q/k/v layout [T, Hkv, G + 2, hd] vs unsharded."""
    config = CONFIGS["gqa"]
    hq, hkv, hd, t = config.num_heads, config.num_kv_heads, config.head_dim, 6
    g = hq // hkv
    rng = np.random.default_rng(1)
    grouped = jnp.asarray(rng.standard_normal((t, hkv, g + 2, hd)), jnp.float32)
    angles = jnp.asarray(rng.standard_normal((t, hd // 2)), jnp.float32)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    slots = jnp.array([0, 1, 2, 5, 9, -1], jnp.int32)
    pool = jnp.zeros((BLOCKS, hkv, BLOCK, hd), jnp.float32)
    want_q, want_k, want_v, _, _ = kv_write.rope_write_kv(pool, pool, grouped, cos, sin, slots)

    def local(k_pool, v_pool, qkv, cos, sin, slot_mapping, k_scale, v_scale):
        q, k_pool, v_pool, _, _ = kv_write.rope_write_kv(k_pool, v_pool, qkv, cos, sin, slot_mapping)
        return q, k_pool, v_pool, k_pool[:, :, :, 0], v_pool[:, :, :, 0]

    mesh = make_mesh(tensor_parallel)
    q, k, v, _, _ = jax.jit(tensor_parallel_rope_write_kv(local, mesh))(
        pool, pool, grouped, cos, sin, slots, pool[:, :, :, 0], pool[:, :, :, 0])
    error = max(float(jnp.max(jnp.abs(a - b))) for a, b in ((q[:, :, :g], want_q[:, :, :g]), (k, want_k), (v, want_v)))
    return dict(error=error, pool_fraction=max(int(np.prod(s.data.shape)) for s in k.addressable_shards) / k.size,
                devices=mesh.devices.size)


def main():
    results = {"device_count": jax.device_count()}
    for name, tp in (("mha", 2), ("mha", 4), ("mha", 8), ("gqa", 2), ("gqa", 8), ("gqa_wide", 8), ("70b", 8)):
        results[f"{name}/tp{tp}"] = tp_case(CONFIGS[name], tp)
    results["gqa/tp4x2"] = tp_case(CONFIGS["gqa"], 4, instances=2)  # both mesh axes
    results["gqa_wide/tp4/shard_map"] = tp_case(CONFIGS["gqa_wide"], 4, attention_in_shard_map=True)
    results["kernel/tp4"] = kernel_case(4)
    results["rope_write/tp4"] = rope_write_case(4)
    print(json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
