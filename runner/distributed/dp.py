"""Agreeing across data-parallel ranks, once per step, whether to ubatch, how far to pad, and how to size.

Every rank must run the same ubatches and layers or an all-to-all pairs with the wrong partner and hangs, so
one all-reduce of a small table (a column per rank: tokens, padded tokens, threshold vote, work, prefill,
split point, cost-model vote) gives every rank the same decision (:func:`decide`), under ``--dbo-dp-rule``
``sglang`` (default: idle and small ranks never veto; the largest rank's cost model decides) or ``vllm`` (all
ranks must vote yes). Design: docs/design_notes.md, "Distributed: DP agreement, launcher, faults".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ubatch.slicing import is_last_ubatch_empty

DP_RULES = ("sglang", "vllm")
_ROWS = 7  # orig, padded, vote, work, prefill, split, pays


@dataclass(frozen=True)
class DPDecision:
    should_ubatch: bool
    num_tokens_padded: int  # what this rank runs (its own count, or the max when ubatching)
    num_tokens_across_dp: tuple[int, ...]
    any_work: bool
    any_prefill: bool = False  # some rank runs a prefill or mixed batch (phase-aware all-to-all picks HT)
    ubatch_token_bounds: tuple[int, ...] | None = None  # per ubatch, max over ranks of its token count
    max_tokens_padded: int = 0  # the most tokens any rank runs this step: what fixed-size buffers may hold


class DPCollectiveError(RuntimeError):
    """A DP/EP collective failed: a peer rank exited, or it did not answer within the timeout."""


def _ubatch_bounds(padded: int, splits: list[int], num_ubatches: int) -> tuple[int, ...]:
    """Per-ubatch max size over ranks, every rank padded to ``padded``; ``splits[r]``: rank r's first cut."""
    if num_ubatches == 2:
        cuts = [s if s > 0 else padded // 2 for s in splits]
        return (max(cuts), padded - min(cuts))
    width = padded // num_ubatches  # more than two ubatches: always the default equal cut
    return (*[width] * (num_ubatches - 1), padded - width * (num_ubatches - 1))


def decide(table: torch.Tensor, rank: int, num_ubatches: int, rule: str = "sglang") -> DPDecision:
    """Pure post-processing of the summed ``[7, dp]`` table (unit-tested without any process group)."""
    if table.shape[0] != _ROWS:
        raise ValueError(f"the DP vote table needs {_ROWS} rows (orig, padded, vote, work, prefill, split, pays), "
                         f"got {table.shape[0]}")
    return _decide(table.tolist(), rank, num_ubatches, rule)


def _decide(rows: list[list[int]], rank: int, num_ubatches: int, rule: str) -> DPDecision:
    """:func:`decide` on the table as lists of ints (row by row, one entry per rank)."""
    if rule not in DP_RULES:
        raise ValueError(f"unknown DP ubatch rule {rule!r}; choose one of {', '.join(DP_RULES)}")
    orig, padded, votes, work, prefill, splits, pays = rows
    any_work = any(work)
    max_padded = max(padded)
    if rule == "vllm":
        should = any_work and all(votes) and all(pays) and not is_last_ubatch_empty(min(orig), max_padded,
                                                                                    num_ubatches)
    else:
        largest = max(range(len(orig)), key=lambda r: (orig[r], -r))  # ties: the lowest rank
        should = any_work and any(v for v, w in zip(votes, work, strict=True) if w) and bool(pays[largest])
    should = should and max_padded // num_ubatches > 0
    bounds = _ubatch_bounds(max_padded, splits, num_ubatches) if should else None
    return DPDecision(should_ubatch=should, num_tokens_padded=max_padded if should else orig[rank],
                      num_tokens_across_dp=tuple(int(x) for x in orig), any_work=any_work,
                      any_prefill=any(p for p, w in zip(prefill, work, strict=True) if w), ubatch_token_bounds=bounds,
                      max_tokens_padded=max_padded)


def _vote_column(num_tokens: int, vote_ubatch: bool, *, is_prefill: bool, split: int, pays: bool,
                 num_tokens_padded: int | None) -> list[int]:
    """This rank's column of the vote table, validated."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    padded = num_tokens if num_tokens_padded is None else num_tokens_padded
    if padded < num_tokens:
        raise ValueError(f"num_tokens_padded={padded} is smaller than num_tokens={num_tokens}")
    if split < 0:
        raise ValueError(f"split must be >= 0 (0: the default cut), got {split}")
    return [num_tokens, padded, int(vote_ubatch), int(num_tokens > 0), int(is_prefill and num_tokens > 0), split,
            int(pays)]


def vote_table(num_tokens: int, vote_ubatch: bool, *, is_prefill: bool, split: int = 0, pays: bool = True,
               rank: int = 0, world: int = 1, num_tokens_padded: int | None = None) -> torch.Tensor:
    """This rank's column of the vote table (the others zero), validated."""
    table = torch.zeros(_ROWS, world, dtype=torch.int64)
    table[:, rank] = torch.tensor(_vote_column(num_tokens, vote_ubatch, is_prefill=is_prefill, split=split,
                                               pays=pays, num_tokens_padded=num_tokens_padded))
    return table


def coordinate_batch_across_dp(num_tokens: int, vote_ubatch: bool, group: Any, num_ubatches: int = 2,
                               num_tokens_padded: int | None = None, *, is_prefill: bool = False, split: int = 0,
                               pays: bool = True, rule: str = "sglang") -> DPDecision:
    """One all-reduce over ``group`` (a CPU/gloo group: the table is tiny and read on the CPU anyway)."""
    if group is None:
        raise ValueError("coordinate_batch_across_dp needs a process group; use local_decision for one rank")
    rank, world = group.rank(), group.size()
    table = vote_table(num_tokens, vote_ubatch, is_prefill=is_prefill, split=split, pays=pays, rank=rank,
                       world=world, num_tokens_padded=num_tokens_padded)
    try:
        group.allreduce([table]).wait()  # the group object itself: works for torchrun and thread-rank groups
    except RuntimeError as exc:
        raise DPCollectiveError(f"DP rank {rank}: the per-step all-reduce over {world} ranks failed; a peer rank "
                                f"probably exited or timed out ({exc})") from exc
    return decide(table, rank, num_ubatches, rule)


def local_decision(num_tokens: int, vote_ubatch: bool, num_ubatches: int = 2, *, is_prefill: bool = False,
                   split: int = 0, pays: bool = True, rule: str = "sglang") -> DPDecision:
    """DP=1: the same rules on this rank's column alone, without a collective and without a tensor."""
    column = _vote_column(num_tokens, vote_ubatch, is_prefill=is_prefill, split=split, pays=pays,
                          num_tokens_padded=None)
    return _decide([[v] for v in column], 0, num_ubatches, rule)
