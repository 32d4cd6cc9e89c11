"""The tuning-data collector on the CPU: shape draws inside their bucket and pool, one group timed in interpret
mode, kernel time read through the KernelTimer it is handed, and the dataset train.py reads back."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.tuner import collect
from jaxllm.tuner.candidates import decode_candidates
from jaxllm.tuner.train import read_dataset
from pallas_kernels.dispatch import Kernels
from tests.seeds import seed


def test_shapes_stay_inside_the_bucket_and_the_pool():
    rng = np.random.default_rng(seed(0))
    for _ in range(50):
        lens, kind = collect.decode_lens(rng, 7, 5000, 4096)
        assert len(lens) == 7 and lens.min() >= 1 and lens.max() <= 4096 and lens.sum() <= 5000 + 7
        assert kind in ("equal", "ragged", "few_long")
        q, prefix = collect.prefill_shape(rng, 128, collect.SMOKE, 10_000)
        assert 64 < q.sum() <= 128 and q.min() >= 1 and len(q) <= collect.SMOKE.max_prefill_seqs
        assert (prefix >= 0).all() and q.sum() + prefix.sum() <= 10_000
    long = dataclasses.replace(collect.SMOKE, min_prefix=200, max_prefill_seqs=1)
    prefixes = [int(collect.prefill_shape(rng, 16, long, 10_000)[1][0]) for _ in range(200)]
    assert 0 in prefixes and min(p for p in prefixes if p) >= 200 and max(prefixes) <= long.max_prefix
    tables = collect.rblock_tables([5, 64, 1], block=4, width=16, layers=2, pool_blocks=100, seq_pad=4)
    assert tables.shape == (2, 4, 16)
    assert tables[0, 0, :2].tolist() == [0, 1] and tables[0, 1, :16].tolist() == list(range(2, 18))
    assert tables[1, 0, 0] == 19  # the second layer's rBlocks follow the first's


def test_one_group_is_timed_in_interpret_mode():
    plan = dataclasses.replace(collect.SMOKE, max_len=256, placements=1, max_shapes=2)
    base = Kernels(decode_attention="triton", interpret=True)
    pools = tuple(collect.make_pool(8, 2, plan.block, 128, s) for s in (0, 1))
    rows = collect.Collector(plan, base, 0).group("decode", (4, 2, 128), 2, pools, decode_candidates(base)[:1],
                                                   groups_left=1, est_compile=0.0)
    assert len(rows) == 2 and all(set(r["us"]) == {"default"} and r["us"]["default"] > 0 for r in rows)
    assert all(1 <= len(r["kv_lens"]) <= 2 and r["op"] == "decode" for r in rows)
    assert all(r["wall_us"] == r["us"] for r in rows)  # SMOKE times with the host clock


class _FakeTimer:
    """A KernelTimer that runs every batch and says each ran `ns` of kernels of `module`, twice."""

    def __init__(self, module: str, ns: int):
        self.module, self.ns, self.labels = module, ns, []

    def __call__(self, batches):
        for label, thunk in batches:
            thunk()
            self.labels.append(label)
        return {label: {self.module: (self.ns, 2)} for label, _ in batches}


def test_kernel_time_is_what_the_timer_read_per_call():
    plan = dataclasses.replace(collect.SMOKE, timing="kernel", reps=3, rep_s=0.0)
    steps = [(jax.jit(lambda x: x + 1), "jit_a"), (jax.jit(lambda x: x * 2), "jit_a")]
    placements = [(jnp.ones(3),)]
    timer = _FakeTimer("jit_a", 6000)
    device_us, wall_us = collect.Collector(plan, Kernels(), 0, kernel_timer=timer).time_shape(steps, placements)
    assert device_us == [6.0, 6.0]  # 6000 ns over one call a rep (rep_s 0: one call)
    assert len(wall_us) == 2 and all(w > 0 for w in wall_us)
    # Each rep times every candidate in turn, rep r starting at candidate r mod 2.
    assert timer.labels == ["tune:0:0", "tune:0:1", "tune:1:1", "tune:1:0", "tune:2:0", "tune:2:1"]
    with pytest.raises(RuntimeError, match="no kernel of jit_a"):
        collect.Collector(plan, Kernels(), 0, kernel_timer=_FakeTimer("jit_other", 1)).time_shape(steps, placements)
    with pytest.raises(RuntimeError, match="saw no GPU kernels"):
        collect.Collector(plan, Kernels(), 0, kernel_timer=lambda batches: {}).time_shape(steps, placements)


def test_kernel_timing_needs_a_timer_and_a_known_timing():
    with pytest.raises(ValueError, match="needs a kernel_timer"):
        collect.Collector(collect.Plan(), Kernels(), 0)
    collect.Collector(collect.SMOKE, Kernels(), 0)  # wall: none needed
    with pytest.raises(ValueError, match="'gpu'"):
        dataclasses.replace(collect.SMOKE, timing="gpu")


def test_a_written_dataset_reads_back(tmp_path):
    path = str(tmp_path / "cpu.jsonl.gz")
    header = dict(format="jaxllm-tuning-v1", device="cpu", definitions=collect.DEFINITIONS)
    rows = [dict(op="decode", heads=[4, 2, 128], block=64, dtype="bfloat16", bucket=1, kind="equal", kv_lens=[9],
                 q_lens=None, us={"default": 1.5}, wall_us={"default": 2.0})]
    collect.write_dataset(path, header, rows)
    assert read_dataset(path) == (header, rows)
    assert not (tmp_path / "cpu.jsonl.gz.tmp").exists()
