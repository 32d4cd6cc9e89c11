"""The tiny model's greedy and seeded outputs for a fixed request set, recorded before the engine-core
refactor (issue 25) by the code of commit efc9b9c: any change to the engine, the model layout or the
kernels' dispatch that alters a token fails here.

They were recorded with the `tiny` preset of four layers (two since session 22): the test draws that model with
the preset's seed and loads it as a HuggingFace directory (the preset's `jaxllm convert` path), so the recorded
tokens still hold."""

import json
import pathlib

import jax.numpy as jnp
import pytest

from jaxllm import LLM, EngineOptions
from jaxllm.model.checkpoints import save_hf
from jaxllm.model.config import LlamaConfig
from jaxllm.model.hf_tokenizer import save_byte_tokenizer
from jaxllm.model.llama import init_model

GOLDEN = json.loads((pathlib.Path(__file__).parent / "data" / "golden_outputs.json").read_text())
RECORDED_LAYERS = 4  # the tiny preset's layers when the outputs were recorded


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    checkpoint = tmp_path_factory.mktemp("tiny-4-layers")
    save_hf(init_model(LlamaConfig.tiny(num_layers=RECORDED_LAYERS), dtype=jnp.float32, seed=0), checkpoint)
    save_byte_tokenizer(checkpoint)
    return LLM(str(checkpoint), max_context=GOLDEN["max_context"], options=EngineOptions(**GOLDEN["options"]),
               progress=False)


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: ",".join(f"{k}={v}" for k, v in c["kwargs"].items()))
def test_outputs_equal_the_recorded_ones(llm, case):
    completions = llm.generate(GOLDEN["prompts"], **case["kwargs"])
    assert [c.token_ids for c in completions] == case["token_ids"]
    assert [c.text for c in completions] == case["texts"]
    assert [c.finish_reason for c in completions] == case["finish_reasons"]
    assert "".join(llm.stream(GOLDEN["prompts"][2], **case["kwargs"])) == case["streamed_prompt2"]
