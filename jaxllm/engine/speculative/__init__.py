"""Speculative decoding's host side: the Proposer contract (draft tokens for running sequences), the proposers
(prompt lookup: `NgramProposer`; a draft model's engine: `DraftModelProposer`; a benchmark's replay of known
tokens: `ReplayProposer`), and the `Speculation`
settings and counters each scheduler keeps. The verify step and the acceptance run on the device
(jaxllm.executor.step.verify_step, jaxllm.executor.acceptance)."""

from jaxllm.engine.speculative.draft_model import DraftCore, DraftModelProposer
from jaxllm.engine.speculative.ngram import NgramProposer, ngram_draft
from jaxllm.engine.speculative.proposer import Proposer, Speculation
from jaxllm.engine.speculative.replay import ReplayProposer

__all__ = ["DraftCore", "DraftModelProposer", "NgramProposer", "Proposer", "ReplayProposer", "Speculation", "ngram_draft"]
