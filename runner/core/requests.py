"""What goes into one DP rank's engine core and what comes out of it, per request (vLLM's ``EngineCoreRequest``
and ``EngineCoreOutput``).

Requests arrive as token ids: tokenization, detokenization, stop strings and ``n > 1`` fan-out belong to the
engine client (``runner/engine/``), never to a rank's step loop. The same types serve the offline ``LLM``
(in-process) and the server (over ZeroMQ), so both run the same engine core.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from runner.core.runner_output import TokenLogprobs
from runner.sampling_params import SamplingParams


@dataclass
class EngineCoreRequest:
    """One sequence to generate. ``request_id`` is unique among the core's live requests (the client maps its
    own ids onto these). ``default_seed`` seeds a random request whose ``sampling_params.seed`` is None, so
    an unseeded request's tokens still depend only on the request, never on its batch or rank."""

    request_id: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    default_seed: int = 0
    arrival_time: float = 0.0


@dataclass
class EngineCoreOutput:
    """What one step added to a request: its new tokens (at most one per step today), their log-probabilities
    when asked for, and, when it finished, why. ``finish_reason`` is vLLM's: "stop" (EOS or a stop token,
    named by ``stop_reason``), "length", "abort", or "error" (``error`` says what was wrong)."""

    request_id: int
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    # vLLM's prompt_logprobs, as the prefill computes them: entries for prompt tokens prompt_logprobs_start ..
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs_start: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class CoreOutput(Protocol):
    """What a client reads of an engine-core output: an :class:`EngineCoreOutput` made in this process, or the
    same fields as a rank sent them over ZeroMQ (``runner.core.messages.WireOutput``), read as they arrive."""

    @property
    def request_id(self) -> int: ...

    @property
    def new_token_ids(self) -> list[int]: ...

    @property
    def new_logprobs(self) -> list[TokenLogprobs] | None: ...

    @property
    def finish_reason(self) -> str | None: ...

    @property
    def stop_reason(self) -> int | None: ...

    @property
    def error(self) -> str | None: ...

    @property
    def new_prompt_logprobs(self) -> list[TokenLogprobs] | None: ...

    @property
    def prompt_logprobs_start(self) -> int: ...

    @property
    def finished(self) -> bool: ...
