"""LearnedTuner over a StepPlan: the base first, cached choices, the model's ranking; features of a plan;
load_tuner and its fallback (logged once, naming the device)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import jaxllm.tuner as tuner_pkg
from jaxllm.contract import StepKind
from jaxllm.engine.allocator import BlockAllocator
from jaxllm.contract import SamplingParams
from jaxllm.contract import StepPlan
from jaxllm.engine.scheduler import Scheduler
from jaxllm.model.config import LlamaConfig
from jaxllm.tuner import FixedTuner, LearnedTuner, StepFeatures, load_tuner
from jaxllm.tuner.candidates import NUM_INTERACTIONS, all_schedules
from jaxllm.tuner.cost_model import CostModel, MlpWeights
from jaxllm.tuner.features import NUM_SHAPE_FEATURES, SMALL_STATS, length_stats, plan_key
from jaxllm.tuner.learned import MAX_VARIANTS, keep_variants, op_ranker
from jaxllm.tuner.protocol import StepTuner
from pallas_kernels.dispatch import Kernels
from tests.seeds import seed

HOPPER = Kernels(decode_attention="triton", prefill_attention="mosaic", rope_kv_write="pallas", decode_layer="pallas")
HEADS = (32, 8, 128)
H100 = "NVIDIA H100 80GB HBM3"


def _model(seed=0) -> CostModel:
    rng = np.random.default_rng(seed)
    ops, names = {}, {}
    for op in ("decode", "prefill"):
        scheds = all_schedules(op)
        f = NUM_SHAPE_FEATURES + len(scheds[0].features) + NUM_INTERACTIONS[op]
        r = lambda *s: rng.normal(size=s).astype(np.float32)
        ops[op] = MlpWeights(w1=r(f, 8), b1=r(8), w2=r(8, 8), b2=r(8), w3=r(8, 1), b3=r(1),
                             x_mean=np.zeros(f, np.float32), x_std=np.full(f, 4.0, np.float32),
                             y_mean=np.float32(4.0), y_std=np.float32(1.0))
        names[op] = tuple(s.name for s in scheds)
    return CostModel(ops, names, {"device": "test"})


def _plan(kv_lens, q_lens) -> StepPlan:
    """A StepPlan built by hand (the fields the tuner reads are kv_lens and cu_q_lens)."""
    s, t = len(kv_lens), int(sum(q_lens))
    z = lambda n, dt=np.int32: np.zeros(n, dt)
    return StepPlan(seq_ids=np.arange(s, dtype=np.int64), token_ids=z(t), positions=z(t), slot_mapping=z(t),
                    cu_q_lens=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
                    kv_lens=np.asarray(kv_lens, np.int32), block_tables=np.zeros((s, 4), np.int32),
                    sample=np.ones(s, bool), temperature=z(s, np.float32), top_k=z(s), top_p=np.ones(s, np.float32),
                    seed=z(s))


def test_learned_tuner_is_a_step_tuner_with_the_base_first():
    tuner = LearnedTuner(HOPPER, _model(), heads=HEADS, block_size=256)
    assert isinstance(tuner, StepTuner)
    for decode, size in ((StepKind.DECODE, 1), (StepKind.DECODE, 64), (StepKind.PREFILL, 16), (StepKind.PREFILL, 2048)):
        variants = tuner.variants(decode, size)
        assert variants[0] is HOPPER and 1 <= len(variants) <= MAX_VARIANTS
        assert len(set(variants)) == len(variants) == len(tuner.variant_names(decode, size))
        assert tuner.variants(decode, size) is variants  # built once per bucket
    everything = LearnedTuner(HOPPER, _model(), heads=HEADS, block_size=256, prune=False, max_variants=99)
    assert everything.variant_names(StepKind.DECODE, 4) == tuple(s.name for s in all_schedules("decode"))


def test_keep_variants_covers_the_worst_shortfall_before_frequent_small_wins():
    rng = np.random.default_rng(seed(31875))
    # 4 candidates over 100 shapes: 1 wins by 2% on 90 of them, 2 by 30% on 5 (a narrow range of lengths),
    # 3 never wins. With room for one more than the base, the narrow big win is the one kept.
    pred = np.zeros((100, 4)) + rng.normal(0, 1e-4, (100, 4)) + np.log(np.array([1.0, 1.0, 1.0, 1.2]))
    pred[:90, 1] -= np.log(1.02)
    pred[90:95, 2] -= np.log(1.3)
    perm = rng.permutation(100)
    assert keep_variants(pred[perm], 2) == [0, 2]
    assert keep_variants(pred[perm], 4) == [0, 1, 2]  # then the 2% one; never the loser, nothing more needed
    assert keep_variants(pred[perm], 1) == [0]
    flat = np.zeros((10, 3))
    assert keep_variants(flat, 3) == [0]  # the base is within 1% everywhere: nothing else compiled


def test_choose_ranks_with_the_model_and_caches_per_key():
    model = _model()
    tuner = LearnedTuner(HOPPER, model, heads=HEADS, block_size=256, prune=False, max_variants=99)
    plan = _plan([3000, 17, 250_000, 9], [1, 1, 1, 1])
    index = tuner.choose(plan, StepKind.DECODE, 4)
    names = tuner.variant_names(StepKind.DECODE, 4)
    ranker = op_ranker(model, "decode", names, kv_heads=HEADS[1], block_size=256)
    f = StepFeatures.from_plan(plan, StepKind.DECODE, 4, heads=HEADS)
    want = int(np.argmin(ranker.predict(f.vector(), f.stats())))
    assert index == want
    assert tuner.stats() == {"predictions": 1, "cache_hits": 0, "cache_keys": 1}
    near = _plan([3001, 18, 250_001, 10], [1, 1, 1, 1])  # one decode step later: the same key
    assert tuner.choose(near, StepKind.DECODE, 4) == tuner.choose(plan, StepKind.DECODE, 4) == index
    assert tuner.stats() == {"predictions": 1, "cache_hits": 2, "cache_keys": 1}
    prefill = _plan([700, 64], [300, 64])
    assert 0 <= tuner.choose(prefill, StepKind.PREFILL, 512) < len(tuner.variants(StepKind.PREFILL, 512))
    assert tuner.stats()["predictions"] == 2


def test_features_of_a_scheduler_plan():
    sched = Scheduler(BlockAllocator(32), 4, max_tokens_per_step=64, max_seqs=4)
    for n in (2, 5, 4):
        sched.add(list(range(1, n + 1)), SamplingParams(max_new_tokens=5), max_len=64)
    prefill = sched.plan()
    f = StepFeatures.from_plan(prefill, StepKind.PREFILL, 16, heads=HEADS)
    assert f.q_lens.tolist() == [2, 5, 4] and f.kv_lens.tolist() == [2, 5, 4]
    v = f.vector()
    assert v.shape == (NUM_SHAPE_FEATURES,) and np.all(np.isfinite(v))
    assert v[0] == 0 and v[1] == 4 and v[3] == pytest.approx(np.log2(12))  # prefill, bucket 2^4, 11 tokens
    assert f.key() == plan_key(prefill, StepKind.PREFILL, 16)
    sched.update(prefill, np.array([9, 9, 9]), eos_id=0)
    decode = sched.plan()
    d = StepFeatures.from_plan(decode, StepKind.DECODE, 4, heads=HEADS)
    assert d.q_lens.tolist() == [1, 1, 1] and d.vector()[0] == 1
    assert d.key() == plan_key(decode, StepKind.DECODE, 4)
    far = StepFeatures(StepKind.DECODE, 4, d.kv_lens * 2, d.q_lens, HEADS)
    assert far.key() != d.key()
    with pytest.raises(ValueError, match="heads"):
        StepFeatures(StepKind.DECODE, 4, d.kv_lens, d.q_lens, (32, 8))


@pytest.mark.parametrize("n", [1, 2, SMALL_STATS, SMALL_STATS + 1, 300])
def test_length_stats_equal_a_float64_oracle_on_both_paths(n):
    rng = np.random.default_rng(seed(31876))
    kv = rng.integers(1, 512 * 1024, size=n).astype(np.int32)  # int32, as plans hold them: squares overflow
    q = np.minimum(rng.integers(1, 4096, size=n), kv).astype(np.int32)
    k64, q64 = kv.astype(np.float64), q.astype(np.float64)
    want_prefill = (n, k64.sum(), k64.max(), k64.min(), (k64 ** 2).sum(), q64.sum(), q64.max(), (q64 * k64).sum(),
                    (q64 ** 2).sum())
    assert length_stats(kv, q) == pytest.approx(want_prefill, rel=1e-12)
    want_decode = (n, k64.sum(), k64.max(), k64.min(), (k64 ** 2).sum(), n, 1.0, k64.sum(), n)
    assert length_stats(kv, None) == pytest.approx(want_decode, rel=1e-12)
    extent = (int(kv.astype(np.int64).sum()), int(kv.max()))
    assert length_stats(kv, None, extent) == pytest.approx(want_decode, rel=1e-12)


def test_a_plan_states_its_kv_extent():
    plan = _plan([3000, 17, 250_000, 9], [1, 1, 1, 1])
    assert plan.kv_extent == (253_026, 250_000)
    assert _plan([], []).kv_extent == (0, 0)


def test_load_tuner_falls_back_to_fixed_and_says_so_once(caplog):
    config = LlamaConfig.tiny()
    with caplog.at_level(logging.INFO, logger="jaxllm.tuner"):
        a = load_tuner(HOPPER, device_kind="Imaginary GPU 9000", config=config, kv_dtype="bfloat16")
        b = load_tuner(HOPPER, device_kind="Imaginary GPU 9000", config=config, kv_dtype="bfloat16")
    assert isinstance(a, FixedTuner) and isinstance(b, FixedTuner) and a.variants(StepKind.DECODE, 8) == (HOPPER,)
    said = [r.getMessage() for r in caplog.records if r.name == "jaxllm.tuner"]
    assert len(said) == 1 and "Imaginary GPU 9000" in said[0]
    assert a.reason == b.reason and "no imaginary-gpu-9000.npz in jaxllm/tuner/models" in a.reason, a.reason


def test_load_tuner_finds_the_shipped_model():
    config = LlamaConfig.llama2_7b()  # 32 / 32 heads of 128: measured in the shipped datasets
    assert tuner_pkg.model_path(H100).endswith("nvidia-h100-80gb-hbm3.npz")
    tuner = load_tuner(HOPPER, device_kind=H100, config=config, kv_dtype="bfloat16", block_size=256)
    assert isinstance(tuner, LearnedTuner) and tuner.variants(StepKind.DECODE, 8)[0] is HOPPER
    assert isinstance(load_tuner(HOPPER, device_kind=H100, config=config, kv_dtype="int8"), FixedTuner)


def _device_heads(config, tp):
    return config.num_heads // tp, config.num_kv_heads // tp, config.head_dim


@pytest.mark.parametrize("device", [H100, "NVIDIA H200"])
def test_load_tuner_keeps_the_defaults_at_heads_its_model_never_measured(device, caplog):
    """A shipped model is used only at the head shapes its datasets measured (its meta lists them): elsewhere the
    fixed defaults, said once, unless asked otherwise. Both models measured 32 / 32 and 32 / 8 heads of 128; the
    H200's also the tensor shards of 13B and 70B over 1, 2 and 4 devices. 13B over 8 devices (5 / 5) none."""
    measured = {tuple(h) for h in CostModel.load(tuner_pkg.model_path(device)).meta["heads"]}
    assert {(32, 8, 128), (32, 32, 128)} <= measured
    if device == "NVIDIA H200":
        assert {(10, 10, 128), (20, 20, 128), (40, 40, 128), (16, 2, 128), (32, 4, 128), (64, 8, 128)} <= measured
    cases = ((LlamaConfig.llama2_13b(), 4), (LlamaConfig.llama2_70b(), 4), (LlamaConfig.llama2_13b(), 1),
             (LlamaConfig.llama2_13b(), 8))
    fixed_heads = []
    for config, tp in cases:
        heads = _device_heads(config, tp)
        with caplog.at_level(logging.INFO, logger="jaxllm.tuner"):
            got = load_tuner(HOPPER, device_kind=device, config=config, kv_dtype="bfloat16", tensor_parallel=tp)
        if heads in measured:
            assert isinstance(got, LearnedTuner) and got.heads == heads, (config.name, tp)
            continue
        fixed_heads.append(heads)
        assert isinstance(got, FixedTuner), (config.name, tp)
        assert f"not this device's {heads}" in got.reason, got.reason
        anyway = load_tuner(HOPPER, device_kind=device, config=config, kv_dtype="bfloat16", tensor_parallel=tp,
                            trained_heads_only=False)
        assert isinstance(anyway, LearnedTuner) and anyway.heads[1] == config.num_kv_heads // tp
    assert (5, 5, 128) in fixed_heads  # the case above that no model measured: the check ran
    assert any(str(fixed_heads[0]) in r.getMessage() and device in r.getMessage() for r in caplog.records)
    # Llama-3-8B's heads (32 / 8) over one device were measured.
    eight_b = LlamaConfig.llama2_70b(hidden_size=4096, num_heads=32, num_layers=1, intermediate_size=256)
    assert isinstance(load_tuner(HOPPER, device_kind=device, config=eight_b, kv_dtype="bfloat16"), LearnedTuner)


