"""The contracts below the engine, the executor and the tuner: a step's plan and a request's sampling
parameters, as plain values (NumPy, no jax), so each of those packages can speak of a step without
importing another."""

from jaxllm.contract.sampling_params import SEED_LIMIT, SamplingParams
from jaxllm.contract.step_plan import PENDING_TOKEN, StepPlan, kv_extent_of

__all__ = ["PENDING_TOKEN", "SEED_LIMIT", "SamplingParams", "StepPlan", "kv_extent_of"]
