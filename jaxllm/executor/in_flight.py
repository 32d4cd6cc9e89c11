"""A dispatched step: its plan, and its outputs, still on the devices (or still being launched) until asked for."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import TYPE_CHECKING, Callable

import jax
import numpy as np

from jaxllm.contract import StepPlan
from jaxllm.executor.step import StepInputs

if TYPE_CHECKING:
    from jaxllm.executor.inputs import StepBatch

__all__ = ["InFlight", "Launched", "host_array", "numbered_outputs"]


def host_array(x: jax.Array, k: int = 0) -> np.ndarray:
    """A device array this process holds all of, on the host (`k`, the output's number, is for a multi-process
    run's reader, which takes the rest from the results channel: Worker.reader)."""
    return np.asarray(x)


@dataclasses.dataclass(frozen=True)
class Launched:
    """What a launched step left on the devices: its sampled tokens [I, S_pad] (None for a step of rBlock
    copies alone), the logprob variant's (token logprob, top ids, top logprobs) [I, S_pad(, K)] or None, and its
    inputs as placed (a continuation reuses their sampling arrays). read(x, k): output number k (OUTPUTS) on the
    host, whole (on a multi-process run, the rows of other processes' instances from the results channel)."""

    tokens: jax.Array | None
    logprobs: tuple[jax.Array, jax.Array, jax.Array] | None
    inputs: StepInputs | None
    prompt_logprobs: tuple[jax.Array, jax.Array, jax.Array] | None = None  # the same per token, [I, T_pad(, K)]
    read: Callable[[jax.Array, int], np.ndarray] = host_array


# A step's outputs by number, as the worker of every process lists them (the results channel names them so):
# tokens, then the logprob variant's three sampled arrays, then its three per-token arrays.
TOKENS, LOGPROBS, PROMPT_LOGPROBS = 0, 1, 4


def numbered_outputs(launched: Launched) -> list:
    """The launched step's device outputs in their numbers' order (None where absent)."""
    return [launched.tokens, *(launched.logprobs or (None,) * 3), *(launched.prompt_logprobs or (None,) * 3)]


class InFlight:
    """A dispatched step. Its outputs are stacked per instance, [I, S_pad, ...]; `rows` picks each plan row's
    flat index in [I * S_pad] (jaxllm.executor.inputs.StepBatch). `launched`: the step's Launched, or the Future
    of it while the launcher thread is still launching it (jaxllm.executor.launcher). batch: the StepBatch it was
    launched with (host arrays), which its continuation advances (InputLayout.advance) instead of laying out anew."""

    def __init__(self, plan: StepPlan, launched: Launched | concurrent.futures.Future, rows: np.ndarray, *,
                 greedy: bool = False, token_rows: np.ndarray | None = None, batch: StepBatch | None = None):
        self.plan = plan
        self.batch = batch
        self.greedy = greedy  # ran the greedy-only step variant (every sequence at temperature 0)
        self.rows = rows
        self.token_rows = token_rows  # per plan token, its flat index in [I * T_pad] (where prompts are scored)
        self._launched = launched
        self._host: np.ndarray | None = None

    def launched(self) -> Launched:
        """The step's device outputs and inputs; waits for its launch (raises what the launch raised)."""
        if isinstance(self._launched, concurrent.futures.Future):
            self._launched = self._launched.result()
        return self._launched

    def _pick(self, x: jax.Array, k: int, rows: np.ndarray | None = None) -> np.ndarray:
        host = self.launched().read(x, k)
        return host.reshape(-1, *host.shape[2:])[self.rows if rows is None else rows]

    def tokens(self) -> np.ndarray:
        """The sampled token of every sequence in the plan ([S] int32); waits for the devices."""
        if self._host is None:
            tokens = self.launched().tokens
            self._host = np.zeros(0, np.int32) if tokens is None else self._pick(tokens, TOKENS)
        return self._host

    def logprobs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(token logprob [S] float32, top ids [S, K] int32, top logprobs [S, K] float32) of every sequence in
        the plan, None unless the step computed them; waits for the devices."""
        logprobs = self.launched().logprobs
        return None if logprobs is None else tuple(self._pick(a, LOGPROBS + i) for i, a in enumerate(logprobs))

    def prompt_logprobs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The same per token of the plan [T]: the log-probability of the prompt token each one precedes
        (StepPlan.targets), None unless the step computed them; waits for the devices."""
        logprobs = self.launched().prompt_logprobs
        if logprobs is None or self.token_rows is None:
            return None
        return tuple(self._pick(a, PROMPT_LOGPROBS + i, self.token_rows) for i, a in enumerate(logprobs))
