"""One executor for every mesh, on CPU host devices: the same greedy and seeded tokens through one device, tensor
parallel 2 and 4, 2 and 4 lending instances and 2 instances x tensor parallel 2 (borrowing on the instance meshes;
recalls compared the same way in test_lending_engine.py); and with instances, as on one device, the tuner's variants are compiled and chosen,
decode continuations feed each step from the last one's device tokens, and nothing compiles after warm-up (borrowed
steps included, with the tuner's variants and with the default tuner).
"""

import collections
import dataclasses
import re

import numpy as np
import pytest

from jaxllm.contract import SamplingParams, StepKind
from jaxllm.engine.core import Request
from jaxllm.llm import LLM, EngineOptions
from tests.devices import needs_host_devices
from tests.jaxllm.tokens import assert_same_greedy

pytestmark = [needs_host_devices, pytest.mark.slow, pytest.mark.xdist_group("jaxllm_meshes")]

BLOCK = 16
SEED = 20261128
# The requests need 8 + 8 + 3 rBlocks at their longest: on 2 instances of 10 and on 4 of 6 some must borrow.
MESHES = {"tp1": dict(num_blocks=32), "tp2": dict(tensor_parallel=2, num_blocks=32),
          "tp4": dict(tensor_parallel=4, num_blocks=32), "i2": dict(instances=2, num_blocks=10),
          "i4": dict(instances=4, num_blocks=6), "i2xtp2": dict(instances=2, tensor_parallel=2, num_blocks=10)}


def _requests(params: SamplingParams) -> list[Request]:
    rng = np.random.default_rng(SEED)
    long_a, long_b, short = ([int(t) for t in rng.integers(3, 250, n)] for n in (100, 100, 20))
    return [Request(long_a, dataclasses.replace(params, max_new_tokens=24)),
            Request(long_b, dataclasses.replace(params, max_new_tokens=24)),
            Request(short, dataclasses.replace(params, max_new_tokens=24))]


def _tokens(llm: LLM, requests: list[Request]) -> list[list[int]]:
    outputs = llm.run(requests)
    return [[t for out in outputs[i] for t in out.token_ids] for i in sorted(outputs)]


@pytest.fixture(scope="module")
def runs():
    greedy = _requests(SamplingParams(ignore_eos=True))
    sampled = _requests(SamplingParams(ignore_eos=True, temperature=0.9, top_k=50, seed=7))
    out = {}
    for name, options in MESHES.items():
        llm = LLM("tiny", options=EngineOptions(block_size=BLOCK, max_seqs=4, **options), progress=False)
        out[name] = dict(llm=llm, greedy=_tokens(llm, greedy), greedy_stats=llm.core.stats(),
                         sampled=_tokens(llm, sampled))
    return greedy, out


@pytest.mark.parametrize("mesh", sorted(set(MESHES) - {"tp1"}))
def test_every_mesh_generates_the_tokens_of_one_device(runs, mesh):
    requests, out = runs
    reference = out["tp1"]
    for request, got, want in zip(requests, out[mesh]["greedy"], reference["greedy"]):
        assert_same_greedy(reference["llm"], list(request.prompt_ids), got, want)
    assert out[mesh]["sampled"] == reference["sampled"]
    stats = out[mesh]["greedy_stats"]
    assert stats.scheduler.preemptions == 0 and stats.scheduler.pool_blocks_free == stats.scheduler.pool_blocks
    if "i" in mesh:  # the instance meshes lent (recalls: test_lending_engine's recall test, same comparison)
        ledger = stats.scheduler.lending
        assert ledger.loans_total > 0 and stats.executor.dist_steps_total > 0 and ledger.borrowed_blocks == 0, stats


class _TwoVariants:
    """A StepTuner with two distinct variants per bucket (the same math: a threshold the CPU path never reads
    differs) that takes them in turn: both get used."""

    def __init__(self, base):
        self.listed = (base, dataclasses.replace(base, mosaic_min_tokens=base.mosaic_min_tokens + 1))
        self.chosen: list[int] = []

    def variants(self, decode, padded_size):
        return self.listed

    def choose(self, plan, decode, padded_size):
        self.chosen.append(len(self.chosen) % 2)
        return self.chosen[-1]

    def stats(self):
        return {"predictions": len(self.chosen), "cache_hits": 0}


# The warm-up tests' engine: 2 instances of 12 rBlocks (a prompt of 200+ tokens borrows), bf16 pools. The test with the
# default tuner runs after the one with two variants a bucket: its programs are that one's variant 0, read from the
# run's compile cache (the same xdist group, so the same process).
WARM = EngineOptions(block_size=BLOCK, kv_dtype="bfloat16", max_seqs=2, max_tokens_per_step=32, instances=2,
                     num_blocks=12)


