"""The measured DBO cost model: tries both sides, keeps the faster, re-checks the loser with back-off, and
compares a step only with steps that executed the same way (graph replay or eager).

Step times are injected, so the decisions are exact; ``drive`` plays the engine's part (vote, then record
what ran, at the cost the test says each side has). Tests of the look schedule's doubling turn the loss budget
off (``explore_budget=None``); its own test is below. The step timers are tested here too: the CUDA one on
the CPU stand-in of ``torch.cuda``. tests/test_dbo_graphs.py runs the whole runner with the graph stand-in.
"""
from __future__ import annotations

from typing import Any

import pytest

from runner.worker.dbo_cost_model import BucketDecision, DBOCostModel, Execution, StepRecord

EAGER, REPLAYED = Execution.EAGER, Execution.REPLAYED


def drive(model: DBOCostModel, steps: int, cost: dict[bool, float | list[float]], tokens: int = 64,
          prefill: bool = False, execution: Execution = EAGER) -> list[bool]:
    """Run ``steps`` steps; ``cost[ubatched]`` is the step's seconds, or that side's steps' seconds in turn (the
    last one repeats). Returns what each step ran."""
    ran: list[bool] = []
    used = {True: 0, False: 0}
    for _ in range(steps):
        ubatched = model.vote(tokens, prefill, execution)
        side = cost[ubatched]
        seconds = side[min(used[ubatched], len(side) - 1)] if isinstance(side, list) else side
        model.record(StepRecord(tokens, prefill, ubatched, execution), seconds)
        used[ubatched] += 1
        ran.append(ubatched)
    return ran


def test_dbo_that_loses_is_turned_off_after_one_look_at_each_side() -> None:
    ran = drive(DBOCostModel(explore_every=8), 8, {True: 1.6, False: 1.0})
    assert ran == [True, False] + [False] * 6


def test_dbo_that_wins_stays_on_and_the_loser_is_looked_at_less_and_less() -> None:
    ran = drive(DBOCostModel(explore_every=8, explore_budget=None), 30, {True: 0.7, False: 1.0})
    # off runs for its first sample, then once after 8 steps of the bucket, then after 16 more
    assert [i for i, r in enumerate(ran) if not r] == [1, 8, 25]


def test_the_loser_is_checked_again_with_doubling_gaps() -> None:
    model = DBOCostModel(explore_every=4, max_explore_every=16, explore_budget=None)
    ran = drive(model, 60, {True: 1.5, False: 1.0})
    # DBO's first sample, then a look after 4 steps of the bucket, 8 more, 16 (the cap), 16 ...
    assert [i for i, r in enumerate(ran) if r] == [0, 4, 13, 30, 47]


def test_a_wrong_first_call_is_corrected_when_the_costs_change() -> None:
    model = DBOCostModel(explore_every=4, explore_budget=None)
    drive(model, 10, {True: 1.2, False: 1.0})  # DBO loses at first (e.g. a noisy first sample) ...
    ran = drive(model, 30, {True: 0.5, False: 1.0})  # ... then wins: the next look flips the decision
    assert ran.index(True) == 3 and sum(not r for r in ran[3:]) == 2 and all(ran[20:])


def test_one_slow_first_step_does_not_keep_the_losing_side() -> None:
    """The first step without DBO compiles a kernel (50x a normal step): DBO, the real loser, runs until the
    first look back at the other side, and not after it."""
    ran = drive(DBOCostModel(explore_every=8, explore_budget=None), 48, {True: 1.5, False: [50.0, 1.0]})
    # DBO after the slow step, the look back at step 8 turns it off; then DBO only in its own looks
    assert [i for i, r in enumerate(ran) if r] == [0, 2, 3, 4, 5, 6, 7, 17, 34]


