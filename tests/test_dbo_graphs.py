"""The measured DBO cost model inside the runner, with CUDA graphs (the eager stand-in on CPU).

The runner captures a plain and a DBO graph at every size the cost model may run either way, so both of
its choices replay, and it compares replayed steps with replayed steps only. The step times are scripted
per (ubatched, execution) -- the issue's H200 figures: a DBO replay 4.4 ms, a plain replay 2.5 ms, an
eager step 12 ms -- so which graph each step replays is exact.
"""
from __future__ import annotations

from typing import Any

import pytest

from cudagraph import GraphKey
from graph_replays import install_graphs
from runner.config import RunnerConfig
from runner.core.runner_output import ModelRunnerOutput
from runner.core.scheduler_output import ScheduledChunk, SchedulerOutput
from runner.sampling_params import SamplingParams
from runner.worker.dbo_cost_model import Execution, StepRecord
from runner.worker.model_runner import ModelRunner
from ubatch import trace

NUM_REQS, PROMPT, BLOCKS_PER_REQ = 8, 5, 16


class ScriptedTimer:
    """A step timer whose seconds are what the test says a step of that kind costs."""

    def __init__(self, seconds: dict[tuple[bool, Execution], float]) -> None:
        self.seconds = seconds
        self.steps: list[StepRecord] = []
        self._done: list[tuple[StepRecord, float]] = []

    def start(self) -> None:
        pass

    def stop(self, step: StepRecord) -> None:
        self.steps.append(step)
        self._done.append((step, self.seconds[step.ubatched, step.execution]))

    def finished(self) -> list[tuple[StepRecord, float]]:
        done, self._done = self._done, []
        return done


def h200_times(dbo_replayed: float) -> dict[tuple[bool, Execution], float]:
    return {(True, Execution.REPLAYED): dbo_replayed, (False, Execution.REPLAYED): 2.5e-3,
            (True, Execution.EAGER): 12e-3, (False, Execution.EAGER): 12e-3}


def runner_with_graphs(times: dict[tuple[bool, Execution], float]) -> tuple[ModelRunner, ScriptedTimer,
                                                                            list[GraphKey]]:
    cfg = RunnerConfig(enable_dbo=True, dbo_decode_token_threshold=4, dbo_prefill_token_threshold=4,
                       max_num_seqs=NUM_REQS, max_model_len=64, max_num_batched_tokens=64, block_size=4,
                       num_kv_blocks=NUM_REQS * BLOCKS_PER_REQ)
    runner = ModelRunner(cfg)
    assert runner.graph_runner is None and runner.cost_model is not None  # CPU: no graphs of its own
    replays = install_graphs(runner)
    timer = ScriptedTimer(times)
    runner.cost_model.timer = timer
    return runner, timer, replays.forward


def chunk(i: int, tokens: list[int], computed: int) -> ScheduledChunk:
    return ScheduledChunk(i, tokens, computed, list(range(i * BLOCKS_PER_REQ, (i + 1) * BLOCKS_PER_REQ)), True,
                          SamplingParams(), 0, slot=i)


def sampled(out: ModelRunnerOutput | None) -> list[int]:
    """What every request of a step sampled (each of them samples in these steps)."""
    assert out is not None
    ids = [t for t in out.sampled_token_ids if t is not None]
    assert len(ids) == len(out.sampled_token_ids), f"a request sampled nothing: {out.sampled_token_ids}"
    return ids


def run_decodes(runner: ModelRunner, steps: int) -> list[list[int]]:
    """A prefill of every request (eager: a mixed batch), then ``steps`` greedy decode steps of all of them."""
    last = sampled(runner.step(SchedulerOutput([chunk(i, [3 + i] * PROMPT, 0) for i in range(NUM_REQS)])))
    tokens = [last]
    for s in range(steps):
        last = sampled(runner.step(SchedulerOutput([chunk(i, [last[i]], PROMPT + s) for i in range(NUM_REQS)])))
        tokens.append(last)
    return tokens


def test_the_plan_holds_a_plain_and_a_dbo_graph_where_the_cost_model_may_choose() -> None:
    runner, _, _ = runner_with_graphs(h200_times(4.4e-3))
    try:
        assert runner.graph_runner is not None
        assert sorted(runner.graph_runner.graphs) == [GraphKey(1), GraphKey(2), GraphKey(4), GraphKey(4, (2, 2)),
                                                      GraphKey(8), GraphKey(8, (4, 4))]
    finally:
        runner.close()


@pytest.mark.parametrize("dbo_replayed, decode_keys", [
    # DBO loses (the H200): one look at each side, then the plain graph
    (4.4e-3, [GraphKey(8, (4, 4)), GraphKey(8)] + [GraphKey(8)] * 6),
    # DBO wins (a slow link): one look at the plain graph, then the DBO graph
    (1.5e-3, [GraphKey(8, (4, 4)), GraphKey(8)] + [GraphKey(8, (4, 4))] * 6),
], ids=["dbo-loses", "dbo-wins"])
def test_every_decode_step_replays_and_the_faster_graph_is_kept(dbo_replayed: float,
                                                                decode_keys: list[GraphKey]) -> None:
    runner, timer, replayed = runner_with_graphs(h200_times(dbo_replayed))
    try:
        with trace.recording(trace.TraceRecorder()) as rec:
            run_decodes(runner, len(decode_keys))
        assert replayed == decode_keys  # no decode step ran eager
        prefill, *decodes = timer.steps
        assert prefill.execution is Execution.EAGER and prefill.is_prefill
        assert all(s.execution is Execution.REPLAYED for s in decodes)
        assert runner.cost_model is not None
        [decision] = [d for d in runner.cost_model.decisions() if not d.is_prefill]
        assert decision.execution is Execution.REPLAYED and decision.dbo_on is (dbo_replayed < 2.5e-3)
        assert decision.ratio == pytest.approx(2.5e-3 / dbo_replayed)
        # the trace marks the decision once, when the bucket first ran both ways
        marks = [i.args for i in rec.instants if i.name == "dbo_cost_model" and "decode" in i.args["bucket"]]
        assert marks == [{"bucket": "decode 8-15 tok replayed", "dbo": "on" if decision.dbo_on else "off",
                          "speedup": round(decision.ratio, 3)}]
    finally:
        runner.close()


