"""Tensor parallelism on 8 CPU host devices: logits equal the unsharded ones, each device holds 1/N.

Each case is computed once per module (fixtures below, cached per case) and asserted on by several tests;
the unsharded logits of a config are computed once and shared by its cases.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm.model import llama
from jaxllm.model.config import LlamaConfig
from jaxllm.model.kv_cache import init_kv_cache
from pallas_kernels import dispatch, kv_write
from pallas_kernels.dispatch import AttentionBatch
from sharding import rules
from sharding.mesh import make_mesh
from sharding.tensor_parallel import (TensorShards, tensor_parallel_attention, tensor_parallel_kernels,
                                     tensor_parallel_rope_write_kv)
from tests.devices import needs_host_devices

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("sharding_tp"), needs_host_devices]

SPLIT = ("attention/qkv", "attention/o", "mlp/gate_up", "mlp/down", "lm_head")
REPLICATED = ("norm/weight", "inv_freq", "embedding")
VOCABULARY = ("lm_head",)  # split over the vocabulary where it divides, else replicated
BLOCK, BLOCKS = 4, 8
CONFIGS = {
    "mha": LlamaConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=8,
                       intermediate_size=128, name="mha"),
    "gqa": LlamaConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=4,
                       intermediate_size=128, name="gqa"),
    "gqa_wide": LlamaConfig(vocab_size=259, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=2,
                            intermediate_size=128, name="gqa_wide"),  # 259: embedding and head replicated
    # llama2-70b's head counts (64 query / 8 KV heads) at a small width
    "70b": LlamaConfig.llama2_70b(vocab_size=512, hidden_size=256, num_layers=2, intermediate_size=256),
}
# case: (config, tensor parallel, instances, kernels: "reference" (XLA partitions everything), "shard_map" (the
# reference attention per shard, the path a Pallas kernel takes) or "decode_layer" (that, and the Pallas add +
# RMSNorm in interpret mode on every device, as tensor_parallel_kernels sets it up on a GPU))
TP_CASES = {
    "mha/tp2": ("mha", 2, 1, "reference"),
    "mha/tp4": ("mha", 4, 1, "reference"),
    "mha/tp8": ("mha", 8, 1, "reference"),
    "gqa/tp2": ("gqa", 2, 1, "reference"),
    "gqa/tp8": ("gqa", 8, 1, "reference"),
    "gqa_wide/tp8": ("gqa_wide", 8, 1, "reference"),
    "70b/tp8": ("70b", 8, 1, "reference"),
    "gqa/tp4x2": ("gqa", 4, 2, "reference"),  # both mesh axes
    "gqa_wide/tp4/shard_map": ("gqa_wide", 4, 1, "shard_map"),
    "gqa/tp4/decode_layer": ("gqa", 4, 1, "decode_layer"),
    "gqa/tp2x2/decode_layer": ("gqa", 2, 2, "decode_layer"),
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
    # one token each, then 6 padding tokens (no sequence, written nowhere), as the executor pads a step
    decode = (jnp.array([60, 61, 0, 0, 0, 0, 0, 0], jnp.int32), jnp.array([5, 3, 0, 0, 0, 0, 0, 0], jnp.int32),
              AttentionBatch(tables, jnp.array([6, 4], jnp.int32), jnp.array([0, 1, 2], jnp.int32),
                             jnp.array([1 * BLOCK + 1, 2 * BLOCK + 3, -1, -1, -1, -1, -1, -1], jnp.int32)))
    return prefill, decode


def _run(graphdef, state, kv, out_shardings=None, kernels=dispatch.REFERENCE):
    """Logits [tokens, vocab] of the prefill then the decode step (real tokens only), and the final pool."""
    def forward(state, kv, tokens, positions, batch):
        model = nnx.merge(graphdef, state)
        hidden, kv = model(tokens, positions, kv, batch, kernels=kernels)
        return model.logits(hidden), kv

    step = jax.jit(forward, out_shardings=out_shardings)
    logits = []
    for (tokens, positions, batch), real in zip(_steps(), (8, 2)):
        out, kv = step(state, kv, tokens, positions, batch)
        logits.append(out[:real])
    return logits, kv


def _split_fraction(arrays):
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


def _unsharded(config):
    """The model's state and its single-device logits."""
    graphdef, state = nnx.split(llama.init_model(config, seed=1))
    return state, _run(graphdef, state, init_kv_cache(config, BLOCKS, BLOCK, "float32"))[0]


