"""The compile, bucket and tuner counters reach Prometheus through register_engine_metrics (both servers)."""

from jaxllm.contract import EngineStats, ExecutorStats
from jaxllm.engine.core import EngineInfo
from serve.metrics import Registry, parse, register_engine_metrics


class _Engine:
    def __init__(self, stats: EngineStats):
        self._stats = stats

    def stats(self) -> EngineStats:
        return self._stats

    def info(self) -> EngineInfo:
        return EngineInfo(model="tiny", architecture="tiny", dtype="float32", kv_dtype="float32", context_limit=64,
                          vocab_size=259, num_layers=1, hidden_size=8, num_heads=1, num_kv_heads=1, block_size=8,
                          num_blocks=8, max_seqs=2, max_tokens_per_step=8)


def test_compile_bucket_and_tuner_series():
    stats = EngineStats(executor=ExecutorStats(compile_count=12, xla_compiles=3, persistent_cache_hits=9,
                                               padding_tokens_total=41,
                                               bucket_steps=(("decode", 1, 7), ("decode", 4, 2), ("prefill", 64, 5)),
                                               tuner=(("cache_hits", 6), ("predictions", 8))))
    engine = None
    registry = Registry()
    register_engine_metrics(registry, lambda: engine)
    before = parse(registry.render())  # not loaded yet: every reading 0, no labelled samples
    assert before["jaxllm_xla_compiles_total"] == 0 and before["jaxllm_padding_tokens_total"] == 0
    assert not any(name.startswith(("jaxllm_bucket_steps_total{", "jaxllm_tuner_events_total{")) for name in before)
    engine = _Engine(stats)
    after = parse(registry.render())
    assert after["jaxllm_compiles_total"] == 12 and after["jaxllm_xla_compiles_total"] == 3
    assert after["jaxllm_persistent_cache_hits_total"] == 9 and after["jaxllm_padding_tokens_total"] == 41
    assert after['jaxllm_bucket_steps_total{kind="decode",size="1"}'] == 7
    assert after['jaxllm_bucket_steps_total{kind="decode",size="4"}'] == 2
    assert after['jaxllm_bucket_steps_total{kind="prefill",size="64"}'] == 5
    assert after['jaxllm_tuner_events_total{stat="predictions"}'] == 8
    assert after['jaxllm_tuner_events_total{stat="cache_hits"}'] == 6
    assert "# TYPE jaxllm_bucket_steps_total counter" in registry.render()
