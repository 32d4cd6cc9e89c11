"""The Llama family in Flax NNX: RMSNorm, RoPE, GQA attention over the rBlock pool, SwiGLU MLP.

Mistral is this model as it is; Qwen2 / Qwen2.5 and Qwen3 are options of it, read from the config
(config.ARCHITECTURES): `qkv_bias` adds a bias to the fused q/k/v projection, `qk_norm` RMSNorms each
head's q and k over head_dim before RoPE.

The model runs on packed tokens of many sequences at once ([tokens, ...], no batch axis);
where each token's K/V goes and what it attends to comes from `AttentionBatch`. The KV pool
is an argument and a result, never module state.

Parameter layout (einsum-friendly; checkpoints/ maps HuggingFace names onto it):
  embedding                 [vocab, hidden]
  layers[i].attention.qkv   [hidden, num_kv_heads, G + 2, head_dim]  (per KV head: its G = num_heads //
                            num_kv_heads query heads, then its k, then its v; query head h is [h // G, h % G])
  layers[i].attention.qkv_bias  [num_kv_heads, G + 2, head_dim]  (qkv_bias only: grouped as qkv)
  layers[i].attention.q_norm.weight, k_norm.weight  [head_dim]  (qk_norm only: one weight for every head)
  layers[i].attention.o     [num_heads, head_dim, hidden]
  layers[i].mlp.gate_up     [hidden, 2, intermediate]  (gate, then up)
  layers[i].mlp.down        [intermediate, hidden]
q/k/v and gate/up are stored fused so a decode step reads each group of weights in one matmul (one wide
weight-streaming matmul reads HBM faster than several narrow ones: benchmarks/NOTES.md). q/k/v are grouped
per KV head so that a tensor-parallel split on the KV-head axis keeps each group whole; the kernels
read the grouped projection in place (group_qkv / ungroup_qkv map the HF-style [q | k | v] order).
Each residual add is done by the next RMSNorm (RMSNorm(x, delta) returns the normalised sum and the
sum), so a decode step runs add + norm as one kernel, and the o and down projections hand over their
split-K partials unreduced for that kernel to sum (dispatch.matmul_unreduced): 355 kernels a 1K
decode step instead of 483 (benchmarks/NOTES.md).
  layers[i].input_norm, layers[i].post_attention_norm, final_norm   [hidden]
  lm_head                   [hidden, vocab]   (absent when tie_word_embeddings)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.model.config import LlamaConfig
from jaxllm.model.kv_cache import KVCache, LayerKV
from jaxllm.model.rope import attention_scaling, inverse_frequencies, rope_tables
from pallas_kernels.dispatch import REFERENCE, AttentionBatch, Kernels, add_rms_norm, matmul_unreduced, paged_attention
from pallas_kernels.rms_norm import rms_norm_reference

_INIT_STD = 0.02


def group_qkv(w: jax.Array, num_heads: int, num_kv_heads: int) -> jax.Array:
    """[..., num_heads + 2 num_kv_heads, hd] (q heads, then k, then v) -> [..., Hkv, G + 2, hd] grouped."""
    g = num_heads // num_kv_heads
    lead, hd = w.shape[:-2], w.shape[-1]
    q = w[..., :num_heads, :].reshape(*lead, num_kv_heads, g, hd)
    k = w[..., num_heads:num_heads + num_kv_heads, None, :]
    v = w[..., num_heads + num_kv_heads:, None, :]
    return jnp.concatenate([q, k, v], axis=-2)


def ungroup_qkv(w: jax.Array) -> jax.Array:
    """group_qkv's inverse: [..., Hkv, G + 2, hd] -> [..., Hkv * G + 2 Hkv, hd] (q heads, then k, then v)."""
    lead, (hkv, stride, hd) = w.shape[:-3], w.shape[-3:]
    q = w[..., :stride - 2, :].reshape(*lead, hkv * (stride - 2), hd)
    return jnp.concatenate([q, w[..., stride - 2, :], w[..., stride - 1, :]], axis=-2)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, fan_in: int | None = None) -> nnx.Param:
    # Scaled normal init keeps random-weight models (tests, benchmarks) numerically tame.
    std = _INIT_STD if fan_in is None else fan_in ** -0.5
    return nnx.Param((std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, delta: jax.Array | None = None, kernels: Kernels = REFERENCE
                 ) -> tuple[jax.Array, jax.Array]:
        """(RMSNorm(x + delta), x + delta) for x, delta [T, D] (delta None: nothing added).

        As HF Llama: the residual add in the activation dtype, normalise in float32, cast back, then
        scale. Adding the previous block's output here lets a decode step do add + norm in one kernel.
        """
        return add_rms_norm(x, delta, self.weight[...], eps=self.eps, kernels=kernels)


class Attention(nnx.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype, rngs: nnx.Rngs, *,
                 qkv_bias: bool = False, qk_norm_eps: float | None = None):
        """qkv_bias: a bias on the q, k and v outputs (Qwen2); qk_norm_eps: RMSNorm q and k per head (Qwen3)."""
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        # Drawn in the ungrouped order, then regrouped: the same random model as before the regrouping.
        qkv = _param(rngs, (hidden, num_heads + 2 * num_kv_heads, head_dim), dtype, fan_in=hidden)
        self.qkv = nnx.Param(group_qkv(qkv[...], num_heads, num_kv_heads))
        self.o = _param(rngs, (num_heads, head_dim, hidden), dtype, fan_in=num_heads * head_dim)
        # Options add Params (and random draws) only where set: a Llama's weights stay those it always had.
        self.has_qkv_bias, self.qk_norm_eps = qkv_bias, qk_norm_eps
        if qkv_bias:
            bias = _param(rngs, (num_heads + 2 * num_kv_heads, head_dim), dtype)
            self.qkv_bias = nnx.Param(group_qkv(bias[...], num_heads, num_kv_heads))
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, dtype)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, dtype)

    def __call__(self, x, cos, sin, layer_kv: LayerKV, batch: AttentionBatch, kernels: Kernels):
        w = self.qkv[...]  # [D, Hkv, G + 2, hd]
        # [T, Hkv, G + 2, hd], or on a decode step [S, T, ...] float32 split-K partials, which the next
        # kernel sums: q and k rotated and K/V written by one kernel on the GPU (float pools), reading
        # their heads in place; q [T, Hkv, Gh, hd] holds each group's rotated queries first (read in place).
        qkv = matmul_unreduced(x, w.reshape(w.shape[0], -1), kernels=kernels)
        qkv = qkv.reshape(*qkv.shape[:-1], *w.shape[1:])
        if self.has_qkv_bias or self.qk_norm_eps is not None:
            qkv = self._bias_and_norm(qkv, x.dtype)
        # RoPE, the K/V write and attention where the KV lives (one device, tensor shards, or instances
        # holding parts of a sequence): the kernels' business, not the model's.
        out, k_pool, v_pool, k_scale, v_scale = paged_attention(
            layer_kv.k, layer_kv.v, layer_kv.k_scale, layer_kv.v_scale, qkv, cos, sin, batch,
            num_q_heads=self.num_heads, dtype=x.dtype, kernels=kernels)  # out [T, Hq, hd]
        return self._project_out(out, x.dtype, kernels), LayerKV(k_pool, v_pool, k_scale, v_scale)

    def _bias_and_norm(self, qkv: jax.Array, dtype) -> jax.Array:
        """The projection [T, Hkv, G + 2, hd] (or its [S, T, ...] float32 partials, summed and rounded to `dtype`
        first, as the kernels would) plus its bias, then q and k RMSNorm-ed per head, as HF's Qwen2 / Qwen3 do
        (the bias added in the activation dtype; each norm in float32, rounded, then scaled). XLA runs this as its
        own fusion, where Llama's decode layer hands the partials to the RoPE kernel unsummed: what it costs a
        decode step is for the GPU benchmark of the qwen3-8b preset to say (scripts/bench_generate.py)."""
        if qkv.ndim == 5:
            qkv = jnp.sum(qkv, axis=0)
        qkv = qkv.astype(dtype)
        if self.has_qkv_bias:
            qkv = qkv + self.qkv_bias[...]
        if self.qk_norm_eps is not None:
            g = qkv.shape[-2] - 2  # each group: its g query heads, then k, then v
            q = rms_norm_reference(qkv[:, :, :g], self.q_norm.weight[...], eps=self.qk_norm_eps)
            k = rms_norm_reference(qkv[:, :, g:g + 1], self.k_norm.weight[...], eps=self.qk_norm_eps)
            qkv = jnp.concatenate([q, k, qkv[:, :, g + 1:]], axis=2)
        return qkv

    def _project_out(self, out, dtype, kernels: Kernels):
        """Attention output [T, Hq, hd] through o, left unreduced where it can be: the next norm adds it to
        the residual stream."""
        o = self.o[...]
        return matmul_unreduced(out.astype(dtype).reshape(out.shape[0], -1), o.reshape(-1, o.shape[-1]),
                                kernels=kernels)


