"""Tensor parallelism through `LLM` on 8 CPU host devices: logits, greedy and seeded tokens equal TP 1's;
each device holds 1/N of the sharded weights and KV pool; checkpoints load straight into their shards.

tp_llm_worker.py runs every case in one subprocess (the device count must be set before jax is
imported, which this shared pytest process cannot do) and reports JSON; the tests below assert on it.
"""

import pytest

from tests.workers import run_json_worker

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("jaxllm_tp")]

CASES = ["mha/tp2", "mha/tp4", "mha/tp8", "gqa/tp2", "gqa/tp4", "gqa/tp8", "gqa_wide/tp2", "gqa_wide/tp4",
         "gqa_wide/tp8", "70b/tp8"]
SPLIT = ("attention/qkv", "attention/o", "mlp/gate_up", "mlp/down", "lm_head", "embedding")
REPLICATED = ("norm/weight", "inv_freq")


@pytest.fixture(scope="module")
def results():
    return run_json_worker("tests/jaxllm/tp_llm_worker.py")


def _tp(case: str) -> int:
    return int(case.split("/")[1].removeprefix("tp"))


@pytest.mark.parametrize("case", CASES + ["orbax/tp4"])
def test_logits_and_tokens_equal_tensor_parallel_1(results, case):
    assert results["device_count"] == 8
    r = results[case]
    assert r["error"] < 1e-5, r["error"]
    if r["generated"]:  # one tensor-parallel size per config generates (tp_llm_worker.GENERATE_AT)
        assert r["greedy_equal"] and r["sampled_equal"], r
        assert all(len(tokens) == 6 for tokens in r["greedy"])


def test_every_config_generates_at_some_tensor_parallel_size(results):
    generated = {case.split("/")[0] for case in CASES if results[case]["generated"]}
    assert generated == {case.split("/")[0] for case in CASES}, generated


def _assert_split(params: dict, n: int, devices: int) -> None:
    assert params
    for name, held in params.items():
        assert held["devices"] == devices, (name, held)
        if name.endswith(SPLIT):
            assert held["fraction"] == pytest.approx(1 / n), (name, held)
        else:
            assert name.endswith(REPLICATED) and held["fraction"] == 1.0, (name, held)


@pytest.mark.parametrize("case", CASES + ["orbax/tp4"])
def test_each_device_holds_its_share_of_weights_and_pool(results, case):
    n, r = _tp(case), results[case]
    _assert_split(r["params"], n, n)
    for name, held in r.get("pool", {}).items():
        assert held["fraction"] == pytest.approx(1 / n) and held["devices"] == n, (name, held)
    if "pool" in r:
        assert len(r["pool"]) == 2 * 2  # k and v of both layers


def test_kv_heads_replicated_when_fewer_than_the_tensor_axis(results):
    assert results["gqa/tp4"]["step_kv_heads"] == 4  # split
    assert results["gqa/tp8"]["step_kv_heads"] == 8  # 4 KV heads, each on 2 devices
    assert results["gqa_wide/tp8"]["step_kv_heads"] == 8
    assert results["gqa_wide/tp8"]["info"]["num_kv_heads"] == 2  # info reports the model's own


def test_info_reports_the_mesh(results):
    assert results["gqa/tp4"]["info"] == dict(tensor_parallel=4, instances=1, processes=1, devices=4, num_kv_heads=4)


def test_hf_checkpoint_loads_straight_into_its_shards(results):
    _assert_split(results["load/hf/tp4"], 4, 4)


def test_pallas_kernels_run_per_shard(results):
    r = results["tiny/tp2/triton"]
    assert r["per_shard"] and r["error"] < 1e-5, r


def test_nothing_compiles_after_warm_up_on_a_mesh(results):
    r = results["warm/tp2"]
    assert r["warm_up_compiles"] > 0 and r["after"] == 0, r
