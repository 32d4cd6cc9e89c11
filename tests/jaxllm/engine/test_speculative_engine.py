"""Speculative decoding end to end on CPU host devices: greedy tokens identical with and without it, for prompt
lookup (`speculative="ngram:K"`) and a draft model (`speculative_model`), on one device, on 4 instances whose
sequences borrow rBlocks, and on tensor parallel 2; with drafts that are accepted (the draft model `tiny` is the
target itself: every draft token is right) and drafts that are not (`tiny-draft`, another model; prompt lookup on
random prompts); stop strings, stop token ids, max_new_tokens and logprobs right when several tokens are accepted
in one step (the replay proposer puts them there); nothing compiled after warm-up, the draft model's steps
included; and the options' errors. That sampled tokens keep the target's distribution is tests/jaxllm/executor/
test_acceptance.py's chi-square test.
"""

import dataclasses

import numpy as np
import pytest

from jaxllm.contract import SamplingParams
from jaxllm.engine.core import Request
from jaxllm.engine.speculative import ReplayProposer
from jaxllm.llm import LLM, EngineOptions
from tests.devices import needs_host_devices
from tests.jaxllm.tokens import assert_same_greedy

pytestmark = [needs_host_devices, pytest.mark.slow, pytest.mark.xdist_group("jaxllm_speculative")]

BLOCK = 16
K = 4
NEW = 20
SEED = 20261207
# As tests/jaxllm/executor/test_meshes.py: the requests need 8 + 8 + 3 rBlocks at their longest, so on 4 instances
# of 6 some borrow; a fourth, repetitive prompt gives prompt lookup something to find.
MESHES = {"tp1": dict(num_blocks=40), "i4": dict(instances=4, num_blocks=6), "tp2": dict(tensor_parallel=2,
                                                                                         num_blocks=40)}
DRAFTS = {"ngram": dict(speculative=f"ngram:{K}"), "draft-same": dict(speculative_model="tiny",
                                                                      num_speculative_tokens=K),
          "draft-other": dict(speculative_model="tiny-draft", num_speculative_tokens=K)}
# Prompt lookup on one device is also tests/serve/test_speculative_serving.py's (the same tokens as without it).
RUNS = [("tp1", "draft-same"), ("tp1", "draft-other"), ("i4", "draft-same"), ("i4", "ngram"), ("tp2", "draft-same"),
        ("tp2", "ngram")]
WARMED = [("tp1", "draft-same"), ("i4", "ngram")]  # warm-up compiles every bucket: two engines show it is enough


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(SEED)
    long_a, long_b, short = ([int(t) for t in rng.integers(3, 250, n)] for n in (100, 100, 20))
    return [long_a, long_b, short, [40, 41, 42, 43, 44, 45] * 6]


def _tokens(llm: LLM, prompts: list[list[int]], **params) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, **params)
    outputs = llm.run([Request(p, params) for p in prompts])
    return [[t for out in outputs[i] for t in out.token_ids] for i in sorted(outputs)]


def _engine(mesh: str, **options) -> LLM:
    return LLM("tiny", options=EngineOptions(block_size=BLOCK, max_seqs=4, **MESHES[mesh], **options), progress=False)


@pytest.fixture(scope="module")
def reference():
    llm = _engine("tp1", max_logprobs=4)
    return llm, _tokens(llm, _prompts())


@pytest.fixture(scope="module")
def runs():
    out = {}
    for mesh, draft in RUNS:
        llm = _engine(mesh, **DRAFTS[draft])
        if (mesh, draft) in WARMED:
            llm.warm_up(progress=False)
        compiled = llm.compile_count
        tokens = _tokens(llm, _prompts())
        out[mesh, draft] = dict(tokens=tokens, stats=llm.stats(), new_compiles=llm.compile_count - compiled)
    return out


@pytest.mark.parametrize("mesh,draft", RUNS, ids=[f"{m}-{d}" for m, d in RUNS])
def test_greedy_tokens_are_the_same_with_speculation(reference, runs, mesh, draft):
    llm, want = reference
    run = runs[mesh, draft]
    for prompt, got, expected in zip(_prompts(), run["tokens"], want):
        assert_same_greedy(llm, prompt, got, expected)
    spec = run["stats"].scheduler.speculative
    assert spec.drafts_total > 0 and spec.draft_tokens_total > 0, spec
    if draft == "draft-same":  # the target drafting for itself: every draft token is right
        assert spec.accepted_tokens_total == spec.draft_tokens_total, spec
        assert spec.mean_acceptance_length > 2, spec
    if draft == "draft-other":  # another model's drafts: (almost) all rejected, the tokens the same
        assert spec.acceptance_rate < 0.5, spec


