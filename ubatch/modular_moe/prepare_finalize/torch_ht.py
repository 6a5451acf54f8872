"""High-throughput all-to-all in plain torch.distributed: the DeepEP-HT shape without DeepEP.

Tokens are sent once per destination *rank* (not per expert) with their top-k ids remapped to that
rank's local ids (``-1`` elsewhere) and their weights, so receivers get the contiguous layout and the
experts return weighted sums. The split sizes need a counts exchange first, a CPU sync, exactly like
DeepEP's HT dispatch busy-waiting for its receive count: this backend is therefore not graph-capturable.

Stream choreography follows vLLM's DeepEP-HT path (3 yields per layer): yield before dispatch so the other
ubatch's compute is queued ahead of the blocking dispatch; yield before combine; and yield after starting
the combine's receive, so the combine is in flight while the other ubatch runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ubatch.context import (
    dbo_switch_to_comm, dbo_switch_to_compute, dbo_switch_to_compute_sync,
    dbo_yield_and_switch_from_comm_to_compute, dbo_yield_and_switch_from_compute_to_comm,
)
from ubatch.modular_moe.comm import AllToAll
from ubatch.modular_moe.prepare_finalize.base import (
    FinalizeReceiver, Hook, PrepareFinalize, PrepareReceiver, pick_group, routed_bytes,
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
    dbo_yields_per_layer = 3

    def __init__(self, num_experts: int, ep_rank: int, ep_size: int, groups: Sequence[Any], link: Any = None) -> None:
        super().__init__(num_experts, ep_rank, ep_size, link)
        self.groups = list(groups)

    def prepare_async(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> tuple[Hook | None, PrepareReceiver]:
        # Dispatch blocks the CPU (counts exchange): queue the other ubatch's compute first.
        dbo_yield_and_switch_from_compute_to_comm()
        comm = AllToAll(pick_group(self.groups))
        r, e_loc = self.ep_size, self.num_local_experts
        num_tokens, top_k = topk_ids.shape
        dest = topk_ids // e_loc  # [T, K]
        in_rank = torch.zeros(num_tokens, r, dtype=torch.bool, device=hidden.device)
        in_rank[torch.arange(num_tokens, device=hidden.device).unsqueeze(1).expand(-1, top_k), dest] = True
        send_rank, send_token = in_rank.t().nonzero(as_tuple=True)  # grouped by destination rank, token order
        send_counts = in_rank.sum(dim=0).to(torch.int64)
        recv_counts = torch.empty_like(send_counts)
        comm.all_to_all(recv_counts, send_counts).wait()
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        local_ids = topk_ids[send_token] - (send_rank * e_loc).unsqueeze(1)
        local_ids = torch.where((local_ids >= 0) & (local_ids < e_loc), local_ids, torch.full_like(local_ids, -1))
        meta = torch.cat([local_ids.float(), topk_weights[send_token].float()], dim=1)  # ids are exact in fp32
        num_recv = sum(recv_splits)
        recv_x = hidden.new_empty(num_recv, hidden.shape[1])
        recv_meta = meta.new_empty(num_recv, 2 * top_k)
        inner = sum_handles([comm.all_to_all(recv_x, hidden[send_token], recv_splits, send_splits),
                             comm.all_to_all(recv_meta, meta, recv_splits, send_splits)])
        handle = self._through_link(routed_bytes(hidden, top_k), inner, "dispatch")
        dbo_switch_to_compute_sync()

        def receiver() -> tuple[ExpertTokens, Any]:
            handle.wait()
            tokens = ExpertTokens("contiguous", recv_x, recv_meta[:, :top_k].long(), recv_meta[:, top_k:])
            return tokens, _HTState(comm, send_token, send_splits, recv_splits, hidden, top_k)

        return None, receiver

    def finalize_async(self, expert_output: torch.Tensor, state: _HTState) -> tuple[Hook | None, FinalizeReceiver]:
        dbo_yield_and_switch_from_compute_to_comm()
        back = expert_output.new_empty(len(state.send_token_index), expert_output.shape[1])
        inner = state.comm.all_to_all(back, expert_output, state.send_splits, state.recv_splits)
        handle = self._through_link(routed_bytes(state.hidden_like, state.top_k), inner, "combine")
        dbo_switch_to_compute()

        def receiver() -> torch.Tensor:
            dbo_switch_to_comm()
            dbo_yield_and_switch_from_comm_to_compute()  # the combine flies while the other ubatch runs
            handle.wait()
            out = torch.zeros(state.hidden_like.shape, dtype=torch.float32, device=back.device)
            out.index_add_(0, state.send_token_index, back.float())
            return out.to(expert_output.dtype)

        return None, receiver
