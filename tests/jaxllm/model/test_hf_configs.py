"""Real checkpoints' config.json files: both RoPE styles transformers writes, every Llama RoPE type, against
the float64 NumPy oracle past the original window; explicit head_dim; the Llama-3 presets; Qwen2 / Qwen3 / Mistral
configs with and without a window that applies; malformed and unsupported configs."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jaxllm.model.checkpoints import CheckpointError, load_hf
from jaxllm.model.config import ConfigError, LlamaConfig, RopeScaling, preset
from tests.jaxllm.model.numpy_llama import numpy_llama_logits, random_hf_tensors
from tests.jaxllm.model.test_weights import _logits, _rel_err, _write_hf

_FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf_configs.json")
with open(_FIXTURES) as _f:
    HF_CONFIGS = json.load(_f)["configs"]  # written by transformers 5 (fixtures/make_hf_configs.py)
T = 40  # past every fixture's original window (16 tokens); dynamic's full extended window (16 * 2.5)


def _without_rope_scaling(raw: dict) -> dict:
    out = {k: v for k, v in raw.items() if k not in ("rope_scaling", "rope_parameters")}
    rope = raw.get("rope_parameters") or {}
    out["rope_theta"] = rope.get("rope_theta", raw.get("rope_theta"))
    return out


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_transformers_configs_match_numpy_oracle(tmp_path, name):
    raw = HF_CONFIGS[name]
    tensors = random_hf_tensors(raw, seed=sum(map(ord, name)))
    model = load_hf(_write_hf(tmp_path, tensors, raw), dtype="float32", progress=False)
    kind = name.split("_")[0]
    assert (model.config.rope_scaling.type if model.config.rope_scaling else "default") == kind
    assert model.config.tie_word_embeddings == raw["tie_word_embeddings"]
    assert model.config.num_kv_heads == raw["num_key_value_heads"]
    tokens = np.random.default_rng(1).integers(0, raw["vocab_size"], T)
    want = numpy_llama_logits(tensors, raw, tokens)
    assert _rel_err(_logits(model, tokens), want) < 1e-5
    if kind != "default":  # the scaling must matter here, or the comparison above proves nothing
        assert _rel_err(numpy_llama_logits(tensors, _without_rope_scaling(raw), tokens), want) > 1e-3


def test_both_styles_give_the_same_config():
    for name in HF_CONFIGS:
        if name.endswith("-legacy"):
            base = name[: -len("-legacy")]
            assert LlamaConfig.from_hf(HF_CONFIGS[name]) == LlamaConfig.from_hf(HF_CONFIGS[base + "-rope_parameters"])


def test_to_hf_round_trips_every_rope_type():
    for raw in HF_CONFIGS.values():
        config = LlamaConfig.from_hf(raw)
        assert LlamaConfig.from_hf(config.to_hf()) == config


def test_explicit_head_dim(tmp_path):
    # head_dim * heads != hidden (as some Llama-family checkpoints have): transformers honours head_dim.
    raw = {**LlamaConfig(vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=88, max_position_embeddings=64).to_hf(), "head_dim": 32}
    tensors = random_hf_tensors(raw, seed=3)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (128, 64)
    model = load_hf(_write_hf(tmp_path, tensors, raw), dtype="float32", progress=False)
    assert model.config.head_dim == 32
    tokens = np.arange(21) % 97
    assert _rel_err(_logits(model, tokens), numpy_llama_logits(tensors, raw, tokens)) < 1e-5


def test_llama3_presets():
    c8, c31 = preset("llama3-8b"), preset("llama3.1-8b")
    assert (c8.vocab_size, c8.num_heads, c8.num_kv_heads, c8.head_dim, c8.rope_theta) == (128256, 32, 8, 128, 5e5)
    assert c8.max_context == 8192 and c8.rope_scaling is None and c8.eos_token_ids == (128001,)
    assert c31.rope_scaling == RopeScaling("llama3", 8.0, original_max_position_embeddings=8192,
                                           low_freq_factor=1.0, high_freq_factor=4.0)
    assert c31.max_context == 131072 and c31.eos_token_ids == (128001, 128008, 128009) and c31.eos_token_id == 128001
    assert LlamaConfig.from_hf({**c31.to_hf(), "_name_or_path": c31.name}) == c31


def test_max_context_per_rope_type():
    base = dict(vocab_size=97, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=4, intermediate_size=8,
                max_position_embeddings=4096)
    assert LlamaConfig(**base, rope_scaling=RopeScaling("linear", 4.0)).max_context == 16384
    assert LlamaConfig(**base, rope_scaling=RopeScaling("dynamic", 2.0)).max_context == 8192
    yarn = RopeScaling("yarn", 32.0, original_max_position_embeddings=4096)
    assert LlamaConfig(**dict(base, max_position_embeddings=131072), rope_scaling=yarn).max_context == 131072


def _changed(raw: dict, changes: dict) -> dict:
    """raw with `changes` (_DROP removes a key)."""
    for key, value in changes.items():
        if value is _DROP:
            raw.pop(key)
        else:
            raw[key] = value
    return raw


def _hf(**changes) -> dict:
    return _changed(json.loads(json.dumps(HF_CONFIGS["llama3_gqa_tied-rope_parameters"])), changes)


_DROP = object()
_LLAMA3 = HF_CONFIGS["llama3_gqa_tied-rope_parameters"]["rope_parameters"]
_HF_TINY = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "hf_tiny")


def _qwen(name: str, **changes) -> dict:
    """A config.json transformers wrote (tests/jaxllm/data/hf_tiny/<name>), with changes (_DROP removes a key)."""
    with open(os.path.join(_HF_TINY, name, "config.json")) as f:
        return _changed(json.load(f), changes)


@pytest.mark.parametrize("name,changes", [
    ("qwen2", {}),  # sliding_window null, use_sliding_window false, every layer full_attention
    ("qwen2", dict(use_sliding_window=False, sliding_window=131072)),  # Qwen2.5's own configs: a window, unused
    ("qwen3", dict(use_sliding_window=True, sliding_window=None)),  # transformers: no window to apply
    ("qwen3", dict(use_sliding_window=True, sliding_window=64, max_window_layers=2, layer_types=_DROP)),  # no layer
    ("mistral", {}),  # sliding_window null: Mistral-7B-v0.2 / v0.3
    ("mistral", dict(head_dim=_DROP)),  # head_dim null or absent: hidden / heads
])
def test_unwindowed_checkpoints_load(name, changes):
    config = LlamaConfig.from_hf(_qwen(name, **changes))
    assert config.architecture == _qwen(name)["architectures"][0]


@pytest.mark.parametrize("raw,message", [
    (_hf(rope_parameters={**_LLAMA3, "rope_type": "longrope"}), r"rope_parameters\.rope_type 'longrope' is not supported"),
    (_hf(rope_parameters=None, rope_scaling={"type": "su", "factor": 2.0}), r"rope_scaling\.rope_type 'su'"),
    (_hf(rope_parameters={k: v for k, v in _LLAMA3.items() if k != "low_freq_factor"}),
     r"missing rope_parameters\.low_freq_factor"),
    (_hf(rope_parameters={"rope_type": "linear", "rope_theta": 1e4}), r"missing rope_parameters\.factor"),
    (_hf(rope_parameters={**_LLAMA3, "factor": "eight"}), r"rope_parameters\.factor must be a number, got 'eight'"),
    (_hf(rope_parameters={**_LLAMA3, "factor": 0.5}), r"factor must be a finite number >= 1, got 0\.5"),
    (_hf(rope_parameters={**_LLAMA3, "low_freq_factor": 4.0}), r"low_freq_factor < high_freq_factor, got 4\.0, 4\.0"),
    (_hf(rope_parameters={"full_attention": _LLAMA3}), r"nested per layer type"),
    (_hf(vocab_size=_DROP), r"missing required key 'vocab_size'"),
    (_hf(num_hidden_layers="two"), r"num_hidden_layers must be an integer, got 'two'"),
    (_hf(architectures=["GemmaForCausalLM"]), r"architectures \['GemmaForCausalLM'\] is not supported; jaxllm "
                                               r"loads one of \['LlamaForCausalLM', 'MistralForCausalLM'"),
    (_hf(architectures=_DROP, model_type="gemma"), r"model_type 'gemma' is not supported; jaxllm loads \['llama', "),
    (_hf(model_type="qwen2"), r"model_type 'qwen2' does not match architectures \['LlamaForCausalLM'\] \(expected "
                              r"'llama'\)"),
    (_hf(attention_bias=True), r"attention_bias True is not supported \(LlamaForCausalLM without biases loads\)"),
    (_qwen("qwen3", attention_bias=True), r"attention_bias True is not supported \(Qwen3ForCausalLM"),
    (_qwen("mistral", sliding_window=4096), r"sliding_window 4096 is not supported: every layer of this Mistral "
                                            r"checkpoint attends only to its last 4096 tokens, and jaxllm has no "
                                            r"windowed attention"),
    (_qwen("mistral", sliding_window=_DROP), r"sliding_window 4096 \(transformers' default: config.json sets none\)"),
    (_qwen("qwen2", use_sliding_window=True, sliding_window=64, layer_types=_DROP, max_window_layers=1),
     r"use_sliding_window true with sliding_window 64 is not supported: layers 1\.\.1 .* no windowed attention"),
    (_qwen("qwen3", use_sliding_window=True, sliding_window=64, layer_types=["sliding_attention", "full_attention"]),
     r"use_sliding_window true with sliding_window 64 is not supported: layers 0\.\.0"),
    (_hf(mlp_bias=True), r"mlp_bias True is not supported"),
    (_hf(partial_rotary_factor=0.5), r"partial_rotary_factor 0\.5 is not supported"),
    (_hf(eos_token_id=[128001, "x"]), r"eos_token_id must be an integer, got 'x'"),
])
def test_malformed_configs_name_key_and_value(tmp_path, raw, message):
    with pytest.raises(ConfigError, match=message):
        LlamaConfig.from_hf(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="config.json: .*" + message):  # the loader names the file too
        load_hf(tmp_path, progress=False)
