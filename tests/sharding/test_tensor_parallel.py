"""Tensor parallelism on 8 CPU host devices: logits equal the unsharded ones, each device holds 1/N.

tp_worker.py runs every case in one subprocess (the device count must be set before jax is imported,
which this shared pytest process cannot do) and reports JSON; the tests below assert on it.
"""

import pytest

from tests.workers import run_json_worker

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("sharding_tp")]

SPLIT = ("attention/qkv", "attention/o", "mlp/gate_up", "mlp/down", "lm_head", "embedding")
REPLICATED = ("norm/weight", "inv_freq")
TP_CASES = ["mha/tp2", "mha/tp4", "mha/tp8", "gqa/tp2", "gqa/tp8", "gqa_wide/tp8", "70b/tp8", "gqa/tp4x2",
            "gqa_wide/tp4/shard_map"]


@pytest.fixture(scope="module")
def results():
    return run_json_worker("tests/sharding/tp_worker.py")


def _tensor_parallel(case: str) -> int:
    return int(case.split("/")[1].removeprefix("tp").split("x")[0])


@pytest.mark.parametrize("case", TP_CASES)
def test_logits_equal_unsharded(results, case):
    assert results["device_count"] == 8
    assert results[case]["error"] < 1e-5, results[case]["error"]


@pytest.mark.parametrize("case", TP_CASES)
def test_each_device_holds_its_share(results, case):
    n = _tensor_parallel(case)
    r = results[case]
    assert r["params"] and r["pool"]
    for name, held in r["params"].items():
        assert held["devices"] == r["devices"], (name, held)
        if name.endswith(SPLIT):
            assert held["fraction"] == pytest.approx(1 / n), (name, held)
        else:
            assert name.endswith(REPLICATED) and held["fraction"] == 1.0, (name, held)
    instances = r["devices"] // n
    for name, held in r["pool"].items():  # KV heads over tensor, rBlocks over instances
        assert held["fraction"] == pytest.approx(1 / (n * instances)), (name, held)


def test_kv_heads_replicated_when_fewer_than_the_tensor_axis(results):
    assert results["gqa/tp2"]["kv_heads"] == 4  # split, not copied
    assert results["gqa/tp8"]["kv_heads"] == 8  # 4 KV heads, each held by 2 devices
    assert results["gqa_wide/tp8"]["kv_heads"] == 8  # 2 KV heads, each held by 4
    assert results["70b/tp8"]["kv_heads"] == 8


def test_pallas_attention_per_shard_equals_unsharded(results):
    r = results["kernel/tp4"]
    assert r["decode"] < 1e-5 and r["prefill"] < 1e-5, r
    assert r["out_spec_decode"] == r["out_spec_prefill"] == "P(None, 'tensor')"


def test_rope_write_per_shard_on_grouped_qkv(results):
    r = results["rope_write/tp4"]
    assert r["error"] < 1e-5 and r["pool_fraction"] == 0.25 and r["devices"] == 4, r
