"""Checkpoint loading: HF safetensors (single, sharded, bf16) against the NumPy oracle, Orbax round trips,
load_model, every user error, the convert CLI, and the progress reporter."""

from __future__ import annotations

import io
import json
import math
import os
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxllm import cli
from jaxllm.model import checkpoints as weights
from jaxllm.model.config import LlamaConfig
from jaxllm.model.kv_cache import init_kv_cache
from pallas_kernels.dispatch import AttentionBatch
from jaxllm.progress import Progress
from jaxllm.model.checkpoints import CheckpointError, load_hf, load_model, load_orbax, save_hf, save_orbax
from tests.jaxllm.model.numpy_llama import numpy_llama_logits, random_hf_tensors

BLOCK = 16


def _config(num_heads=4, num_kv_heads=2, tied=False, **overrides) -> LlamaConfig:
    # Awkward sizes (vocab 97, intermediate 88) so a swapped axis cannot reshape silently.
    base = dict(vocab_size=97, hidden_size=64, num_layers=2, num_heads=num_heads, num_kv_heads=num_kv_heads,
                intermediate_size=88, max_position_embeddings=128, tie_word_embeddings=tied, name="test")
    return LlamaConfig(**{**base, **overrides})


def _write_hf(directory, tensors: dict, hf_config: dict, num_shards: int = 1) -> str:
    """An HF-format checkpoint as transformers writes it: config.json + one file, or shards + index."""
    directory = str(directory)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config, f)
    if num_shards == 1:
        save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        return directory
    names = list(tensors)
    weight_map = {}
    for k in range(num_shards):
        file = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::num_shards]}
        save_file(part, os.path.join(directory, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    return directory


def _logits(model, tokens: np.ndarray) -> np.ndarray:
    """Logits [T, vocab] of one sequence run through the rBlock pool."""
    T = len(tokens)
    nb = math.ceil(T / BLOCK)
    kv = init_kv_cache(model.config, num_blocks=nb, block_size=BLOCK, dtype="float32")
    batch = AttentionBatch(block_tables=jnp.arange(nb, dtype=jnp.int32)[None], kv_lens=jnp.array([T], jnp.int32),
                           cu_q_lens=jnp.array([0, T], jnp.int32), slot_mapping=jnp.arange(T, dtype=jnp.int32))
    hidden, _ = model(jnp.asarray(tokens, jnp.int32), jnp.arange(T, dtype=jnp.int32), kv, batch)
    return np.asarray(model.logits(hidden), np.float64)


def _rel_err(got, want) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def _params(model) -> dict:
    return {k: np.asarray(v) for k, v in weights.param_arrays(model).items()}


def _assert_models_equal(a, b):
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    for key in pa:
        assert pa[key].dtype == pb[key].dtype, key
        assert np.array_equal(pa[key], pb[key]), key
    assert np.array_equal(np.asarray(a.inv_freq[...]), np.asarray(b.inv_freq[...]))


# ----- HF loading against the oracle -----


@pytest.mark.parametrize("num_heads,num_kv_heads,tied,num_shards,extra", [
    (4, 4, False, 1, {}),                                                    # MHA, untied, one file
    (4, 2, True, 3, {}),                                                     # GQA, tied, sharded
    (8, 2, False, 2, {"rope_scaling": {"type": "linear", "factor": 2.0}}),   # GQA 4:1, sharded, scaled RoPE
])
def test_load_hf_matches_numpy_oracle(tmp_path, num_heads, num_kv_heads, tied, num_shards, extra):
    hf_config = {**_config(num_heads, num_kv_heads, tied).to_hf(), **extra}
    tensors = random_hf_tensors(hf_config, seed=num_heads + num_shards)
    _write_hf(tmp_path, tensors, hf_config, num_shards)
    model = load_hf(tmp_path, dtype="float32", progress=False)
    assert model.config.num_kv_heads == num_kv_heads and model.config.tie_word_embeddings == tied
    assert all(v.dtype == np.float32 for v in _params(model).values())
    assert ("lm_head",) not in _params(model) if tied else ("lm_head",) in _params(model)
    tokens = np.random.default_rng(7).integers(0, hf_config["vocab_size"], 37)  # 37: crosses two rBlocks
    assert _rel_err(_logits(model, tokens), numpy_llama_logits(tensors, hf_config, tokens)) < 1e-5


def test_save_hf_round_trip_sharded_then_single(tmp_path):
    hf_config = _config().to_hf()
    tensors = random_hf_tensors(hf_config, seed=3)
    model = load_hf(_write_hf(tmp_path / "src", tensors, hf_config), progress=False)
    out = tmp_path / "out"
    save_hf(model, out, max_shard_bytes=40_000)
    index = json.load(open(out / "model.safetensors.index.json"))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all(os.path.isfile(out / f) for f in files)
    written = {}
    for f in files:
        written.update(load_file(str(out / f)))
    assert written.keys() == tensors.keys()
    for name in tensors:
        assert np.array_equal(written[name], tensors[name]), name
    again = load_hf(out, progress=False)
    _assert_models_equal(model, again)
    assert again.config == model.config
    # Re-export unsharded into the same directory: the stale shards and index must go.
    save_hf(again, out)
    assert sorted(p for p in os.listdir(out) if "safetensors" in p) == ["model.safetensors"]
    _assert_models_equal(model, load_hf(out, progress=False))


def test_bf16_checkpoint_loads_and_converts(tmp_path):
    hf_config = _config(tied=True).to_hf()
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in random_hf_tensors(hf_config, seed=5).items()}
    _write_hf(tmp_path, tensors, {**hf_config, "torch_dtype": "bfloat16"}, num_shards=2)
    native = load_hf(tmp_path, progress=False)
    assert all(v.dtype == jnp.bfloat16 for v in _params(native).values())
    assert np.array_equal(_params(native)[("embedding",)], tensors["model.embed_tokens.weight"])
    q = tensors["model.layers.1.self_attn.q_proj.weight"]  # [Hq*hd, D] -> qkv[:, :, :G] [D, Hkv, G, hd]
    qkv = _params(native)[("layers", 1, "attention", "qkv")]  # [D, Hkv, G + 2, hd]
    assert np.array_equal(qkv[:, :, :qkv.shape[2] - 2].reshape(64, 4, 16), q.T.reshape(64, 4, 16))
    up = tensors["model.layers.1.mlp.up_proj.weight"]  # [F, D] -> gate_up[:, 1] [D, F]
    assert np.array_equal(_params(native)[("layers", 1, "mlp", "gate_up")][:, 1], up.T)
    upcast = load_hf(tmp_path, dtype=jnp.float32, progress=False)
    for key, value in _params(native).items():
        assert np.array_equal(_params(upcast)[key], value.astype(np.float32)), key
    tokens = np.random.default_rng(2).integers(0, 97, 19)
    want = numpy_llama_logits({k: v.astype(np.float32) for k, v in tensors.items()}, hf_config, tokens)
    assert _rel_err(_logits(upcast, tokens), want) < 1e-5


def test_float32_checkpoint_without_torch_dtype_converts_to_bf16(tmp_path):
    hf_config = _config().to_hf()  # no torch_dtype: the tensors' dtype (float32) is the default
    tensors = random_hf_tensors(hf_config, seed=6)
    _write_hf(tmp_path, tensors, hf_config)
    assert _params(load_hf(tmp_path, progress=False))[("embedding",)].dtype == np.float32
    down = _params(load_hf(tmp_path, dtype="bfloat16", progress=False))[("layers", 0, "mlp", "down")]
    assert down.dtype == ml_dtypes.bfloat16
    assert np.array_equal(down, tensors["model.layers.0.mlp.down_proj.weight"].T.astype(ml_dtypes.bfloat16))


# ----- Orbax -----


@pytest.mark.parametrize("dtype,tied", [(jnp.bfloat16, False), (jnp.float32, True)])
def test_orbax_round_trip_is_bit_exact(tmp_path, dtype, tied):
    config = _config(tied=tied, rope_scaling=None)
    from jaxllm.model.llama import init_model

    model = init_model(config, dtype=dtype, seed=11)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.model").write_bytes(b"\x00sentencepiece\xff")
    save_orbax(model, tmp_path / "ckpt", tokenizer_dir=tmp_path / "tok")
    restored = load_orbax(tmp_path / "ckpt")
    assert restored.config == config
    _assert_models_equal(model, restored)
    assert (tmp_path / "ckpt" / "tokenizer.model").read_bytes() == b"\x00sentencepiece\xff"
    # Saving again over our own checkpoint is allowed; a changed dtype on restore converts.
    save_orbax(restored, tmp_path / "ckpt")
    f16 = load_orbax(tmp_path / "ckpt", dtype="float16")
    for key, value in _params(model).items():
        assert np.array_equal(_params(f16)[key], value.astype(np.float16)), key


# ----- load_model -----


def test_load_model_preset_hf_and_orbax(tmp_path):
    model, tok = load_model("tiny", dtype="bfloat16")
    assert tok is None and model.config.name == "tiny" and model.embedding[...].dtype == jnp.bfloat16
    again, _ = load_model("tiny", dtype="bfloat16")
    _assert_models_equal(model, again)  # seed 0: deterministic

    hf_config = _config().to_hf()
    hf_dir = _write_hf(tmp_path / "hf", random_hf_tensors(hf_config, seed=1), hf_config)
    hf_model, tok = load_model(hf_dir, progress=False)
    assert tok is None
    (tmp_path / "hf" / "tokenizer.model").write_bytes(b"tok")
    _, tok = load_model(hf_dir, dtype="bfloat16", progress=False)
    assert tok == hf_dir

    save_orbax(hf_model, tmp_path / "orbax", tokenizer_dir=hf_dir)
    orbax_model, tok = load_model(str(tmp_path / "orbax"))
    assert tok == str(tmp_path / "orbax")
    _assert_models_equal(hf_model, orbax_model)


def test_load_model_rejects_unknown_spec_and_dtype(tmp_path):
    with pytest.raises(ValueError, match=r"'llama9-1b' is neither a preset \(known: \[.*'tiny'"):
        load_model("llama9-1b")
    with pytest.raises(ValueError, match="neither a preset"):
        load_model(str(tmp_path))  # a directory, but not a checkpoint
    with pytest.raises(ValueError, match="'float8'"):
        load_model("tiny", dtype="float8")
    with pytest.raises(ValueError, match="int32"):
        load_model("tiny", dtype=jnp.int32)


# ----- errors -----


def _break_missing_tensor(d, t, c):
    del t["model.layers.1.mlp.up_proj.weight"], t["model.norm.weight"]
    _write_hf(d, t, c)


def _break_shape(d, t, c):
    t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:-1]
    _write_hf(d, t, c)


