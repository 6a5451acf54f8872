"""How one MoE layer is spread over expert-parallel ranks, and which backends move and compute its tokens."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass
class MoEParallelConfig:
    """Per-rank expert-parallel settings shared by every FusedMoE layer of a model.

    ``ep_groups`` holds one process group per ubatch slot (index = ``dbo_current_ubatch_id()``): the two
    ubatch threads issue collectives in different interleavings, so each needs its own group to keep
    collective order identical on every rank. Slot 0 is also used outside DBO.
    """

    ep_rank: int = 0
    ep_size: int = 1
    all2all_backend: str = "none"
    experts_backend: str = "torch"
    ep_groups: Sequence[Any] | None = None
    max_dispatch_tokens_per_rank: int = 256
    emulate_link: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.ep_size < 1 or not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"bad expert-parallel rank {self.ep_rank} for ep_size {self.ep_size}")
        if self.max_dispatch_tokens_per_rank < 1:
            raise ValueError(f"max_dispatch_tokens_per_rank must be >= 1, got {self.max_dispatch_tokens_per_rank}")

    def local_expert_range(self, num_experts: int) -> range:
        """Experts are assigned in contiguous blocks: rank r owns ``[r*E/R, (r+1)*E/R)``."""
        if num_experts % self.ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={self.ep_size}")
        per_rank = num_experts // self.ep_size
        return range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)
