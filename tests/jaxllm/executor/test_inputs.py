"""InputLayout.advance: a continuation's batch from its source's arrays equals the batch laid out anew
(InputLayout.build), on one instance and on several (lending, rows crossing rBlocks); host NumPy only, no device."""

import dataclasses

import numpy as np

from jaxllm.contract import SamplingParams, StepKind
from jaxllm.engine.instances import InstanceSchedulers
from jaxllm.executor.inputs import InputLayout
from jaxllm.tuner.buckets import Buckets
from tests.seeds import seed

BLOCK = 4


def _assert_same_batch(got, want):
    assert np.array_equal(got.rows, want.rows) and got.size == want.size and got.borrowed == want.borrowed
    assert got.busiest == want.busiest
    for field in dataclasses.fields(want.inputs):
        a, b = getattr(got.inputs, field.name), getattr(want.inputs, field.name)
        if field.name == "penalties" and b is not None:
            for f in dataclasses.fields(b):
                assert np.array_equal(getattr(a, f.name), getattr(b, f.name)), f.name
            continue
        if field.name == "parts" and b is not None:
            for f in dataclasses.fields(b):
                x, y = getattr(a, f.name), getattr(b, f.name)
                assert (x is None and y is None) or np.array_equal(x, y), f.name
            continue
        assert (a is None and b is None) or np.array_equal(a, b), field.name


def test_an_advanced_batch_equals_the_batch_built_anew():
    rng = np.random.default_rng(seed(6101))
    advanced = rebuilt = 0
    for trial in range(30):
        instances = int(rng.integers(1, 4))
        scheds = InstanceSchedulers(instances, int(rng.integers(6, 20)), BLOCK, max_tokens_per_step=64,
                                    max_seqs=4, lending=True)
        layout = InputLayout(instances=instances, blocks_per_instance=scheds.blocks_per_instance, block_size=BLOCK,
                             buckets=Buckets(max_seqs=4, max_tokens_per_step=64, table_width=32), bias_width=2)
        for i in range(int(rng.integers(1, 4 * instances + 1))):
            params = SamplingParams(max_new_tokens=40, temperature=float(rng.choice([0.0, 0.8])), seed=i,
                                    presence_penalty=float(rng.choice([0.0, 0.5])))
            scheds.add(rng.integers(1, 50, size=int(rng.integers(1, 12))).tolist(), params,
                       max_len=scheds.blocks_per_instance * BLOCK * instances)
        prev = None
        for _ in range(30):
            if prev is None:
                prev = scheds.plan()
                if prev is None:
                    break
                batch = layout.build(prev)
            cont = scheds.plan_continuation(prev) if prev.kind is StepKind.DECODE else None
            scheds.update(prev, rng.integers(1, 50, size=prev.num_seqs), 0)
            if cont is None:
                prev = None
                continue
            moved = layout.advance(batch, cont)
            _assert_same_batch(moved, layout.build(cont))
            advanced += moved.inputs.positions is not batch.inputs.positions and cont.block_tables is prev.block_tables
            rebuilt += cont.block_tables is not prev.block_tables
            prev, batch = cont, moved
    assert advanced > 50 and rebuilt > 10, (advanced, rebuilt)
