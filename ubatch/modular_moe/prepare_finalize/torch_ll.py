"""Low-latency all-to-all in plain torch.distributed: the DeepEP-LL shape without DeepEP.

Every rank sends a fixed-capacity buffer ``[E, Nmax, H]`` (``Nmax = num_max_dispatch_tokens_per_rank``)
with one equal-split ``all_to_all_single`` per direction, plus the per-expert counts. When the step's
forward context carries ``max_tokens_across_dp`` (known on the CPU from the DP vote, identical on every
rank), the buffer shrinks to that bound rounded up to a power of two: equal on every rank, still no sync,
and a sender no longer pays for 512 empty rows per expert on a 32-token decode step. All index math
runs on the device (one-hot cumsum for slots, a stable argsort to pack), with no ``.item()`` and no
data-dependent shapes, so on NCCL the whole step is CUDA-graph capturable. Receivers get the masked
layout ``[E_local, R*Nmax, H]`` with valid tokens packed at the front of each expert and
``expert_num_tokens[E_local]``; combine applies the routing weights on the token's home rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from ubatch.forward_context import maybe_get_forward_context
from ubatch.modular_moe.comm import AllToAll
from ubatch.modular_moe.prepare_finalize.base import (
    FinalizeReceiver, Hook, PrepareFinalize, PrepareReceiver, pick_group, routed_bytes,
)
from ubatch.modular_moe.prepare_finalize.emulated_link import sum_handles
from ubatch.modular_moe.types import ExpertTokens


@dataclass
class _LLState:
    comm: AllToAll
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    slots: torch.Tensor  # [T, K] position of each routed copy in its expert's send block
    pack_order: torch.Tensor  # [E_local, R*Nmax] received row -> packed row permutation
    capacity: int
    hidden_like: torch.Tensor  # the dispatched [T,H] input: sizes the combine on the emulated link


class TorchLowLatency(PrepareFinalize):
    name = "torch_ll"
    layout = "masked"
    dbo_yields_per_layer = 2

    def __init__(self, num_experts: int, ep_rank: int, ep_size: int, groups: Sequence[Any],
                 max_dispatch_tokens_per_rank: int, link: Any = None) -> None:
        super().__init__(num_experts, ep_rank, ep_size, link)
        self.groups = list(groups)
        self.capacity = max_dispatch_tokens_per_rank

    def step_capacity(self, num_tokens: int) -> int:
        """Rows per expert block this step: the configured capacity, or less when the DP bound allows."""
        fc = maybe_get_forward_context()
        bound = fc.dp_metadata.max_tokens_across_dp if fc is not None and fc.dp_metadata is not None else None
        if not bound:
            return self.capacity
        if bound < num_tokens:
            raise ValueError(f"torch_ll: {num_tokens} tokens exceed the step's max_tokens_across_dp={bound}")
        return min(self.capacity, 1 << (int(bound) - 1).bit_length())

    def prepare_async(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> tuple[Hook | None, PrepareReceiver]:
        num_tokens, hidden_size = hidden.shape
        if num_tokens > self.capacity:
            raise ValueError(f"torch_ll: {num_tokens} tokens on rank {self.ep_rank} exceed "
                             f"num_max_dispatch_tokens_per_rank={self.capacity}; raise the capacity "
                             "(--max-dispatch-tokens-per-rank) - tokens are never dropped silently")
        comm = AllToAll(pick_group(self.groups))
        e, cap = self.num_experts, self.step_capacity(num_tokens)
        membership = F.one_hot(topk_ids, e).sum(dim=1)  # [T, E]: 1 where the token picked the expert
        slots = torch.gather(membership.cumsum(dim=0) - 1, 1, topk_ids)  # [T, K]
        send = hidden.new_zeros(e, cap, hidden_size)
        send[topk_ids.reshape(-1), slots.reshape(-1)] = hidden.repeat_interleave(topk_ids.shape[1], dim=0)
        counts = membership.sum(dim=0).to(torch.int64)  # [E] tokens this rank sends to each expert
        recv = torch.empty_like(send)
        recv_counts = torch.empty_like(counts)
        inner = sum_handles([comm.all_to_all(recv, send), comm.all_to_all(recv_counts, counts)])
        handle = self._through_link(routed_bytes(hidden, topk_ids.shape[1]), inner, "dispatch")

        def receiver() -> tuple[ExpertTokens, Any]:
            r, e_loc = self.ep_size, self.num_local_experts
            by_expert = recv.view(r, e_loc, cap, hidden_size).transpose(0, 1).reshape(e_loc, r * cap, hidden_size)
            per_src = recv_counts.view(r, e_loc).transpose(0, 1)  # [E_local, R]
            valid = torch.arange(cap, device=hidden.device).view(1, 1, cap) < per_src.unsqueeze(-1)
            order = torch.argsort((~valid).reshape(e_loc, r * cap).to(torch.int8), dim=1, stable=True)
            packed = torch.gather(by_expert, 1, order.unsqueeze(-1).expand(-1, -1, hidden_size))
            tokens = ExpertTokens("masked", packed, expert_num_tokens=per_src.sum(dim=1))
            return tokens, _LLState(comm, topk_ids, topk_weights, slots, order, cap, hidden)

        return handle.wait, receiver

    def finalize_async(self, expert_output: torch.Tensor, state: _LLState) -> tuple[Hook | None, FinalizeReceiver]:
        r, e_loc, cap = self.ep_size, self.num_local_experts, state.capacity
        hidden_size = expert_output.shape[-1]
        unpacked = torch.empty_like(expert_output).scatter_(
            1, state.pack_order.unsqueeze(-1).expand(-1, -1, hidden_size), expert_output)
        send = unpacked.view(e_loc, r, cap, hidden_size).transpose(0, 1).contiguous()  # [R(home), E_local, cap, H]
        recv = torch.empty_like(send)
        inner = state.comm.all_to_all(recv, send)
        handle = self._through_link(routed_bytes(state.hidden_like, state.topk_ids.shape[1]),
                                    inner, "combine")

        def receiver() -> torch.Tensor:
            per_expert = recv.view(self.num_experts, cap, hidden_size)
            picked = per_expert[state.topk_ids, state.slots]  # [T, K, H]
            out = (picked.float() * state.topk_weights.unsqueeze(-1).float()).sum(dim=1)
            return out.to(expert_output.dtype)

        return handle.wait, receiver
