"""What the scheduler hands the model runner for one step: the chunk of tokens each request computes.

These types are the model runner's input contract; the scheduler (``runner/core/scheduler.py``) produces
them. They live on the worker side so that the model runner depends on nothing above it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from runner.sampling_params import SamplingParams


@dataclass
class ScheduledChunk:
    """The tokens one request computes in this step, at positions ``num_computed_tokens ..``."""

    req_id: int
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]  # every block the request holds (a copy): enough for num_computed + len(token_ids)
    sample: bool  # this chunk reaches the end of the known tokens -> sample one token
    sampling: SamplingParams
    seed: int = 0  # the request's sampling seed: params.seed, else the engine's per-request default
    slot: int = -1  # the request's slot for its life: its future-map entry and its penalty counts
    prompt_len: int | None = None  # None: every token up to this chunk's end is prompt (no outputs yet)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return self.num_computed_tokens + len(self.token_ids) if self.prompt_len is None else self.prompt_len

    @property
    def output_index(self) -> int:
        """How many outputs the request has before the token this chunk samples (0: its first)."""
        return self.num_computed_tokens + len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == 1 and self.num_computed_tokens > 0


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    finished_req_ids: list[int] = field(default_factory=list)  # finished since the previous schedule()
    step_id: int = -1  # schedule() numbers its outputs: update() must see them in this order

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def num_scheduled_tokens(self) -> list[int]:
        return [len(c.token_ids) for c in self.chunks]

    @property
    def is_uniform_decode(self) -> bool:
        """Every chunk is one token on top of cached context (the decode-threshold case); False when empty."""
        return bool(self.chunks) and all(c.is_decode for c in self.chunks)

    @property
    def has_prefill(self) -> bool:
        return any(not c.is_decode for c in self.chunks)

    def __len__(self) -> int:
        return len(self.chunks)
