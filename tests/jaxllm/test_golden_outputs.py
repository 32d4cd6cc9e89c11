"""The tiny model's greedy and seeded outputs for a fixed request set, recorded before the engine-core
refactor (issue 25) by the code of commit efc9b9c: any change to the engine, the model layout or the
kernels' dispatch that alters a token fails here."""

import json
import pathlib

import pytest

from jaxllm import LLM, EngineOptions

GOLDEN = json.loads((pathlib.Path(__file__).parent / "data" / "golden_outputs.json").read_text())


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", max_context=GOLDEN["max_context"], options=EngineOptions(**GOLDEN["options"]), progress=False)


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: ",".join(f"{k}={v}" for k, v in c["kwargs"].items()))
def test_outputs_equal_the_recorded_ones(llm, case):
    completions = llm.generate(GOLDEN["prompts"], **case["kwargs"])
    assert [c.token_ids for c in completions] == case["token_ids"]
    assert [c.text for c in completions] == case["texts"]
    assert [c.finish_reason for c in completions] == case["finish_reasons"]
    assert "".join(llm.stream(GOLDEN["prompts"][2], **case["kwargs"])) == case["streamed_prompt2"]
