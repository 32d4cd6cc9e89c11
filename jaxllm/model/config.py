"""Model configuration: frozen dataclasses with named presets, and HuggingFace config.json import."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

RopeScalingType = Literal["linear", "dynamic", "yarn", "llama3"]
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
_ARCHITECTURES = ("LlamaForCausalLM",)


class ConfigError(ValueError):
    """A model configuration is malformed or names something we do not support."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling as Llama-family checkpoints ship it (HF `rope_parameters` / `rope_scaling`).

    `linear` divides positions by `factor` (position interpolation). `dynamic` is NTK-aware
    scaling; HF recomputes its base from each forward's sequence length, we apply it statically for
    the whole extended window (max_position_embeddings * factor), as vLLM does, so a token's
    rotation never depends on how long its sequence has grown: cached keys stay valid and a cached
    decode equals a full recompute (the two agree exactly for a sequence of that full length).
    `yarn` blends interpolated and original frequencies between the `beta_fast` / `beta_slow`
    rotation counts of the `original_max_position_embeddings` window and scales cos/sin by an
    attention factor; `llama3` divides low frequencies by `factor`, keeps high ones, and interpolates
    smoothly between `low_freq_factor` and `high_freq_factor`. Semantics: transformers'
    modeling_rope_utils; rope.py computes them.
    """

    type: RopeScalingType
    factor: float
    original_max_position_embeddings: int | None = None  # yarn, llama3: the pre-training window
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    attention_factor: float | None = None  # yarn; None: derived from factor (and mscale / mscale_all_dim)
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dimensions

    def __post_init__(self):
        if self.type not in ROPE_TYPES[1:]:
            raise ConfigError(f"rope_type {self.type!r} is not supported; use one of {list(ROPE_TYPES)}")
        if not (isinstance(self.factor, (int, float)) and self.factor >= 1.0 and math.isfinite(self.factor)):
            raise ConfigError(f"rope factor must be a finite number >= 1, got {self.factor!r}")
        orig = self.original_max_position_embeddings
        if orig is not None and (isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0):
            raise ConfigError(f"original_max_position_embeddings must be a positive integer, got {orig!r}")
        if self.type in ("yarn", "llama3") and orig is None:
            raise ConfigError(f"rope_type {self.type!r} needs original_max_position_embeddings")
        if self.type == "llama3":
            low, high = self.low_freq_factor, self.high_freq_factor
            if low is None or high is None:
                raise ConfigError(f"rope_type 'llama3' needs low_freq_factor and high_freq_factor, got {low!r}, {high!r}")
            if not (0 < low < high):
                raise ConfigError(f"llama3 rope needs 0 < low_freq_factor < high_freq_factor, got {low}, {high}")
        if self.attention_factor is not None and not self.attention_factor > 0:
            raise ConfigError(f"rope attention_factor must be positive, got {self.attention_factor!r}")
        if not (self.beta_fast > 0 and self.beta_slow > 0):
            raise ConfigError(f"yarn beta_fast and beta_slow must be positive, got {self.beta_fast}, {self.beta_slow}")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape and numerics of a Llama family model (Llama-2, CodeLlama, Llama-3.x).

    head_dim None means hidden_size // num_heads (HF's default); eos_token_ids are every id that ends
    generation (Llama-3.1 has three), eos_token_id the first.
    """

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
    eos_token_ids: tuple[int, ...] = (2,)
    name: str = "custom"
    head_dim: int | None = None

    def __post_init__(self):
        for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                      "max_position_embeddings"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{field} must be a positive integer, got {value!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ConfigError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        elif isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim <= 0:
            raise ConfigError(f"head_dim must be a positive integer, got {self.head_dim!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim {self.head_dim} must be even for RoPE")
        if not (0 < self.rms_norm_eps < 1):
            raise ConfigError(f"rms_norm_eps must be in (0, 1), got {self.rms_norm_eps}")
        if not (self.rope_theta > 0):
            raise ConfigError(f"rope_theta must be positive, got {self.rope_theta}")
        eos = self.eos_token_ids
        if isinstance(eos, int) and not isinstance(eos, bool):
            eos = (eos,)
        eos = tuple(eos) if isinstance(eos, (tuple, list)) else eos
        if not isinstance(eos, tuple) or not eos or not all(isinstance(i, int) and i >= 0 for i in eos):
            raise ConfigError(f"eos_token_ids must be a non-empty tuple of ids >= 0, got {self.eos_token_ids!r}")
        object.__setattr__(self, "eos_token_ids", eos)

    @property
    def eos_token_id(self) -> int:
        """The first EOS id (the one a single-EOS consumer uses)."""
        return self.eos_token_ids[0]

    @property
    def max_context(self) -> int:
        """Longest context the model is meant for, as vLLM derives it from the RoPE settings.

        linear / dynamic: the trained window times the factor; yarn: its original window times the
        factor; llama3 configs already state the extended window in max_position_embeddings.
        """
        s = self.rope_scaling
        if s is None or s.type == "llama3":
            return self.max_position_embeddings
        window = s.original_max_position_embeddings if s.type == "yarn" else self.max_position_embeddings
        return int(window * s.factor)

    def describe_max_context(self) -> str:
        """Where max_context comes from, for messages: "max_position_embeddings 2048", or the RoPE scaling."""
        s = self.rope_scaling
        if s is None or s.type == "llama3":
            return f"max_position_embeddings {self.max_position_embeddings}"
        if s.type == "yarn":
            return f"yarn RoPE scaling: original_max_position_embeddings {s.original_max_position_embeddings} x factor {s.factor:g}"
        return f"{s.type} RoPE scaling: max_position_embeddings {self.max_position_embeddings} x factor {s.factor:g}"

    def replace(self, **overrides: Any) -> "LlamaConfig":
        return dataclasses.replace(self, **overrides)

    # ----- presets -----

    @classmethod
    def tiny(cls, **overrides: Any) -> "LlamaConfig":
        """About 1.6 million parameters over the byte-level vocabulary: tests and the offline demo. Two layers: every
        per-layer path (weights, KV, sharding) still sees more than one layer, and the test suite, which compiles
        steps of this model over and over, compiles each ~20% faster than at four."""
        base = dict(vocab_size=259, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
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
    def llama3_8b(cls, **overrides: Any) -> "LlamaConfig":
        """Meta-Llama-3-8B's shape: GQA 32 / 8, theta 500000, 8K window, 128K-token BPE vocabulary."""
        base = dict(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                    intermediate_size=14336, max_position_embeddings=8192, rope_theta=500000.0,
                    bos_token_id=128000, eos_token_ids=(128001,), name="llama3-8b")
        return cls(**{**base, **overrides})

    @classmethod
    def llama3_1_8b(cls, **overrides: Any) -> "LlamaConfig":
        """Llama-3.1-8B's shape: llama3 RoPE scaling (factor 8 over the 8K window) to 128K, three EOS ids."""
        scaling = RopeScaling("llama3", 8.0, original_max_position_embeddings=8192, low_freq_factor=1.0,
                              high_freq_factor=4.0)
        base = dict(max_position_embeddings=131072, rope_scaling=scaling, eos_token_ids=(128001, 128008, 128009),
                    name="llama3.1-8b")
        return cls.llama3_8b(**{**base, **overrides})

    @classmethod
    def from_hf(cls, raw: dict) -> "LlamaConfig":
        """Build from the parsed dict of a HuggingFace `config.json`, either transformers-5 style
        (`rope_parameters`) or legacy (`rope_theta` + `rope_scaling`); checkpoints' readers read the file."""
        return _from_hf(cls, raw)

    def to_hf(self) -> dict:
        """The HuggingFace config.json dict for this config (used when writing checkpoints).

        RoPE goes out in the legacy `rope_theta` + `rope_scaling` keys, which transformers 4 and 5
        both read (transformers 4 ignores `rope_parameters`).
        """
        out = {
            "architectures": list(_ARCHITECTURES), "model_type": "llama", "hidden_act": "silu",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings, "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id if len(self.eos_token_ids) == 1 else list(self.eos_token_ids),
        }
        if self.rope_scaling:
            fields = dataclasses.asdict(self.rope_scaling)
            kind = fields.pop("type")
            out["rope_scaling"] = {"rope_type": kind, **{k: v for k, v in fields.items()
                                                         if k in _ROPE_KEYS[kind] and v is not None}}
        return out


# Keys each rope type reads (besides rope_type / type / rope_theta); others are ignored, as transformers does.
_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
}
_ROPE_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
                  "llama3": ("factor", "low_freq_factor", "high_freq_factor")}


def _number(value, key: str, *, integer: bool = False):
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ConfigError(f"{key} must be {'an integer' if integer else 'a number'}, got {value!r}")
    return value if integer else float(value)


def _rope_from_hf(raw: dict) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either config style, with transformers 5's precedence: a legacy
    `rope_scaling` wins over `rope_parameters`; theta from the RoPE dict, else top-level `rope_theta`."""
    if raw.get("rope_scaling"):
        key, params = "rope_scaling", raw["rope_scaling"]
    else:
        key, params = "rope_parameters", raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{key} must be a JSON object, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        raise ConfigError(f"{key} is nested per layer type ({sorted(params)}); Llama has one RoPE for all layers")
    theta = _number(params.get("rope_theta", raw.get("rope_theta", 10000.0)), f"{key}.rope_theta")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(f"{key}.rope_type {kind!r} is not supported; use one of {list(ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ConfigError(f"partial_rotary_factor {partial!r} is not supported (Llama rotates the whole head)")
    if kind == "default":
        return theta, None
    missing = [k for k in _ROPE_REQUIRED[kind] if params.get(k) is None]
    if missing:
        raise ConfigError(f"{key} of rope_type {kind!r} is missing {', '.join(f'{key}.{k}' for k in missing)}")
    values: dict[str, Any] = {}
    for k in _ROPE_KEYS[kind]:
        v = params.get(k)
        if v is None:
            continue
        if k == "truncate":
            if not isinstance(v, bool):
                raise ConfigError(f"{key}.truncate must be true or false, got {v!r}")
            values[k] = v
        else:
            values[k] = _number(v, f"{key}.{k}", integer=(k == "original_max_position_embeddings"))
    if kind in ("yarn", "llama3") and "original_max_position_embeddings" not in values:
        # transformers' standardize_rope_params: the pre-training window defaults to max_position_embeddings.
        values["original_max_position_embeddings"] = int(raw.get("max_position_embeddings", 4096))
    try:
        return theta, RopeScaling(kind, **values)
    except ConfigError as e:
        raise ConfigError(f"{key}: {e}") from e


def _from_hf(cls, raw: dict) -> LlamaConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type", "llama")
    if model_type != "llama":
        raise ConfigError(f"model_type {model_type!r} is not a Llama model (expected 'llama')")
    architectures = raw.get("architectures")
    if architectures is not None:
        if not isinstance(architectures, list) or any(a not in _ARCHITECTURES for a in architectures):
            raise ConfigError(f"architectures {architectures!r} is not a Llama model (expected {list(_ARCHITECTURES)})")
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    missing = [k for k in required if raw.get(k) is None]
    if missing:
        raise ConfigError(f"missing required key {missing[0]!r}" + (f" (and {missing[1:]})" if missing[1:] else ""))
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {raw['hidden_act']!r} is not supported (Llama uses 'silu')")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise ConfigError(f"{key} {raw[key]!r} is not supported (Llama has no biases)")
    ints = {k: _number(raw[k], k, integer=True) for k in required}
    theta, scaling = _rope_from_hf(raw)
    eos = raw.get("eos_token_id")
    eos = (2,) if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    for i in eos:
        _number(i, "eos_token_id", integer=True)
    bos = raw.get("bos_token_id")
    head_dim = raw.get("head_dim")
    return cls(
        vocab_size=ints["vocab_size"],
        hidden_size=ints["hidden_size"],
        num_layers=ints["num_hidden_layers"],
        num_heads=ints["num_attention_heads"],
        num_kv_heads=_number(raw.get("num_key_value_heads") or ints["num_attention_heads"], "num_key_value_heads",
                             integer=True),
        intermediate_size=ints["intermediate_size"],
        max_position_embeddings=_number(raw.get("max_position_embeddings", 4096), "max_position_embeddings",
                                        integer=True),
        rms_norm_eps=_number(raw.get("rms_norm_eps", 1e-5), "rms_norm_eps"),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=1 if bos is None else _number(bos, "bos_token_id", integer=True),
        eos_token_ids=eos,
        name=str(raw.get("_name_or_path") or "hf"),
        head_dim=None if head_dim is None else _number(head_dim, "head_dim", integer=True),
    )


PRESETS = {
    "tiny": LlamaConfig.tiny,
    "llama2-7b": LlamaConfig.llama2_7b,
    "llama2-13b": LlamaConfig.llama2_13b,
    "llama2-70b": LlamaConfig.llama2_70b,
    "llama3-8b": LlamaConfig.llama3_8b,
    "llama3.1-8b": LlamaConfig.llama3_1_8b,
}


def preset(name: str, **overrides: Any) -> LlamaConfig:
    """A named preset; raises ConfigError listing the known names for an unknown one."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
    return PRESETS[name](**overrides)
