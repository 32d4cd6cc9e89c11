"""FixedTuner, the runner's checks on a tuner's answers, the options and the compile-event counter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm import EngineOptions
from jaxllm.model.kv_cache import init_kv_cache
from jaxllm.contract import StepKind
from jaxllm.executor.executor import build_executor
from jaxllm.model.config import LlamaConfig
from jaxllm.model.llama import Llama
from jaxllm.tuner.compile_cache import ENV_VAR, CompileEvents, compile_events, resolve_cache_dir
from jaxllm.tuner.fixed import FixedTuner
from jaxllm.tuner.protocol import StepTuner
from pallas_kernels.dispatch import Kernels


def test_fixed_tuner_is_one_variant_everywhere():
    kernels = Kernels(decode_attention="triton", interpret=True)
    tuner = FixedTuner(kernels)
    assert isinstance(tuner, StepTuner)
    for kind, size in ((StepKind.DECODE, 1), (StepKind.DECODE, 256), (StepKind.PREFILL, 4096)):
        assert tuner.variants(kind, size) == (kernels,)
        assert tuner.choose(None, kind, size) == 0
    assert tuner.stats() == {"predictions": 0, "cache_hits": 0}
    with pytest.raises(ValueError, match="Kernels"):
        FixedTuner("triton")


class _Listing:
    def __init__(self, listed, index=0):
        self.listed, self.index = listed, index

    def variants(self, kind, padded_size):
        return self.listed

    def choose(self, plan, kind, padded_size):
        return self.index

    def stats(self):
        return {}


def _runner(tuner=None):
    config = LlamaConfig.tiny(num_layers=1)
    return build_executor(Llama(config, rngs=nnx.Rngs(0)), init_kv_cache(config, 4, 8, jnp.float32), max_seqs=2,
                  max_tokens_per_step=8, table_width=2, tuner=tuner)


def test_runner_defaults_to_its_kernels_and_checks_the_tuner():
    runner = _runner()
    D, P = StepKind.DECODE, StepKind.PREFILL
    assert isinstance(runner.tuner, FixedTuner) and runner.variants.kernels_for(D, 1) == runner.tuner.kernels
    plan = [(call.kind is D, size, call.greedy, call.logprobs, call.variant, call.borrowed)
            for call, size in runner.warm_up_plan()]
    assert plan == [(True, 1, False, False, 0, False), (True, 1, True, False, 0, False),
                    (True, 2, False, False, 0, False), (True, 2, True, False, 0, False),
                    (False, 8, False, False, 0, False)]
    with pytest.raises(ValueError, match="variant 1 of the decode bucket 1 does not exist"):
        runner.variants.kernels_for(D, 1, 1)
    with pytest.raises(ValueError, match="lists no variant"):
        _runner(_Listing(())).variants.kernels_for(P, 8)
    a, b = Kernels(), Kernels(mosaic_min_tokens=256)
    listed = _runner(_Listing((a, b, a, b)))
    assert listed.variants.kernels_for(D, 2, 3) == b
    # Decode bucket 2, sampled then greedy: the two distinct variants each, the repeats not again.
    assert [call.variant for call, size in listed.warm_up_plan() if call.kind is D and size == 2] == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="replaced before warm-up"):
        listed.tuner = FixedTuner(a)  # its buckets already listed _Listing's variants


def test_options_and_cache_directory(monkeypatch):
    for bad in (dict(tuner="learned"), dict(compile_cache_dir=""), dict(compile_cache_dir=3)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineOptions(**bad)
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_cache_dir(None) is None
    monkeypatch.setenv(ENV_VAR, "/tmp/from-env")
    assert resolve_cache_dir(None) == "/tmp/from-env" and resolve_cache_dir("/tmp/opt") == "/tmp/opt"


def test_compile_events_see_an_xla_compile():
    before = compile_events()
    jax.jit(lambda x: x * 3.25 + 0.5)(np.arange(7, dtype=np.float32)).block_until_ready()
    delta = compile_events() - before
    assert delta.backend_requests >= 1 and delta.xla_compiles + delta.cache_hits == delta.backend_requests
    assert CompileEvents(5, 2, 1).xla_compiles == 3
