"""Rotary position embeddings as Llama-family checkpoints use them: the angle tables of a config.

Every RoPE type follows transformers' modeling_rope_utils (default, linear, dynamic, yarn, llama3),
except that `dynamic` is fixed at its full extended window (see config.RopeScaling for why). The
rotation itself (rotate-half layout) is `pallas_kernels.rope.apply_rope`, which the RoPE + KV-write
kernel follows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.model.config import LlamaConfig, RopeScaling


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_scaling(config: LlamaConfig) -> float:
    """The factor cos and sin are multiplied by: yarn's attention factor, 1.0 for every other type."""
    s = config.rope_scaling
    if s is None or s.type != "yarn":
        return 1.0
    if s.attention_factor is not None:
        return float(s.attention_factor)
    if s.mscale and s.mscale_all_dim:
        return _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    return _yarn_mscale(s.factor)


def _yarn(inv_freq: np.ndarray, dim: int, base: float, s: RopeScaling) -> np.ndarray:
    # Dimensions that turn fewer than beta_slow times over the original window are interpolated
    # (divided by factor), more than beta_fast times kept, with a linear ramp between.
    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoids a division by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1: extrapolate (original frequency), 0: interpolate
    return (inv_freq / s.factor) * (1.0 - keep) + inv_freq * keep


def _llama3(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    old = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def inverse_frequencies(config: LlamaConfig) -> np.ndarray:
    """[head_dim // 2] float64 inverse frequencies, with the config's RoPE scaling folded in.

    `linear` scaling divides positions by the factor, which is the same as dividing the
    frequencies. `dynamic` (NTK) raises the base as for a sequence filling the whole extended
    window; applied statically so cached keys never need re-rotation (see RopeScaling).
    """
    dim = config.head_dim
    base = config.rope_theta
    s = config.rope_scaling
    if s is not None and s.type == "dynamic" and s.factor > 1.0:
        f = s.factor
        max_len = config.max_position_embeddings * f
        base = base * ((f * max_len / config.max_position_embeddings) - (f - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if s is None or s.type == "dynamic":
        return inv_freq
    if s.type == "linear":
        return inv_freq / s.factor
    if s.type == "yarn":
        return _yarn(inv_freq, dim, base, s)
    return _llama3(inv_freq, s)


def rope_tables(inv_freq: jax.Array, positions: jax.Array, scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """cos, sin [tokens, head_dim // 2] float32 for integer positions [tokens], times `scale`
    (attention_scaling(config); the multiply is left out at 1.0 so unscaled models round as before)."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq.astype(jnp.float32)[None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos, sin
