"""DP coordination: the all-or-nothing ubatch vote, padding to the max, idle ranks, loop termination."""
from __future__ import annotations

import pytest
import torch

from runner.dp import coordinate_batch_across_dp, decide, local_decision
from ubatch.distributed import run_thread_ranks


def table(orig: list[int], votes: list[int], padded: list[int] | None = None) -> torch.Tensor:
    padded = padded or orig
    return torch.tensor([orig, padded, votes, [int(n > 0) for n in orig]])


@pytest.mark.parametrize("orig,votes,rank,should,padded,any_work", [
    ([64, 64], [1, 1], 0, True, 64, True),          # everyone agrees
    ([64, 40], [1, 1], 1, True, 64, True),          # smaller rank pads to the max
    ([64, 40], [1, 0], 0, False, 64, True),         # one rank below threshold: nobody ubatches
    ([64, 0], [1, 0], 1, False, 0, True),           # idle rank: runs a dummy step, vote is no
    ([0, 0], [0, 0], 0, False, 0, False),           # nobody has work: every rank ends its loop
    ([64, 1], [1, 1], 1, False, 1, True),           # last ubatch would be empty on rank 1 (32*1 >= 1)
    ([3, 3, 3], [1, 1, 1], 2, True, 3, True),       # three ranks
])
def test_decide(orig: list[int], votes: list[int], rank: int, should: bool, padded: int, any_work: bool) -> None:
    d = decide(table(orig, votes), rank, num_ubatches=2)
    assert (d.should_ubatch, d.num_tokens_padded, d.any_work) == (should, padded, any_work)
    assert d.num_tokens_across_dp == tuple(orig)


def test_local_decision_matches_single_rank_table() -> None:
    assert local_decision(10, True) == decide(table([10], [1]), 0, 2)
    assert not local_decision(1, True).should_ubatch  # a 1-token step cannot be split
    assert not local_decision(0, False).any_work


def test_coordinate_over_thread_ranks() -> None:
    counts, votes = [48, 20, 0], [True, True, False]

    def rank_main(rank: int, groups: list) -> tuple:
        d = coordinate_batch_across_dp(counts[rank], votes[rank], groups[0])
        return d.should_ubatch, d.num_tokens_padded, d.any_work

    # rank 2 is idle: it votes no, so nobody ubatches, but everybody keeps stepping
    assert run_thread_ranks(3, rank_main, num_groups=1) == [(False, 48, True), (False, 20, True), (False, 0, True)]


def test_bad_counts_raise() -> None:
    with pytest.raises(ValueError, match="num_tokens must be >= 0, got -1"):
        coordinate_batch_across_dp(-1, False, None)
    with pytest.raises(ValueError, match="num_tokens_padded=3 is smaller than num_tokens=4"):
        coordinate_batch_across_dp(4, False, None, num_tokens_padded=3)