def _break_dtype(d, t, c):
    t["model.layers.1.mlp.gate_proj.weight"] = t["model.layers.1.mlp.gate_proj.weight"].astype(np.int32)
    _write_hf(d, t, c)


def _break_index(d, t, c):
    _write_hf(d, t, c, num_shards=2)
    os.remove(os.path.join(d, "model-00002-of-00002.safetensors"))


def _break_no_safetensors(d, t, c):
    _write_hf(d, t, c)
    os.remove(os.path.join(d, "model.safetensors"))


def _break_config_json(d, t, c):
    _write_hf(d, t, c)
    open(os.path.join(d, "config.json"), "w").write('{"vocab_size": 97,')


def _break_model_type(d, t, c):
    _write_hf(d, t, {**c, "model_type": "mistral"})


def _break_no_config(d, t, c):
    _write_hf(d, t, c)
    os.remove(os.path.join(d, "config.json"))


def _break_truncated(d, t, c):
    _write_hf(d, t, c)
    path = os.path.join(d, "model.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) - 100])


@pytest.mark.parametrize("breaker,message", [
    (_break_missing_tensor, r"2 tensors missing.*model\.layers\.1\.mlp\.up_proj\.weight"),
    (_break_shape, r"model\.layers\.0\.self_attn\.k_proj\.weight: expected shape \[32, 64\], got \[31, 64\]"),
    (_break_dtype, r"model\.layers\.1\.mlp\.gate_proj\.weight.*I32"),
    (_break_index, r"model-00002-of-00002\.safetensors.*does not exist"),
    (_break_no_safetensors, r"no safetensors files in"),
    (_break_config_json, r"config\.json is malformed"),
    (_break_model_type, r"'mistral'"),
    (_break_no_config, r"no config\.json in"),
    (_break_truncated, r"model\.safetensors is not a readable safetensors file.*not fully covered"),
])
def test_load_hf_errors(tmp_path, breaker, message):
    hf_config = _config().to_hf()
    directory = str(tmp_path / "ckpt")
    breaker(directory, random_hf_tensors(hf_config, seed=0), hf_config)
    with pytest.raises(CheckpointError, match=message):
        load_hf(directory, progress=False)


def test_missing_directory_and_orbax_errors(tmp_path):
    with pytest.raises(CheckpointError, match="nowhere.*does not exist"):
        load_hf(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="no jaxllm_config.json"):
        load_orbax(tmp_path)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    from jaxllm.model.llama import init_model

    with pytest.raises(CheckpointError, match="refusing to write into .*other"):
        save_orbax(init_model(_config(num_layers=1)), tmp_path / "other")
    # A checkpoint of the old layout (separate q/k/v, gate/up) is refused by name, not half-loaded.
    save_orbax(init_model(_config(num_layers=1)), tmp_path / "old")
    marker = tmp_path / "old" / "jaxllm_config.json"
    marker.write_text(marker.read_text().replace('"version": 2', '"version": 1'))
    with pytest.raises(CheckpointError, match="layout version 1.*jaxllm convert"):
        load_orbax(tmp_path / "old")


def test_unexpected_tensors_warn_and_inv_freq_is_ignored(tmp_path):
    hf_config = _config(tied=True).to_hf()
    tensors = random_hf_tensors(hf_config, seed=4)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros(8, np.float32)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]  # tied ones may keep a copy
    _write_hf(tmp_path / "a", tensors, hf_config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = load_hf(tmp_path / "a", progress=False)
    want_inv_freq = (1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16.0)).astype(np.float32)  # computed, not the zeros
    assert np.array_equal(np.asarray(model.inv_freq[...]), want_inv_freq)
    tensors["model.layers.0.self_attn.extra_bias"] = np.zeros(3, np.float32)
    _write_hf(tmp_path / "b", tensors, hf_config)
    with pytest.warns(UserWarning, match="1 unexpected tensors.*extra_bias"):
        load_hf(tmp_path / "b", progress=False)


