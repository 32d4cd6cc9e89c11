"""The Flax model against the independent float64 NumPy Llama-2 (tests.jaxllm.model.numpy_llama.py)."""

import numpy as np
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxllm.model.config import LlamaConfig, RopeScaling
from jaxllm.model.kv_cache import init_kv_cache
from pallas_kernels.dispatch import AttentionBatch
from jaxllm.model.llama import Llama, group_qkv, init_model, ungroup_qkv
from pallas_kernels.dispatch import default_kernels
from tests.jaxllm.model.numpy_llama import numpy_llama_logits, random_hf_tensors
from tests.seeds import seed as fixed_seed


def load_hf_tensors_into(model, tensors, config):
    """Our parameter layout from HF tensors, written out here independently of jaxllm/model/checkpoints/."""
    D, H, hd = config.hidden_size, config.num_heads, config.head_dim
    put = lambda param, value: param.set_value(jnp.asarray(value, param[...].dtype)) if hasattr(param, "set_value") \
        else setattr(param, "value", jnp.asarray(value, param[...].dtype))
    put(model.embedding, tensors["model.embed_tokens.weight"])
    put(model.final_norm.weight, tensors["model.norm.weight"])
    if not config.tie_word_embeddings:
        put(model.lm_head, tensors["lm_head.weight"].T)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        # Grouped per KV head: [D, Hkv, G + 2, hd], each KV head's G query heads, then its k, then its v.
        hkv = config.num_kv_heads
        put(layer.attention.qkv, np.concatenate([tensors[p + "self_attn.q_proj.weight"].T.reshape(D, hkv, -1, hd),
                                                 tensors[p + "self_attn.k_proj.weight"].T.reshape(D, hkv, 1, hd),
                                                 tensors[p + "self_attn.v_proj.weight"].T.reshape(D, hkv, 1, hd)],
                                                axis=2))
        put(layer.attention.o, tensors[p + "self_attn.o_proj.weight"].T.reshape(H, hd, D))
        put(layer.mlp.gate_up, np.stack([tensors[p + "mlp.gate_proj.weight"].T, tensors[p + "mlp.up_proj.weight"].T],
                                        axis=1))
        put(layer.mlp.down, tensors[p + "mlp.down_proj.weight"].T)
        put(layer.input_norm.weight, tensors[p + "input_layernorm.weight"])
        put(layer.post_attention_norm.weight, tensors[p + "post_attention_layernorm.weight"])


