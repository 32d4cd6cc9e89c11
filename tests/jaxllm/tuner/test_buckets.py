"""Buckets: every size maps into its bucket, the stated waste bound holds, and warm-up runs exactly the
listed shapes."""

import jax.numpy as jnp
import pytest
from flax import nnx

from jaxllm.contract import StepKind
from jaxllm.model.kv_cache import init_kv_cache
from jaxllm.executor.executor import build_executor
from jaxllm.model.config import LlamaConfig
from jaxllm.model.llama import Llama
from jaxllm.tuner.buckets import Buckets, Shape

LIMITS = [dict(max_seqs=1, max_tokens_per_step=8, table_width=3),
          dict(max_seqs=5, max_tokens_per_step=100, table_width=7, min_tokens=3, verify_queries=3),
          dict(max_seqs=256, max_tokens_per_step=4096, table_width=2049, verify_queries=5),
          dict(max_seqs=48, max_tokens_per_step=512, table_width=33, min_tokens=16, verify_queries=16)]


@pytest.mark.parametrize("limits", LIMITS)
def test_every_size_pads_to_the_smallest_bucket_holding_it(limits):
    b = Buckets(**limits)
    for kind in StepKind:
        by_seqs = kind is not StepKind.PREFILL
        sizes = b.sizes(kind)
        assert list(sizes) == sorted(set(sizes)) and all(s & (s - 1) == 0 for s in sizes)
        if not sizes:  # no speculative decoding: no verify buckets, and no verify step pads
            assert kind is StepKind.VERIFY and not b.verify_queries
            with pytest.raises(ValueError, match="no verify buckets"):
                b.padded(kind, 1)
            continue
        for size in range(1, sizes[-1] + 1):
            tokens, seqs = b.padded(kind, size)
            key = seqs if by_seqs else tokens
            assert key in sizes and key >= size
            assert key == min(s for s in sizes if s >= size)  # the smallest that holds it
            if kind is StepKind.DECODE:
                assert tokens == seqs
            elif kind is StepKind.VERIFY:
                assert tokens == seqs * b.verify_queries  # k + 1 tokens a sequence, each at s * Q + j
            else:
                assert seqs == min(tokens, b.seq_cap)
    assert b.decode_sizes[-1] >= b.max_seqs and b.prefill_sizes[-1] >= b.max_tokens_per_step
    assert b.prefill_sizes[0] >= b.min_tokens
    if b.verify_queries:  # every verify step the scheduler plans (its rows x Q within the token budget) has a bucket
        assert b.verify_sizes[-1] >= b.verify_seqs and b.verify_seqs * b.verify_queries <= b.max_tokens_per_step


@pytest.mark.parametrize("limits", LIMITS)
def test_waste_bound_holds_and_is_reached(limits):
    b = Buckets(**limits)
    for kind in StepKind:
        worst = {}
        if not b.sizes(kind):
            continue
        for size in range(1, b.sizes(kind)[-1] + 1):
            tokens, seqs = b.padded(kind, size)
            key = tokens if kind is StepKind.PREFILL else seqs
            waste = (key - size) / key
            assert waste <= b.waste_bound(kind, key) + 1e-12
            worst[key] = max(worst.get(key, 0.0), waste)
        for key, w in worst.items():  # the bound is the worst case, not a loose one
            assert w == pytest.approx(b.waste_bound(kind, key))
        assert b.max_waste(kind) < 0.5  # powers of two: under half of a bucket is padding
        assert b.max_waste(kind, above_smallest=False) == max(worst.values())


def test_batch_one_decode_keeps_its_shape_and_limits_are_enforced():
    b = Buckets(max_seqs=8, max_tokens_per_step=32, table_width=5)
    D, P = StepKind.DECODE, StepKind.PREFILL
    assert b.padded(D, 1) == (1, 1)
    assert b.shape(D, 3) == Shape(D, 4, 4, 5)
    for kind, size in ((D, 9), (P, 33), (D, 0)):
        with pytest.raises(ValueError, match="outside the buckets"):
            b.padded(kind, size)
    with pytest.raises(TypeError, match="StepKind"):  # a stray boolean is no kind (True would read as PREFILL)
        b.padded(True, 1)
    with pytest.raises(ValueError, match="max_seqs"):
        Buckets(max_seqs=0, max_tokens_per_step=8, table_width=1)
    for bad in (1, -2, True, 33):  # k + 1 >= 2 tokens a sequence, at most a step's budget
        with pytest.raises(ValueError, match="verify"):
            Buckets(max_seqs=8, max_tokens_per_step=32, table_width=5, verify_queries=bad)
    v = Buckets(max_seqs=8, max_tokens_per_step=32, table_width=5, verify_queries=5)
    assert v.verify_seqs == 6 and v.verify_sizes == (1, 2, 4, 8) and v.padded(StepKind.VERIFY, 3) == (20, 4)
    with pytest.raises(ValueError, match="not a decode bucket"):
        b.waste_bound(D, 3)


@pytest.mark.slow  # ten compiles, about 30 s on two CPU cores
@pytest.mark.xdist_group("tuner_compiles")
def test_shapes_listed_are_the_shapes_warm_up_runs(monkeypatch):
    config = LlamaConfig.tiny(num_layers=1)
    runner = build_executor(Llama(config, rngs=nnx.Rngs(0)), init_kv_cache(config, 8, 8, jnp.float32), max_seqs=3,
                    max_tokens_per_step=16, table_width=4, max_logprobs=2)
    ran = []
    original = runner.worker.run

    def record(call, inputs):
        # inputs are stacked per instance ([1, ...] here): the step's own shapes are the trailing axes.
        ran.append((Shape(call.kind, inputs.num_tokens, inputs.num_seqs, inputs.block_tables.shape[-1]),
                    call.greedy, call.logprobs, call.variant))
        return original(call, inputs)

    monkeypatch.setattr(runner.worker, "run", record)
    runner.warm_up(progress=False)
    listed = runner.buckets.shapes()
    assert {shape for shape, *_ in ran} == set(listed)
    # decode: greedy and sampling; prefill: sampling; each with and without logprobs; one variant each.
    assert len(ran) == len(set(ran)) == len(runner.warm_up_plan()) == runner.compile_count
    assert len(ran) == 2 * (2 * len(runner.buckets.decode_sizes) + len(runner.buckets.prefill_sizes))
    D, P = StepKind.DECODE, StepKind.PREFILL
    assert [s for s in listed if s.kind is D] == [Shape(D, n, n, 4) for n in (1, 2, 4)]
    assert [s for s in listed if s.kind is P] == [Shape(P, 8, 4, 4), Shape(P, 16, 4, 4)]
