"""High-throughput all-to-all in plain torch.distributed: the DeepEP-HT shape without DeepEP.

Tokens are sent once per destination *rank* (not per expert) with their top-k ids remapped to that
rank's local ids (``-1`` elsewhere) and their weights, so receivers get the contiguous layout and the
experts return weighted sums. Only real rows cross the wire (rows routed to ``-1``, i.e. padding, go
nowhere), which is why the phase-aware ``auto`` backend picks this layout for prefill. The split sizes need
a counts exchange first, a CPU sync (DeepEP's HT dispatch busy-waits for its receive count the same
way), so this backend is not CUDA-graph capturable.

Under DBO it uses the same hook protocol as ``torch_ll`` (2 yields per layer): the counts exchange is a
short blocking round trip, then the token transfer is *posted* and its receive is parked on the other
ubatch, so the bulk of the dispatch is in flight while the other ubatch computes (its attention); the
combine likewise flies during the other ubatch's experts. vLLM's DeepEP-HT choreography (3 yields and
explicit comm-stream switches, ``deepep.py``) exists because DeepEP launches its kernels on a comm stream
it manages; torch.distributed collectives already run on their own stream (NCCL) or thread (gloo) and
complete at ``wait()``, which the hook calls.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ubatch import trace
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
class _HTState:
    comm: AllToAll
    send_token_index: torch.Tensor  # [S] which local token each sent row came from
    send_splits: list[int]
    recv_splits: list[int]
    hidden_like: torch.Tensor
    top_k: int


class TorchHighThroughput(PrepareFinalize):
    name = "torch_ht"
    layout = "contiguous"
    dbo_yields_per_layer = 2

    def __init__(self, num_experts: int, ep_rank: int, ep_size: int, groups: Sequence[Any], link: Any = None) -> None:
        super().__init__(num_experts, ep_rank, ep_size, link)
        self.groups = list(groups)

    def prepare_async(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> tuple[Hook | None, PrepareReceiver]:
        comm = AllToAll(pick_group(self.groups))
        r, e_loc = self.ep_size, self.num_local_experts
        num_tokens, top_k = topk_ids.shape
        with trace.compute_span("pack", "P"):
            routed = topk_ids >= 0
            dest = torch.where(routed, topk_ids // e_loc, torch.full_like(topk_ids, r))  # r: a spare column
            in_rank = torch.zeros(num_tokens, r + 1, dtype=torch.bool, device=hidden.device)
            in_rank[torch.arange(num_tokens, device=hidden.device).unsqueeze(1).expand(-1, top_k), dest] = True
            in_rank = in_rank[:, :r]
            send_rank, send_token = in_rank.t().nonzero(as_tuple=True)  # grouped by destination rank, token order
            send_counts = in_rank.sum(dim=0).to(torch.int64)
            recv_counts = torch.empty_like(send_counts)
        with trace.region("counts", "copy"):
            comm.all_to_all(recv_counts, send_counts).wait()
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        with trace.compute_span("pack", "P"):
            local_ids = topk_ids[send_token] - (send_rank * e_loc).unsqueeze(1)
            local_ids = torch.where((local_ids >= 0) & (local_ids < e_loc), local_ids, torch.full_like(local_ids, -1))
            meta = torch.cat([local_ids.float(), topk_weights[send_token].float()], dim=1)  # ids exact in fp32
            send_x = hidden.index_select(0, send_token)
            num_recv = sum(recv_splits)
            recv_x = hidden.new_empty(num_recv, hidden.shape[1])
            recv_meta = meta.new_empty(num_recv, 2 * top_k)
        self.wire.add("dispatch", send_x.numel() * send_x.element_size() + meta.numel() * meta.element_size())
        start = self.comm_start()  # cuda trace clock: the token transfer's comm span starts here
        inner = sum_handles([comm.all_to_all(recv_x, send_x, recv_splits, send_splits),
                             comm.all_to_all(recv_meta, meta, recv_splits, send_splits)])
        handle = self._through_link(routed_bytes(hidden, top_k), inner, "dispatch", start)

        def receiver() -> tuple[ExpertTokens, Any]:
            tokens = ExpertTokens("contiguous", recv_x, recv_meta[:, :top_k].long(), recv_meta[:, top_k:])
            return tokens, _HTState(comm, send_token, send_splits, recv_splits, hidden, top_k)

        return handle.wait, receiver

    def finalize_async(self, expert_output: torch.Tensor, state: _HTState) -> tuple[Hook | None, FinalizeReceiver]:
        back = expert_output.new_empty(len(state.send_token_index), expert_output.shape[1])
        self.wire.add("combine", expert_output.numel() * expert_output.element_size())
        start = self.comm_start()
        inner = state.comm.all_to_all(back, expert_output, state.send_splits, state.recv_splits)
        handle = self._through_link(routed_bytes(state.hidden_like, state.top_k), inner, "combine", start)

        def receiver() -> torch.Tensor:
            with trace.compute_span("combine_sum", "U"):
                out = torch.zeros(state.hidden_like.shape, dtype=torch.float32, device=back.device)
                out.index_add_(0, state.send_token_index, back.float())
            return out.to(expert_output.dtype)

        return handle.wait, receiver
