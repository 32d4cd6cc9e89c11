"""The host tier end to end on the tiny model (issue 35): swapped sequences give the tokens they would have given
unpreempted; a full tier falls back to recompute and loses nothing; copies that land late are waited for; a
host prefix-cache hit gives the logits a fresh prefill gives; nothing compiles after warm-up with the tier on."""

import threading
import time
import types

import jax
import numpy as np
import pytest

from jaxllm import LLM, EngineOptions
from jaxllm.tuner.compile_cache import compile_events
from tests.devices import needs_host_devices

POOL = 24  # rBlocks of 4 tokens: four sequences of up to 62 tokens cannot all fit, so the youngest are preempted
PROMPTS = ["first prompt here", "second one", "third prompt, longer than the rest", "fourth"]
SAMPLED = dict(max_new_tokens=30, temperature=0.7, seed=7)


def _engine(host_kv_bytes: int | None, *, num_blocks: int | None = POOL, prefix_caching: bool = True,
            max_logprobs: int = 0) -> LLM:
    return LLM("tiny", max_context=128, options=EngineOptions(
        block_size=4, num_blocks=num_blocks, max_tokens_per_step=32, host_kv_bytes=host_kv_bytes,
        prefix_caching=prefix_caching, max_logprobs=max_logprobs), progress=False)


def _block_bytes(llm: LLM) -> int:
    return llm.executor.worker.host_store.block_bytes


@pytest.fixture(scope="module")
def roomy():
    return _engine(0, num_blocks=None, prefix_caching=False, max_logprobs=5)


@pytest.fixture(scope="module")
def expected(roomy):
    return [c.token_ids for c in roomy.generate(PROMPTS, **SAMPLED)]


def _host(llm: LLM):
    return llm.core.stats()


def _idle(llm: LLM) -> None:
    stats = llm.core.scheduler.stats()
    assert stats.pool_blocks_free == stats.pool_blocks and stats.waiting == stats.running == 0, stats
    assert stats.host.swapped_sequences == 0, stats.host


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_swapped_sequences_give_the_same_tokens_as_never_preempted(expected, prefix_caching):
    tight = _engine(1 << 20, prefix_caching=prefix_caching)
    got = [c.token_ids for c in tight.generate(PROMPTS, **SAMPLED)]
    host = tight.core.scheduler.stats().host
    assert host.swap_outs_total > 0 and host.swap_ins_total == host.swap_outs_total, host
    assert host.swap_fallbacks_total == 0 and host.blocks_in_total > 0, host
    assert got == expected
    _idle(tight)
    if prefix_caching:  # again: the prompts come back from the host cache, and a swap pins those rBlocks (no copy)
        assert [c.token_ids for c in tight.generate(PROMPTS, **SAMPLED)] == expected
        host = tight.core.scheduler.stats().host
        assert host.hit_blocks_total > 0 and host.swap_cached_blocks_total > 0, host
        _idle(tight)


def test_full_host_tier_falls_back_to_recompute(expected):
    from jaxllm.model.config import LlamaConfig
    from jaxllm.model.kv_cache import kv_bytes_per_block

    tiny = _engine(2 * kv_bytes_per_block(LlamaConfig.tiny(), 4, "float32"))  # two rBlocks: no preempted sequence fits
    got = [c.token_ids for c in tiny.generate(PROMPTS, **SAMPLED)]
    host = tiny.core.scheduler.stats().host
    assert host.blocks == 2 and host.swap_fallbacks_total > 0 and host.swap_outs_total == 0, host
    assert tiny.core.stats().scheduler.preemptions > 0
    assert got == expected
    _idle(tiny)


class _LateRun:
    """A host run whose contents arrive `delay` seconds after its copy started (zeros until then)."""

    def __init__(self, device_arrays, delay: float, log: list):
        self._buffer = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), device_arrays)
        self._landed = threading.Event()
        self._log = log
        source = jax.tree.map(np.asarray, device_arrays)  # read now: the pool may change after this call

        def land():
            time.sleep(delay)
            for dst, src in zip(jax.tree.leaves(self._buffer), jax.tree.leaves(source)):
                dst[...] = src
            self._landed.set()

        threading.Thread(target=land, daemon=True).start()

    def wait(self) -> None:
        self._log.append("waited" if not self._landed.is_set() else "landed")
        self._landed.wait()

    def arrays(self):
        return self._buffer


class _LateTransfer:
    """A HostTransfer whose copies to the host take `delay` seconds to land."""

    def __init__(self, real, delay: float):
        self.real, self.delay, self.log = real, delay, []

    def to_host(self, run, instance=0):
        return _LateRun(run, self.delay, self.log)

    def to_device(self, run):
        return jax.device_put(run.arrays(), self.real.device_shardings)


