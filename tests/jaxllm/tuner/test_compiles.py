"""Compiles happen at warm-up only, exactly as many as it announces, whatever the context length (1..512K);
with the persistent compilation cache a second process compiles nothing."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm import LLM, EngineOptions
from jaxllm.model.kv_cache import init_kv_cache
from jaxllm.executor.calls import Op
from jaxllm.executor.executor import Executor
from jaxllm.contract import StepPlan
from jaxllm.model.config import LlamaConfig
from jaxllm.model.llama import Llama
from jaxllm.tuner.protocol import StepTuner
from pallas_kernels.dispatch import Kernels
from tests.workers import xla_flags

ROOT = Path(__file__).resolve().parents[3]


class _TwoVariants:
    """A StepTuner with two distinct variants per bucket (the same math: a threshold the CPU path never
    reads differs), listing the first twice: warm-up must compile two per bucket, not three."""

    def __init__(self, base: Kernels):
        self.listed = (base, dataclasses.replace(base, mosaic_min_tokens=base.mosaic_min_tokens + 1), base)
        self.chosen: list[int] = []

    def variants(self, decode, padded_size):
        return self.listed

    def choose(self, plan, decode, padded_size):
        self.chosen.append(plan.num_tokens % 2)  # both variants get used, on the host alone
        return self.chosen[-1]

    def stats(self):
        return {"predictions": len(self.chosen), "cache_hits": 0}


def _compiles(runner) -> tuple[int, int]:
    """Traces, and XLA compiles or persistent-cache reads (the pytest process leaves the cache off; either way
    each trace is one of the two)."""
    return runner.compile_count, runner.xla_compiles + runner.persistent_cache_hits


@pytest.mark.slow
@pytest.mark.xdist_group("tuner_compiles")
def test_generation_over_context_lengths_compiles_only_what_warm_up_announced():
    llm = LLM("tiny", max_context=2048, options=EngineOptions(block_size=16, max_seqs=4, max_tokens_per_step=32,
                                                              tuner="fixed"), progress=False)
    tuner = _TwoVariants(llm.executor.kernels)
    assert isinstance(tuner, StepTuner)
    llm.executor.tuner = tuner  # before anything asked it for variants
    plan = llm.executor.warm_up_plan()
    buckets = llm.executor.buckets
    assert len(plan) == 2 * (2 * len(buckets.decode_sizes) + len(buckets.prefill_sizes))  # x2: two variants
    llm.warm_up(progress=False)
    warm = _compiles(llm.executor)
    assert warm == (len(plan), len(plan))
    rng = np.random.default_rng(0)
    # Context from 1 token to most of the window, in one batch and alone; greedy and sampled.
    for lengths, temperature in (([1, 2, 17, 200], 0.0), ([1200], 0.0), ([3, 40, 300, 500], 0.8)):
        prompts = [[int(t) for t in rng.integers(3, 259, size=n)] for n in lengths]
        llm.generate(prompts, max_new_tokens=6, temperature=temperature, ignore_eos=True)
    assert _compiles(llm.executor) == warm  # nothing after warm-up
    assert set(tuner.chosen) == {0, 1}
    stats = llm.core.stats()
    assert stats.compile_count == len(plan) and dict(stats.tuner)["predictions"] == len(tuner.chosen)
    assert sum(n for _, _, n in stats.bucket_steps) == len(tuner.chosen) == stats.steps_total
    assert {(k, s) for k, s, _ in stats.bucket_steps} <= {("decode" if call.op == Op.DECODE else "prefill", size)
                                                        for call, size in plan}
    assert stats.padding_tokens_total > 0


def _decode_plan(lengths: list[int], block_size: int, num_blocks: int) -> StepPlan:
    """A real decode step at these context lengths; its rBlock tables reuse a small pool's rBlocks over and
    over (the values read do not matter here, the shapes do)."""
    s = len(lengths)
    width = max(-(-n // block_size) for n in lengths)
    tables = np.stack([np.arange(width) % num_blocks for _ in lengths]).astype(np.int32)
    positions = np.array([n - 1 for n in lengths], np.int32)
    slots = np.array([tables[i, p // block_size] * block_size + p % block_size for i, p in enumerate(positions)],
                     np.int32)
    return StepPlan(seq_ids=np.arange(s), token_ids=np.full(s, 5, np.int32), positions=positions,
                    slot_mapping=slots, cu_q_lens=np.arange(s + 1, dtype=np.int32),
                    kv_lens=np.array(lengths, np.int32), block_tables=tables, sample=np.ones(s, bool),
                    temperature=np.zeros(s, np.float32), top_k=np.zeros(s, np.int32), top_p=np.ones(s, np.float32),
                    seed=np.zeros(s, np.int32))


@pytest.mark.slow
@pytest.mark.xdist_group("tuner_compiles")
def test_decode_up_to_512k_context_compiles_nothing_after_warm_up():
    # Driven at the runner: a 512K-token pool or prefill is out of reach on a CPU, a decode step at 512K
    # is not. The Pallas kernels (interpreted) read only up to each kv_len, where the reference would
    # gather the whole 512K-token table width for every token, padding included.
    block_size, num_blocks, longest = 256, 8, 1 << 19
    config = LlamaConfig.tiny(max_position_embeddings=2 * longest)
    kernels = Kernels(decode_attention="triton", prefill_attention="triton", interpret=True)
    runner = Executor(Llama(config, rngs=nnx.Rngs(0)), init_kv_cache(config, num_blocks, block_size, jnp.float32),
                    max_seqs=2, max_tokens_per_step=16, table_width=longest // block_size + 1, kernels=kernels)
    runner.warm_up(progress=False)
    warm = _compiles(runner)
    assert warm == (len(runner.warm_up_plan()),) * 2
    for lengths in ([1], [1000], [4097, 3], [longest, 1]):
        tokens = runner.step(_decode_plan(lengths, block_size, num_blocks))
        assert tokens.shape == (len(lengths),) and np.all((tokens >= 0) & (tokens < config.vocab_size))
    assert _compiles(runner) == warm
    assert runner.bucket_steps == {(True, 1): 2, (True, 2): 2}


def _worker(*args: str, env_extra: dict | None = None) -> dict:
    env = {key: value for key, value in os.environ.items() if key not in ("XLA_FLAGS", "JAXLLM_COMPILE_CACHE")}
    env.update(XLA_FLAGS=xla_flags(), PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env_extra or {}))
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("cache_worker.py")), *args], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.xdist_group("tuner_compiles")
def test_a_restart_with_the_persistent_cache_compiles_nothing(tmp_path):
    cache = tmp_path / "cache"
    first = _worker(str(cache))  # EngineOptions.compile_cache_dir
    assert first["traces"] == first["plan"] == first["runner_xla"] and first["runner_hits"] == 0
    assert first["process_writes"] >= first["plan"]  # every step function went to disk
    second = _worker(env_extra={"JAXLLM_COMPILE_CACHE": str(cache)})  # the environment variable
    assert second["traces"] == second["plan"] == second["runner_hits"]  # traced, then read from disk
    assert second["runner_xla"] == 0 and second["process_xla"] == 0  # nothing in the process compiled
    assert second["process_writes"] == 0
    assert second["tokens"] == first["tokens"]
