"""Agreeing across data-parallel ranks, once per step, whether to ubatch and how far to pad.

Every rank issues the same MoE all-to-alls, so every rank must run the same number of ubatches with the
same number of layers, or a collective pairs with the wrong partner and hangs. One small all-reduce
settles it (vLLM #25768 folded three into one): each rank writes its own column of
``[orig tokens, padded tokens, ubatch vote, has work]``; the sum gives every rank the full table.

- Ubatch only if **all** ranks vote yes and the last ubatch is non-empty on every rank: the split point
  comes from the padded (max) count, so the test uses min original against max padded.
- When ubatching, every rank pads to the max, so ubatch sizes match across ranks (CUDA graphs need that).
- A rank with no work still takes part (the caller runs a dummy step) while any rank has work; when no
  rank has work, every rank learns it in the same step and the loop ends everywhere together.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ubatch.slicing import is_last_ubatch_empty


@dataclass(frozen=True)
class DPDecision:
    should_ubatch: bool
    num_tokens_padded: int  # what this rank runs (its own count, or the max when ubatching)
    num_tokens_across_dp: tuple[int, ...]
    any_work: bool


class DPCollectiveError(RuntimeError):
    """A DP/EP collective failed: a peer rank exited, or it did not answer within the timeout."""


def decide(table: torch.Tensor, rank: int, num_ubatches: int) -> DPDecision:
    """Pure post-processing of the summed ``[4, dp]`` table (unit-tested without any process group)."""
    orig, padded, votes, work = (table[i].tolist() for i in range(4))
    busy = [i for i, w in enumerate(work) if w]
    any_work = bool(busy)
    should = any_work and all(votes) and not is_last_ubatch_empty(min(orig), max(padded), num_ubatches) \
        and max(padded) // num_ubatches > 0
    return DPDecision(should_ubatch=should, num_tokens_padded=max(padded) if should else orig[rank],
                      num_tokens_across_dp=tuple(int(x) for x in orig), any_work=any_work)


def coordinate_batch_across_dp(num_tokens: int, vote_ubatch: bool, group: Any, num_ubatches: int = 2,
                               num_tokens_padded: int | None = None) -> DPDecision:
    """One all-reduce over ``group`` (a CPU/gloo group: the table is tiny and read on the CPU anyway)."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    padded = num_tokens if num_tokens_padded is None else num_tokens_padded
    if padded < num_tokens:
        raise ValueError(f"num_tokens_padded={padded} is smaller than num_tokens={num_tokens}")
    rank, world = group.rank(), group.size()
    table = torch.zeros(4, world, dtype=torch.int64)
    table[:, rank] = torch.tensor([num_tokens, padded, int(vote_ubatch), int(num_tokens > 0)])
    try:
        group.allreduce([table]).wait()  # the group object itself: works for torchrun and thread-rank groups
    except RuntimeError as exc:
        raise DPCollectiveError(f"DP rank {rank}: the per-step all-reduce over {world} ranks failed; a peer rank "
                                f"probably exited or timed out ({exc})") from exc
    return decide(table, rank, num_ubatches)


def local_decision(num_tokens: int, vote_ubatch: bool, num_ubatches: int = 2) -> DPDecision:
    """DP=1: the same rules without a collective."""
    table = torch.tensor([[num_tokens], [num_tokens], [int(vote_ubatch)], [int(num_tokens > 0)]])
    return decide(table, 0, num_ubatches)
