"""How HuggingFace Llama tensors map onto our Params (the layout documented in llama.py).

  model.embed_tokens.weight                  [V, D]        -> embedding [V, D]
  model.layers.{i}.self_attn.q/k/v_proj      [H*hd, D]     -> layers[i].attention.qkv (fuse_qkv)
  model.layers.{i}.self_attn.q/k/v_proj.bias [H*hd]        -> layers[i].attention.qkv_bias (Qwen2: fuse_qkv_bias)
  model.layers.{i}.self_attn.q/k_norm.weight [hd]          -> layers[i].attention.q_norm / k_norm (Qwen3)
  model.layers.{i}.self_attn.o_proj.weight   [D, Hq*hd]    -> layers[i].attention.o [Hq, hd, D]
  model.layers.{i}.mlp.gate/up_proj.weight   [F, D]        -> layers[i].mlp.gate_up [D, 2, F] (gate, then up)
  model.layers.{i}.mlp.down_proj.weight      [D, F]        -> layers[i].mlp.down [F, D]
  model.layers.{i}.input_layernorm.weight / post_attention_layernorm.weight -> input_norm / post_attention_norm
  model.norm.weight -> final_norm.weight;  lm_head.weight [V, D] -> lm_head [D, V] (absent when tied)
HF stores Linear weights [out, in]; each is transposed to [in, out] and its out axis split into
heads where the Param has them. HF's q/k projections are already in the rotate-half order our RoPE
uses, so no permutation.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jaxllm.model.config import LlamaConfig


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One stored tensor: its HF name and shape, and its shape once in our orientation ([in, ...out])."""

    name: str
    hf_shape: tuple[int, ...]
    shape: tuple[int, ...]
    transpose: bool  # a Linear weight: [out, in] in HF


@dataclasses.dataclass(frozen=True)
class ParamRule:
    """A Param built from one or more HF tensors: fuse(parts) -> Param, split(Param) -> parts."""

    path: tuple  # nnx state path, e.g. ("layers", 0, "attention", "qkv")
    tensors: tuple[HFTensor, ...]
    fuse: Callable[[list[jax.Array]], jax.Array] | None = None  # None: the Param is tensors[0]
    split: Callable[[jax.Array], list[jax.Array]] | None = None


