"""All-to-all backends by ``--all2all-backend`` name."""
from __future__ import annotations

from typing import Any, Sequence

from ubatch.modular_moe.prepare_finalize.base import PrepareFinalize
from ubatch.modular_moe.prepare_finalize.emulated_link import EmulatedLink, LinkSpec, parse_link

ALL2ALL_BACKENDS = ("none", "torch_ll", "torch_ht", "deepep_low_latency", "deepep_high_throughput")
# Phase-aware choice (SGLang's ``--deepep-mode auto``): the high-throughput layout for steps where any DP
# rank runs a prefill or mixed batch, the low-latency one for pure decode steps.
PHASE_AWARE_BACKENDS = {"auto": ("torch_ht", "torch_ll")}  # name -> (prefill backend, decode backend)
ALL2ALL_CHOICES = (*ALL2ALL_BACKENDS, *PHASE_AWARE_BACKENDS)


def make_prepare_finalize(name: str, *, num_experts: int, hidden_size: int, ep_rank: int = 0, ep_size: int = 1,
                          groups: Sequence[Any] | None = None, max_dispatch_tokens_per_rank: int = 256,
                          link: EmulatedLink | None = None, deep_ep_module: Any = None) -> PrepareFinalize:
    """``deep_ep_module``: a module with DeepEP's API to use instead of importing ``deep_ep`` (the tests'
    CPU stand-in); only the DeepEP backends take it."""
    if name not in ALL2ALL_BACKENDS:
        raise ValueError(f"unknown all2all backend {name!r}; choose one of {', '.join(ALL2ALL_BACKENDS)}")
    if name == "none":
        from ubatch.modular_moe.prepare_finalize.none import NoAllToAll
        return NoAllToAll(num_experts, ep_rank, ep_size, link)
    if not groups:
        raise ValueError(f"all2all backend {name!r} needs expert-parallel process groups (one per ubatch)")
    if name == "torch_ll":
        from ubatch.modular_moe.prepare_finalize.torch_ll import TorchLowLatency
        return TorchLowLatency(num_experts, ep_rank, ep_size, groups, max_dispatch_tokens_per_rank, link)
    if name == "torch_ht":
        from ubatch.modular_moe.prepare_finalize.torch_ht import TorchHighThroughput
        return TorchHighThroughput(num_experts, ep_rank, ep_size, groups, link)
    from ubatch.modular_moe.prepare_finalize import deepep
    if name == "deepep_low_latency":
        return deepep.DeepEPLowLatency(num_experts, ep_rank, ep_size, groups, hidden_size,
                                       max_dispatch_tokens_per_rank, link, deep_ep_module=deep_ep_module)
    return deepep.DeepEPHighThroughput(num_experts, ep_rank, ep_size, groups, hidden_size, link,
                                       deep_ep_module=deep_ep_module)


__all__ = ["ALL2ALL_BACKENDS", "ALL2ALL_CHOICES", "PHASE_AWARE_BACKENDS", "EmulatedLink", "LinkSpec", "PrepareFinalize", "make_prepare_finalize", "parse_link"]
