"""Checkpoints transformers itself wrote (tests/jaxllm/data/hf_tiny, by scripts/make_hf_fixtures.py), one per
architecture beside Llama: Qwen2 (q/k/v biases, tied embeddings, yarn RoPE), Qwen3 (q/k norms, head_dim 32 where
hidden / heads is 16, untied, a model vocabulary wider than the tokenizer's) and Mistral (untied), all GQA, in
bfloat16. Loaded in float32, their logits match transformers' own float32 logits and their greedy tokens its
`generate`; their chat templates render and tokenize as transformers does; they convert to Orbax and back, run
with an int8 KV pool, and the presets of each architecture build and convert. Meshes (tensor parallel 2, 4
lending instances): tests/jaxllm/test_hf_architectures_meshes.py. No torch or transformers needed.
"""

from __future__ import annotations

import functools
import json
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import cli
from jaxllm.llm import LLM, EngineOptions
from jaxllm.model.chat import chat_prompt, render_chat
from jaxllm.model.checkpoints import load_hf, load_model, param_arrays
from jaxllm.model.config import PRESETS, LlamaConfig, preset
from jaxllm.model.kv_cache import init_kv_cache
from jaxllm.model.tokenizer_files import load_tokenizer
from pallas_kernels.dispatch import AttentionBatch
from tests.jaxllm.model.test_weights import _assert_models_equal

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "hf_tiny")
NAMES = ("qwen2", "qwen3", "mistral")
# max |error| / max |logit| against transformers' float32 forward: the bound of the float64-oracle tests (measured
# ~1e-6 here, on one device and on meshes).
TOLERANCE = 1e-5
OPTIONS = dict(block_size=8, max_seqs=2, max_tokens_per_step=128, num_blocks=16)


def checkpoint(name: str) -> str:
    return os.path.join(DATA, name)


@functools.cache
def reference(name: str) -> dict:
    """What transformers computed for this checkpoint: prompt_ids, logits [T, vocab], greedy, chats, ..."""
    with open(os.path.join(DATA, f"{name}.reference.json")) as f:
        out = json.load(f)
    with np.load(os.path.join(DATA, f"{name}.reference.npz")) as arrays:
        out.update({k: arrays[k] for k in arrays.files})
    return out


def relative_error(got, want) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.fixture(scope="module")
def llm():
    """name -> its LLM on one device (float32), built once for the module."""
    return functools.cache(lambda name: LLM(checkpoint(name), dtype="float32", progress=False,
                                            options=EngineOptions(**OPTIONS)))


@pytest.mark.parametrize("name", NAMES)
def test_each_architecture_reads_its_options(name):
    config = load_hf(checkpoint(name), progress=False).config
    assert config.architecture == reference(name)["architecture"]
    want = {"qwen2": (True, False, True, 16), "qwen3": (False, True, False, 32), "mistral": (False, False, False, 8)}
    assert (config.qkv_bias, config.qk_norm, config.tie_word_embeddings, config.head_dim) == want[name]
    assert config.num_kv_heads == 2 < config.num_heads  # GQA in all
    if name == "qwen2":
        assert config.rope_scaling.type == "yarn" and config.max_context == 128
        assert len(reference(name)["prompt_ids"]) > config.rope_scaling.original_max_position_embeddings
    if name == "qwen3":
        assert config.head_dim * config.num_heads != config.hidden_size
    assert LlamaConfig.from_hf(config.to_hf()) == config.replace(name="hf")


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(llm, name):
    ref = reference(name)
    got = llm(name).logits(ref["prompt_ids"].tolist())
    assert got.shape == ref["logits"].shape
    assert relative_error(got, ref["logits"]) < TOLERANCE


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_equal_transformers_generate(llm, name):
    ref = reference(name)
    out = llm(name).generate([ref["prompt_ids"].tolist()], temperature=0.0, max_new_tokens=len(ref["greedy"]),
                             ignore_eos=True)
    assert list(out[0].token_ids) == ref["greedy"].tolist()
    assert ref["min_greedy_margin"] > 1e-2  # no near-tie in transformers' own run: the equality means something


@pytest.mark.parametrize("name", NAMES)
def test_chat_templates_render_and_tokenize_as_transformers(name):
    tokenizer = load_tokenizer(checkpoint(name))
    assert tokenizer.chat_template  # from chat_template.jinja, where transformers 5 writes it
    for chat in reference(name)["chats"]:
        text = render_chat(chat["messages"], template=tokenizer.chat_template, bos_token=tokenizer.bos_token,
                           eos_token=tokenizer.eos_token, add_generation_prompt=chat["add_generation_prompt"])
        assert text == chat["text"]
        # what generate is given: the template's own BOS cut, the tokenizer's BOS id added back (Mistral; Qwen has none)
        prompt = chat_prompt(tokenizer, chat["messages"], add_generation_prompt=chat["add_generation_prompt"])
        assert tokenizer.encode(prompt) == chat["ids"]
    assert reference(name)["chats"][0]["ids"] == reference(name)["prompt_ids"].tolist()


