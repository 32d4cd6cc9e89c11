"""An independent float64 NumPy Llama-2, over HuggingFace tensor names: the oracle for model tests.

Written from the Llama-2 paper / HF modeling code, sharing nothing with jaxllm/model/llama.py.
"""

from __future__ import annotations

import numpy as np


def _rms_norm(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _inv_freq(head_dim, theta, scaling, max_pos):
    base = theta
    if scaling and scaling["type"] == "dynamic":
        f = scaling["factor"]
        # NTK base for a sequence of max_pos * f tokens, fixed (as vLLM applies it).
        base = theta * ((f * (max_pos * f) / max_pos) - (f - 1)) ** (head_dim / (head_dim - 2))
    inv = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling and scaling["type"] == "linear":
        inv = inv / scaling["factor"]
    return inv


def _rotate(x, positions, inv):
    # x [T, H, D]; HF's rotate_half convention.
    ang = positions[:, None].astype(np.float64) * inv[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def numpy_llama_logits(tensors: dict, hf_config: dict, token_ids) -> np.ndarray:
    """Logits [T, vocab] (float64) of one sequence under full causal attention."""
    t = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
    c = hf_config
    n_heads, n_kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    hd = c["hidden_size"] // n_heads
    eps = c["rms_norm_eps"]
    ids = np.asarray(token_ids)
    T = len(ids)
    pos = np.arange(T)
    inv = _inv_freq(hd, c.get("rope_theta", 10000.0), c.get("rope_scaling"), c["max_position_embeddings"])
    x = t["model.embed_tokens.weight"][ids]
    mask = np.tril(np.ones((T, T), bool))
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms_norm(x, t[p + "input_layernorm.weight"], eps)
        q = (h @ t[p + "self_attn.q_proj.weight"].T).reshape(T, n_heads, hd)
        k = (h @ t[p + "self_attn.k_proj.weight"].T).reshape(T, n_kv, hd)
        v = (h @ t[p + "self_attn.v_proj.weight"].T).reshape(T, n_kv, hd)
        q, k = _rotate(q, pos, inv), _rotate(k, pos, inv)
        rep = n_heads // n_kv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
        scores = np.where(mask[None], scores, -np.inf)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        probs = scores / scores.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(T, n_heads * hd)
        x = x + attn @ t[p + "self_attn.o_proj.weight"].T
        h = _rms_norm(x, t[p + "post_attention_layernorm.weight"], eps)
        gate = h @ t[p + "mlp.gate_proj.weight"].T
        up = h @ t[p + "mlp.up_proj.weight"].T
        x = x + ((gate / (1 + np.exp(-gate))) * up) @ t[p + "mlp.down_proj.weight"].T
    x = _rms_norm(x, t["model.norm.weight"], eps)
    head = t["model.embed_tokens.weight"] if c.get("tie_word_embeddings") else t["lm_head.weight"]
    return x @ head.T


def random_hf_tensors(hf_config: dict, seed: int) -> dict:
    """Random float32 HF-named tensors for a config (norm weights near 1)."""
    rng = np.random.default_rng(seed)
    c = hf_config
    D, F, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    n_heads, n_kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    hd = D // n_heads

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    out = {"model.embed_tokens.weight": w(V, D), "model.norm.weight": (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)}
    if not c.get("tie_word_embeddings"):
        out["lm_head.weight"] = w(V, D)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = w(n_heads * hd, D)
        out[p + "self_attn.k_proj.weight"] = w(n_kv * hd, D)
        out[p + "self_attn.v_proj.weight"] = w(n_kv * hd, D)
        out[p + "self_attn.o_proj.weight"] = w(D, n_heads * hd)
        out[p + "mlp.gate_proj.weight"] = w(F, D)
        out[p + "mlp.up_proj.weight"] = w(F, D)
        out[p + "mlp.down_proj.weight"] = w(D, F)
        out[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
        out[p + "post_attention_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    return out