def _tp_case(unsharded, config, tensor_parallel, instances=1, kernels_kind="reference"):
    state, want = unsharded
    tp_config, tp_state = rules.prepare_tensor_parallel(config, state, tensor_parallel)
    tp_graphdef = nnx.graphdef(llama.abstract_model(tp_config))
    mesh = make_mesh(tensor_parallel, instances)
    sharded = rules.shard_params(tp_state, mesh)
    kv = rules.shard_kv_pool(init_kv_cache(tp_config, BLOCKS, BLOCK, "float32"), mesh)
    kv_shardings = rules.kv_pool_shardings(kv, mesh)
    kernels = dispatch.REFERENCE
    if kernels_kind == "shard_map":  # the per-device path a Pallas kernel takes (Kernels.per_shard), over the reference
        kernels = dataclasses.replace(kernels, per_shard=TensorShards(mesh))
    elif kernels_kind == "decode_layer":
        kernels = tensor_parallel_kernels(dispatch.Kernels(decode_layer="pallas", interpret=True), mesh)
    got, kv = _run(tp_graphdef, sharded, kv, out_shardings=(rules.replicated(mesh), kv_shardings), kernels=kernels)
    # Which Pallas kernels the decode step runs (by name), and whether a skinny matmul is among them.
    decode_step = _steps()[1]
    jaxpr = str(jax.make_jaxpr(lambda state, kv: nnx.merge(tp_graphdef, state)(*decode_step[:2], kv, decode_step[2],
                                                                               kernels=kernels))(sharded, kv))
    error = max(float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w))) for g, w in zip(got, want))
    params = _split_fraction(_named_leaves(sharded))
    pool = _split_fraction({f"pool/{k}": v for k, v in _named_leaves(kv).items()})
    return dict(error=error, kv_heads=tp_config.num_kv_heads, params=params, pool=pool, devices=mesh.devices.size,
                rms_norm_kernels=jaxpr.count("rms_norm"), skinny_kernels=jaxpr.count("skinny_matmul"))


