"""The AutoTuner's scripts on the CPU: tuning-data collection on tiny shapes in interpret mode, training + held-out
evaluation on a small synthetic dataset, the re-measurement of the misses (the GPU runs must not fail on a typo).
The collector itself (jaxllm.tuner.collect) is tested in tests/jaxllm/tuner/test_collect.py."""

from __future__ import annotations

import gzip
import json

import numpy as np

from scripts import collect_tuning_data, train_tuner


def test_kernels_are_assigned_to_the_window_they_start_in():
    from scripts.common import device_trace

    kernels = [(100, 5, "jit_a"), (104, 3, "jit_a"), (150, 7, "jit_b"), (151, 2, "jit_x"), (99, 9, "jit_a"),
               (205, 4, "jit_a"), (300, 1, "jit_b")]
    windows = [(200, 260, "r1:a"), (100, 120, "r0:a"), (140, 199, "r0:b")]
    got = device_trace.assign_to_windows(kernels, windows, ["r0:a", "r0:b", "r1:a", "r2:b"])
    assert got == {"r0:a": {"jit_a": (8, 2)}, "r0:b": {"jit_b": (7, 1), "jit_x": (2, 1)}, "r1:a": {"jit_a": (4, 1)},
                   "r2:b": {}}


def _synthetic_dataset(path):
    """Decode rows where split_coarse wins long contexts and default wins short ones; prefill rows where
    triton_q64_k64_w4 always wins."""
    rng = np.random.default_rng(0)
    rows = []
    for i in range(160):
        bucket = int(rng.choice([1, 4, 16]))
        n = bucket if bucket == 1 else int(rng.integers(bucket // 2 + 1, bucket + 1))
        lens = np.exp(rng.uniform(0, np.log(200_000), n)).astype(int) + 1
        long = lens.sum() > 20_000
        base = 20 + lens.sum() / 1e3
        us = {"default": base * (1.3 if long else 1.0), "bk128": base * 1.2, "stages2": base * 1.25,
              "split_fine": base * 1.4, "split_coarse": base * (1.0 if long else 1.3), "bk128_w8": base * 1.5}
        rows.append(dict(op="decode", heads=[32, 8, 128], block=256, dtype="bfloat16", bucket=bucket, kind="ragged",
                         kv_lens=lens.tolist(), q_lens=None, us=us))
    for i in range(60):
        q = [int(rng.integers(9, 16))]
        kv = [q[0] + int(rng.integers(0, 1000))]
        us = {"triton_default": 30.0, "triton_q64_k64_w4": 20.0, "triton_q128_k64_w8": 40.0}
        rows.append(dict(op="prefill", heads=[32, 8, 128], block=256, dtype="bfloat16", bucket=16, kind="prefill",
                         kv_lens=kv, q_lens=q, us=us))
    header = dict(format="jaxllm-tuning-v1", device="Test GPU", date="2026-01-01", jax="0", plan={})
    with gzip.open(path, "wt") as f:
        for line in [header] + rows:
            f.write(json.dumps(line) + "\n")


def test_train_and_evaluate_on_held_out_shapes(tmp_path):
    data = tmp_path / "test-gpu.jsonl.gz"
    _synthetic_dataset(data)
    assert train_tuner.main(["--device", "test-gpu", "--datasets", str(data), "--model-out", str(tmp_path / "m.npz"),
                             "--out", str(tmp_path), "--steps", "400", "--members", "1"]) == 0
    result = json.load(open(next(tmp_path.glob("test-gpu-*-tuner.json"))))
    assert result["device"] == "Test GPU" and result["summary"]["all"]["shapes"] == 55
    assert result["summary"]["prefill"]["tuned_avg"] == 1.0  # one candidate always wins: found every time
    assert result["summary"]["decode"]["tuned_avg"] > result["summary"]["decode"]["fixed_avg"]
    assert all(e["variants"][0] == ("default" if e["op"] == "decode" else "triton_default")
               for e in result["held_out"])
    from jaxllm.tuner.cost_model import CostModel

    assert CostModel.load(str(tmp_path / "m.npz")).meta["heads"] == [[32, 8, 128]]  # what load_tuner checks


def test_train_takes_decode_only_from_the_datasets_named(tmp_path):
    """--decode-datasets: the other datasets' decode rows (an older decode kernel's) are left out, their prefill
    rows kept; a path that is not among the datasets read is an error."""
    import pytest

    old, new = tmp_path / "test-gpu.jsonl.gz", tmp_path / "test-gpu.shards.jsonl.gz"
    _synthetic_dataset(old)
    header, *rows = [json.loads(line) for line in gzip.open(old, "rt")]
    with gzip.open(new, "wt") as f:  # the decode rows again, at a tensor shard's heads
        for line in [header] + [dict(r, heads=[10, 10, 128]) for r in rows if r["op"] == "decode"]:
            f.write(json.dumps(line) + "\n")
    args = ["--device", "test-gpu", "--datasets", str(old), str(new), "--model-out", str(tmp_path / "m.npz"),
            "--out", str(tmp_path), "--steps", "200", "--members", "1"]
    assert train_tuner.main(args + ["--decode-datasets", str(new)]) == 0
    result = json.load(open(next(tmp_path.glob("test-gpu-*-tuner.json"))))
    assert {tuple(e["heads"]) for e in result["held_out"] if e["op"] == "decode"} == {(10, 10, 128)}
    assert {tuple(e["heads"]) for e in result["held_out"] if e["op"] == "prefill"} == {(32, 8, 128)}
    assert [d["ops"] for d in result["datasets"]] == [["prefill"], ["decode"]]
    with pytest.raises(SystemExit):
        train_tuner.main(args + ["--decode-datasets", str(tmp_path / "elsewhere.jsonl.gz")])


def test_collect_smoke_writes_a_dataset_train_reads(tmp_path):
    """The script end to end on one small group: every decode candidate of bucket 1, in interpret mode."""
    from jaxllm.tuner.candidates import decode_candidates
    from jaxllm.tuner.collect import base_kernels
    from jaxllm.tuner.train import read_dataset

    assert collect_tuning_data.main(["--smoke", "--ops", "decode", "--decode-buckets", "1", "--seed", "0",
                                     "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*.smoke.jsonl.gz")
    header, rows = read_dataset(str(path))
    assert header["script"] == "scripts/collect_tuning_data.py" and header["seed"] == 0 and header["smoke"]
    assert header["plan"]["decode_buckets"] == [1] and header["elapsed_s"] > 0
    names = {s.name for s in decode_candidates(base_kernels(True))}
    assert {c["name"] for c in header["candidates"]["decode"]} == names
    assert len(rows) == 2 and all(r["op"] == "decode" and r["bucket"] == 1 and set(r["us"]) == names for r in rows)


def test_collect_takes_a_tensor_shards_head_shapes():
    import argparse

    import pytest

    assert collect_tuning_data._heads("10/10/128") == (10, 10, 128)
    assert collect_tuning_data._heads("16/2/128") == (16, 2, 128)
    for bad in ("16/3/128", "16x2x128", "0/1/128", "16/2"):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad)):
            collect_tuning_data._heads(bad)


def test_recheck_fractions_take_each_candidates_median_over_passes():
    from scripts import recheck_tuner

    passes = [{"a": 10.0, "b": 8.0}, {"a": 10.0, "b": 14.0}, {"a": 11.0, "b": 9.0}]
    per_pass, median, best = recheck_tuner.fractions(passes, "a")
    assert per_pass == [0.8, 1.0, 9.0 / 11.0]
    assert median == 9.0 / 10.0 and best == "b"  # medians: a 10, b 9


def test_recheck_re_measures_only_the_shapes_under_the_threshold(tmp_path):
    from scripts import recheck_tuner

    shape = dict(op="decode", bucket=2, heads=[4, 2, 128], kind="ragged", q_lens=None, block=64,
                 variants=["default", "bk128"], default_us=8.0, best_us=8.0)
    evaluation = dict(device="cpu", model="m.npz", held_out=[
        dict(shape, kv_lens=[100, 37], chosen="bk128", best="default", chosen_us=10.0),
        dict(shape, kv_lens=[5], chosen="default", best="default", chosen_us=8.0)])
    path = tmp_path / "ev.json"
    path.write_text(json.dumps(evaluation))
    assert recheck_tuner.main(["--evaluation", str(path), "--out", str(tmp_path), "--smoke", "--passes", "2"]) == 0
    (result,) = [json.loads(p.read_text()) for p in tmp_path.glob("*-tuner-recheck.json")]
    (only,) = result["shapes"]
    assert only["kv_lens"] == [100, 37] and only["first_fraction"] == 0.8 and len(only["passes"]) == 2
    assert all(set(p) == {"default", "bk128", "stages2", "split_fine", "split_coarse", "bk128_w8"}
               for p in only["passes"])
    assert result["summary"]["rechecked"] == 1 and result["summary"]["first_below_85"] == 1
