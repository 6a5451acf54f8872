"""Row exchange over a gloo process group: the transport under the DeepEP stand-in's "kernels".

Every rank of the group must call these in the same order (they are blocking collectives), which the DBO
protocol guarantees: every rank makes the same sequence of DeepEP calls.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def all_to_all_rows(group: Any, per_dest: Sequence[torch.Tensor],
                    recv_counts: Sequence[int] | None = None) -> list[torch.Tensor]:
    """``per_dest[r]``: the rows this rank sends to rank ``r`` (one dtype and row shape for all); returns the
    rows received from each rank, in rank order. ``recv_counts`` skips the counts exchange when known."""
    send_counts = [int(t.shape[0]) for t in per_dest]
    if recv_counts is None:
        sc = torch.tensor(send_counts, dtype=torch.int64)
        rc = torch.empty_like(sc)
        group.alltoall_base(rc, sc, [], [], dist.AllToAllOptions()).wait()
        recv_counts = rc.tolist()
    send = torch.cat(list(per_dest)).contiguous()
    recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
    group.alltoall_base(recv, send, list(recv_counts), send_counts, dist.AllToAllOptions()).wait()
    return list(recv.split(list(recv_counts)))


def gather_matrix(group: Any, row: torch.Tensor) -> torch.Tensor:
    """Every rank's ``row`` (int64 ``[n]``), stacked ``[world, n]`` on every rank."""
    world = group.size()
    send = row.to(torch.int64).repeat(world)
    recv = torch.empty_like(send)
    group.alltoall_base(recv, send, [], [], dist.AllToAllOptions()).wait()
    return recv.view(world, -1)