def test_chat_through_the_llm(llm):
    """LLM.chat: the conversation's prompt is transformers' ids, its greedy answer transformers' tokens."""
    ref = reference("qwen3")
    out = llm("qwen3").chat(ref["chats"][0]["messages"], temperature=0.0, max_new_tokens=len(ref["greedy"]),
                            ignore_eos=True)
    assert list(out.token_ids) == ref["greedy"].tolist()


@pytest.mark.parametrize("name", NAMES)
def test_orbax_conversion_keeps_the_model_and_its_chat_template(tmp_path, name):
    dst = str(tmp_path / name)
    assert cli.main(["convert", checkpoint(name), dst, "--quiet"]) == 0
    converted, tokenizer_dir = load_model(dst)
    _assert_models_equal(converted, load_hf(checkpoint(name), progress=False))
    assert converted.config == load_hf(checkpoint(name), progress=False).config
    assert load_tokenizer(tokenizer_dir).chat_template == load_tokenizer(checkpoint(name)).chat_template


def _int8_logits(model, tokens) -> np.ndarray:
    """Logits [T, vocab] of one sequence prefilled into an int8 pool (test_weights._logits with an int8 pool)."""
    T, block = len(tokens), 8
    nb = math.ceil(T / block)
    kv = init_kv_cache(model.config, num_blocks=nb, block_size=block, dtype="int8")
    batch = AttentionBatch(block_tables=jnp.arange(nb, dtype=jnp.int32)[None], kv_lens=jnp.array([T], jnp.int32),
                           cu_q_lens=jnp.array([0, T], jnp.int32), slot_mapping=jnp.arange(T, dtype=jnp.int32))
    hidden, _ = model(jnp.asarray(tokens, jnp.int32), jnp.arange(T, dtype=jnp.int32), kv, batch)
    return np.asarray(model.logits(hidden), np.float64)


def test_int8_kv():
    """Qwen3's K is normalised per head, then rotated, then quantised into an int8 pool: within int8's error of
    transformers (test_int8_kv.py's bounds), not equal to it."""
    ref = reference("qwen3")
    got = _int8_logits(load_hf(checkpoint("qwen3"), dtype="float32", progress=False), ref["prompt_ids"])
    want = ref["logits"]
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert 1e-5 < rel < 5e-2, rel
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.9


def test_presets_have_the_real_checkpoints_shapes():
    q25, q3, m = preset("qwen2.5-7b"), preset("qwen3-8b"), preset("mistral-7b")
    assert (q25.hidden_size, q25.num_layers, q25.num_heads, q25.num_kv_heads, q25.head_dim, q25.intermediate_size,
            q25.vocab_size, q25.rope_theta, q25.rms_norm_eps) == (3584, 28, 28, 4, 128, 18944, 152064, 1e6, 1e-6)
    assert q25.qkv_bias and not q25.qk_norm and not q25.tie_word_embeddings
    assert (q3.hidden_size, q3.num_layers, q3.num_heads, q3.num_kv_heads, q3.head_dim, q3.intermediate_size,
            q3.vocab_size, q3.rope_theta, q3.rms_norm_eps) == (4096, 36, 32, 8, 128, 12288, 151936, 1e6, 1e-6)
    assert q3.qk_norm and not q3.qkv_bias and not q3.tie_word_embeddings
    assert (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.intermediate_size, m.vocab_size,
            m.rope_theta, m.rms_norm_eps) == (4096, 32, 32, 8, 128, 14336, 32768, 1e6, 1e-5)
    assert not (m.qkv_bias or m.qk_norm) and m.architecture == "MistralForCausalLM"
    for config in (q25, q3, m):
        hf = config.to_hf()
        assert hf.get("sliding_window", "absent") is None  # said outright: transformers' Mistral defaults to 4096
        assert LlamaConfig.from_hf({**hf, "_name_or_path": config.name}) == config


@pytest.mark.parametrize("name", ["qwen2.5-7b", "qwen3-8b", "mistral-7b"])
def test_convert_writes_each_preset_as_a_huggingface_directory(monkeypatch, tmp_path, name):
    """`jaxllm convert <preset> DST`, at a small width (the 7-8B weights are too big for a test): the directory
    names its architecture and loads back as the same model, its options' weights included."""
    small = PRESETS[name](vocab_size=300, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                          intermediate_size=64)
    monkeypatch.setitem(PRESETS, name, lambda **overrides: small.replace(**overrides))
    dst = str(tmp_path / name)
    assert cli.main(["convert", name, dst]) == 0
    with open(os.path.join(dst, "config.json")) as f:
        assert json.load(f)["architectures"] == [small.architecture]
    back, _ = load_model(dst)
    _assert_models_equal(back, load_model(name)[0])
    names = {"/".join(map(str, path)) for path in param_arrays(back)}
    assert ("layers/0/attention/qkv_bias" in names) == small.qkv_bias
    assert ("layers/0/attention/q_norm/weight" in names) == small.qk_norm