class MLP(nnx.Module):
    def __init__(self, hidden: int, intermediate: int, dtype, rngs: nnx.Rngs):
        self.gate_up = _param(rngs, (hidden, 2, intermediate), dtype, fan_in=hidden)
        self.down = _param(rngs, (intermediate, hidden), dtype, fan_in=intermediate)

    def __call__(self, x, kernels: Kernels):
        """x [T, D] normalised -> the MLP's output, [T, D] or unreduced (see matmul_unreduced)."""
        gate_up = jnp.einsum("TD,DGF->TGF", x, self.gate_up[...])  # [T, 2, F]
        return matmul_unreduced(jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1], self.down[...], kernels=kernels)


class DecoderLayer(nnx.Module):
    def __init__(self, config: LlamaConfig, dtype, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.attention = Attention(config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                                   dtype, rngs, qkv_bias=config.qkv_bias,
                                   qk_norm_eps=config.rms_norm_eps if config.qk_norm else None)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, dtype, rngs)

    def __call__(self, x, delta, cos, sin, layer_kv, batch, kernels: Kernels):
        """(x, delta): the residual stream and the previous layer's MLP output, not yet added (None
        for the first layer). Returns this layer's (x, MLP output, KV): each add is done by the next norm."""
        normed, x = self.input_norm(x, delta, kernels)
        attn_out, layer_kv = self.attention(normed, cos, sin, layer_kv, batch, kernels)
        normed, x = self.post_attention_norm(x, attn_out, kernels)
        return x, self.mlp(normed, kernels), layer_kv


