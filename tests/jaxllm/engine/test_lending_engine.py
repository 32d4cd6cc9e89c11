"""Engines of 2, 4 and 8 instances on CPU host devices that lend each other rBlocks (DistKV-LLM) and attend
where the KV lives (DistAttention), against one instance with a pool big enough: the same greedy tokens
(bf16 and int8 pools, 2, 4 and 8 instances) for a sequence longer than any one instance's pool, under a skewed load, and across a
recall; nothing preempted while the mesh has room; nothing leaked.

lending_worker.py runs every case in one subprocess (the device count must be set before jax is imported)
with a fresh seed, printed on failure, and reports JSON.
"""

import pytest

from tests.workers import run_json_worker

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("jaxllm_lending")]

LONG = ["long/2/bfloat16", "long/4/bfloat16", "long/8/int8"]  # int8 and bf16 pools; 2, 4 and 8 instances


@pytest.fixture(scope="module")
def results():
    return run_json_worker("tests/jaxllm/engine/lending_worker.py")


def _done(r):
    """Every rBlock home and free again: nothing borrowed, nothing leaked."""
    return r["borrowed"] == 0 and r["free"] == r["blocks"] and r["lending_instances"] == 0


@pytest.mark.parametrize("case", LONG)
def test_a_sequence_longer_than_one_pool_generates_by_borrowing(results, case):
    r = results[case]
    assert r["long_len"] > r["pool_tokens"], r
    assert r["equal"], (results["seed"], r["got"], r["want"])
    assert r["loans"] > 0 and r["dist_steps"] > 0, r
    assert r["preemptions"] == 0, r  # the mesh had room for every request
    assert _done(r), r


def test_skewed_load_borrows_instead_of_preempting(results):
    on, off = results["skew/lending=True"], results["skew/lending=False"]
    assert on["equal"] and on["preemptions"] == 0 and on["loans"] > 0 and _done(on), (results["seed"], on)
    assert off["preemptions"] > 0 and off["loans"] == 0, off  # the same load without lending preempts
    assert off["equal"], (results["seed"], off)


def test_recall_copies_lent_rblocks_home_and_outputs_do_not_change(results):
    r = results["recall"]
    assert r["recalled_while_running"] > 0, r
    assert r["equal"], (results["seed"], r)
    assert r["preemptions"] == 0 and _done(r), r


def test_a_run_that_borrows_nothing_runs_no_dist_attention(results):
    r = results["unborrowed"]
    assert r["borrowed_before"] == 0 and r["loans"] == 0, r
    assert r["padded_steps"] > 0, r  # zero padding named another instance's rBlock in some step
    assert r["dist_steps"] == 0, r
    assert r["preemptions"] == 0 and _done(r), r


def test_lending_off_limits_a_sequence_to_its_instance_pool(results):
    assert results["lending_off_context_limit"] == 160
    assert "context limit 160" in results["refused"]


def test_nothing_compiles_after_warm_up(results):
    r = results["warm"]
    assert r["warm_up_compiles"] > 0 and r["dist_steps"] > 0, r  # the run borrowed
    assert r["after"] == 0, r