def test_instances_compile_and_choose_tuner_variants_pipeline_and_compile_nothing_after_warm_up(monkeypatch):
    # Prompts prefilled chunk by chunk on their homes (no spreading: jaxllm.engine.spread), so the short ones borrow
    # nothing and their steps ask the tuner.
    options = dataclasses.replace(WARM, tuner="fixed", spread_prompts=False)
    llm = LLM("tiny", options=options, progress=False)
    tuner = _TwoVariants(llm.executor.tuner.kernels)
    llm.executor.tuner = tuner  # before anything asked it for variants
    plan = llm.executor.warm_up_plan()
    assert {call.variant for call, _ in plan} == {0, 1} and any(call.borrowed for call, _ in plan)
    llm.warm_up(progress=False)
    warm = llm.compile_count
    assert warm == len(plan) + 1  # and the recall copy
    continued = []
    dispatch = llm.executor.dispatch

    def counting(plan, token_source=None):
        continued.append(token_source is not None)
        return dispatch(plan, token_source=token_source)

    monkeypatch.setattr(llm.executor, "dispatch", counting)
    rng = np.random.default_rng(SEED)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    short = [Request([int(t) for t in rng.integers(3, 250, n)], params) for n in (30, 40)]  # nothing borrowed
    long = [Request([int(t) for t in rng.integers(3, 250, n)], params) for n in (230, 30)]  # the first borrows
    got = [_tokens(llm, short), _tokens(llm, long)]
    assert llm.compile_count == warm
    assert set(tuner.chosen) == {0, 1} and len(tuner.chosen) >= 12  # every unborrowed step asked the tuner
    assert sum(continued) > 0  # steps fed from the previous step's device tokens
    assert llm.core.stats().executor.dist_steps_total > 0
    unpipelined = LLM("tiny", options=dataclasses.replace(options, pipeline=False), progress=False)
    assert [_tokens(unpipelined, short), _tokens(unpipelined, long)] == got  # same shapes, same tokens


def test_nothing_compiles_after_warm_up_borrowed_steps_included():
    """The default tuner (one variant a bucket): warm-up compiles every bucket plain and borrowed, and the recall
    copy; a run that borrows compiles nothing more, its long prompt spread over both instances (jaxllm.engine.spread)."""
    rng = np.random.default_rng([20261127, 200])
    llm = LLM("tiny", options=WARM, progress=False)
    llm.warm_up(progress=False)
    warm = llm.compile_count
    assert warm == len(llm.executor.warm_up_plan()) + 1  # every bucket plain and borrowed, and the recall copy
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (8, 5)]
    _tokens(llm, [Request([int(t) for t in rng.integers(3, 250, int(rng.integers(200, 260)))], params[0]),
                  Request([int(t) for t in rng.integers(3, 250, int(rng.integers(5, 40)))], params[1])])
    assert llm.core.stats().executor.dist_steps_total > 0  # the run borrowed
    assert any(r.spread for r in llm.core.scheduler.prefill_reports.finished)  # the long prompt ran on both instances
    assert llm.compile_count == warm


def test_instances_share_cached_prefixes():
    llm = LLM("tiny", options=EngineOptions(block_size=BLOCK, instances=2, num_blocks=16), progress=False)
    rng = np.random.default_rng(SEED + 1)
    system = [int(t) for t in rng.integers(3, 250, 3 * BLOCK)]
    first = llm.generate([system + [5, 6, 7]], max_new_tokens=4, ignore_eos=True)[0].token_ids
    assert llm.core.stats().scheduler.cached_tokens == 0
    again = llm.generate([system + [5, 6, 7]], max_new_tokens=4, ignore_eos=True)[0].token_ids
    stats = llm.core.stats()
    assert stats.scheduler.cached_tokens == 3 * BLOCK and stats.scheduler.cached_blocks >= 3
    assert again == first


def test_a_borrowed_step_under_tensor_parallelism_runs_the_pallas_kernels_per_shard():
    """2 instances x tensor parallel 2, the Triton kernels (interpret mode): a prompt longer than one instance's
    pool borrows, and its DistAttention steps run the per-part attention through the same dispatch as every step,
    the kernels per tensor shard (no reference fallback); the tokens are one instance's."""
    rng = np.random.default_rng(SEED + 2)
    prompt = [int(t) for t in rng.integers(3, 250, 40)]
    reference = LLM("tiny", options=EngineOptions(block_size=BLOCK, num_blocks=16), progress=False)
    want = reference.generate([prompt], max_new_tokens=4, ignore_eos=True)[0].token_ids
    llm = LLM("tiny", options=EngineOptions(block_size=BLOCK, num_blocks=2, instances=2, tensor_parallel=2,
                                            attention_backend="triton", max_tokens_per_step=16), progress=False)
    borrowed = llm.executor.variants.kernels_for(StepKind.DECODE, 1, borrowed=True)
    assert borrowed.distributed is not None and borrowed.decode_attention == "triton" and borrowed.per_shard is not None
    got = llm.generate([prompt], max_new_tokens=4, ignore_eos=True)[0].token_ids
    assert_same_greedy(reference, prompt, got, want)
    stats = llm.core.stats()
    assert stats.scheduler.lending.loans_total > 0 and stats.executor.dist_steps_total > 0


_COLLECTIVE = re.compile(r"= .*? (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")


def _decode_step_collectives(llm: LLM) -> collections.Counter:
    """The collectives XLA put in the program of a greedy decode step of one short sequence (nothing borrowed)."""
    request_id = llm.core.add(Request([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=8, ignore_eos=True)))
    produced = 0
    while produced < 2:  # the prefill, then a decode step
        produced += sum(len(out.token_ids) for out in llm.core.step() if out.request_id == request_id)
    llm.core.drain()
    plan = llm.scheduler.plan()
    assert plan.kind is StepKind.DECODE and plan.num_seqs == 1
    text = llm.executor.compiled_step_text(plan)
    llm.core.cancel(request_id)
    return collections.Counter(_COLLECTIVE.findall(text))


@pytest.mark.parametrize("mesh", ["tp2", "i2", "i2xtp2"])
def test_a_decode_step_runs_only_the_collectives_it_needs(runs, mesh):
    """Tensor parallel: two all-reduces a layer (after the row-parallel o and down projections), nothing else: no
    all-gather or resharding of the residual stream (the tiny model's vocabulary divides nothing, so its embedding
    and head are replicated). Instances with nothing borrowed: no collective at all."""
    llm = runs[1][mesh]["llm"]
    expected = {"all-reduce": 2 * llm.config.num_layers} if llm.options.tensor_parallel > 1 else {}
    assert dict(_decode_step_collectives(llm)) == expected
