"""DP coordination: the two ubatch rules, padding to the max, per-ubatch bounds, idle ranks, loop termination."""
from __future__ import annotations

import functools
import operator

import pytest
import torch

from runner.distributed.dp import coordinate_batch_across_dp, decide, local_decision, vote_table
from ubatch.testing.thread_ranks import run_thread_ranks


def table(orig: list[int], votes: list[int], prefill: list[int] | None = None,
          splits: list[int] | None = None, pays: list[int] | None = None) -> torch.Tensor:
    """The summed vote table: each rank's column as ``vote_table`` writes it."""
    n = len(orig)
    prefill = prefill or [0] * n
    splits = splits or [0] * n
    pays = pays or [1] * n
    columns = [vote_table(o, bool(v), is_prefill=bool(p), split=s, pays=bool(c), rank=r, world=n)
               for r, (o, v, p, s, c) in enumerate(zip(orig, votes, prefill, splits, pays, strict=True))]
    return functools.reduce(operator.add, columns)


# (orig tokens, votes, this rank) -> (should ubatch, padded) under each rule
CASES = {
    "all agree": ([64, 64], [1, 1], 0, {"sglang": (True, 64), "vllm": (True, 64)}),
    "smaller rank pads to the max": ([64, 40], [1, 1], 1, {"sglang": (True, 64), "vllm": (True, 64)}),
    # vLLM: one rank under the threshold vetoes; SGLang: the largest rank decides, the small one splits too
    "one rank under the threshold": ([64, 40], [1, 0], 1, {"sglang": (True, 64), "vllm": (False, 40)}),
    # vLLM: the idle rank votes no; SGLang: it runs two padding-only ubatches
    "idle rank": ([64, 0], [1, 0], 1, {"sglang": (True, 64), "vllm": (False, 0)}),
    "all under the threshold": ([20, 12], [0, 0], 0, {"sglang": (False, 20), "vllm": (False, 20)}),
    "nobody has work": ([0, 0], [0, 0], 0, {"sglang": (False, 0), "vllm": (False, 0)}),
    # vLLM: rank 1's real token would not reach the second ubatch; SGLang: that ubatch is padding only
    "last ubatch all padding": ([64, 1], [1, 1], 1, {"sglang": (True, 64), "vllm": (False, 1)}),
    "three ranks": ([3, 3, 3], [1, 1, 1], 2, {"sglang": (True, 3), "vllm": (True, 3)}),
}


@pytest.mark.parametrize("rule", ["sglang", "vllm"])
@pytest.mark.parametrize("case", list(CASES))
def test_decide(case: str, rule: str) -> None:
    orig, votes, rank, expected = CASES[case]
    d = decide(table(orig, votes), rank, num_ubatches=2, rule=rule)
    assert (d.should_ubatch, d.num_tokens_padded) == expected[rule]
    assert d.any_work == any(orig)
    assert d.num_tokens_across_dp == tuple(orig)
    if d.should_ubatch:  # every rank pads to the max and cuts it in half
        m = max(orig)
        assert d.ubatch_token_bounds == (m // 2, m - m // 2)
    else:
        assert d.ubatch_token_bounds is None


def test_an_idle_rank_never_votes() -> None:
    """Whatever an idle rank writes in its vote column, it does not change the decision (SGLang's rule)."""
    for idle_vote in (0, 1):
        d = decide(table([0, 30, 50], [idle_vote, 0, 1]), 0, 2, "sglang")
        assert d.should_ubatch and d.num_tokens_padded == 50
        assert not decide(table([0, 30, 50], [idle_vote, 0, 0]), 0, 2, "sglang").should_ubatch


@pytest.mark.parametrize("prefill, any_prefill", [([0, 0], False), ([1, 0], True), ([0, 1], True)])
def test_mixed_prefill_and_decode_ranks_agree_on_the_phase(prefill: list[int], any_prefill: bool) -> None:
    """A phase-aware all-to-all must use one layout on every rank: prefill anywhere means prefill everywhere."""
    for rank in (0, 1):
        d = decide(table([40, 33], [1, 1], prefill), rank, 2, "sglang")
        assert d.any_prefill is any_prefill and d.should_ubatch


def test_an_idle_rank_does_not_make_the_step_a_prefill() -> None:
    assert not decide(table([40, 0], [1, 0], [0, 1]), 0, 2).any_prefill


def test_balanced_splits_give_per_ubatch_bounds_over_ranks() -> None:
    """Ubatch 0's bound is the largest first cut, ubatch 1's what the smallest cut leaves of the padded max."""
    d = decide(table([40, 36], [1, 1], splits=[25, 14]), 0, 2)
    assert d.num_tokens_padded == 40 and d.ubatch_token_bounds == (25, 40 - 14)
    d = decide(table([40, 36], [1, 1], splits=[25, 0]), 1, 2)  # rank 1 uses the default cut, 40 // 2
    assert d.ubatch_token_bounds == (25, 20)


@pytest.mark.parametrize("pays, sglang, vllm", [
    ([1, 1], True, True),
    ([1, 0], True, False),   # the largest rank (0) says it pays: SGLang's rule follows it; vLLM needs all
    ([0, 1], False, False),  # the largest rank's measurements say DBO loses at its size
])
def test_the_cost_model_row(pays: list[int], sglang: bool, vllm: bool) -> None:
    t = table([64, 40], [1, 1], pays=pays)
    assert decide(t, 0, 2, "sglang").should_ubatch is sglang
    assert decide(t, 0, 2, "vllm").should_ubatch is vllm


def test_local_decision_matches_single_rank_table() -> None:
    for rule in ("sglang", "vllm"):
        assert local_decision(10, True, rule=rule) == decide(table([10], [1]), 0, 2, rule)
        assert not local_decision(1, True, rule=rule).should_ubatch  # a 1-token step cannot be split
        assert not local_decision(0, False, rule=rule).any_work


def test_coordinate_over_thread_ranks() -> None:
    counts, votes = [48, 20, 0], [True, False, False]

    def rank_main(rank: int, groups: list) -> tuple:
        out = []
        for rule in ("sglang", "vllm"):
            d = coordinate_batch_across_dp(counts[rank], votes[rank], groups[0], rule=rule)
            out.append((d.should_ubatch, d.num_tokens_padded, d.any_work, d.ubatch_token_bounds))
        return tuple(out)

    # sglang: rank 0 decides; rank 1 (under threshold) and rank 2 (idle) ubatch with it, padded to 48.
    # vllm: ranks 1 and 2 veto; everybody keeps stepping unpadded.
    sglang = [(True, 48, True, (24, 24))] * 3
    vllm = [(False, 48, True, None), (False, 20, True, None), (False, 0, True, None)]
    assert run_thread_ranks(3, rank_main, num_groups=1) == list(zip(sglang, vllm, strict=True))


def test_bad_input_raises() -> None:
    with pytest.raises(ValueError, match="num_tokens must be >= 0, got -1"):
        local_decision(-1, False)
    with pytest.raises(ValueError, match="num_tokens_padded=3 is smaller than num_tokens=4"):
        vote_table(4, False, is_prefill=False, num_tokens_padded=3)
    with pytest.raises(ValueError, match="unknown DP ubatch rule 'majority'"):
        local_decision(8, True, rule="majority")
    with pytest.raises(ValueError, match="needs a process group"):
        coordinate_batch_across_dp(4, False, None)