def test_copies_in_flight_are_never_read_before_they_land(expected):
    """Every copy to the host lands 0.3 s late, with zeros until then: a swap-in that read its run before it
    landed would restore zeros and change the tokens."""
    tight = _engine(1 << 20, prefix_caching=False)
    late = _LateTransfer(tight.executor.worker.host_store.transfer, delay=0.3)
    tight.executor.worker.host_store.transfer = late
    got = [c.token_ids for c in tight.generate(PROMPTS, **SAMPLED)]
    assert tight.core.scheduler.stats().host.swap_ins_total > 0
    assert got == expected
    assert "waited" in late.log, late.log  # some swap-in came before its copy out had landed
    _idle(tight)


def test_host_cache_hit_gives_the_logits_of_a_fresh_prefill(roomy):
    """A prompt whose prefix the device cache evicted (spilled to the host) copies it back instead of prefilling
    it; its tokens and their log-probabilities are those of a fresh prefill."""
    rng = np.random.default_rng(35)
    prefix = rng.integers(3, 259, size=48).tolist()  # 12 full rBlocks: half the pool
    others = [rng.integers(3, 259, size=60).tolist() for _ in range(3)]  # each fills most of the pool
    tight = _engine(1 << 20, max_logprobs=5)
    first = tight.generate(prefix + [7, 8], max_new_tokens=2, logprobs=5)[0]
    for other in others:  # the device cache must evict the prefix to hold these
        tight.generate(other, max_new_tokens=2)
    host = tight.core.scheduler.stats().host
    assert host.spilled_blocks_total >= 12, host
    prompt = prefix + [9, 10, 11]
    got = tight.generate(prompt, max_new_tokens=6, logprobs=5)[0]
    hits = tight.core.scheduler.stats().host.hit_blocks_total
    assert hits == 12, tight.core.scheduler.stats().host
    want = roomy.generate(prompt, max_new_tokens=6, logprobs=5)[0]
    assert got.token_ids == want.token_ids
    np.testing.assert_allclose([lp for lp, _ in got.logprobs], [lp for lp, _ in want.logprobs], atol=1e-4)
    for (_, top_got), (_, top_want) in zip(got.logprobs, want.logprobs):
        np.testing.assert_allclose([v for _, v in top_got], [v for _, v in top_want], atol=1e-4)
    assert first.token_ids == roomy.generate(prefix + [7, 8], max_new_tokens=2)[0].token_ids
    _idle(tight)


def test_nothing_compiles_after_warm_up_with_the_tier_on():
    llm = LLM("tiny", max_context=128, options=EngineOptions(block_size=4, num_blocks=POOL, max_seqs=8,
                                                              max_tokens_per_step=32, host_kv_bytes=1 << 20),
              progress=False)
    llm.warm_up(progress=False)
    warm = llm.compile_count
    assert warm == len(llm.executor.bucket_shapes()) + 2 * len(llm.executor.worker.host_store.run_lengths())
    before = compile_events()
    rng = np.random.default_rng(20261127)
    for _ in range(6):  # preemption-heavy batches of random lengths, greedy and sampled
        prompts = [rng.integers(3, 259, size=n).tolist() for n in rng.integers(1, 60, size=6)]
        temperature = float(rng.uniform(0, 1)) if rng.random() < 0.5 else 0.0
        llm.generate(prompts, max_new_tokens=int(rng.integers(4, 30)), temperature=temperature,
                     seed=int(rng.integers(0, 1000)))
    host = llm.core.scheduler.stats().host
    assert host.swap_outs_total > 0 and host.blocks_in_total > 0 and host.spilled_blocks_total > 0, host
    assert llm.compile_count == warm
    assert (compile_events() - before).xla_compiles == 0


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_bad_host_kv_bytes_is_refused_naming_it(value):
    with pytest.raises(ValueError, match=f"host_kv_bytes must be an integer >= 0 .*got {value!r}"):
        EngineOptions(host_kv_bytes=value)


def test_host_tier_smaller_than_one_rblock_is_refused():
    with pytest.raises(ValueError, match=r"host_kv_bytes 100 is less than one rBlock \(\d+ bytes\)"):
        LLM("tiny", max_context=64, options=EngineOptions(block_size=4, host_kv_bytes=100), progress=False)