def test_every_repeated_key_is_a_cache_hit_whatever_variant_it_chose():
    """Property: a step whose key was seen costs no prediction and counts as a hit, variant 0 (the base)
    included; a new key costs exactly one prediction."""
    rng = np.random.default_rng(8)
    chose_base = 0
    for model_seed in range(3):
        tuner = LearnedTuner(HOPPER, _model(model_seed), heads=HEADS, block_size=256, prune=False, max_variants=99)
        for _ in range(60):
            decode = bool(rng.random() < 0.5)
            n = int(rng.integers(1, 9))
            kv = rng.integers(1, 200_000, size=n)
            q = np.ones(n, np.int64) if decode else np.minimum(rng.integers(1, 512, size=n), kv)
            bucket = 8 if decode else 4096
            plan = _plan(kv, q)
            before = tuner.stats()
            index = tuner.choose(plan, StepKind.DECODE if decode else StepKind.PREFILL, bucket)
            seen = before["cache_keys"] == tuner.stats()["cache_keys"]
            assert tuner.stats()["predictions"] == before["predictions"] + (not seen)
            assert tuner.stats()["cache_hits"] == before["cache_hits"] + seen
            before = tuner.stats()
            assert tuner.choose(plan, StepKind.DECODE if decode else StepKind.PREFILL, bucket) == index
            assert tuner.stats() == {**before, "cache_hits": before["cache_hits"] + 1}, (index, before)
            chose_base += index == 0
    assert chose_base >= 10, chose_base


