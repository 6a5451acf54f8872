"""Low-latency all-to-all in plain torch.distributed: the DeepEP-LL shape without DeepEP.

Every rank sends a fixed-capacity buffer ``[E, cap, H]`` with one equal-split ``all_to_all_single`` per
direction, plus the per-expert counts. ``cap`` is the step's token bound when the DP vote agreed one
(``DPMetadata.token_bound``: identical on every rank, known on the CPU, so still no sync): under DBO each
ubatch is sized by *its own* bound -- the max over ranks of that ubatch's tokens -- so two ubatches move
the bytes of one whole step, not twice them. Without a bound (a CUDA-graph capture) it is the configured
``num_max_dispatch_tokens_per_rank``. All index math runs on the device (one-hot cumsum for slots, a stable
argsort to pack) with no ``.item()`` and no data-dependent shapes, so on NCCL the step is graph-capturable.

The wire carries ``E * cap`` rows whatever the routing (DeepEP LL writes only the real rows over RDMA; an
equal-split collective cannot), which is why the phase-aware ``auto`` backend uses the high-throughput
layout for prefill. Receivers get the masked layout ``[E_local, R*cap, H]`` with valid tokens packed at
the front of each expert and ``expert_num_tokens[E_local]``; rows past the count are never read by the
experts, so no buffer is zero-filled. Rows routed to ``-1`` (padding) take no slot and send nothing.
Combine applies the routing weights on the token's home rank.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ubatch import trace
from ubatch.forward_context import maybe_get_forward_context
from ubatch.modular_moe.comm import AllToAll
from ubatch.modular_moe.prepare_finalize.base import (
    FinalizeReceiver,
    Hook,
    PrepareFinalize,
    PrepareReceiver,
    pick_group,
    routed_bytes,
)
from ubatch.modular_moe.prepare_finalize.emulated_link import sum_handles
from ubatch.modular_moe.types import ExpertTokens


@dataclass
class _LLState:
    comm: AllToAll
    flat_slot: torch.Tensor  # [T, K] row of each routed copy in the [E*cap] send/receive layout (-1: none)
    topk_weights: torch.Tensor
    source_rows: torch.Tensor  # [E_local*R*cap] received row feeding each packed row
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
        """Rows per expert block for this (micro)batch: its agreed token bound, or the configured capacity."""
        fc = maybe_get_forward_context()
        dp = fc.dp_metadata if fc is not None else None
        bound = dp.token_bound(fc.ubatch_id) if fc is not None and dp is not None else None
        if bound is None:
            return self.capacity
        if bound < num_tokens:
            assert fc is not None and dp is not None  # a bound comes from the step's DP metadata
            which = "the step's" if fc.ubatch_id is None else f"ubatch {fc.ubatch_id}'s"
            raise ValueError(f"torch_ll: {num_tokens} tokens exceed {which} agreed token bound {bound} "
                             f"(max_tokens_across_dp={dp.max_tokens_across_dp})")
        return min(self.capacity, max(bound, 1))

    def prepare_async(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> tuple[Hook | None, PrepareReceiver]:
        num_tokens, hidden_size = hidden.shape
        if num_tokens > self.capacity:
            raise ValueError(f"torch_ll: {num_tokens} tokens on rank {self.ep_rank} exceed "
                             f"num_max_dispatch_tokens_per_rank={self.capacity}; raise the capacity "
                             "(--max-dispatch-tokens-per-rank) - tokens are never dropped silently")
        comm = AllToAll(pick_group(self.groups))
        e, cap, top_k = self.num_experts, self.step_capacity(num_tokens), topk_ids.shape[1]
        with trace.compute_span("pack", "P"):
            routed = topk_ids >= 0
            ids = topk_ids.clamp(min=0)
            membership = F.one_hot(ids, e) * routed.unsqueeze(-1)  # [T, K, E]
            per_token = membership.sum(dim=1)  # [T, E]: 1 where the token picked the expert
            slots = torch.gather(per_token.cumsum(dim=0) - 1, 1, ids)  # [T, K]
            flat_slot = torch.where(routed, ids * cap + slots, torch.full_like(slots, e * cap))  # e*cap: a spare row
            send = hidden.new_empty(e * cap + 1, hidden_size)
            send.index_copy_(0, flat_slot.reshape(-1), hidden.repeat_interleave(top_k, dim=0))
            send = send[: e * cap]
            counts = per_token.sum(dim=0).to(torch.int64)  # [E] tokens this rank sends to each expert
            recv = torch.empty_like(send)
            recv_counts = torch.empty_like(counts)
        self.wire.add("dispatch", send.numel() * send.element_size() + counts.numel() * counts.element_size())
        start = self.comm_start()  # cuda trace clock: the collective's comm span starts here
        inner = sum_handles([comm.all_to_all(recv, send), comm.all_to_all(recv_counts, counts)])
        handle = self._through_link(routed_bytes(hidden, top_k), inner, "dispatch", start)

        def receiver() -> tuple[ExpertTokens, Any]:
            r, e_loc = self.ep_size, self.num_local_experts
            with trace.compute_span("unpack", "U"):
                per_src = recv_counts.view(r, e_loc).transpose(0, 1)  # [E_local, R]
                valid = torch.arange(cap, device=hidden.device).view(1, 1, cap) < per_src.unsqueeze(-1)
                order = torch.argsort((~valid).reshape(e_loc, r * cap).to(torch.int8), dim=1, stable=True)
                # packed row (e, p) <- received row order[e, p] = src*cap + c of the [R, E_local, cap] layout
                src_rank, col = order // cap, order % cap
                expert = torch.arange(e_loc, device=hidden.device).unsqueeze(1)
                source_rows = ((src_rank * e_loc + expert) * cap + col).reshape(-1)
                packed = recv.index_select(0, source_rows).view(e_loc, r * cap, hidden_size)
            tokens = ExpertTokens("masked", packed, expert_num_tokens=per_src.sum(dim=1))
            return tokens, _LLState(comm, flat_slot, topk_weights, source_rows, cap, hidden)

        return handle.wait, receiver

    def finalize_async(self, expert_output: torch.Tensor, state: _LLState) -> tuple[Hook | None, FinalizeReceiver]:
        cap, hidden_size = state.capacity, expert_output.shape[-1]
        with trace.compute_span("pack", "P"):
            # Back to the received layout [R(home), E_local, cap]: what each home rank expects for its experts.
            send = expert_output.new_empty(self.ep_size * self.num_local_experts * cap, hidden_size)
            send.index_copy_(0, state.source_rows, expert_output.reshape(-1, hidden_size))
            recv = torch.empty_like(send)
        self.wire.add("combine", send.numel() * send.element_size())
        start = self.comm_start()
        inner = state.comm.all_to_all(recv, send)
        handle = self._through_link(routed_bytes(state.hidden_like, state.flat_slot.shape[1]), inner, "combine",
                                    start)

        def receiver() -> torch.Tensor:
            with trace.compute_span("combine_sum", "U"):
                routed = (state.flat_slot < self.num_experts * cap).unsqueeze(-1)
                picked = recv.index_select(0, state.flat_slot.clamp(max=self.num_experts * cap - 1).reshape(-1))
                picked = picked.view(*state.flat_slot.shape, hidden_size).float()
                # where, not a zero weight: an unrouted copy points at a never-written row (0 * NaN is NaN)
                weighted = torch.where(routed, picked * state.topk_weights.float().unsqueeze(-1), 0.0)
                out = weighted.sum(dim=1)
            return out.to(expert_output.dtype)

        return handle.wait, receiver
