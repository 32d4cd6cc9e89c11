"""The shipped H100 cost model driving a runner on the CPU (Pallas kernels in interpret mode): every variant it
lists compiles and runs, it predicts per step, and the tokens are the fixed defaults' (a schedule changes
speed, never results)."""

import jax.numpy as jnp
import pytest
from flax import nnx

from jaxllm.contract import StepKind
from jaxllm.engine.allocator import BlockAllocator
from jaxllm.model.kv_cache import init_kv_cache
from jaxllm.executor.executor import build_executor
from jaxllm.contract import SamplingParams
from jaxllm.engine.scheduler import Scheduler
from jaxllm.model.config import LlamaConfig
from jaxllm.model.llama import Llama
from jaxllm.tuner import LearnedTuner, load_tuner
from jaxllm.tuner.fixed import FixedTuner
from pallas_kernels.dispatch import Kernels

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("tuner_runner")]

BLOCK = 16
H100 = "NVIDIA H100 80GB HBM3"


def _generate(tuner_for, prompts):
    config = LlamaConfig.tiny(num_layers=1)
    base = Kernels(decode_attention="triton", prefill_attention="triton", interpret=True)
    runner = build_executor(Llama(config, rngs=nnx.Rngs(0)), init_kv_cache(config, 24, BLOCK, jnp.float32), max_seqs=4,
                    max_tokens_per_step=32, table_width=4, kernels=base, tuner=tuner_for(base, config))
    scheduler = Scheduler(BlockAllocator(24), BLOCK, max_tokens_per_step=32, max_seqs=4, prefix_caching=False)
    seqs = [scheduler.add(p, SamplingParams(max_new_tokens=n, ignore_eos=True), max_len=64) for p, n in prompts]
    while scheduler.has_work():
        plan = scheduler.plan()
        scheduler.update(plan, runner.step(plan), eos_id=-1)
    return [s.output_ids for s in seqs], runner


def test_the_learned_tuner_runs_its_variants_and_keeps_the_tokens():
    prompts = [(list(range(3, 3 + n)), m) for n, m in ((5, 9), (23, 6), (40, 4), (2, 12))]
    chosen = []

    def learned(base, config):
        # The tiny model's heads were never measured: the model is asked anyway (its machinery is under test).
        tuner = load_tuner(base, device_kind=H100, config=config, kv_dtype="float32", block_size=BLOCK,
                           trained_heads_only=False, max_context=64)
        choose = tuner.choose
        tuner.choose = lambda plan, decode, size: chosen.append(choose(plan, decode, size)) or chosen[-1]
        return tuner

    tokens, runner = _generate(learned, prompts)
    assert any(chosen) and len(chosen) == sum(runner.bucket_steps.values())  # steps ran non-default schedules
    assert isinstance(runner.tuner, LearnedTuner)
    assert runner.tuner.stats()["predictions"] > 0
    listed = {size: runner.variants.variants(StepKind.DECODE, size) for size in (1, 2, 4)}
    assert any(len(v) > 1 for v in listed.values()), listed  # the model lists schedules beyond the default
    want, _ = _generate(lambda base, config: FixedTuner(base), prompts)
    assert tokens == want
