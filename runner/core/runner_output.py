"""What the model runner hands back for one step (vLLM's ``vllm/v1/outputs.py``): a sampled token per chunk that
reached the end of its known tokens, and, for requests that asked for them, log-probabilities (OpenAI's
``logprobs``); and the launched step whose output the host has not read yet (:class:`PendingStep`, vLLM's
``AsyncModelRunnerOutput``)."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from runner.core.logprob_rows import LogprobRows, StepLogprobs


@dataclass
class PromptLogprobs:
    """One prefill chunk's prompt log-probabilities: row ``j`` of ``rows`` is prompt token ``start + j``
    (``start`` >= 1: the first prompt token has none) given the tokens before it, with the ``top_n`` most likely
    there."""

    start: int
    rows: LogprobRows


@dataclass
class ModelRunnerOutput:
    """``sampled_token_ids[i]`` belongs to ``SchedulerOutput.chunks[i]`` (None: that chunk sampled nothing).
    ``logprobs``, when not None, has the rows of the chunks whose requests asked (``positions``: chunk indices)."""

    sampled_token_ids: list[int | None]
    logprobs: StepLogprobs | None = None
    prompt_logprobs: list[PromptLogprobs | None] | None = None  # per chunk, where its request asked for them


ReadResult = Callable[[float | None], ModelRunnerOutput]


class PendingStep:
    """A launched step: ``result(timeout_s)`` reads its output once (later calls return it again); ``read_at`` is
    the ``time.perf_counter()`` at which the read returned (None before). A runner that queues its steps on a
    device returns one whose read waits for the device; a runner that computes a step at launch returns a
    :meth:`ready` one, its output (and its host read) already done on the forward side (``read_at_launch``)."""

    def __init__(self, read: ReadResult) -> None:
        self._read: ReadResult | None = read
        self._output: ModelRunnerOutput | None = None
        self.read_at: float | None = None
        self.read_at_launch = False

    @classmethod
    def ready(cls, output: ModelRunnerOutput) -> PendingStep:
        """A step whose output is already on the host (a runner that computes it at launch)."""
        pending = cls(lambda _timeout: output)
        pending.read_at_launch = True
        return pending

    def result(self, timeout_s: float | None = None) -> ModelRunnerOutput:
        if self._read is not None:
            read, self._read = self._read, None
            self._output = read(timeout_s)
            self.read_at = time.perf_counter()
        assert self._output is not None
        return self._output
