"""A dispatched step: its plan, and its outputs still on the devices until asked for."""

from __future__ import annotations

import jax
import numpy as np

from jaxllm.contract import StepPlan
from jaxllm.executor.step import StepInputs

__all__ = ["InFlight", "host_array"]


def host_array(x: jax.Array) -> np.ndarray:
    """A device array on the host: all of it, or on a multi-process mesh this process's (replicated) copy."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))


class InFlight:
    """A dispatched step. Its outputs are stacked per instance, [I, S_pad, ...]; `rows` picks each plan row's
    flat index in [I * S_pad] (jaxllm.executor.inputs.StepBatch)."""

    def __init__(self, plan: StepPlan, device_tokens: jax.Array | None, inputs: StepInputs | None, rows: np.ndarray,
                 *, greedy: bool = False, device_logprobs: tuple[jax.Array, jax.Array, jax.Array] | None = None):
        self.plan = plan
        self.greedy = greedy  # ran the greedy-only step variant (every sequence at temperature 0)
        self.device_tokens = device_tokens  # [I, S_pad] int32; None for a step of rBlock copies alone
        self.inputs = inputs  # the step's inputs; its sampling arrays are on the devices
        self.rows = rows
        # The logprob variant's (token logprob, top ids, top logprobs), [I, S_pad(, K)]; None otherwise.
        self.device_logprobs = device_logprobs
        self._host: np.ndarray | None = None

    def _pick(self, x: jax.Array) -> np.ndarray:
        host = host_array(x)
        return host.reshape(-1, *host.shape[2:])[self.rows]

    def tokens(self) -> np.ndarray:
        """The sampled token of every sequence in the plan ([S] int32); waits for the device."""
        if self._host is None:
            self._host = np.zeros(0, np.int32) if self.device_tokens is None else self._pick(self.device_tokens)
        return self._host

    def logprobs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(token logprob [S] float32, top ids [S, K] int32, top logprobs [S, K] float32) of every sequence in
        the plan, None unless the step computed them; waits for the device."""
        if self.device_logprobs is None:
            return None
        return tuple(self._pick(a) for a in self.device_logprobs)