def test_one_slow_step_of_the_winner_does_not_flip_the_decision() -> None:
    """A garbage collection or a noisy neighbour in the middle of a run: one step 20x slower."""
    ran = drive(DBOCostModel(explore_every=8, explore_budget=None), 48,
                {True: [0.7] * 5 + [14.0] + [0.7], False: 1.0})
    assert [i for i, r in enumerate(ran) if not r] == [1, 8, 25]  # the same looks as without the slow step


def test_a_side_that_really_slows_down_loses_within_the_window() -> None:
    model = DBOCostModel(explore_every=8, window=3, explore_budget=None)
    ran = drive(model, 48, {True: [0.7] * 6 + [2.0], False: 1.0})
    # DBO's 7th step (run step 7) and all after it cost 2.0: its best of the last 3 passes 1.0 after its
    # third slow step (run steps 7, 9, 10; step 8 was a look at the other side), and it is off from step 11
    assert "".join("D" if r else "." for r in ran[:26]) == "D.DDDDDD.DD" + "." * 14 + "D"


def test_buckets_by_phase_and_size_are_independent() -> None:
    model = DBOCostModel(explore_every=8)
    drive(model, 5, {True: 2.0, False: 1.0}, tokens=32)  # small decodes: DBO loses
    drive(model, 5, {True: 0.5, False: 1.0}, tokens=512)  # large decodes: DBO wins
    drive(model, 5, {True: 0.5, False: 1.0}, tokens=32, prefill=True)  # small prefills: DBO wins
    assert not model.vote(40, False, EAGER) and model.vote(600, False, EAGER) and model.vote(40, True, EAGER)
    assert "decode 32-63 tok eager: DBO off (0.50x)" in model.summary()
    assert "decode 512-1023 tok eager: DBO on (2.00x)" in model.summary()
    assert model.decisions()[0] == BucketDecision(False, 32, 63, EAGER, False, 0.5)


def test_time_is_compared_per_token() -> None:
    """Two steps of the same bucket but different sizes: the longer one is not penalised for its size."""
    model = DBOCostModel()
    model.record(StepRecord(40, False, True, EAGER), 0.40)  # 10 ms per token with DBO
    model.record(StepRecord(60, False, False, EAGER), 0.72)  # 12 ms per token without
    assert model.vote(50, False, EAGER)


def test_looks_at_a_loser_cost_at_most_the_budget_of_the_buckets_time() -> None:
    """DBO twice as slow: a look costs one whole step more, so at a 5 % budget once a look has confirmed the loser
    the next waits 20 steps, not the doubled 8; a loser that barely loses keeps the doubling."""
    ran = drive(DBOCostModel(explore_every=4, max_explore_every=64, explore_budget=0.05), 60, {True: 2.0, False: 1.0})
    assert [i for i, r in enumerate(ran) if r] == [0, 4, 25]
    ran = drive(DBOCostModel(explore_every=4, max_explore_every=64, explore_budget=0.05), 60, {True: 1.1, False: 1.0})
    assert [i for i, r in enumerate(ran) if r] == [0, 4, 13, 30]


def test_a_settled_bucket_times_only_its_first_steps_the_looks_and_the_steps_before_them() -> None:
    """What ``needs_time`` asks of the engine: each side's first ``window`` steps, every look at the loser and the
    winner's last ``window`` steps before it; the bucket's other steps (DBO decided off) are not timed."""
    model = DBOCostModel(explore_every=8, explore_budget=None)
    ran, timed = [], []
    for _ in range(30):
        ubatched = model.vote(64, False, EAGER)
        ran.append(ubatched)
        timed.append(model.needs_time(64, False, EAGER, ubatched))
        if timed[-1]:
            model.record(StepRecord(64, False, ubatched, EAGER), 1.6 if ubatched else 1.0)
    assert [i for i, r in enumerate(ran) if r] == [0, 8, 25]  # the looks of a run that times every step
    assert [i for i, t in enumerate(timed) if not t] == list(range(9, 21)) + list(range(26, 30))
    assert model.needs_time(64, False, None, False)  # two choices that execute differently: always timed
    assert model.needs_time(4096, True, EAGER, False)  # a bucket never voted for


