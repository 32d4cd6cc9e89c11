"""The mesh's checks, the rule table and KV-head replication, on one device (no mesh of many needed)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxllm.model.config import LlamaConfig
from jaxllm.model.llama import abstract_model
from sharding import rules
from sharding.mesh import TENSOR, check_tensor_parallel, make_mesh

GQA = LlamaConfig(vocab_size=259, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=2, intermediate_size=96)


def test_make_mesh_shape_and_errors():
    mesh = make_mesh(1, 1)
    assert mesh.axis_names == ("instance", "tensor") and mesh.devices.shape == (1, 1)
    n = len(jax.devices())
    with pytest.raises(ValueError, match=f"needs {2 * n} devices; only {n}"):
        make_mesh(n, 2)
    devices = jax.devices()[:1] * 4  # the same device named four times: only the count matters here
    assert make_mesh(2, 2, devices=devices).devices.shape == (2, 2)
    with pytest.raises(ValueError, match="tensor_parallel must be a positive integer"):
        make_mesh(0)


@pytest.mark.parametrize("n, message", [(3, "does not divide the model's 8 query heads"),
                                        (16, "does not divide the model's 8 query heads"),
                                        (-1, "positive integer")])
def test_check_tensor_parallel_errors(n, message):
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(GQA, n)


def test_check_tensor_parallel_kv_heads_and_mlp():
    for n in (1, 2, 4, 8):
        check_tensor_parallel(GQA, n)
    with pytest.raises(ValueError, match="6 KV heads: one must divide the other"):
        check_tensor_parallel(GQA.replace(num_heads=24, hidden_size=96, num_kv_heads=6), 4)
    with pytest.raises(ValueError, match="intermediate_size 90"):
        check_tensor_parallel(GQA.replace(intermediate_size=90), 4)


def test_param_specs_follow_the_table():
    _, state = nnx.split(abstract_model(GQA))
    # 2 KV heads over 4 devices: each replicated twice first (the grouped q/k/v is [D, Hkv, G + 2, hd])
    prepared = jax.eval_shape(lambda s: rules.prepare_tensor_parallel(GQA, s, 4)[1], state)
    specs = {rules._path_name(p): s for p, s in jax.tree_util.tree_flatten_with_path(
        rules.param_specs(prepared, 4), is_leaf=lambda x: isinstance(x, P))[0]}
    assert specs["layers/1/attention/qkv"] == P(None, TENSOR, None, None)
    with pytest.raises(ValueError, match=r"attention/qkv \(64, 2, 6, 8\): tensor_parallel 4 divides none"):
        rules.param_specs(state, 4)  # unreplicated: 2 KV heads cannot be split 4 ways
    assert specs["layers/1/attention/o"] == P(TENSOR, None, None)
    assert specs["layers/0/mlp/gate_up"] == P(None, None, TENSOR)
    assert specs["layers/0/mlp/down"] == P(TENSOR, None)
    # 259 words divide by nothing: replicated (split over hidden they would split the residual stream)
    assert specs["embedding"] == specs["lm_head"] == P()
    assert specs["final_norm/weight"] == specs["layers/0/input_norm/weight"] == specs["inv_freq"] == P()
    assert all(s == P() for s in jax.tree.leaves(rules.param_specs(state, 1), is_leaf=lambda x: isinstance(x, P)))
    assert rules.spec_for("lm_head", (64, 256), 4) == P(None, TENSOR)  # a vocabulary that divides
    assert rules.spec_for("embedding", (256, 64), 4) == P()  # replicated whatever divides (rules.py says why)


def test_biases_split_with_their_heads_and_q_k_norms_stay_whole():
    """Qwen2's q/k/v biases [Hkv, G + 2, hd] go with their KV heads' q/k/v columns; Qwen3's q/k norm weights
    [head_dim] are one weight for every head, whole on every device; replicated KV heads take their biases along."""
    qwen2 = GQA.replace(architecture="Qwen2ForCausalLM")
    qwen3 = GQA.replace(architecture="Qwen3ForCausalLM", head_dim=16)
    _, state2 = nnx.split(abstract_model(qwen2))
    _, state3 = nnx.split(abstract_model(qwen3))
    specs2 = {rules._path_name(p): s for p, s in jax.tree_util.tree_flatten_with_path(
        rules.param_specs(state2, 2), is_leaf=lambda x: isinstance(x, P))[0]}
    specs3 = {rules._path_name(p): s for p, s in jax.tree_util.tree_flatten_with_path(
        rules.param_specs(state3, 2), is_leaf=lambda x: isinstance(x, P))[0]}
    assert specs2["layers/0/attention/qkv_bias"] == P(TENSOR, None, None)
    assert specs3["layers/1/attention/q_norm/weight"] == specs3["layers/1/attention/k_norm/weight"] == P()
    assert specs3["layers/1/attention/qkv"] == P(None, TENSOR, None, None)
    # 2 KV heads over 4 devices: loaded whole, then repeated with the weights (the bias's copy h*f+j is head h's)
    load = rules.load_sharding(qwen2, make_mesh(4, devices=jax.devices()[:1] * 4))  # only the count matters
    assert load(("layers", 0, "attention", "qkv_bias"), (2, 6, 8)).spec == P()
    assert load(("layers", 0, "attention", "qkv"), (64, 2, 6, 8)).spec == P(TENSOR)
    rng = np.random.default_rng(1)
    bias = jnp.asarray(rng.standard_normal((2, 6, 8)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal((64, 2, 6, 8)), jnp.float32)
    new_config, new = rules.repeat_kv_heads(qwen2, {"layers": [{"attention": {"qkv": weight, "qkv_bias": bias}}]}, 2)
    got = new["layers"][0]["attention"]["qkv_bias"]
    assert new_config.num_kv_heads == 4 and got.shape == (4, 4, 8)
    np.testing.assert_array_equal(got, rules._repeat_qkv(bias[None], 8, 2, 2)[0])
    np.testing.assert_array_equal(got[1, 2:], bias[0, 4:])  # KV head 0's second copy: its k and v biases
    np.testing.assert_array_equal(got[1, :2], bias[0, 2:4])  # ... and the second half of its query heads' biases


def test_spec_errors_name_the_parameter():
    with pytest.raises(ValueError, match=r"layers/0/mlp/down \(90, 64\): tensor_parallel 4 divides none"):
        rules.spec_for("layers/0/mlp/down", (90, 64), 4)
    with pytest.raises(ValueError, match="matches no sharding rule"):
        rules.spec_for("layers/0/attention/new_thing", (8,), 2)


def _attention(qkv_grouped, x, g):
    """Causal-free toy attention of one token batch, from the per-KV-head layout: [T, Hq, hd]."""
    qkv = jnp.einsum("TD,DKGH->TKGH", x, qkv_grouped)
    q, k, v = qkv[:, :, :g], qkv[:, :, g], qkv[:, :, g + 1]  # [T, Hkv, G, hd], [T, Hkv, hd] x 2
    s = jnp.einsum("TKGH,SKH->KGTS", q, k)
    out = jnp.einsum("KGTS,SKH->TKGH", jax.nn.softmax(s, axis=-1), v)
    return out.reshape(x.shape[0], -1, out.shape[-1])


@pytest.mark.parametrize("factor", [2, 4])
def test_repeat_kv_heads_keeps_the_function(factor):
    rng = np.random.default_rng(0)
    hkv, g, d, hd, t = 2, 4, 16, 8, 5
    grouped = jnp.asarray(rng.standard_normal((d, hkv, g + 2, hd)), jnp.float32)
    fused = jnp.concatenate([grouped[:, :, :g].reshape(d, hkv * g, hd), grouped[:, :, g], grouped[:, :, g + 1]], 1)
    config = GQA.replace(num_heads=hkv * g, num_kv_heads=hkv, hidden_size=hkv * g * hd)
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    new_config, new = rules.repeat_kv_heads(config, {"layers": [{"attention": {"qkv": grouped}}]}, factor)
    assert new_config.num_kv_heads == hkv * factor
    expanded = new["layers"][0]["attention"]["qkv"]
    assert expanded.shape == (d, hkv * factor, g // factor + 2, hd)
    np.testing.assert_allclose(_attention(expanded, x, g // factor), _attention(grouped, x, g), rtol=1e-5, atol=1e-4)
    # the fused layout: the same query heads, each KV head copied `factor` times in place
    _, new_fused = rules.repeat_kv_heads(config, {"layers": [{"attention": {"qkv": fused}}]}, factor)
    new_fused = new_fused["layers"][0]["attention"]["qkv"]
    q_end = hkv * g
    np.testing.assert_array_equal(new_fused[:, :q_end], fused[:, :q_end])
    np.testing.assert_array_equal(new_fused[:, q_end:q_end + hkv * factor], jnp.repeat(fused[:, q_end:q_end + hkv], factor, 1))
    np.testing.assert_array_equal(new_fused[:, q_end + hkv * factor:], jnp.repeat(fused[:, q_end + hkv:], factor, 1))


def test_repeat_kv_heads_errors_and_replication():
    with pytest.raises(ValueError, match="must be a positive divisor of the group size 4"):
        rules.repeat_kv_heads(GQA, {}, 3)
    assert rules.kv_head_replication(GQA, 8) == 4 and rules.kv_head_replication(GQA, 2) == 1
    assert rules.repeat_kv_heads(GQA, {"a": 1}, 1) == (GQA, {"a": 1})


def test_kv_pool_specs_and_errors():
    from jaxllm.model.kv_cache import init_kv_cache

    mesh = make_mesh(1)
    pool = init_kv_cache(GQA.replace(num_layers=1), 4, 8, "int8")
    assert jax.tree.leaves(rules.kv_pool_specs(pool, mesh), is_leaf=lambda x: isinstance(x, P)) == [P(None, None)] * 4
    big = make_mesh(4, devices=jax.devices() * 4)
    with pytest.raises(ValueError, match="2 KV heads cannot be split tensor_parallel 4 ways"):
        rules.kv_pool_specs(pool, big)
    assert rules.kv_pool_specs(jax.ShapeDtypeStruct((4, 8, 8, 8), jnp.float32), big) == P(None, TENSOR)
    with pytest.raises(ValueError, match="5 rBlocks cannot be split among 2 instances"):
        rules.kv_pool_specs(jax.ShapeDtypeStruct((5, 8, 8, 8), jnp.float32), make_mesh(1, 2, jax.devices() * 2))
