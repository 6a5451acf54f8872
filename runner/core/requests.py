"""What goes into one DP rank's engine core and what comes out of it, per request (vLLM's ``EngineCoreRequest``
and ``EngineCoreOutput``).

Requests arrive as token ids: tokenization, detokenization, stop strings and ``n > 1`` fan-out belong to the
engine client (``runner/engine/``), never to a rank's step loop. The same types serve the offline ``LLM``
(in-process) and the server (over ZeroMQ), so both run the same engine core.
"""
from __future__ import annotations

from dataclasses import dataclass

import msgspec

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


class EngineCoreOutput(msgspec.Struct, array_like=True, gc=False):
    """What one step added to a request: its new tokens (at most one per step today), their log-probabilities
    when asked for, and, when it finished, why. ``finish_reason`` is vLLM's: "stop" (EOS or a stop token,
    named by ``stop_reason``), "length", "abort", or "error" (``error`` says what was wrong).

    One type in process and on the rank -> client link: a msgspec struct encoded as a msgpack array of its values
    without the fields' names (a map with every name is about ten times the bytes, and slower to decode;
    docs/benchmarks.md has the figures). No reference cycle can pass through one, so the garbage collector does
    not track them (``gc=False``)."""

    request_id: int
    new_token_ids: list[int] = []
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    # vLLM's prompt_logprobs, as the prefill computes them: entries for prompt tokens prompt_logprobs_start ..
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs_start: int = 0
    # vLLM's num_cached_tokens: prompt tokens whose KV came from the prefix cache when the request was first
    # scheduled (0 with caching off), on the first output made after that; None on the others, and for a request
    # that never ran (refused when added)
    num_cached_tokens: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def default_seed(seed: int, index: int) -> int:
    """The seed of the ``index``-th engine request an engine client makes under ``cfg.seed`` = ``seed``: an
    unseeded random request's tokens then depend only on its prompt and this number, never on its rank or batch."""
    return seed * 1_000_003 + index
