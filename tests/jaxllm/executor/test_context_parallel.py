"""Context-parallel prefill (jaxllm.engine.spread) on CPU host devices: a prompt of 3.5x one instance's pool (14
chunks) on 4 instances, and of 1.8x (10 chunks) on 2 instances x tensor parallel 2, float32 and int8 pools, spread
over every instance, against one instance with one big pool: the same teacher-forced logits (relative error <= 1e-5
with the model's float32 pools) and the same greedy tokens, in a quarter of the steps (one chunk an instance a
step); with a cached prefix. That a spread prompt compiles nothing after warm-up: test_meshes.py (its borrowed-steps
warm-up test, whose long prompt is spread); the balance of the work: tests/jaxllm/engine/test_spread.py and
`scripts/bench_mesh.py --parts longest`.

An int8 (or bf16) pool stores each K/V rounded: programs of other shapes compute K/V that differ in the last float32
bits, and where such a value sits on a rounding boundary its stored copy moves by a whole step. The logits then
differ by ~4e-4 of their largest (measured: the same for today's chunk-by-chunk lending as for the spread prompt),
so there the test reads the greedy tokens and a bound of a few rounding steps.
"""

import numpy as np
import pytest

from jaxllm.contract import SamplingParams
from jaxllm.engine.core import Request
from jaxllm.llm import LLM, EngineOptions
from tests.devices import needs_host_devices
from tests.jaxllm.tokens import assert_same_greedy

pytestmark = [needs_host_devices, pytest.mark.slow, pytest.mark.xdist_group("jaxllm_context_parallel")]

BLOCK = 16
POOL = 8  # rBlocks an instance: 128 tokens
SEED = 20261207
# (instances, tensor parallel, prompt / one instance's pool, tokens a step gives an instance: 8 chunks or more)
MESHES = {"i4": (4, 1, 3.5, 32), "i2xtp2": (2, 2, 1.8, 24)}
CHUNK = MESHES["i4"][3]
RTOL = {None: 1e-5, "int8": 2e-3}  # by pool dtype (None: the model's, float32); the module docstring says why


def _options(kv: str | None, chunk: int = CHUNK, **options) -> EngineOptions:
    return EngineOptions(block_size=BLOCK, kv_dtype=kv, max_seqs=2, max_tokens_per_step=chunk, **options)


def _prompt(instances: int, ratio: float) -> list[int]:
    rng = np.random.default_rng([SEED, instances])
    return [int(t) for t in rng.integers(3, 250, int(ratio * POOL * BLOCK))]


def _greedy(llm: LLM, prompt: list[int], new: int = 6) -> list[int]:
    out = llm.run([Request(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True))])
    return [t for o in next(iter(out.values())) for t in o.token_ids]


def _relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.fixture(scope="module")
def reference():
    return {(kv, chunk): LLM("tiny", options=_options(kv, chunk, num_blocks=4 * POOL), progress=False)
            for kv in RTOL for chunk in sorted({m[3] for m in MESHES.values()})}


@pytest.mark.parametrize("kv", RTOL, ids=["float32", "int8"])
@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_a_long_prompt_spread_over_the_mesh_gives_one_big_pools_logits_and_tokens(reference, mesh, kv):
    instances, tp, ratio, chunk = MESHES[mesh]
    prompt = _prompt(instances, ratio)
    assert len(prompt) > POOL * BLOCK and len(prompt) >= 8 * chunk
    llm = LLM("tiny", options=_options(kv, chunk, num_blocks=POOL, instances=instances, tensor_parallel=tp),
              progress=False)
    one = reference[kv, chunk]
    tokens = _greedy(llm, prompt)
    assert_same_greedy(one, prompt, tokens, _greedy(one, prompt))
    report = llm.core.scheduler.prefill_reports.finished[-1]
    assert report.spread and report.prompt_tokens == len(prompt)
    assert report.steps == -(-len(prompt) // (instances * chunk))  # every step one chunk an instance
    got, want = llm.logits(prompt), one.logits(prompt)
    assert got.shape == want.shape and _relative_error(got, want) <= RTOL[kv]
    stats = llm.core.stats().scheduler
    assert stats.lending.borrowed_blocks == 0 and stats.pool_blocks_free == stats.pool_blocks  # all given back


def test_a_cached_prefix_counts_as_past_kv(reference):
    prompt = _prompt(4, 3.5)
    llm = LLM("tiny", options=_options(None, num_blocks=POOL, instances=4), progress=False)
    prefix = prompt[:CHUNK]  # one chunk: not spread, so its full rBlocks are cached on its home
    _greedy(llm, prefix, new=1)
    tokens = _greedy(llm, prompt)
    stats = llm.core.stats().scheduler
    assert stats.cached_tokens >= 2 * BLOCK
    report = llm.core.scheduler.prefill_reports.finished[-1]
    assert report.spread and sum(report.matmul_tokens) == len(prompt) - stats.cached_tokens
    assert_same_greedy(reference[None, CHUNK], prompt, tokens, _greedy(reference[None, CHUNK], prompt))
