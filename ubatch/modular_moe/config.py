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


def _link_and_backend_cache(parallel: MoEParallelConfig) -> dict[str, Any]:
    return parallel.extra.setdefault("_cache", {})


def get_emulated_link(parallel: MoEParallelConfig, device: Any = None) -> Any:
    """One link model per rank, shared by every layer and ubatch (they contend for the same wire)."""
    if parallel.emulate_link is None:
        return None
    from ubatch.modular_moe.prepare_finalize.emulated_link import EmulatedLink, parse_link

    cache = _link_and_backend_cache(parallel)
    if "link" not in cache:
        cache["link"] = EmulatedLink(parse_link(parallel.emulate_link), device)
    return cache["link"]


def get_prepare_finalize(parallel: MoEParallelConfig, num_experts: int, hidden_size: int, device: Any = None) -> Any:
    """One backend instance per (rank, layer shape): DeepEP buffers are expensive and meant to be shared."""
    from ubatch.modular_moe.prepare_finalize import make_prepare_finalize

    cache = _link_and_backend_cache(parallel)
    key = ("pf", num_experts, hidden_size)
    if key not in cache:
        cache[key] = make_prepare_finalize(
            parallel.all2all_backend, num_experts=num_experts, hidden_size=hidden_size, ep_rank=parallel.ep_rank,
            ep_size=parallel.ep_size, groups=parallel.ep_groups,
            max_dispatch_tokens_per_rank=parallel.max_dispatch_tokens_per_rank,
            link=get_emulated_link(parallel, device))
    return cache[key]