def _pool_and_tables(rng, config, lens, block):
    k = jnp.asarray(rng.standard_normal((BLOCKS * 2, config.num_kv_heads, block, config.head_dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal(k.shape), jnp.float32)
    tables = jnp.array([[0, 1, 2, 3], [4, 5, 6, 7]], jnp.int32)
    return k, v, tables, jnp.array(lens, jnp.int32)


def _kernel_case(tensor_parallel):
    """The Triton-lowered Pallas attention (interpret mode) per shard vs the reference unsharded."""
    block = 16  # the decode kernel's smallest rBlock
    config = LlamaConfig(vocab_size=256, hidden_size=512, num_layers=1, num_heads=8, num_kv_heads=2,
                         intermediate_size=128)  # head_dim 64: a size the kernels take; TP 4 replicates KV heads
    config, _ = rules.repeat_kv_heads(config, {}, rules.kv_head_replication(config, tensor_parallel))
    rng = np.random.default_rng(0)
    mesh = make_mesh(tensor_parallel)
    attention = jax.jit(tensor_parallel_attention(dispatch.ragged_attention, mesh),
                        static_argnames=("single_query", "num_q_heads", "kernels"))
    triton = dispatch.Kernels(decode_attention="triton", prefill_attention="triton", interpret=True)
    errors = {}
    for decode, lens, cu in ((True, [37, 6], [0, 1, 2]), (False, [37, 6], [0, 5, 8])):
        k, v, tables, kv_lens = _pool_and_tables(rng, config, lens, block)
        q = jnp.asarray(rng.standard_normal((cu[-1], config.num_heads, config.head_dim)), jnp.float32)
        cu = jnp.array(cu, jnp.int32)
        want = dispatch.ragged_attention(q, k, v, tables, kv_lens, cu, single_query=decode)
        got = attention(q, k, v, tables, kv_lens, cu, single_query=decode, kernels=triton)
        errors["decode" if decode else "prefill"] = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
        errors["out_spec_" + ("decode" if decode else "prefill")] = str(got.sharding.spec)
    return errors


def _rope_write_case(tensor_parallel):
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


@pytest.fixture(scope="module")
def tp_result():
    """case -> its result, each computed once (a case that raises fails only the tests that ask for it)."""
    unsharded = functools.cache(lambda name: _unsharded(CONFIGS[name]))

    @functools.cache
    def result(case: str) -> dict:
        name, tensor_parallel, instances, shard_map = TP_CASES[case]
        return _tp_case(unsharded(name), CONFIGS[name], tensor_parallel, instances, shard_map)

    return result


@pytest.fixture(scope="module")
def kernel_result():
    return _kernel_case(4)


@pytest.fixture(scope="module")
def rope_write_result():
    return _rope_write_case(4)


@pytest.mark.parametrize("case", TP_CASES)
def test_logits_equal_unsharded(tp_result, case):
    assert jax.device_count() == 8
    assert tp_result(case)["error"] < 1e-5, tp_result(case)["error"]


@pytest.mark.parametrize("case", TP_CASES)
def test_each_device_holds_its_share(tp_result, case):
    config, n = CONFIGS[TP_CASES[case][0]], TP_CASES[case][1]
    r = tp_result(case)
    assert r["params"] and r["pool"]
    for name, held in r["params"].items():
        assert held["devices"] == r["devices"], (name, held)
        if name.endswith(SPLIT) and (config.vocab_size % n == 0 or not name.endswith(VOCABULARY)):
            assert held["fraction"] == pytest.approx(1 / n), (name, held)
        else:
            assert name.endswith(REPLICATED + VOCABULARY) and held["fraction"] == 1.0, (name, held)
    instances = r["devices"] // n
    for name, held in r["pool"].items():  # KV heads over tensor, rBlocks over instances
        assert held["fraction"] == pytest.approx(1 / (n * instances)), (name, held)


@pytest.mark.parametrize("case", [c for c, spec in TP_CASES.items() if spec[3] == "decode_layer"])
def test_decode_layer_norms_run_as_the_pallas_kernel_and_the_matmuls_stay_xla(tp_result, case):
    r = tp_result(case)
    layers = CONFIGS[TP_CASES[case][0]].num_layers
    assert r["rms_norm_kernels"] >= 2 * layers + 1 and r["skinny_kernels"] == 0, r  # two a layer, the final norm
    assert tp_result("gqa/tp2")["rms_norm_kernels"] == 0


def test_kv_heads_replicated_when_fewer_than_the_tensor_axis(tp_result):
    assert tp_result("gqa/tp2")["kv_heads"] == 4  # split, not copied
    assert tp_result("gqa/tp8")["kv_heads"] == 8  # 4 KV heads, each held by 2 devices
    assert tp_result("gqa_wide/tp8")["kv_heads"] == 8  # 2 KV heads, each held by 4
    assert tp_result("70b/tp8")["kv_heads"] == 8


def test_pallas_attention_per_shard_equals_unsharded(kernel_result):
    r = kernel_result
    assert r["decode"] < 1e-5 and r["prefill"] < 1e-5, r
    assert r["out_spec_decode"] == r["out_spec_prefill"] == "P(None, 'tensor')"


def test_rope_write_per_shard_on_grouped_qkv(rope_write_result):
    r = rope_write_result
    assert r["error"] < 1e-5 and r["pool_fraction"] == 0.25 and r["devices"] == 4, r
