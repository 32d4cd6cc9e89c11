"""Compiles happen at warm-up only, exactly as many as it announces, whatever the context length (1..512K);
with the persistent compilation cache a second process compiles nothing."""

import dataclasses

import numpy as np
import pytest

from jaxllm import LLM, EngineOptions
from jaxllm.tuner.protocol import StepTuner
from pallas_kernels.dispatch import Kernels
from tests.workers import repository_env, run_json_worker


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
    llm = LLM("tiny", max_context=1024, options=EngineOptions(block_size=16, max_seqs=4, max_tokens_per_step=32,
                                                              tuner="fixed"), progress=False)
    tuner = _TwoVariants(llm.executor.tuner.kernels)
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
    for lengths, temperature in (([1, 2, 17, 200], 0.0), ([1000], 0.0), ([3, 40, 300, 500], 0.8)):
        prompts = [[int(t) for t in rng.integers(3, 259, size=n)] for n in lengths]
        llm.generate(prompts, max_new_tokens=6, temperature=temperature, ignore_eos=True)
    assert _compiles(llm.executor) == warm  # nothing after warm-up
    assert set(tuner.chosen) == {0, 1}
    stats = llm.core.stats()
    ran = stats.executor
    assert ran.compile_count == len(plan) and dict(ran.tuner)["predictions"] == len(tuner.chosen)
    assert sum(n for _, _, n in ran.bucket_steps) == len(tuner.chosen) == stats.core.steps_total
    assert {(k, s) for k, s, _ in ran.bucket_steps} <= {(call.kind.label, size) for call, size in plan}
    assert ran.padding_tokens_total > 0


@pytest.mark.slow
@pytest.mark.xdist_group("tuner_compiles")
def test_decode_up_to_512k_context_compiles_nothing_after_warm_up():
    r = _worker(script="long_decode_worker.py", flags=False)
    assert r["warm"] == [r["plan"]] * 2  # traces and XLA compiles: one each per program warm-up announced
    for step in r["steps"]:
        assert len(step["tokens"]) == len(step["lengths"]) and all(0 <= t < r["vocab_size"] for t in step["tokens"])
    assert r["steps"][-1]["lengths"][0] == 1 << 19
    assert r["after"] == r["warm"]  # nothing compiled at any context length
    assert r["bucket_steps"] == [["decode", 1, 2], ["decode", 2, 2]]


def _worker(*args: str, env_extra: dict | None = None, script: str = "cache_worker.py", flags: bool = True) -> dict:
    """Run a worker script of this folder in a fresh process (without the run's compile cache; flags: with the
    suite's XLA flags, else XLA's defaults) and return the JSON line it printed last."""
    env = repository_env(**({} if flags else {"XLA_FLAGS": ""}))
    env.pop("JAXLLM_COMPILE_CACHE", None)
    env.update(env_extra or {})
    return run_json_worker(f"tests/jaxllm/tuner/{script}", *args, env=env, timeout=300)


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