def test_borrowing_happened_on_the_instance_mesh(runs):
    for draft in ("draft-same", "ngram"):
        assert runs["i4", draft]["stats"].scheduler.lending.loans_total > 0


@pytest.mark.parametrize("mesh,draft", WARMED, ids=[f"{m}-{d}" for m, d in WARMED])
def test_nothing_compiles_after_warm_up(runs, mesh, draft):
    assert runs[mesh, draft]["new_compiles"] == 0


@pytest.fixture(scope="module")
def replayed(reference):
    """An engine whose replay proposer drafts what the reference generated (every draft accepted)."""
    llm, want = reference
    proposer = ReplayProposer()
    for prompt, tokens in zip(_prompts(), want):
        proposer.expect(prompt, tokens)
    options = EngineOptions(block_size=BLOCK, max_seqs=4, num_blocks=40, num_speculative_tokens=K, max_logprobs=4)
    return LLM("tiny", options=options, progress=False, proposer=proposer)


def _completions(llm: LLM, prompt: list[int], **kwargs):
    return llm.generate([prompt], temperature=0.0, **kwargs)[0]


@pytest.mark.parametrize("cut", [5, 9, 14])
def test_a_stop_string_inside_an_accepted_run_ends_at_its_token(reference, replayed, cut):
    llm, want = reference
    prompt = _prompts()[1]
    text = llm.tokenizer.decode(want[1][:cut])
    stop = text[-2:]  # ends on the cut's last token; may occur earlier, where both engines stop alike
    accepted = replayed.stats().scheduler.speculative.accepted_tokens_total
    got = _completions(replayed, prompt, max_new_tokens=NEW, stop=stop, ignore_eos=True)
    plain = _completions(llm, prompt, max_new_tokens=NEW, stop=stop, ignore_eos=True)
    assert (got.text, got.token_ids, got.finish_reason) == (plain.text, plain.token_ids, plain.finish_reason)
    assert got.finish_reason == "stop" and len(got.token_ids) <= cut
    assert replayed.stats().scheduler.speculative.accepted_tokens_total > accepted


@pytest.mark.parametrize("cut", [3, 7, 10])
def test_a_stop_token_inside_an_accepted_run_ends_before_it(reference, replayed, cut):
    llm, want = reference
    prompt = _prompts()[0]
    stop_id = want[0][cut]
    first = want[0].index(stop_id)
    got = _completions(replayed, prompt, max_new_tokens=NEW, stop_token_ids=[stop_id], ignore_eos=True)
    assert got.token_ids == want[0][:first] and got.finish_reason == "stop"


@pytest.mark.parametrize("max_new", [1, 2, 6, 11])
def test_max_new_tokens_inside_an_accepted_run(reference, replayed, max_new):
    llm, want = reference
    got = _completions(replayed, _prompts()[1], max_new_tokens=max_new, ignore_eos=True)
    assert got.token_ids == want[1][:max_new] and got.finish_reason == "length"


def test_logprobs_of_accepted_tokens_are_the_plain_runs(reference, replayed):
    llm, _ = reference
    prompt = _prompts()[2]
    got = _completions(replayed, prompt, max_new_tokens=12, ignore_eos=True, logprobs=3)
    plain = _completions(llm, prompt, max_new_tokens=12, ignore_eos=True, logprobs=3)
    assert got.token_ids == plain.token_ids
    for (lp, top), (want_lp, want_top) in zip(got.logprobs, plain.logprobs):
        assert lp == pytest.approx(want_lp, abs=1e-4)
        assert [t for t, _ in top] == [t for t, _ in want_top]
        np.testing.assert_allclose([v for _, v in top], [v for _, v in want_top], atol=1e-4)


def test_a_request_that_opts_out_decodes_without_drafts(reference, replayed):
    llm, want = reference
    before = replayed.stats().scheduler.speculative.draft_tokens_total
    got = _completions(replayed, _prompts()[0], max_new_tokens=NEW, ignore_eos=True, num_speculative_tokens=0)
    assert got.token_ids == want[0]
    assert replayed.stats().scheduler.speculative.draft_tokens_total == before


def test_the_options_name_what_is_wrong():
    with pytest.raises(ValueError, match="needs num_speculative_tokens"):
        EngineOptions(speculative_model="tiny-draft")
    with pytest.raises(ValueError, match="two draft sources"):
        EngineOptions(speculative="ngram:2", speculative_model="tiny-draft", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="draft_pool_seqs"):
        EngineOptions(speculative_model="tiny-draft", num_speculative_tokens=2, draft_pool_seqs=0)
    with pytest.raises(ValueError, match="speculative_model 'no-such-model'"):
        LLM("tiny", options=EngineOptions(speculative_model="no-such-model", num_speculative_tokens=2),
            progress=False)

