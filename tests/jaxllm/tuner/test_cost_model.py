"""The cost model: NumPy inference equals the jax forward used in training; ranking, ensembles and files;
a model trained on synthetic timings with a known best recovers it."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm.tuner.cost_model import CostModel, MlpWeights, OpRanker, forward_jnp, forward_np
from jaxllm.tuner.train import ensemble, train_op
from tests.seeds import seed


def _weights(f=9, h=8, seed=0) -> MlpWeights:
    rng = np.random.default_rng(seed)
    r = lambda *s: rng.normal(size=s).astype(np.float32)
    return MlpWeights(w1=r(f, h), b1=r(h), w2=r(h, h) / 3, b2=r(h), w3=r(h, 1), b3=r(1), x_mean=r(f),
                      x_std=np.abs(r(f)) + 0.5, y_mean=np.float32(3.0), y_std=np.float32(0.7))


def test_numpy_inference_equals_the_jax_forward():
    w = _weights()
    x = np.random.default_rng(1).normal(size=(17, 9)).astype(np.float32)
    jax_out = np.asarray(forward_jnp(w.params(), (x - w.x_mean) / w.x_std)) * w.y_std + w.y_mean
    np.testing.assert_allclose(forward_np(w, x), jax_out, rtol=1e-5, atol=1e-5)


def test_ranker_folds_the_schedule_half_exactly():
    w = _weights()
    rng = np.random.default_rng(2)
    sched = rng.normal(size=(4, 3)).astype(np.float32)
    ranker = OpRanker.build(w, ["a", "b", "c", "d"], sched)
    for _ in range(5):
        shape = rng.normal(size=6).astype(np.float32)
        full = forward_np(w, np.concatenate([np.repeat(shape[None], 4, 0), sched], 1))
        np.testing.assert_allclose(ranker.predict(shape), full, rtol=1e-4, atol=1e-4)
        assert ranker.best(shape.tolist()) == int(np.argmin(full))
    with pytest.raises(ValueError, match="model takes 9 features"):
        OpRanker.build(w, ["a"], np.zeros((1, 9), np.float32))


def test_ranker_folds_the_schedule_part_exactly_beside_interaction_features():
    w = _weights(f=11)
    rng = np.random.default_rng(seed(31298))
    sched = rng.normal(size=(4, 3)).astype(np.float32)
    inter = lambda stats: np.outer(np.arange(1, 5), np.array(stats[:2])).ravel().tolist()  # [C x 2]  # noqa: E731
    ranker = OpRanker.build(w, ["a", "b", "c", "d"], sched, inter, num_interactions=2)
    for _ in range(5):
        shape, stats = rng.normal(size=6).astype(np.float32), tuple(rng.normal(size=2))
        x = np.concatenate([np.repeat(shape[None], 4, 0), sched, np.reshape(inter(stats), (4, 2))], 1)
        full = forward_np(w, x.astype(np.float32))
        np.testing.assert_allclose(ranker.predict(shape, stats), full, rtol=1e-4, atol=1e-4)
        assert ranker.best(shape.tolist(), stats) == int(np.argmin(full))
    with pytest.raises(ValueError, match="interaction"):
        OpRanker.build(w, ["a", "b", "c", "d"], sched, None, num_interactions=2)


def test_ensemble_is_one_network_computing_the_members_mean():
    members = [_weights(seed=s) for s in range(3)]
    members = [MlpWeights(**{**m.__dict__, "x_mean": members[0].x_mean, "x_std": members[0].x_std}) for m in members]
    x = np.random.default_rng(3).normal(size=(11, 9)).astype(np.float32)
    merged = ensemble(members)
    assert merged.w1.shape == (9, 24)
    np.testing.assert_allclose(forward_np(merged, x), np.mean([forward_np(m, x) for m in members], 0),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="normalised differently"):
        ensemble([members[0], _weights(seed=9)])


def test_model_file_round_trip(tmp_path):
    model = CostModel({"decode": _weights()}, {"decode": ("x", "y")}, {"device": "test"})
    model.save(tmp_path / "m.npz")
    back = CostModel.load(str(tmp_path / "m.npz"))
    assert back.names == {"decode": ("x", "y")} and back.meta == {"device": "test"}
    x = np.ones((2, 9), np.float32)
    np.testing.assert_array_equal(forward_np(back.ops["decode"], x), forward_np(model.ops["decode"], x))


def test_training_recovers_a_known_best_on_held_out_shapes():
    # Two shape features, three candidates: time = base(shape) + a penalty that depends on which side of
    # a boundary the shape lies and on the candidate: the best is candidate 0 left of s0 = 0, 2 right of it.
    rng = np.random.default_rng(0)
    s = rng.uniform(-1, 1, size=(240, 2)).astype(np.float32)
    cand = np.array([[0.0], [0.5], [1.0]], np.float32)
    x = np.concatenate([np.repeat(s[:, None], 3, 1), np.repeat(cand[None], 240, 0)], 2)
    y = (1.0 + s[:, None, 1] + 0.4 * np.abs(cand[None, :, 0] - (s[:, None, 0] > 0)) +
         0.1 * (cand[None, :, 0] == 0.5)).astype(np.float32)
    mask = np.ones_like(y)
    w = train_op(x[:180], y[:180], mask[:180], hidden=16, steps=600, lr=1e-2)
    pred = forward_np(w, x[180:].reshape(-1, 3)).reshape(60, 3)
    want = np.where(s[180:, 0] > 0, 2, 0)
    assert np.mean(pred.argmin(1) == want) >= 0.95
