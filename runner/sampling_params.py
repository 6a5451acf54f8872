"""Per-request generation settings, under vLLM's names (``vllm/sampling_params.py``).

Shared by every layer: the front ends build them, the scheduler reads the stop conditions, the sampler the
sampling settings.
"""
from __future__ import annotations

from dataclasses import dataclass


# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): dividing by ~0 only produces inf/NaN.
SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    """Per-request generation settings (vLLM names). ``seed`` makes a random request reproducible."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not self.temperature >= 0.0 or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.stop_token_ids is not None:
            ids = list(self.stop_token_ids)
            bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or t < 0]
            if bad:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {bad[0]!r}")
            self.stop_token_ids = ids
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS
