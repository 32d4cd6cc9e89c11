"""Model configuration: frozen dataclasses with named presets, and HuggingFace config.json import.

One config for the Llama family as jaxllm loads it: Llama itself and the architectures that differ from it in a few
named places (`ARCHITECTURES`), each difference an option of the one model (jaxllm/model/llama.py), never a copy.

About 480 lines on purpose: the dataclass, its presets and its translation from and to config.json are one
contract (every field's meaning, its HF key, its default per architecture and its refusal live side by side, so
a new field is one place to read); split, each field would be described in two files.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

RopeScalingType = Literal["linear", "dynamic", "yarn", "llama3"]
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
# The HF architectures that load, by their config.json model_type, and how each differs from Llama:
#   MistralForCausalLM  Llama, plus an optional sliding window (`sliding_window`): refused where set (_check_window);
#                       sliding_window null (Mistral-7B-v0.2 / v0.3) loads
#   Qwen2ForCausalLM    a bias on the q, k and v projections (LlamaConfig.qkv_bias); Qwen2 and Qwen2.5
#   Qwen3ForCausalLM    an RMSNorm of each head's q and k over head_dim before RoPE (LlamaConfig.qk_norm), explicit
#                       head_dim (128 where hidden / heads is not), no bias
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3"}
_MODEL_TYPES = {model_type: architecture for architecture, model_type in ARCHITECTURES.items()}


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
    """Shape and numerics of a Llama family model (Llama-2, CodeLlama, Llama-3.x, Mistral, Qwen2 / 2.5, Qwen3).

    head_dim None means hidden_size // num_heads (HF's default); eos_token_ids are every id that ends
    generation (Llama-3.1 has three), eos_token_id the first. architecture: the HF architecture (a key of
    ARCHITECTURES), which decides the options that differ from Llama (qkv_bias, qk_norm) and what to_hf writes.
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
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"architecture {self.architecture!r} is not supported; use one of {list(ARCHITECTURES)}")
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
    def qkv_bias(self) -> bool:
        """Whether the q, k and v projections add a bias (Qwen2 / Qwen2.5; o has none)."""
        return self.architecture == "Qwen2ForCausalLM"

    @property
    def qk_norm(self) -> bool:
        """Whether each head's q and k are RMSNorm-ed over head_dim (one weight [head_dim] each) before RoPE (Qwen3)."""
        return self.architecture == "Qwen3ForCausalLM"

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
    def tiny_draft(cls, **overrides: Any) -> "LlamaConfig":
        """A draft model for `tiny` (speculative decoding's tests): its vocabulary and tokenizer, one narrow layer."""
        base = dict(vocab_size=259, hidden_size=128, num_layers=1, num_heads=2, num_kv_heads=1,
                    intermediate_size=344, max_position_embeddings=2048, name="tiny-draft")
        return cls(**{**base, **overrides})

    @classmethod
    def llama_68m(cls, **overrides: Any) -> "LlamaConfig":
        """JackFram/llama-68m's shape (the draft model vLLM's speculative-decoding tests pair with Llama-2): the
        Llama-2 vocabulary, 2 layers of 768, 12 heads of 64."""
        base = dict(vocab_size=32000, hidden_size=768, num_layers=2, num_heads=12, num_kv_heads=12,
                    intermediate_size=3072, max_position_embeddings=2048, name="llama-68m")
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
    def qwen2_5_7b(cls, **overrides: Any) -> "LlamaConfig":
        """Qwen2.5-7B-Instruct's shape: q/k/v biases, GQA 28 / 4 (head_dim 128), theta 1e6, 32K window, untied."""
        base = dict(vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4,
                    intermediate_size=18944, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6,
                    bos_token_id=151643, eos_token_ids=(151645,), name="qwen2.5-7b", architecture="Qwen2ForCausalLM")
        return cls(**{**base, **overrides})

    @classmethod
    def qwen3_8b(cls, **overrides: Any) -> "LlamaConfig":
        """Qwen3-8B's shape: q/k norms, GQA 32 / 8, head_dim 128, theta 1e6, 40K window, untied."""
        base = dict(vocab_size=151936, hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                    intermediate_size=12288, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
                    bos_token_id=151643, eos_token_ids=(151645,), name="qwen3-8b", architecture="Qwen3ForCausalLM")
        return cls(**{**base, **overrides})

    @classmethod
    def mistral_7b(cls, **overrides: Any) -> "LlamaConfig":
        """Mistral-7B-v0.3's shape: GQA 32 / 8, theta 1e6, 32K window, no sliding window, 32768-token vocabulary."""
        base = dict(vocab_size=32768, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                    intermediate_size=14336, max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1e6,
                    name="mistral-7b", architecture="MistralForCausalLM")
        return cls(**{**base, **overrides})

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
            "architectures": [self.architecture], "model_type": ARCHITECTURES[self.architecture], "hidden_act": "silu",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings, "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id if len(self.eos_token_ids) == 1 else list(self.eos_token_ids),
        }
        # Said outright: transformers' Mistral and Qwen configs default to a window (4096) or a bias when left out.
        if self.architecture == "MistralForCausalLM":
            out["sliding_window"] = None
        elif self.architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            out.update(use_sliding_window=False, sliding_window=None)
            if self.architecture == "Qwen3ForCausalLM":
                out["attention_bias"] = False
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


# What transformers' config classes take for a key a config.json leaves out, where it differs by architecture
# (Llama keeps the defaults jaxllm always read, Llama-2's: rms_norm_eps 1e-5, a 4096-token window).
_DEFAULTS = {
    "LlamaForCausalLM": dict(max_position_embeddings=4096, rms_norm_eps=1e-5),
    "MistralForCausalLM": dict(max_position_embeddings=131072, rms_norm_eps=1e-6, num_key_value_heads=8),
    "Qwen2ForCausalLM": dict(max_position_embeddings=32768, rms_norm_eps=1e-6),
    "Qwen3ForCausalLM": dict(max_position_embeddings=32768, rms_norm_eps=1e-6, head_dim=128),
}
# Bias keys each architecture's transformers code reads (Llama: attention_bias puts one on q, k, v and o; Qwen3 the
# same; Qwen2's q/k/v bias is always there and the key unread; Mistral has none): any set is refused.
_BIAS_KEYS = {"LlamaForCausalLM": ("attention_bias", "mlp_bias"), "Qwen3ForCausalLM": ("attention_bias",)}


def _architecture(raw: dict) -> str:
    """The ARCHITECTURES key of a config.json: from `architectures`, else `model_type`; the two must agree."""
    model_type, architectures = raw.get("model_type"), raw.get("architectures")
    if architectures is None:
        kind = "llama" if model_type is None else model_type
        if kind not in _MODEL_TYPES:
            raise ConfigError(f"model_type {model_type!r} is not supported; jaxllm loads {list(_MODEL_TYPES)}")
        return _MODEL_TYPES[kind]
    if not isinstance(architectures, list) or len(architectures) != 1 or architectures[0] not in ARCHITECTURES:
        raise ConfigError(f"architectures {architectures!r} is not supported; jaxllm loads one of "
                          f"{list(ARCHITECTURES)}")
    architecture = architectures[0]
    if model_type is not None and model_type != ARCHITECTURES[architecture]:
        raise ConfigError(f"model_type {model_type!r} does not match architectures {architectures!r} (expected "
                          f"{ARCHITECTURES[architecture]!r})")
    return architecture


def _check_window(raw: dict, architecture: str, num_layers: int) -> None:
    """Refuse a checkpoint whose attention is windowed anywhere, reading the keys as transformers does: Mistral's
    `sliding_window` applies to every layer when set; Qwen2 / Qwen3 use theirs only with `use_sliding_window`, on
    the layers `layer_types` marks (or, without it, those from `max_window_layers` on). A window a config.json
    leaves out is transformers' default, 4096, in all three."""
    if architecture == "MistralForCausalLM":
        if raw.get("sliding_window", _DEFAULT_WINDOW) is not None:
            raise ConfigError(f"sliding_window {_window_text(raw)} is not supported: every layer of this Mistral "
                              f"checkpoint attends only to its last {raw.get('sliding_window', _DEFAULT_WINDOW)!r} "
                              "tokens, and jaxllm has no windowed attention (it loads Mistral checkpoints with "
                              "sliding_window null)")
        return
    if architecture not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") or not raw.get("use_sliding_window"):
        return
    window = raw.get("sliding_window", _DEFAULT_WINDOW)
    if window is None:
        return  # transformers: no window to apply
    layer_types = raw.get("layer_types")
    if layer_types is None:
        first = _number(raw.get("max_window_layers", 28), "max_window_layers", integer=True)
        windowed = list(range(first, num_layers))
    elif isinstance(layer_types, list):
        windowed = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    else:
        raise ConfigError(f"layer_types must be a list, got {layer_types!r}")
    if windowed:
        raise ConfigError(f"use_sliding_window true with sliding_window {_window_text(raw)} is not supported: layers "
                          f"{windowed[0]}..{windowed[-1]} of this checkpoint attend only to their last {window!r} "
                          "tokens, and jaxllm has no windowed attention (set use_sliding_window false to load it "
                          "with full attention, as the checkpoint's own long-context settings usually do)")


_DEFAULT_WINDOW = 4096  # transformers' MistralConfig, Qwen2Config and Qwen3Config


def _window_text(raw: dict) -> str:
    if "sliding_window" in raw:
        return repr(raw["sliding_window"])
    return f"{_DEFAULT_WINDOW} (transformers' default: config.json sets none)"


def _from_hf(cls, raw: dict) -> LlamaConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a JSON object, got {type(raw).__name__}")
    architecture = _architecture(raw)
    defaults = _DEFAULTS[architecture]
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    missing = [k for k in required if raw.get(k) is None]
    if missing:
        raise ConfigError(f"missing required key {missing[0]!r}" + (f" (and {missing[1:]})" if missing[1:] else ""))
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {raw['hidden_act']!r} is not supported (Llama uses 'silu')")
    for key in _BIAS_KEYS.get(architecture, ()):
        if raw.get(key):
            raise ConfigError(f"{key} {raw[key]!r} is not supported ({architecture} without biases loads)")
    ints = {k: _number(raw[k], k, integer=True) for k in required}
    _check_window(raw, architecture, ints["num_hidden_layers"])
    theta, scaling = _rope_from_hf(raw)
    eos = raw.get("eos_token_id")
    eos = (2,) if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    for i in eos:
        _number(i, "eos_token_id", integer=True)
    bos = raw.get("bos_token_id")
    head_dim = raw.get("head_dim", defaults.get("head_dim"))
    return cls(
        vocab_size=ints["vocab_size"],
        hidden_size=ints["hidden_size"],
        num_layers=ints["num_hidden_layers"],
        num_heads=ints["num_attention_heads"],
        num_kv_heads=_number(raw.get("num_key_value_heads") or defaults.get("num_key_value_heads")
                             or ints["num_attention_heads"], "num_key_value_heads", integer=True),
        intermediate_size=ints["intermediate_size"],
        max_position_embeddings=_number(raw.get("max_position_embeddings", defaults["max_position_embeddings"]),
                                        "max_position_embeddings", integer=True),
        rms_norm_eps=_number(raw.get("rms_norm_eps", defaults["rms_norm_eps"]), "rms_norm_eps"),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=1 if bos is None else _number(bos, "bos_token_id", integer=True),
        eos_token_ids=eos,
        name=str(raw.get("_name_or_path") or "hf"),
        head_dim=None if head_dim is None else _number(head_dim, "head_dim", integer=True),
        architecture=architecture,
    )


PRESETS = {
    "tiny": LlamaConfig.tiny,
    "tiny-draft": LlamaConfig.tiny_draft,
    "llama-68m": LlamaConfig.llama_68m,
    "llama2-7b": LlamaConfig.llama2_7b,
    "llama2-13b": LlamaConfig.llama2_13b,
    "llama2-70b": LlamaConfig.llama2_70b,
    "llama3-8b": LlamaConfig.llama3_8b,
    "llama3.1-8b": LlamaConfig.llama3_1_8b,
    "qwen2.5-7b": LlamaConfig.qwen2_5_7b,
    "qwen3-8b": LlamaConfig.qwen3_8b,
    "mistral-7b": LlamaConfig.mistral_7b,
}


def preset(name: str, **overrides: Any) -> LlamaConfig:
    """A named preset; raises ConfigError listing the known names for an unknown one."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
    return PRESETS[name](**overrides)
