"""An independent float64 NumPy Llama, over HuggingFace tensor names: the oracle for model tests.

Written from the Llama-2 paper / HF modeling code, sharing nothing with jaxllm/model/llama.py. RoPE of
every Llama type (default, linear, dynamic, yarn, llama3) follows transformers 5's modeling_rope_utils,
read straight from a config.json dict of either style (`rope_parameters`, or `rope_theta` +
`rope_scaling`), including dynamic NTK's base recomputed from the sequence's length.
"""

from __future__ import annotations

import math

import numpy as np


def _rms_norm(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _rope_params(c: dict) -> dict:
    """The RoPE dict of a config.json, as transformers standardises it (theta and type filled in)."""
    params = dict(c.get("rope_scaling") or c.get("rope_parameters") or {})
    params.setdefault("rope_theta", c.get("rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in ("yarn", "llama3"):
        params.setdefault("original_max_position_embeddings", c["max_position_embeddings"])
    return params


def _inv_freq(head_dim: int, c: dict, seq_len: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies [head_dim // 2], attention factor) for a forward over seq_len tokens."""
    p = _rope_params(c)
    kind, base, dim = p["rope_type"], p["rope_theta"], head_dim
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
    if kind == "default":
        return 1.0 / base ** exponents, 1.0
    factor = p["factor"]
    if kind == "linear":
        return 1.0 / base ** exponents / factor, 1.0
    if kind == "dynamic":
        max_pos = c["max_position_embeddings"]
        seq_len = max(seq_len, max_pos)  # HF: the base grows only past the trained window
        base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / base ** exponents, 1.0
    if kind == "llama3":
        inv = 1.0 / base ** exponents
        old = p["original_max_position_embeddings"]
        lo, hi = p["low_freq_factor"], p["high_freq_factor"]
        out = []
        for f in inv:  # per frequency, as Meta's reference apply_scaling loop
            wavelen = 2 * math.pi / f
            if wavelen < old / hi:
                out.append(f)
            elif wavelen > old / lo:
                out.append(f / factor)
            else:
                smooth = (old / wavelen - lo) / (hi - lo)
                out.append((1 - smooth) * f / factor + smooth * f)
        return np.array(out), 1.0
    if kind == "yarn":
        orig = p["original_max_position_embeddings"]

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention = p.get("attention_factor")
        if attention is None:
            if p.get("mscale") and p.get("mscale_all_dim"):
                attention = get_mscale(factor, p["mscale"]) / get_mscale(factor, p["mscale_all_dim"])
            else:
                attention = get_mscale(factor)
        beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

        def corr(rot):
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        low, high = corr(beta_fast), corr(beta_slow)
        if p.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
        extrapolate = 1 - ramp
        pos_freqs = base ** exponents
        inv = (1 / (factor * pos_freqs)) * (1 - extrapolate) + (1 / pos_freqs) * extrapolate
        return inv, attention
    raise ValueError(f"oracle: unknown rope_type {kind!r}")


def _rotate(x, positions, inv, attention_factor):
    # x [T, H, D]; HF's rotate_half convention; yarn scales cos and sin.
    ang = positions[:, None].astype(np.float64) * inv[None, :]
    cos = attention_factor * np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
    sin = attention_factor * np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def numpy_llama_logits(tensors: dict, hf_config: dict, token_ids, *, dynamic_len: int | None = None) -> np.ndarray:
    """Logits [T, vocab] (float64) of one sequence under full causal attention, as HF computes them.

    dynamic_len: the sequence length dynamic NTK scaling computes its base from (HF: T, the default).
    """
    t = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
    c = hf_config
    n_heads, n_kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    hd = c.get("head_dim") or c["hidden_size"] // n_heads
    eps = c["rms_norm_eps"]
    ids = np.asarray(token_ids)
    T = len(ids)
    pos = np.arange(T)
    inv, attention_factor = _inv_freq(hd, c, dynamic_len or T)
    x = t["model.embed_tokens.weight"][ids]
    mask = np.tril(np.ones((T, T), bool))
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms_norm(x, t[p + "input_layernorm.weight"], eps)
        q = (h @ t[p + "self_attn.q_proj.weight"].T).reshape(T, n_heads, hd)
        k = (h @ t[p + "self_attn.k_proj.weight"].T).reshape(T, n_kv, hd)
        v = (h @ t[p + "self_attn.v_proj.weight"].T).reshape(T, n_kv, hd)
        q, k = _rotate(q, pos, inv, attention_factor), _rotate(k, pos, inv, attention_factor)
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
    hd = c.get("head_dim") or D // n_heads

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
