"""The all-to-all half of the modular MoE kernel: move tokens to their experts and the results back.

Each direction is split in two so the kernel can overlap it: ``*_async`` starts the transfer and returns
``(hook, receiver)``. ``hook`` (may be ``None``) completes the receive; under DBO the kernel parks it on
the *other* ubatch, which runs it just before its own send, so the transfer is in flight while the other
ubatch computes. ``receiver`` then hands over the data. Backends whose choreography needs explicit stream
switches (the high-throughput shape) yield inside ``*_async``/``receiver`` themselves and return no hook.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Sequence

import torch

from ubatch.context import dbo_current_ubatch_id
from ubatch.modular_moe.comm import Handle
from ubatch.modular_moe.prepare_finalize.emulated_link import EmulatedLink
from ubatch.modular_moe.types import ExpertTokens, Layout

Hook = Callable[[], None]
PrepareReceiver = Callable[[], tuple[ExpertTokens, Any]]
FinalizeReceiver = Callable[[], torch.Tensor]


class PrepareFinalize(ABC):
    name: str = "base"
    layout: Layout = "contiguous"
    #: yields per MoE layer per ubatch under DBO (asserted by tests; every ubatch must match)
    dbo_yields_per_layer: int = 2

    def __init__(self, num_experts: int, ep_rank: int = 0, ep_size: int = 1, link: EmulatedLink | None = None) -> None:
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={ep_size}")
        self.num_experts = num_experts
        self.ep_rank = ep_rank
        self.ep_size = ep_size
        self.num_local_experts = num_experts // ep_size
        self.link = link

    @abstractmethod
    def prepare_async(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> tuple[Hook | None, PrepareReceiver]:
        """Start dispatch of ``hidden [T,H]`` routed by global ``topk_ids [T,K]``."""

    @abstractmethod
    def finalize_async(self, expert_output: torch.Tensor, state: Any) -> tuple[Hook | None, FinalizeReceiver]:
        """Start combine of the experts' output; the receiver returns ``[T,H]`` (weights applied)."""

    def _through_link(self, nbytes: int, inner: Handle | None, label: str) -> Handle | None:
        if self.link is None:
            return inner
        return self.link.transfer(nbytes, inner, label=f"{label}{dbo_current_ubatch_id()}")


def routed_bytes(hidden: torch.Tensor, top_k: int) -> int:
    """Bytes the emulated link charges per direction for ``hidden [T,H]``: every routed copy crosses it.

    This models the wide-EP regime (almost every expert is remote) and needs no device sync, so it works
    unchanged inside a CUDA graph and is identical for every backend and world size.
    """
    return hidden.shape[0] * top_k * hidden.shape[-1] * hidden.element_size()


def pick_group(groups: Sequence[Any]) -> Any:
    """Each ubatch issues its collectives on its own group, so ranks never pair up different ubatches."""
    ubatch = dbo_current_ubatch_id()
    if ubatch >= len(groups):
        raise ValueError(f"ubatch {ubatch} has no process group: {len(groups)} EP groups were given; "
                         "create one EP group per ubatch")
    return groups[ubatch]