# ----- CLI -----


def test_cli_convert(tmp_path, capsys):
    hf_config = _config().to_hf()
    src = _write_hf(tmp_path / "hf", random_hf_tensors(hf_config, seed=9), hf_config)
    (tmp_path / "hf" / "tokenizer.model").write_bytes(b"tok")
    dst = str(tmp_path / "orbax")
    assert cli.main(["convert", src, dst, "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr()
    assert dst in out.out and "loading" in out.err  # progress goes to stderr
    converted, tok = load_model(dst)
    assert tok == dst
    _assert_models_equal(converted, load_hf(src, dtype="bfloat16", progress=False))
    assert cli.main(["convert", str(tmp_path / "missing"), dst]) == 2
    assert "missing" in capsys.readouterr().err


def test_cli_convert_a_preset_writes_a_huggingface_directory_offline(tmp_path, capsys):
    """`jaxllm convert tiny DST`: the preset as an HF directory (its random weights, its byte tokenizer as
    tokenizer.json) that loads back as the same model, and whose tokenizer gives the preset's ids and text."""
    import random

    from jaxllm.model.tokenizer import ByteTokenizer
    from jaxllm.model.tokenizer_files import load_tokenizer

    dst = str(tmp_path / "tiny-hf")
    assert cli.main(["convert", "tiny", dst]) == 0
    assert dst in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(dst))
    model, tokenizer_dir = load_model(dst)
    assert (model.config.name, tokenizer_dir) == ("tiny", dst)
    _assert_models_equal(model, load_model("tiny")[0])
    tokenizer, reference = load_tokenizer(tokenizer_dir), ByteTokenizer()
    assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (259, 1, 2, 0)
    for text in ["Once upon a time", "  two  spaces\tand a tab\n", "ünïcode 日本語 🦙", "\x00\x7f", ""]:
        assert tokenizer.encode(text) == reference.encode(text)
    rng = random.Random(34)
    for _ in range(300):  # random ids: invalid UTF-8 decodes as the byte tokenizer decodes it
        ids = [rng.randrange(259) for _ in range(rng.randrange(1, 16))]
        assert tokenizer.decode(ids) == reference.decode(ids), ids


def test_cli_convert_a_preset_drawn_in_shards(tmp_path):
    """`jaxllm convert tiny DST --tensor-parallel 2`: the preset drawn in its shards over two devices (how a model
    larger than one device is written) and saved: the same weights as on one device, up to float rounding."""
    from tests.devices import HOST_DEVICES

    if jax.device_count() < 2:
        pytest.skip(f"needs 2 devices (conftest gives {HOST_DEVICES} CPU host devices)")
    dst = str(tmp_path / "tiny-tp2")
    assert cli.main(["convert", "tiny", dst, "--tensor-parallel", "2", "--quiet"]) == 0
    got = nnx.state(load_model(dst)[0], nnx.Param)
    want = nnx.state(load_model("tiny")[0], nnx.Param)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


# ----- progress -----


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self._tty = tty

    def isatty(self):
        return self._tty


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_progress_plain_tty_and_disabled():
    clock, plain = _Clock(), _Stream(tty=False)
    with Progress(100, "work", unit="B", stream=plain, clock=clock) as bar:
        for _ in range(100):
            clock.t += 0.01
            bar.update(1, detail="x")
    lines = plain.getvalue().splitlines()
    assert "\r" not in plain.getvalue()
    assert len(lines) == 10 and lines[0].startswith("work:  10.0% 10 B/100 B") and "ETA" in lines[0]
    assert lines[-1] == "work: done 100 B/100 B in 0:01 (100 B/s)"

    clock, tty = _Clock(), _Stream(tty=True)
    with Progress(None, "steps", stream=tty, clock=clock) as bar:
        for _ in range(5):
            clock.t += 1.0
            bar.update()
    text = tty.getvalue()
    assert text.count("\r") == 6 and text.endswith("\n") and "steps: done 5 in 0:05" in text

    quiet = _Stream(tty=False)
    with Progress(10, "quiet", stream=quiet, enabled=False) as bar:
        bar.update(10)
    assert quiet.getvalue() == "" and bar.done == 10