def test_bad_settings_raise() -> None:
    with pytest.raises(ValueError, match="explore_every"):
        DBOCostModel(explore_every=0)
    with pytest.raises(ValueError, match="window must be at least 1 step, got 0"):
        DBOCostModel(window=0)
    with pytest.raises(ValueError, match="explore_budget must lie in"):
        DBOCostModel(explore_budget=0.0)


def test_eager_steps_are_never_compared_with_replayed_ones() -> None:
    """The issue's run: DBO steps replay a graph (4.4 ms), steps without DBO run eager (12 ms) -- and replayed
    plain steps take 2.5 ms. DBO wins no comparison: each execution kind has its own bucket."""
    model = DBOCostModel(explore_every=8)
    model.record(StepRecord(256, False, True, REPLAYED), 4.4)
    model.record(StepRecord(256, False, False, EAGER), 12.0)
    assert model.decisions() == []  # neither kind has run both ways: nothing compared yet
    assert not model.vote(256, False, REPLAYED)  # the replayed bucket wants its plain side measured ...
    assert model.vote(256, False, EAGER)  # ... the eager one its DBO side
    model.record(StepRecord(256, False, False, REPLAYED), 2.5)
    assert not model.vote(256, False, REPLAYED)
    assert [d.describe() for d in model.decisions()] == ["decode 256-511 tok replayed: DBO off (0.57x)"]


def test_a_step_whose_two_choices_execute_differently_is_left_to_the_thresholds() -> None:
    model = DBOCostModel()
    drive(model, 4, {True: 2.0, False: 1.0}, execution=REPLAYED)  # DBO loses where both replay
    assert not model.vote(64, False, REPLAYED)
    assert model.vote(64, False, None)  # one choice would replay and the other not: no like-for-like figure


# ---- step timers ---------------------------------------------------------------------------------------
def test_the_cuda_timer_reads_device_time_one_step_later_without_a_sync() -> None:
    """GPU time of the forward, not the host's: the host launches both steps long before the GPU ends them,
    and a step's time is handed over only once the GPU has passed its end event (``query``, no sync)."""
    from runner.worker.dbo_step_timing import CudaEventStepTimer
    from standins.cuda_events import FakeCuda

    class CountingCuda(FakeCuda):
        num_events = 0

        def Event(self, enable_timing: bool = False) -> Any:
            self.num_events += 1
            return super().Event(enable_timing)

    cuda = CountingCuda()
    timer = CudaEventStepTimer(cuda)
    first, second = StepRecord(64, False, True, REPLAYED), StepRecord(64, False, False, REPLAYED)
    for step, gpu_seconds in ((first, 0.004), (second, 0.0025)):
        timer.start()
        cuda.run(gpu_seconds)  # the forward's kernels
        timer.stop(step)
        cuda.host += 0.0001  # the host goes on launching: it does not wait for the GPU
        cuda.run(0.001)  # sampling, not timed
    assert timer.finished() == [] and cuda.num_syncs == 0  # the GPU is still on the first step
    cuda.host = 0.0045
    assert timer.finished() == [(first, pytest.approx(0.004))]
    cuda.host = 1.0
    assert timer.finished() == [(second, pytest.approx(0.0025))] and cuda.num_syncs == 0
    with pytest.raises(RuntimeError, match="without start"):
        timer.stop(first)
    timer.start()
    cuda.run(0.003)
    timer.stop(first)
    cuda.host = 2.0
    assert timer.finished() == [(first, pytest.approx(0.003))]
    assert cuda.num_events == 4  # the third step reused the events of a step already read


def test_the_host_timer_hands_each_step_over_at_once() -> None:
    from runner.worker.dbo_step_timing import HostStepTimer

    timer = HostStepTimer()
    step = StepRecord(8, True, False, EAGER)
    timer.start()
    timer.stop(step)
    (got, seconds), = timer.finished()
    assert got == step and seconds >= 0 and timer.finished() == []