def test_host_tier_past_the_backends_pinned_memory_is_refused_naming_the_cap(monkeypatch):
    """On a GPU XLA pins host memory up to a cap (64 GiB unless XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB says otherwise):
    a tier past it would fail mid-serving; it is refused at start, naming the cap and how to raise it."""
    from pallas_kernels import compat

    monkeypatch.setattr(compat, "pinned_host_limit_bytes", lambda device: 1 << 30)
    with pytest.raises(ValueError, match=r"host_kv_bytes 1048576 x 2 instance\(s\) \+ 1024 MiB of copies in flight "
                                         r"exceeds the backend's pinned host memory, 1 GiB: .*"
                                         r"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=<GiB>"):
        LLM("tiny", max_context=64, options=EngineOptions(block_size=4, instances=2, host_kv_bytes=1 << 20),
            progress=False)


def test_the_pinned_host_cap_follows_xlas_variable(monkeypatch):
    from pallas_kernels import compat

    class _Gpu:
        platform = "gpu"

        def addressable_memories(self):
            return [type("M", (), {"kind": k})() for k in ("device", "pinned_host", "unpinned_host")]

    monkeypatch.delenv(compat.PINNED_HOST_LIMIT_VAR, raising=False)
    assert compat.pinned_host_limit_bytes(_Gpu()) == 64 << 30
    monkeypatch.setenv(compat.PINNED_HOST_LIMIT_VAR, "200")
    assert compat.pinned_host_limit_bytes(_Gpu()) == 200 << 30
    import jax

    assert compat.pinned_host_limit_bytes(jax.devices("cpu")[0]) is None


@pytest.mark.parametrize("entry", ["generate", "serve"])
def test_negative_host_kv_gib_flag_is_refused_naming_it(entry, capsys):
    import importlib

    main = importlib.import_module(f"jaxllm.{entry}").main
    args = ["--host-kv-gib", "-1"] + (["hi"] if entry == "generate" else [])
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--host-kv-gib must be a finite number >= 0 (0 turns the host tier off), got -1.0" in err, err


def test_engine_stats_report_the_tiers():
    tight = _engine(1 << 20, prefix_caching=False)
    tight.generate(PROMPTS, **SAMPLED)
    stats = tight.stats()
    host = stats.scheduler.host
    assert host.blocks == tight.host_blocks > 0 and stats.executor.kv_block_bytes == _block_bytes(tight)
    assert host.swap_outs_total == host.swap_ins_total > 0 and host.blocks_in_total > 0
    assert host.blocks_out_total >= host.blocks_in_total
    assert host.blocks_used == 0 and stats.executor.host_store.bytes_used == 0  # every swapped run came back
    from serve.metrics import Registry, parse, register_engine_metrics

    registry = Registry()
    engine = types.SimpleNamespace(stats=tight.core.stats, info=tight.info)  # what the metrics read of an Engine
    register_engine_metrics(registry, lambda: engine)
    metrics = parse(registry.render())
    assert metrics['jaxllm_kv_tier_blocks{tier="host"}'] == host.blocks
    assert metrics['jaxllm_kv_swap_outs_total'] == host.swap_outs_total
    assert metrics['jaxllm_kv_host_copied_blocks_total{direction="in"}'] == host.blocks_in_total


@needs_host_devices
@pytest.mark.slow
def test_instances_swap_to_their_own_host_tiers(roomy):
    """Two lending instances on CPU host devices, each with its own host tier, pools too small for their sequences
    (swaps, loans and recalls): the tokens of a pool big enough, every swap back in. (Lending off is the simpler
    case; test_host_tier_ledger's mirror of three instances covers both.)"""
    lending = True
    from jaxllm.contract import SamplingParams
    from jaxllm.engine.core import Request

    rng = np.random.default_rng(3535)
    requests = [Request(rng.integers(3, 259, size=int(n)).tolist(), SamplingParams(max_new_tokens=24, temperature=0.7,
                                                                                    seed=int(seed)))
                for n, seed in zip(rng.integers(10, 40, size=6), rng.integers(0, 1000, size=6))]
    llm = LLM("tiny", max_context=128, options=EngineOptions(
        block_size=4, num_blocks=16, max_tokens_per_step=32, max_seqs=4, instances=2, lending=lending,
        host_kv_bytes=1 << 20), progress=False)
    outputs = llm.run(requests)
    got = [[t for out in outputs[i] for t in out.token_ids] for i in sorted(outputs)]
    want = roomy.run(requests)
    assert got == [[t for out in want[i] for t in out.token_ids] for i in sorted(want)]
    queue = llm.stats().scheduler
    assert queue.host.swap_outs_total > 0 and queue.host.swap_ins_total == queue.host.swap_outs_total, queue
    assert queue.host.blocks == 2 * llm.host_blocks and queue.host.blocks_used == queue.host.cached_blocks
    assert not lending or queue.lending.loans_total > 0, queue