def run_full(model, config, ids, block_size=8, shuffle_seed=None, backend="auto"):
    """Logits of one sequence in one prefill step, through the rBlock pool (optionally fragmented)."""
    T = len(ids)
    nb = -(-T // block_size)
    blocks = np.arange(nb * 3)
    if shuffle_seed is not None:
        np.random.default_rng(shuffle_seed).shuffle(blocks)
    blocks = blocks[:nb].astype(np.int32)
    kv = init_kv_cache(config, nb * 3, block_size, "float32")
    pos = np.arange(T)
    batch = AttentionBatch(jnp.asarray(blocks[None]), jnp.asarray([T], jnp.int32), jnp.asarray([0, T], jnp.int32),
                           jnp.asarray(blocks[pos // block_size] * block_size + pos % block_size, jnp.int32))
    kernels = default_kernels(backend, head_dim=config.head_dim)
    hidden, _ = model(jnp.asarray(ids, jnp.int32), jnp.asarray(pos, jnp.int32), kv, batch, kernels=kernels)
    return np.asarray(model.logits(hidden), np.float64)


SMALL = dict(vocab_size=97, hidden_size=128, num_layers=2, num_heads=4, intermediate_size=160,
             max_position_embeddings=64)


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("scaling", [None, RopeScaling("linear", 4.0), RopeScaling("dynamic", 2.0)],
                         ids=["rope", "linear", "dynamic"])
def test_logits_match_numpy_oracle(num_kv_heads, scaling):
    config = LlamaConfig(**SMALL, num_kv_heads=num_kv_heads, rope_scaling=scaling, rope_theta=500.0)
    seed = fixed_seed(58489)
    tensors = random_hf_tensors(config.to_hf(), seed)
    model = init_model(config)
    load_hf_tensors_into(model, tensors, config)
    ids = np.random.default_rng(seed).integers(0, config.vocab_size, size=37)
    ours = run_full(model, config, ids, shuffle_seed=seed)
    # jaxllm fixes dynamic NTK at the full extended window (config.RopeScaling); HF, at a sequence that long.
    dynamic_len = config.max_context if scaling is not None and scaling.type == "dynamic" else None
    ref = numpy_llama_logits(tensors, config.to_hf(), ids, dynamic_len=dynamic_len)
    rel = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
    assert rel < 1e-5, f"seed {seed}: relative error {rel}"


def test_tied_embeddings_match_oracle():
    config = LlamaConfig(**SMALL, num_kv_heads=2, tie_word_embeddings=True)
    tensors = random_hf_tensors(config.to_hf(), 3)
    model = init_model(config)
    assert not hasattr(model, "lm_head")
    load_hf_tensors_into(model, tensors, config)
    ids = np.arange(20) % config.vocab_size
    ref = numpy_llama_logits(tensors, config.to_hf(), ids)
    ours = run_full(model, config, ids)
    assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 1e-5


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_close_to_oracle(dtype):
    config = LlamaConfig(**SMALL, num_kv_heads=2)
    tensors = random_hf_tensors(config.to_hf(), 5)
    model = init_model(config, dtype=dtype)
    load_hf_tensors_into(model, tensors, config)
    ids = np.arange(30) * 7 % config.vocab_size
    T = len(ids)
    kv = init_kv_cache(config, 4, 8, jnp.dtype(dtype).name)
    batch = AttentionBatch(jnp.arange(4, dtype=jnp.int32)[None], jnp.asarray([T], jnp.int32),
                           jnp.asarray([0, T], jnp.int32), jnp.arange(T, dtype=jnp.int32))
    hidden, _ = model(jnp.asarray(ids, jnp.int32), jnp.arange(T, dtype=jnp.int32), kv, batch)
    ours = np.asarray(model.logits(hidden), np.float64)
    ref = numpy_llama_logits(tensors, config.to_hf(), ids)
    assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 5e-2


def test_rope_scaling_changes_logits():
    """Guards the oracle comparison: scaling must actually reach the model."""
    base = LlamaConfig(**SMALL, num_kv_heads=2)
    tensors = random_hf_tensors(base.to_hf(), 11)
    ids = np.arange(40) % base.vocab_size
    outs = []
    for scaling in (None, RopeScaling("linear", 4.0), RopeScaling("dynamic", 4.0)):
        config = base.replace(rope_scaling=scaling)
        model = init_model(config)
        load_hf_tensors_into(model, tensors, config)
        outs.append(run_full(model, config, ids))
    assert not np.allclose(outs[0], outs[1], atol=1e-3)
    assert not np.allclose(outs[0], outs[2], atol=1e-3)


def test_kernel_backend_matches_oracle():
    """A step of <= 64 tokens on the kernel backend (interpret mode here): the output projections as
    skinny-matmul split-K partials, summed by the add + RMSNorm kernel, Triton attention."""
    config = LlamaConfig(**dict(SMALL, num_heads=2), num_kv_heads=2, rope_theta=500.0)  # head_dim 64
    seed = fixed_seed(58490)
    tensors = random_hf_tensors(config.to_hf(), seed)
    model = init_model(config)
    load_hf_tensors_into(model, tensors, config)
    ids = np.random.default_rng(seed).integers(0, config.vocab_size, size=21)
    ours = run_full(model, config, ids, block_size=16, shuffle_seed=seed, backend="triton")
    ref = numpy_llama_logits(tensors, config.to_hf(), ids)
    rel = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
    assert rel < 1e-5, f"seed {seed}: relative error {rel}"


@pytest.mark.parametrize("hidden,num_heads,num_kv_heads", [(128, 2, 1), (256, 4, 2)], ids=["mqa", "gqa"])
def test_kernel_backend_decode_step_matches_oracle(hidden, num_heads, num_kv_heads):
    """Prefill all but the last token, then one decode step on the kernel backend (interpret mode): RoPE
    and the KV write as one kernel reading the grouped q/k/v in place, the decode kernel reading the
    rotated queries it returns. head_dim 64."""
    config = LlamaConfig(**dict(SMALL, hidden_size=hidden, num_heads=num_heads), num_kv_heads=num_kv_heads,
                         rope_theta=500.0)
    kernels = default_kernels("triton", head_dim=config.head_dim)
    seed = fixed_seed(58491)
    tensors = random_hf_tensors(config.to_hf(), seed)
    model = init_model(config)
    load_hf_tensors_into(model, tensors, config)
    ids = np.random.default_rng(seed).integers(0, config.vocab_size, size=19)
    block_size, T = 16, len(ids)
    blocks = np.random.default_rng(seed).permutation(6)[:2].astype(np.int32)
    kv = init_kv_cache(config, 6, block_size, "float32")
    slot = lambda pos: blocks[pos // block_size] * block_size + pos % block_size
    pos = np.arange(T - 1)
    prefill = AttentionBatch(jnp.asarray(blocks[None]), jnp.asarray([T - 1], jnp.int32),
                             jnp.asarray([0, T - 1], jnp.int32), jnp.asarray(slot(pos), jnp.int32))
    _, kv = model(jnp.asarray(ids[:-1], jnp.int32), jnp.asarray(pos, jnp.int32), kv, prefill, kernels=kernels)
    decode = AttentionBatch(jnp.asarray(blocks[None]), jnp.asarray([T], jnp.int32), jnp.asarray([0, 1], jnp.int32),
                            jnp.asarray([slot(T - 1)], jnp.int32), single_query=True)
    hidden, _ = model(jnp.asarray(ids[-1:], jnp.int32), jnp.asarray([T - 1], jnp.int32), kv, decode, kernels=kernels)
    ours = np.asarray(model.logits(hidden), np.float64)[-1]
    ref = numpy_llama_logits(tensors, config.to_hf(), ids)[-1]
    rel = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
    assert rel < 1e-5, f"seed {seed}: relative error {rel}"


def test_model_takes_kernels_not_a_backend_string():
    """The step's kernels are a `Kernels` value read by the model, never a backend string resolved in it."""
    import inspect

    params = inspect.signature(Llama.__call__).parameters
    assert "kernels" in params and "backend" not in params


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_qkv_grouping_keeps_each_kv_heads_group_whole(num_heads, num_kv_heads):
    """group_qkv puts query head h at [h // G, h % G] and KV head j's k, v at [j, G], [j, G + 1];
    ungroup_qkv undoes it; init_model draws the ungrouped tensor, so the grouped one is its regrouping."""
    g, hd = num_heads // num_kv_heads, 3
    flat = np.arange(5 * (num_heads + 2 * num_kv_heads) * hd).reshape(5, num_heads + 2 * num_kv_heads, hd)
    grouped = np.asarray(group_qkv(jnp.asarray(flat), num_heads, num_kv_heads))
    assert grouped.shape == (5, num_kv_heads, g + 2, hd)
    for h in range(num_heads):
        np.testing.assert_array_equal(grouped[:, h // g, h % g], flat[:, h])
    for j in range(num_kv_heads):
        np.testing.assert_array_equal(grouped[:, j, g], flat[:, num_heads + j])
        np.testing.assert_array_equal(grouped[:, j, g + 1], flat[:, num_heads + num_kv_heads + j])
    np.testing.assert_array_equal(np.asarray(ungroup_qkv(jnp.asarray(grouped))), flat)


@pytest.mark.parametrize("architecture", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_kernel_backend_runs_the_qwen_options(architecture):
    """Qwen2's q/k/v bias and Qwen3's q/k norms on the kernel backend (interpret mode, head_dim 64): a short prefill
    and a decode step take the skinny matmul's split-K partials, which the options sum before adding the bias and
    normalising (the RoPE + KV-write kernel then reads the result), and equal the reference backend's logits (which
    tests/jaxllm/model/test_hf_architectures.py checks against transformers)."""
    config = LlamaConfig(**dict(SMALL, hidden_size=256), num_kv_heads=2, rope_theta=500.0, architecture=architecture)
    model = init_model(config, seed=fixed_seed(58492))
    rng = np.random.default_rng(3)
    for layer in model.layers:  # the options' weights away from their ones and zeros
        for param in ([layer.attention.qkv_bias] if config.qkv_bias else
                      [layer.attention.q_norm.weight, layer.attention.k_norm.weight]):
            value = param[...] + jnp.asarray(0.5 * rng.standard_normal(param[...].shape), jnp.float32)
            param.set_value(value) if hasattr(param, "set_value") else setattr(param, "value", value)
    ids = rng.integers(0, config.vocab_size, size=19)
    block_size, T = 16, len(ids)
    slot = lambda pos: pos  # rBlocks 0 and 1
    tables = jnp.asarray([[0, 1]], jnp.int32)

    def last_logits(backend):
        kernels = default_kernels(backend, head_dim=config.head_dim)
        kv = init_kv_cache(config, 2, block_size, "float32")
        pos = np.arange(T - 1)
        prefill = AttentionBatch(tables, jnp.asarray([T - 1], jnp.int32), jnp.asarray([0, T - 1], jnp.int32),
                                 jnp.asarray(slot(pos), jnp.int32))
        hidden, kv = model(jnp.asarray(ids[:-1], jnp.int32), jnp.asarray(pos, jnp.int32), kv, prefill, kernels=kernels)
        decode = AttentionBatch(tables, jnp.asarray([T], jnp.int32), jnp.asarray([0, 1], jnp.int32),
                                jnp.asarray([slot(T - 1)], jnp.int32), single_query=True)
        last, _ = model(jnp.asarray(ids[-1:], jnp.int32), jnp.asarray([T - 1], jnp.int32), kv, decode, kernels=kernels)
        return np.asarray(model.logits(jnp.concatenate([hidden, last])), np.float64)

    ours, ref = last_logits("triton"), last_logits("reference")
    rel = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
    assert rel < 1e-5, f"relative error {rel}"
