"""The contracts below the engine, the executor and the tuner: a step's plan and a request's sampling
parameters, the step's kind, as plain values (NumPy, no jax), so each of those packages can speak of a step without
importing another; and the stats tree every part reports its counters in (`stats`: EngineStats and its parts)."""

from jaxllm.contract.host_copies import HostCopies
from jaxllm.contract.sampling_params import BIAS_LIMIT, PENALTY_LIMIT, SEED_LIMIT, SamplingParams
from jaxllm.contract.stats import (CoreStats, EngineStats, ExecutorStats, HostStoreStats, HostTierStats,
                                   LendingStats, SchedulerStats, SpeculativeStats)
from jaxllm.contract.step_kind import StepKind
from jaxllm.contract.step_plan import PENDING_TOKEN, LogitBias, RowPenalties, StepPlan, kv_extent_of

__all__ = ["BIAS_LIMIT", "CoreStats", "EngineStats", "ExecutorStats", "HostCopies", "HostStoreStats",
           "HostTierStats", "LendingStats", "PENALTY_LIMIT", "PENDING_TOKEN", "SEED_LIMIT", "LogitBias", "RowPenalties",
           "SamplingParams", "SchedulerStats", "SpeculativeStats", "StepKind", "StepPlan", "kv_extent_of"]