def test_shape_features_of_a_32_8_x_128_model_by_hand():
    """The 13 shape features pinned to numbers worked out by hand from their definitions (features.py), for
    32 query heads, 8 KV heads of 128 (bf16: 2 bytes)."""
    # Decode, bucket 4, two sequences of 3 and 12 keys: 15 keys, mean 7.5, variance 153/2 - 7.5^2 = 20.25,
    # cv 4.5 / 7.5 = 0.6; each query sees all its keys: 15 pairs.
    decode = StepFeatures(StepKind.DECODE, 4, np.array([3, 12]), np.array([1, 1]), (32, 8, 128)).vector()
    want = [1, 2, 1, np.log2(3), 1, 4, np.log2(13), np.log2(8.5), 0.6, 4, 2, 11, 2]
    np.testing.assert_allclose(decode, want, rtol=1e-6)
    # Prefill, bucket 16: 3 new tokens of a 3-token sequence (they see 1, 2, 3 keys) and 4 new tokens after 8
    # cached (they see 9..12): 6 + 42 = 48 pairs; 7 query tokens, the longest 4. int8 KV: 8 x 128 x 1 bytes.
    prefill = StepFeatures(StepKind.PREFILL, 16, np.array([3, 12]), np.array([3, 4]), (32, 8, 128), dtype_bytes=1).vector()
    want = [0, 4, 1, 3, np.log2(5), 4, np.log2(13), np.log2(8.5), 0.6, np.log2(49), 2, 10, 2]
    np.testing.assert_allclose(prefill, want, rtol=1e-6)