class Llama(nnx.Module):
    """A Llama-family model (config.architecture) over packed tokens. `dtype` is both the parameter and the
    activation dtype."""

    def __init__(self, config: LlamaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.embedding = _param(rngs, (config.vocab_size, config.hidden_size), dtype)
        self.layers = nnx.List([DecoderLayer(config, dtype, rngs) for _ in range(config.num_layers)])
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if not config.tie_word_embeddings:
            self.lm_head = _param(rngs, (config.hidden_size, config.vocab_size), dtype, fan_in=config.hidden_size)
        # Not a Param: fixed by the config, kept out of checkpoints.
        self.inv_freq = nnx.Variable(jnp.asarray(inverse_frequencies(config), jnp.float32))

    def __call__(self, tokens: jax.Array, positions: jax.Array, kv_cache: KVCache, batch: AttentionBatch,
                 *, kernels: Kernels = REFERENCE) -> tuple[jax.Array, KVCache]:
        """tokens, positions [T] int32 -> (final hidden states [T, hidden], updated KV pool).

        kernels: each op's implementation and schedule (pallas_kernels.dispatch.default_kernels), read,
        never resolved, here."""
        x, delta = self.embedding[...][tokens], None  # [T, D]
        cos, sin = rope_tables(self.inv_freq[...], positions, attention_scaling(self.config))
        new_layers = []
        for layer, layer_kv in zip(self.layers, kv_cache.layers):
            x, delta, layer_kv = layer(x, delta, cos, sin, layer_kv, batch, kernels)
            new_layers.append(layer_kv)
        return self.final_norm(x, delta, kernels)[0], KVCache(new_layers)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [N, D] -> logits [N, vocab] in float32."""
        head = self.embedding[...].T if self.config.tie_word_embeddings else self.lm_head[...]
        return jnp.einsum("ND,DV->NV", hidden, head, preferred_element_type=jnp.float32)


def init_model(config: LlamaConfig, *, dtype=jnp.float32, seed: int = 0, sharding=None) -> Llama:
    """A model with deterministic random weights (the `tiny` default, tests, benchmarks).

    sharding: None builds every array on the default device; else a function (path, shape) -> the jax Sharding
    of each variable (what a checkpoint loads with: sharding.rules.load_sharding): the random weights are drawn
    straight into their shards, so no device ever holds the whole model (a 70B preset over 4 GPUs). They are the
    same weights up to float rounding (jax's random bits do not depend on the sharding; the draw, compiled, scales
    them in fused code that may round one ulp apart from the op-by-op draw).
    """
    def make():
        return Llama(config, dtype=dtype, rngs=nnx.Rngs(params=seed))

    if sharding is None:
        return make()
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    where = jax.tree_util.tree_map_with_path(lambda path, x: sharding(_state_path(path), tuple(x.shape)), abstract)
    nnx.replace_by_pure_dict(abstract, _draw_by_layer(config, dtype, seed, nnx.to_pure_dict(where)))
    return nnx.merge(graphdef, abstract)


def _seeded_at(seed: int, count) -> nnx.Rngs:
    """nnx.Rngs(params=seed) whose next draw is its `count`-th (count may be traced): what a module built part way
    through Llama.__init__ draws."""
    rngs = nnx.Rngs(params=seed)
    rngs.params.count[...] = jnp.asarray(count, jnp.uint32)
    return rngs


def _draw_by_layer(config: LlamaConfig, dtype, seed: int, where: dict) -> dict:
    """init_model's weights drawn into their shardings `where` (a pure dict of shardings, the model's state's
    shape) as a pure dict, one decoder layer a program: layers placed alike share one compiled program, run for
    each (the whole model as one program grows with the layers: 39 s to compile on 4 CPU host devices for the
    70B shape against 1.5 s by layer, benchmarks/NOTES.md). Each part is drawn with the keys Llama.__init__
    gives it (the embedding key 0, then each layer's in turn, then the head), so the weights are init_model's
    unsharded ones."""
    first, per_layer = _layer_program(config, dtype, seed, *_flat(where["layers"][0]))(1)
    per_layer = int(per_layer) - 1  # the keys a layer draws: the one sync, then every layer is dispatched at once
    drawn = {"layers": {0: first}}
    for i in range(1, config.num_layers):
        drawn["layers"][i], _ = _layer_program(config, dtype, seed, *_flat(where["layers"][i]))(1 + i * per_layer)
    ends = {name: value for name, value in where.items() if name != "layers"}
    # The head draws the key after the last layer's: a one-layer model drawn from one layer's keys earlier.
    drawn.update(_ends_program(config, dtype, seed, *_flat(ends))(config.num_layers * per_layer - per_layer))
    return drawn


def _flat(tree) -> tuple:
    """A pytree of shardings as a hashable (treedef, leaves) pair (the program caches' key)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(leaves)


@functools.lru_cache(maxsize=8)
def _layer_program(config: LlamaConfig, dtype, seed: int, where_treedef, where_leaves: tuple):
    """Jitted: a decoder layer drawn from its first key's count, into these shardings, and the count after it
    (cached: layers placed alike, and a process that builds the same sharded model again, compile nothing)."""
    def draw_layer(count):
        rngs = _seeded_at(seed, count)
        return nnx.to_pure_dict(nnx.state(DecoderLayer(config, dtype, rngs))), rngs.params.count[...]

    return jax.jit(draw_layer, out_shardings=(jax.tree.unflatten(where_treedef, where_leaves), None))


@functools.lru_cache(maxsize=8)
def _ends_program(config: LlamaConfig, dtype, seed: int, where_treedef, where_leaves: tuple):
    """Jitted: all but the layers, from a one-layer model drawn from key 0 (its embedding's), and the head from one
    drawn from `head_count` (its head draws one layer's keys later); XLA drops the draws it does not return."""
    where = jax.tree.unflatten(where_treedef, where_leaves)
    one_layer = dataclasses.replace(config, num_layers=1)

    def one_layer_model(count) -> dict:
        return nnx.to_pure_dict(nnx.state(Llama(one_layer, dtype=dtype, rngs=_seeded_at(seed, count))))

    def draw_ends(head_count):
        out = {name: value for name, value in one_layer_model(0).items() if name in where and name != "lm_head"}
        if "lm_head" in where:
            out["lm_head"] = one_layer_model(head_count)["lm_head"]
        return out

    return jax.jit(draw_ends, out_shardings=where)


def _state_path(path) -> tuple:
    """A jax key path into an nnx State -> the variable's path as checkpoints name it (('layers', 0, 'mlp', 'down'))."""
    out = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            out.append(key.key)
        elif isinstance(key, jax.tree_util.SequenceKey):
            out.append(key.idx)
        elif isinstance(key, jax.tree_util.GetAttrKey) and key.name != "value":  # nnx.Variable's payload
            out.append(key.name)
    return tuple(out)


def abstract_model(config: LlamaConfig, *, dtype=jnp.float32) -> Llama:
    """The model's structure with ShapeDtypeStructs in place of arrays (for loading without allocating twice)."""
    return nnx.eval_shape(lambda: Llama(config, dtype=dtype, rngs=nnx.Rngs(params=0)))