def test_dbo_and_plain_graphs_sample_the_same_tokens() -> None:
    """Both kinds of graph compute the same step: the tokens of a run that keeps DBO equal one that drops it
    (float32 on CPU)."""
    loses, _, _ = runner_with_graphs(h200_times(4.4e-3))
    wins, _, _ = runner_with_graphs(h200_times(1.5e-3))
    try:
        assert run_decodes(loses, 6) == run_decodes(wins, 6)
    finally:
        loses.close()
        wins.close()


def test_the_run_summary_says_what_the_cost_model_decided() -> None:
    """``generate``'s summary line names each bucket that ran both ways, DBO on or off and the speed-up."""
    from runner.entrypoints.llm import LLM

    llm = LLM(RunnerConfig(enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=2,
                           max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64, block_size=4))
    try:
        llm.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
        stats = llm.last_stats
        assert stats is not None and stats.dbo_decisions
        cost_model = llm.model_runner.cost_model
        assert cost_model is not None
        assert stats.dbo_decisions == [d.describe() for d in cost_model.decisions()]
        assert "DBO cost model: decode 4-7 tok eager: DBO o" in stats.summary()
    finally:
        llm.close()


def test_a_size_whose_dbo_step_runs_eager_is_left_to_the_thresholds() -> None:
    """Both graphs are captured, but the DBO step does not replay (a ``--ubatch-split balanced`` cut the DBO graph
    was not captured with): after that step the size is not compared at all, rather than eager DBO against a
    replayed plain step."""
    runner, timer, _ = runner_with_graphs(h200_times(4.4e-3))
    graph_runner = runner.graph_runner
    assert graph_runner is not None and runner.cost_model is not None
    original = graph_runner.try_replay

    def no_dbo_replay(meta: Any, slices: Any, input_ids: Any, positions: Any) -> Any:
        if slices:
            graph_runner.last_replay = None
            return NotImplemented  # the runner runs the step eager
        return original(meta, slices, input_ids, positions)

    graph_runner.try_replay = no_dbo_replay  # type: ignore[method-assign]
    try:
        run_decodes(runner, 4)
        decodes = [s for s in timer.steps if not s.is_prefill]
        assert decodes[0] == StepRecord(NUM_REQS, False, True, Execution.EAGER)  # predicted replayed, ran eager
        assert runner.cost_model.execution(NUM_REQS, False) is None
        assert all(s.ubatched for s in decodes)  # the thresholds decide: DBO on
        assert not [d for d in runner.cost_model.decisions() if not d.is_prefill]  # nothing compared
    finally:
        runner.close()


def test_once_dbo_is_decided_off_its_steps_are_not_timed() -> None:
    """DBO loses: after one look with it and the plain side's first figures, the plain graph replays untimed
    (no timing events) until the next look is near; the tokens are those of a run that times every step."""
    runner, timer, replayed = runner_with_graphs(h200_times(4.4e-3))
    try:
        tokens = run_decodes(runner, 12)
        decodes = [s for s in timer.steps if not s.is_prefill]
        assert [s.ubatched for s in decodes] == [True, False, False, False]  # window 3 of the plain side
        assert replayed == [GraphKey(8, (4, 4))] + [GraphKey(8)] * 11
    finally:
        runner.close()
    every, every_timer, _ = runner_with_graphs(h200_times(4.4e-3))
    assert every.cost_model is not None
    every.cost_model.model.needs_time = lambda *_: True  # type: ignore[method-assign]
    try:
        assert run_decodes(every, 12) == tokens
        assert len([s for s in every_timer.steps if not s.is_prefill]) == 12
    finally:
        every.close()


def test_a_step_the_thresholds_keep_from_ubatching_asks_the_cost_model_nothing() -> None:
    """Below the thresholds (one rank) no DBO work is done: no vote, no bucket, no timing."""
    runner, timer, replayed = runner_with_graphs(h200_times(4.4e-3))
    runner.cfg = runner.cfg.replace(dbo_decode_token_threshold=64, dbo_prefill_token_threshold=64)
    try:
        run_decodes(runner, 4)
        assert timer.steps == [] and runner.cost_model is not None and runner.cost_model.model.buckets == {}
        assert replayed == [GraphKey(8)] * 4
    finally:
        runner.close()


def test_the_timed_window_opens_once_the_steps_inputs_are_built() -> None:
    """A GPU waiting while the host builds the step's inputs is not the forward's time: when the timer starts, the
    step's token ids are already in the input buffer (each decode step feeds the previous step's tokens)."""
    runner, timer, _ = runner_with_graphs(h200_times(4.4e-3))
    seen: list[list[int]] = []
    scripted_start = timer.start

    def start() -> None:
        seen.append(runner.input_ids[:NUM_REQS].tolist())
        scripted_start()

    timer.start = start  # type: ignore[method-assign]
    try:
        tokens = run_decodes(runner, 3)
        prompt_ids = [3 + i for i in range(NUM_REQS) for _ in range(PROMPT)]
        assert seen == [prompt_ids[:NUM_REQS]] + [[int(t) for t in step] for step in tokens[:3]]
    finally:
        runner.close()
