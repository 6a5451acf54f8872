"""One rank: tokens stay where they are. Still hook-shaped, so DBO yields at the same points as with EP."""
from __future__ import annotations

from typing import Any

import torch

from ubatch.modular_moe.prepare_finalize.base import (
    FinalizeReceiver,
    Hook,
    PrepareFinalize,
    PrepareReceiver,
    routed_bytes,
)
from ubatch.modular_moe.types import ExpertTokens


class NoAllToAll(PrepareFinalize):
    name = "none"
    layout = "contiguous"
    dbo_yields_per_layer = 2

    def __init__(self, num_experts: int, ep_rank: int = 0, ep_size: int = 1, link: Any = None) -> None:
        if ep_size != 1:
            raise ValueError(f"the 'none' all2all backend serves one rank; got ep_size={ep_size} "
                             "(use torch_ll, torch_ht or a DeepEP backend for expert parallelism)")
        super().__init__(num_experts, ep_rank, ep_size, link)

    def prepare_async(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> tuple[Hook | None, PrepareReceiver]:
        handle = self._through_link(routed_bytes(hidden, topk_ids.shape[1]), None, "dispatch")
        tokens = ExpertTokens("contiguous", hidden, topk_ids, topk_weights)
        return (handle.wait if handle else _noop), lambda: (tokens, topk_ids.shape[1])

    def finalize_async(self, expert_output: torch.Tensor, state: Any) -> tuple[Hook | None, FinalizeReceiver]:
        handle = self._through_link(routed_bytes(expert_output, state), None, "combine")
        return (handle.wait if handle else _noop), lambda: expert_output


def _noop() -> None:
    return None
