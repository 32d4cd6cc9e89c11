"""The threaded Engine over an EngineCore: built from the core, the tokenizer and the EngineInfo (no LLM),
it shows front ends the core's one RequestLimits."""

import dataclasses

import pytest

from jaxllm import LLM, EngineOptions
from jaxllm.engine.sampling import SamplingParams
from jaxllm.engine.threaded import Engine


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", max_context=64, options=EngineOptions(block_size=4, max_tokens_per_step=32), progress=False)


@pytest.fixture
def engine(llm):
    engine = Engine(llm.core, llm.tokenizer, llm.info(), max_waiting=2)
    yield engine
    engine.shutdown(grace_s=5.0)


def test_engine_shows_the_cores_tokenizer_limits_and_info(llm, engine):
    assert engine.tokenizer is llm.tokenizer and engine.limits is llm.limits is llm.core.limits
    assert engine.info() == dataclasses.replace(llm.info(), max_queue=2)
    text = "a short prompt"
    stream = engine.submit(text, SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert stream.prompt_tokens == len(llm.tokenizer.encode(text))
    assert sum(len(event.token_ids) for event in stream) == 2


def test_info_of_another_engine_is_refused(llm):
    with pytest.raises(ValueError, match="context limit 32 and vocabulary 259, where the core's limits have 64"):
        Engine(llm.core, llm.tokenizer, dataclasses.replace(llm.info(), context_limit=32))
