"""Model configuration: frozen dataclasses with named presets, and HuggingFace config.json import."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

RopeScalingType = Literal["linear", "dynamic"]


class ConfigError(ValueError):
    """A model configuration is malformed or names something we do not support."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling as long-context Llama-2 derivatives ship it in config.json.

    `linear` divides positions by `factor` (position interpolation). `dynamic` is NTK-aware
    scaling; we apply it statically for the whole extended window (max_position_embeddings *
    factor), as vLLM does, so a token's rotation never depends on how long its sequence has
    grown: cached keys stay valid and a cached decode equals a full recompute.
    """

    type: RopeScalingType
    factor: float

    def __post_init__(self):
        if self.type not in ("linear", "dynamic"):
            raise ConfigError(f"rope_scaling type {self.type!r} is not supported; use 'linear' or 'dynamic'")
        if not (self.factor >= 1.0 and math.isfinite(self.factor)):
            raise ConfigError(f"rope_scaling factor must be a finite number >= 1, got {self.factor}")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape and numerics of a Llama-2 family model."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int = 1
    eos_token_id: int = 2
    name: str = "custom"

    def __post_init__(self):
        for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                      "max_position_embeddings"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{field} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim {self.head_dim} must be even for RoPE")
        if not (0 < self.rms_norm_eps < 1):
            raise ConfigError(f"rms_norm_eps must be in (0, 1), got {self.rms_norm_eps}")
        if not (self.rope_theta > 0):
            raise ConfigError(f"rope_theta must be positive, got {self.rope_theta}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_context(self) -> int:
        """Longest context the model is meant for: the trained window times any RoPE scaling factor."""
        factor = self.rope_scaling.factor if self.rope_scaling else 1.0
        return int(self.max_position_embeddings * factor)

    def replace(self, **overrides: Any) -> "LlamaConfig":
        return dataclasses.replace(self, **overrides)

    # ----- presets -----

    @classmethod
    def tiny(cls, **overrides: Any) -> "LlamaConfig":
        """A few million parameters over the byte-level vocabulary: tests and the offline demo."""
        base = dict(vocab_size=259, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                    intermediate_size=688, max_position_embeddings=2048, name="tiny")
        return cls(**{**base, **overrides})

    @classmethod
    def llama2_7b(cls, **overrides: Any) -> "LlamaConfig":
        base = dict(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32,
                    intermediate_size=11008, name="llama2-7b")
        return cls(**{**base, **overrides})

    @classmethod
    def llama2_13b(cls, **overrides: Any) -> "LlamaConfig":
        base = dict(vocab_size=32000, hidden_size=5120, num_layers=40, num_heads=40, num_kv_heads=40,
                    intermediate_size=13824, name="llama2-13b")
        return cls(**{**base, **overrides})

    @classmethod
    def llama2_70b(cls, **overrides: Any) -> "LlamaConfig":
        base = dict(vocab_size=32000, hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                    intermediate_size=28672, name="llama2-70b")
        return cls(**{**base, **overrides})

    @classmethod
    def from_hf(cls, raw: dict) -> "LlamaConfig":
        """Build from the parsed dict of a HuggingFace `config.json` (weights._read_hf_config reads the file)."""
        where = "config dict"
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: expected a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type", "llama")
        if model_type != "llama":
            raise ConfigError(f"{where}: model_type {model_type!r} is not a Llama model")
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
        missing = [k for k in required if k not in raw]
        if missing:
            raise ConfigError(f"{where}: missing keys {missing}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{where}: hidden_act {raw['hidden_act']!r} is not supported (Llama uses 'silu')")
        head_dim = raw.get("head_dim")
        if head_dim is not None and head_dim * raw["num_attention_heads"] != raw["hidden_size"]:
            raise ConfigError(f"{where}: head_dim {head_dim} * num_attention_heads != hidden_size; not supported")
        scaling = raw.get("rope_scaling")
        rope_scaling = None
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind not in (None, "default"):
                rope_scaling = RopeScaling(type=kind, factor=float(scaling.get("factor", 1.0)))
        eos = raw.get("eos_token_id", 2)
        if isinstance(eos, list):
            eos = eos[0]
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=int(raw["num_attention_heads"]),
            num_kv_heads=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
            intermediate_size=int(raw["intermediate_size"]),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=int(raw.get("bos_token_id", 1) if raw.get("bos_token_id") is not None else 1),
            eos_token_id=int(eos if eos is not None else 2),
            name=str(raw.get("_name_or_path") or "hf"),
        )

    def to_hf(self) -> dict:
        """The HuggingFace config.json dict for this config (used when writing checkpoints)."""
        out = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "intermediate_size": self.intermediate_size, "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings, "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if self.rope_scaling:
            out["rope_scaling"] = {"type": self.rope_scaling.type, "factor": self.rope_scaling.factor}
        return out


PRESETS = {
    "tiny": LlamaConfig.tiny,
    "llama2-7b": LlamaConfig.llama2_7b,
    "llama2-13b": LlamaConfig.llama2_13b,
    "llama2-70b": LlamaConfig.llama2_70b,
}


def preset(name: str, **overrides: Any) -> LlamaConfig:
    """A named preset; raises ConfigError listing the known names for an unknown one."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
    return PRESETS[name](**overrides)
