"""What a request gives back, in vLLM's shape (``vllm/outputs.py``): a :class:`RequestOutput` holding one
:class:`CompletionOutput` per sample (``n`` of them), so code written for vLLM reads
``outs[0].outputs[0].text`` here too.

Shared by the front ends (offline ``LLM``, the OpenAI server) and the engine client that builds them.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """One token's log-probability, its rank among all tokens (1 = the most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token: the sampled token and the top ``logprobs`` alternatives, by token id (vLLM's type).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]  # vLLM's: None for the first prompt token, then one dict each


@dataclass
class CompletionOutput:
    """One sample of a request. ``finish_reason``: "stop" (EOS, a stop token or a stop string, named by
    ``stop_reason``; None for EOS), "length", "abort", or "error" (the request could not run)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Host-clock times (``time.time()``) of a request's life, for latency metrics."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """All samples of one request. ``error`` says why a request that could not run failed (its outputs then
    have ``finish_reason`` "error"); vLLM raises instead, here one bad prompt must not fail its batch."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # with SamplingParams(prompt_logprobs=N), once the prompt ran
    # vLLM's: prompt tokens whose KV came from the prefix cache when the request was first scheduled (0 with
    # caching off; with n > 1, the sample reporting this output's); None until the engine scheduled it
    num_cached_tokens: int | None = None
