"""StepInputs built from a plain StepPlan on one instance (the input layout's padding: jaxllm.executor.inputs), and the
step functions' signatures."""

from __future__ import annotations

import inspect

import jax
import numpy as np
import pytest

from jaxllm.executor import step
from jaxllm.engine.allocator import BlockAllocator
from jaxllm.contract import SamplingParams
from jaxllm.contract import StepKind, StepPlan
from jaxllm.engine.scheduler import Scheduler
from jaxllm.executor.inputs import InputLayout
from jaxllm.executor.step import StepInputs
from jaxllm.tuner.buckets import Buckets

LIMITS = dict(min_tokens=8, max_seqs=4, max_tokens_per_step=16, table_width=6)


def make_step_inputs(plan: StepPlan, **limits) -> StepInputs:
    """The plan laid out on one instance of a pool of 32 rBlocks of 4 tokens, the instance axis dropped."""
    layout = InputLayout(instances=1, blocks_per_instance=32, block_size=4, buckets=Buckets(**limits))
    return jax.tree.map(lambda x: x[0], layout.build(plan).inputs)


def _plans():
    """A prefill plan of 3 sequences (11 tokens), then their first decode plan; distinct sampling params."""
    sched = Scheduler(BlockAllocator(32), 4, max_tokens_per_step=64, max_seqs=4)
    params = [SamplingParams(temperature=0.5, top_k=3, top_p=0.9, seed=7, max_new_tokens=5),
              SamplingParams(max_new_tokens=5),
              SamplingParams(temperature=1.5, top_p=0.5, seed=11, max_new_tokens=5)]
    seqs = [sched.add(list(range(1, n + 1)), p, max_len=64) for n, p in zip((2, 5, 4), params)]
    prefill = sched.plan()
    sched.update(prefill, np.array([9, 9, 9]), eos_id=0)
    return seqs, prefill, sched.plan()


def test_plan_is_plain_arrays_and_ids():
    seqs, prefill, decode = _plans()
    assert prefill.seq_ids.tolist() == decode.seq_ids.tolist() == [s.seq_id for s in seqs]
    assert not hasattr(prefill, "seqs") and len(prefill) == prefill.num_seqs == 3
    assert prefill.kind is StepKind.PREFILL and decode.kind is StepKind.DECODE and prefill.num_tokens == 11
    np.testing.assert_array_equal(prefill.temperature, np.float32([0.5, 0.0, 1.5]))
    np.testing.assert_array_equal(prefill.top_k, [3, 0, 0])
    np.testing.assert_array_equal(prefill.top_p, np.float32([0.9, 1.0, 0.5]))
    np.testing.assert_array_equal(prefill.seed, [7, 0, 11])
    with pytest.raises(ValueError, match=r"StepPlan.top_k has 2 rows, want 3 \(3 sequences, 11 tokens\)"):
        StepPlan(**{**prefill.__dict__, "top_k": prefill.top_k[:2]})


def test_prefill_inputs_pad_to_the_bucket_with_inert_rows():
    _, plan, _ = _plans()
    inputs = make_step_inputs(plan, **LIMITS)
    assert (inputs.num_tokens, inputs.num_seqs) == (16, 4)
    assert inputs.block_tables.shape == (4, 6) and inputs.cu_q_lens.shape == (5,)
    np.testing.assert_array_equal(inputs.tokens[:11], plan.token_ids)
    np.testing.assert_array_equal(inputs.positions[:11], plan.positions)
    np.testing.assert_array_equal(inputs.slot_mapping[:11], plan.slot_mapping)
    np.testing.assert_array_equal(inputs.block_tables[:3, :plan.block_tables.shape[1]], plan.block_tables)
    np.testing.assert_array_equal(inputs.kv_lens[:3], plan.kv_lens)
    np.testing.assert_array_equal(inputs.cu_q_lens, [0, 2, 7, 11, 11])  # the padding sequence has no token
    # Padding tokens write nowhere; the padding sequence attends to nothing and is greedy.
    assert np.all(inputs.slot_mapping[11:] == -1) and np.all(inputs.tokens[11:] == 0)
    assert inputs.kv_lens[3] == 0 and np.all(inputs.block_tables[3] == 0)
    np.testing.assert_array_equal(inputs.temperature, np.float32([0.5, 0.0, 1.5, 0.0]))
    np.testing.assert_array_equal(inputs.top_k, [3, 0, 0, 0])
    np.testing.assert_array_equal(inputs.top_p, np.float32([0.9, 1.0, 0.5, 1.0]))
    np.testing.assert_array_equal(inputs.seed, [7, 0, 11, 0])
    for name in ("tokens", "positions", "block_tables", "kv_lens", "cu_q_lens", "slot_mapping", "top_k", "seed"):
        assert getattr(inputs, name).dtype == np.int32, name


def test_decode_inputs_keep_cu_equal_to_arange():
    """The decode kernel's contract: one query token per (padded) sequence, cu == arange(S + 1)."""
    _, _, plan = _plans()
    inputs = make_step_inputs(plan, **LIMITS)
    assert (inputs.num_tokens, inputs.num_seqs) == (4, 4)  # 3 sequences -> the bucket of 4
    np.testing.assert_array_equal(inputs.cu_q_lens, np.arange(5))
    assert inputs.kv_lens[3] == 0 and inputs.slot_mapping[3] == -1 and inputs.temperature[3] == 0


def test_plans_past_the_limits_raise():
    _, prefill, decode = _plans()
    with pytest.raises(ValueError, match=r"3 sequences x 2 rBlocks exceed the executor's limits \(4 x 1\)"):
        make_step_inputs(prefill, **{**LIMITS, "table_width": 1})
    with pytest.raises(ValueError, match=r"exceed the executor's limits \(2 x 6\)"):
        make_step_inputs(prefill, **{**LIMITS, "max_seqs": 2})
    with pytest.raises(ValueError, match="a decode step of 3 sequences is outside the buckets"):
        make_step_inputs(decode, **{**LIMITS, "max_seqs": 2})  # never a shape warm-up did not compile
    assert make_step_inputs(decode, **{**LIMITS, "table_width": 2}).block_tables.shape == (4, 2)  # exactly fits


def test_inputs_are_one_pytree():
    """What a mesh shards and process 0 sends: one value of eleven array leaves, moved as one."""
    _, plan, _ = _plans()
    inputs = make_step_inputs(plan, **LIMITS)
    leaves, treedef = jax.tree_util.tree_flatten(inputs)
    assert len(leaves) == 11 and all(isinstance(x, np.ndarray) for x in leaves)
    on_device = jax.device_put(inputs)
    assert isinstance(on_device, StepInputs) and all(isinstance(x, jax.Array) for x in jax.tree.leaves(on_device))
    np.testing.assert_array_equal(np.asarray(on_device.cu_q_lens), inputs.cu_q_lens)
    assert jax.tree_util.tree_structure(on_device) == treedef


@pytest.mark.parametrize("fn", [step.decode_step, step.prefill_step, step.logits_step])
def test_step_functions_take_kernels_not_a_backend_string(fn):
    params = inspect.signature(fn).parameters
    assert list(params)[:4] == ["graphdef", "state", "kv_pool", "inputs"]
    assert params["kernels"].kind is inspect.Parameter.KEYWORD_ONLY and "backend" not in params
