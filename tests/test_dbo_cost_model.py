"""The measured DBO cost model: tries both sides, keeps the faster, re-checks the loser with back-off.

Step times are injected, so the decisions are exact; ``drive`` plays the engine's part (vote, then record
what ran, at the cost the test says each side has).
"""
from __future__ import annotations

import pytest

from runner.worker.dbo_cost_model import DBOCostModel


def drive(model: DBOCostModel, steps: int, cost: dict[bool, float | list[float]], tokens: int = 64,
          prefill: bool = False) -> list[bool]:
    """Run ``steps`` steps; ``cost[ubatched]`` is the step's seconds, or that side's steps' seconds in turn (the
    last one repeats). Returns what each step ran."""
    ran: list[bool] = []
    used = {True: 0, False: 0}
    for _ in range(steps):
        ubatched = model.vote(tokens, prefill)
        side = cost[ubatched]
        seconds = side[min(used[ubatched], len(side) - 1)] if isinstance(side, list) else side
        model.record(tokens, prefill, ubatched, seconds)
        used[ubatched] += 1
        ran.append(ubatched)
    return ran


def test_dbo_that_loses_is_turned_off_after_one_look_at_each_side() -> None:
    ran = drive(DBOCostModel(explore_every=8), 8, {True: 1.6, False: 1.0})
    assert ran == [True, False] + [False] * 6


def test_dbo_that_wins_stays_on_and_the_loser_is_looked_at_less_and_less() -> None:
    ran = drive(DBOCostModel(explore_every=8), 30, {True: 0.7, False: 1.0})
    # off runs for its first sample, then once after 8 steps of the bucket, then after 16 more
    assert [i for i, r in enumerate(ran) if not r] == [1, 8, 25]


def test_the_loser_is_checked_again_with_doubling_gaps() -> None:
    model = DBOCostModel(explore_every=4, max_explore_every=16)
    ran = drive(model, 60, {True: 1.5, False: 1.0})
    # DBO's first sample, then a look after 4 steps of the bucket, 8 more, 16 (the cap), 16 ...
    assert [i for i, r in enumerate(ran) if r] == [0, 4, 13, 30, 47]


def test_a_wrong_first_call_is_corrected_when_the_costs_change() -> None:
    model = DBOCostModel(explore_every=4)
    drive(model, 10, {True: 1.2, False: 1.0})  # DBO loses at first (e.g. a noisy first sample) ...
    ran = drive(model, 30, {True: 0.5, False: 1.0})  # ... then wins: the next look flips the decision
    assert ran.index(True) == 3 and sum(not r for r in ran[3:]) == 2 and all(ran[20:])


def test_one_slow_first_step_does_not_keep_the_losing_side() -> None:
    """The first step without DBO compiles a kernel (50x a normal step): DBO, the real loser, runs until the
    first look back at the other side, and not after it."""
    ran = drive(DBOCostModel(explore_every=8), 48, {True: 1.5, False: [50.0, 1.0]})
    # DBO after the slow step, the look back at step 8 turns it off; then DBO only in its own looks
    assert [i for i, r in enumerate(ran) if r] == [0, 2, 3, 4, 5, 6, 7, 17, 34]


def test_one_slow_step_of_the_winner_does_not_flip_the_decision() -> None:
    """A garbage collection or a noisy neighbour in the middle of a run: one step 20x slower."""
    ran = drive(DBOCostModel(explore_every=8), 48, {True: [0.7] * 5 + [14.0] + [0.7], False: 1.0})
    assert [i for i, r in enumerate(ran) if not r] == [1, 8, 25]  # the same looks as without the slow step


def test_a_side_that_really_slows_down_loses_within_the_window() -> None:
    model = DBOCostModel(explore_every=8, window=3)
    ran = drive(model, 48, {True: [0.7] * 6 + [2.0], False: 1.0})
    # DBO's 7th step (run step 7) and all after it cost 2.0: its best of the last 3 passes 1.0 after its
    # third slow step (run steps 7, 9, 10; step 8 was a look at the other side), and it is off from step 11
    assert "".join("D" if r else "." for r in ran[:26]) == "D.DDDDDD.DD" + "." * 14 + "D"


def test_buckets_by_phase_and_size_are_independent() -> None:
    model = DBOCostModel(explore_every=8)
    drive(model, 5, {True: 2.0, False: 1.0}, tokens=32)  # small decodes: DBO loses
    drive(model, 5, {True: 0.5, False: 1.0}, tokens=512)  # large decodes: DBO wins
    drive(model, 5, {True: 0.5, False: 1.0}, tokens=32, prefill=True)  # small prefills: DBO wins
    assert not model.vote(40, False) and model.vote(600, False) and model.vote(40, True)
    assert "decode 32-63 tok: DBO off (0.50x)" in model.summary()
    assert "decode 512-1023 tok: DBO on (2.00x)" in model.summary()


def test_time_is_compared_per_token() -> None:
    """Two steps of the same bucket but different sizes: the longer one is not penalised for its size."""
    model = DBOCostModel()
    model.record(40, False, True, 0.40)  # 10 ms per token with DBO
    model.record(60, False, False, 0.72)  # 12 ms per token without
    assert model.vote(50, False)


def test_bad_settings_raise() -> None:
    with pytest.raises(ValueError, match="explore_every"):
        DBOCostModel(explore_every=0)
    with pytest.raises(ValueError, match="window must be at least 1 step, got 0"):
        DBOCostModel(window=0)