def fuse_qkv(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """q [D, Hq, hd], k and v [D, Hkv, hd] -> the attention.qkv Param grouped per KV head [D, Hkv, G + 2, hd]
    (each KV head's G query heads, then its k, then its v: a tensor-parallel split on Hkv keeps groups whole)."""
    d, hq, hd = q.shape
    hkv = k.shape[1]
    grouped_q = q.reshape(d, hkv, hq // hkv, hd)  # query head h belongs to KV head h // G
    return jnp.concatenate([grouped_q, k[:, :, None], v[:, :, None]], axis=2)


def fuse_qkv_bias(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """q [Hq, hd], k and v [Hkv, hd] biases -> the attention.qkv_bias Param [Hkv, G + 2, hd], grouped as qkv is."""
    return fuse_qkv(q[None], k[None], v[None])[0]


def split_qkv_bias(bias: jax.Array, config: LlamaConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The attention.qkv_bias Param [Hkv, G + 2, hd] -> q [Hq, hd], k [Hkv, hd], v [Hkv, hd]."""
    return tuple(part[0] for part in split_qkv(bias[None], config))


def split_qkv(qkv: jax.Array, config: LlamaConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The attention.qkv Param [D, Hkv, G + 2, hd] -> q [D, Hq, hd], k [D, Hkv, hd], v [D, Hkv, hd]."""
    d, hkv, stride, hd = qkv.shape
    g = stride - 2
    return qkv[:, :, :g].reshape(d, hkv * g, hd), qkv[:, :, g], qkv[:, :, g + 1]


def _linear(name: str, out_dims: tuple[int, ...], in_dim: int) -> HFTensor:
    out = 1
    for d in out_dims:
        out *= d
    return HFTensor(name, (out, in_dim), (in_dim, *out_dims), True)


def hf_layout(config: LlamaConfig) -> list[ParamRule]:
    """Every Param's rule, in the order tensors are stored (and sharded) in HF checkpoints."""
    D, F, V, hd = config.hidden_size, config.intermediate_size, config.vocab_size, config.head_dim
    Hq, Hkv = config.num_heads, config.num_kv_heads
    rules = [ParamRule(("embedding",), (HFTensor("model.embed_tokens.weight", (V, D), (V, D), False),))]
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn, mlp = ("layers", i, "attention"), ("layers", i, "mlp")
        rules += [
            ParamRule(("layers", i, "input_norm", "weight"), (HFTensor(p + "input_layernorm.weight", (D,), (D,), False),)),
            ParamRule(attn + ("qkv",), (_linear(p + "self_attn.q_proj.weight", (Hq, hd), D),
                                        _linear(p + "self_attn.k_proj.weight", (Hkv, hd), D),
                                        _linear(p + "self_attn.v_proj.weight", (Hkv, hd), D)),
                      fuse=lambda parts: fuse_qkv(*parts), split=lambda qkv: list(split_qkv(qkv, config))),
            *_attention_options(config, p, attn),
            ParamRule(attn + ("o",), (HFTensor(p + "self_attn.o_proj.weight", (D, Hq * hd), (Hq, hd, D), True),)),
            ParamRule(("layers", i, "post_attention_norm", "weight"),
                      (HFTensor(p + "post_attention_layernorm.weight", (D,), (D,), False),)),
            ParamRule(mlp + ("gate_up",), (_linear(p + "mlp.gate_proj.weight", (F,), D),
                                           _linear(p + "mlp.up_proj.weight", (F,), D)),
                      fuse=lambda parts: jnp.stack(parts, axis=1), split=lambda w: [w[:, 0], w[:, 1]]),
            ParamRule(mlp + ("down",), (_linear(p + "mlp.down_proj.weight", (D,), F),)),
        ]
    rules.append(ParamRule(("final_norm", "weight"), (HFTensor("model.norm.weight", (D,), (D,), False),)))
    if not config.tie_word_embeddings:
        rules.append(ParamRule(("lm_head",), (_linear("lm_head.weight", (V,), D),)))
    return rules


def _attention_options(config: LlamaConfig, p: str, attn: tuple) -> list[ParamRule]:
    """The rules of the options beside Llama's attention weights: Qwen2's q/k/v biases, Qwen3's q/k norms."""
    hd, Hq, Hkv = config.head_dim, config.num_heads, config.num_kv_heads
    rules = []
    if config.qkv_bias:
        rules.append(ParamRule(attn + ("qkv_bias",), tuple(
            HFTensor(p + f"self_attn.{n}_proj.bias", (heads * hd,), (heads, hd), False)
            for n, heads in (("q", Hq), ("k", Hkv), ("v", Hkv))),
            fuse=lambda parts: fuse_qkv_bias(*parts), split=lambda b: list(split_qkv_bias(b, config))))
    if config.qk_norm:
        rules += [ParamRule(attn + (f"{n}_norm", "weight"), (HFTensor(p + f"self_attn.{n}_norm.weight", (hd,), (hd,),
                                                                       False),)) for n in ("q", "k")]
    return rules


def ignored_tensor(name: str, config: LlamaConfig) -> bool:
    """Stored tensors we skip without a warning: inv_freq is recomputed from the config; tied
    checkpoints sometimes store a copy of the embedding as lm_head."""
    return name.endswith("rotary_emb.inv_freq") or (config.tie_word_embeddings and name == "lm_head.weight")


def _to_ours_impl(x, transpose, shape, dtype):
    x = x.T if transpose else x  # [out, in] -> [in, out], then split heads: [D, H*hd] -> [D, H, hd]
    return x.reshape(shape).astype(dtype)


def _to_hf_impl(x, transpose, hf_shape):
    return x.reshape(hf_shape[::-1]).T if transpose else x.reshape(hf_shape)


# Jitted so the transpose and cast run on the device, one tensor at a time; one compile per distinct shape.
_to_ours = jax.jit(_to_ours_impl, static_argnums=(1, 2, 3))
_to_hf = jax.jit(_to_hf_impl, static_argnums=(1, 2))


def to_ours(x: jax.Array, tensor: HFTensor, dtype) -> jax.Array:
    """An HF tensor (on the device) in our orientation and dtype."""
    return _to_ours(x, tensor.transpose, tensor.shape, jnp.dtype(dtype))


def to_hf(x: jax.Array, tensor: HFTensor) -> jax.Array:
    """Our part of a Param back in HF's orientation [out, in]."""
    return _to_hf(x, tensor.transpose, tensor.hf_shape)


def param_parts(rule: ParamRule, param: jax.Array) -> list[jax.Array]:
    """The Param cut into its HF tensors' parts (our orientation), in rule.tensors' order."""
    return [param] if rule.split is None else rule.split(param)


def fuse_parts(rule: ParamRule, parts: list[jax.Array]) -> jax.Array:
    """The Param from its HF tensors' parts (our orientation)."""
    return parts[0] if rule.fuse is None else rule.fuse(parts)
