"""What the model runner hands back for one step: a sampled token per chunk that reached the end of its known
tokens, and, for requests that asked for them, log-probabilities (OpenAI's ``logprobs``)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenLogprobs:
    """One sampled token: its log-probability and rank (1 = the most likely token), and the ``top_n`` most
    likely tokens with theirs, most likely first."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class PromptLogprobs:
    """One prefill chunk's prompt log-probabilities: ``entries[j]`` is prompt token ``start + j`` (``start`` >= 1:
    the first prompt token has none) given the tokens before it, with the ``top_n`` most likely there."""

    start: int
    entries: list[TokenLogprobs]


@dataclass
class ModelRunnerOutput:
    """``sampled_token_ids[i]`` belongs to ``SchedulerOutput.chunks[i]`` (None: that chunk sampled nothing).
    ``logprobs``, when not None, is aligned the same way (None where a chunk asked for none)."""

    sampled_token_ids: list[int | None]
    logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs: list[PromptLogprobs | None] | None = None  # per chunk, where its request asked for them
