"""transformers' tiny Qwen2, Qwen3 and Mistral checkpoints (tests/jaxllm/data/hf_tiny) on CPU host devices: under
tensor parallel 2 (q/k/v biases split with their heads, q/k norms whole on every device) and on 4 lending instances
(rBlocks few enough that every sequence borrows: DistAttention over the biased / normalised K), the logits match
transformers' float32 logits, as on one device (tests/jaxllm/model/test_hf_architectures.py), and so do the greedy
tokens of its `generate`: teacher-forced for every architecture (the logits of the prompt and transformers' tokens,
one program a mesh: each token is the argmax of the row before it), generated step by step for one architecture a
mesh (the decode programs; on one device every architecture generates). Qwen3's decode step runs Llama's
collectives and no more; with KV heads replicated (tensor parallel 4 over 2 KV heads) Qwen2's biases are
replicated with their heads.
"""

import functools

import numpy as np
import pytest

from jaxllm.llm import LLM, EngineOptions
from tests.devices import needs_host_devices
from tests.jaxllm.executor.test_meshes import _decode_step_collectives
from tests.jaxllm.model.test_hf_architectures import NAMES, OPTIONS, TOLERANCE, checkpoint, reference, relative_error

pytestmark = [needs_host_devices, pytest.mark.slow, pytest.mark.xdist_group("jaxllm_hf_meshes")]

# 4 rBlocks of 8 tokens an instance: the prompts (34 and 67 tokens) and their answers need more, so they borrow.
MESHES = {"tp2": dict(tensor_parallel=2), "i4": dict(instances=4, num_blocks=4)}
# Generated step by step (two programs more a model): Qwen3's norms split over heads, Qwen2's biases in borrowed
# decode steps.
GENERATE = {"tp2": "qwen3", "i4": "qwen2"}


@pytest.fixture(scope="module")
def run():
    """(mesh, name) -> its teacher-forced logits, generated tokens (GENERATE only) and stats, each computed once."""

    @functools.cache
    def result(mesh: str, name: str) -> dict:
        ref = reference(name)
        prompt, greedy = ref["prompt_ids"].tolist(), ref["greedy"].tolist()
        llm = LLM(checkpoint(name), dtype="float32", progress=False, options=EngineOptions(**{**OPTIONS,
                                                                                               **MESHES[mesh]}))
        out = dict(logits=llm.logits(prompt + greedy[:-1]), stats=llm.core.stats())
        if GENERATE[mesh] == name:
            generated = llm.generate([prompt], temperature=0.0, max_new_tokens=len(greedy), ignore_eos=True)
            out.update(generated=list(generated[0].token_ids), stats=llm.core.stats())
            if mesh == "tp2":
                out.update(collectives=dict(_decode_step_collectives(llm)), config=llm.config)
        return out

    return result


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_logits_and_greedy_tokens_match_transformers(run, mesh, name):
    ref, r = reference(name), run(mesh, name)
    prompt = len(ref["prompt_ids"])
    assert relative_error(r["logits"][:prompt], ref["logits"]) < TOLERANCE
    assert r["logits"][prompt - 1:].argmax(-1).tolist() == ref["greedy"].tolist()  # teacher-forced greedy
    if "generated" in r:
        assert r["generated"] == ref["greedy"].tolist()
    if mesh == "i4":
        stats = r["stats"]
        assert stats.scheduler.lending.loans_total > 0 and stats.executor.dist_steps_total > 0, stats


def test_a_decode_step_of_qwen3_runs_only_the_collectives_llama_does(run):
    """The q/k norms (over head_dim, inside each device's heads) add no collective: two all-reduces a layer, and the
    greedy argmax's two over the head split on its vocabulary (test_meshes.py's count for Llama)."""
    r = run("tp2", "qwen3")
    config = r["config"]
    assert not config.tie_word_embeddings and config.vocab_size % 2 == 0  # the head is split: its argmax's two
    assert r["collectives"] == {"all-reduce": 2 * config.num_layers + 2}


def test_every_mesh_generates_some_architecture(run):
    assert all("generated" in run(mesh, name) for mesh, name in GENERATE.items())


def test_replicated_kv_heads_keep_their_biases():
    """Tensor parallel 4 over Qwen2's 2 KV heads: each KV head (and its q/k/v biases) stored twice."""
    ref = reference("qwen2")
    llm = LLM(checkpoint("qwen2"), dtype="float32", progress=False,
              options=EngineOptions(**{**OPTIONS, "tensor_parallel": 4}))
    assert llm.executor.worker.config.num_kv_heads == 4
    assert relative_error(llm.logits(ref["prompt_ids"].tolist()), ref["logits"]) < TOLERANCE
    assert np.argmax(ref["logits"][-1]) == ref["greedy"][0]
