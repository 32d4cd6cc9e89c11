"""The step tuner (issue 22): per bucket a few compiled Kernels variants, per step the one a learned cost model
predicts fastest (LearnedTuner), or today's fixed defaults (FixedTuner) where no model exists for the device or
the model never measured the device's head shape.

`load_tuner` is what the engine calls; models ship in jaxllm/tuner/models/<device-slug>.npz
(scripts/train_tuner.py writes them from benchmarks/tuning/ datasets).
"""

from __future__ import annotations

import logging
import os

from jaxllm.tuner.features import StepFeatures, device_slug
from jaxllm.tuner.fixed import FixedTuner
from jaxllm.tuner.learned import LearnedTuner

__all__ = ["FixedTuner", "LearnedTuner", "StepFeatures", "load_tuner", "model_path"]

MODELS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models")
_log = logging.getLogger("jaxllm.tuner")
_said: set[tuple[str, str]] = set()  # (device, reason) already logged: each is said once per process


def model_path(device_kind: str, models_dir: str | None = None) -> str:
    """Where the trained model for a device kind lives (it may not exist)."""
    return os.path.join(models_dir or MODELS_DIR, device_slug(device_kind) + ".npz")


def _fixed(base, device_kind: str, reason: str) -> FixedTuner:
    if (device_kind, reason) not in _said:
        _said.add((device_kind, reason))
        _log.info("tuner: fixed kernel schedules on %r: %s", device_kind, reason)
    return FixedTuner(base, reason=reason)


def load_tuner(base, *, device_kind: str, config, kv_dtype, block_size: int | None = None,
               tensor_parallel: int = 1, max_context: int | None = None, models_dir: str | None = None,
               trained_heads_only: bool = True):
    """The StepTuner for this device: LearnedTuner over base where a trained model exists for device_kind,
    the pool is a float dtype and (trained_heads_only) the model's datasets measured this device's head shape,
    else FixedTuner(base) (said once in the log, naming the device and why).

    config: the LlamaConfig (its heads and head_dim; divided by tensor_parallel per device). kv_dtype: the
    pool's dtype (int8 pools keep their own decode schedule: fixed). block_size: the rBlock size.
    trained_heads_only: a model extrapolating to a head shape it never measured can pick a slower schedule
    than the default (13B's tensor shard of 10 KV heads on an H200: 16.4 us against the default's 14.9 at 4K,
    benchmarks/NOTES.md); False uses it anyway. A model whose meta names no heads (older) is used anywhere.
    """
    import jax.numpy as jnp

    from jaxllm.tuner.cost_model import CostModel

    path = model_path(device_kind, models_dir)
    if not os.path.exists(path):
        where = models_dir or "jaxllm/tuner/models"
        return _fixed(base, device_kind, f"no trained cost model for this device (no {os.path.basename(path)} in "
                                         f"{where})")
    dtype = jnp.dtype(kv_dtype)
    if dtype == jnp.int8:
        return _fixed(base, device_kind, "int8 KV pools keep their measured int8 decode schedule")
    if tensor_parallel < 1 or config.num_kv_heads % tensor_parallel:
        raise ValueError(f"tensor_parallel {tensor_parallel} must divide num_kv_heads {config.num_kv_heads}")
    heads = (config.num_heads // tensor_parallel, config.num_kv_heads // tensor_parallel, config.head_dim)
    model = CostModel.load(path)
    trained = [tuple(h) for h in model.meta.get("heads", ())]
    if trained_heads_only and trained and heads not in trained:
        return _fixed(base, device_kind, f"its cost model measured heads (q, kv, head_dim) {trained}, not this "
                                         f"device's {heads}: collect data at them (scripts/collect_tuning_data.py) "
                                         f"and retrain")
    return LearnedTuner(base, model, heads=heads, dtype_bytes=dtype.itemsize, block_size=block_size,
                        max_context=max_context or config.max_context)