def test_shape_features_in_closed_form():
    """Property, over random draws: n equal decode sequences of L keys, and one prefill of Q new tokens after P
    cached, give the features their definitions say (pairs: n L for decode, Q P + Q (Q + 1) / 2 for a causal
    prefill; no spread)."""
    rng = np.random.default_rng(9)
    log2 = np.log2
    for _ in range(200):
        heads = (32, 8, 128)
        n, length, bucket = int(rng.integers(1, 65)), int(rng.integers(1, 1 << 19)), 1 << int(rng.integers(0, 10))
        f = StepFeatures(StepKind.DECODE, bucket, np.full(n, length), np.ones(n, np.int64), heads).vector()
        total = n * length
        want = [1, log2(bucket), log2(n), log2(1 + n), 1, log2(1 + total), log2(1 + length), log2(1 + length), 0,
                log2(1 + total), 2, 11, log2(1 + length)]
        np.testing.assert_allclose(f, want, rtol=1e-6, atol=1e-6)
        q, p = int(rng.integers(1, 4097)), int(rng.integers(0, 1 << 18))
        f = StepFeatures(StepKind.PREFILL, bucket, np.array([p + q]), np.array([q]), heads).vector()
        pairs = q * p + q * (q + 1) // 2
        want = [0, log2(bucket), 0, log2(1 + q), log2(1 + q), log2(1 + p + q), log2(1 + p + q), log2(1 + p + q), 0,
                log2(1 + pairs), 2, 11, log2(1 + p + q)]
        np.testing.assert_allclose(f, want, rtol=1e-6, atol=1e-6)
