"""The step contract between the scheduler and a model runner (runner/core/scheduler_output.py,
runner/core/overlap_loop.py): a scheduled step is read-only and holds snapshots, never the scheduler's live
requests, so scheduling the next step cannot change one in flight; a step in flight that fails is reported."""
from __future__ import annotations

import dataclasses

import pytest

from fake_runner import FakeRunner, run_steps
from runner.core.overlap_loop import ForwardExecutor, make_step_loop
from runner.core.runner_output import ModelRunnerOutput
from runner.core.scheduler import Request, Scheduler
from runner.core.scheduler_output import RequestSnapshot, SchedulerOutput
from runner.sampling_params import SamplingParams


def make_sched(runner: FakeRunner) -> Scheduler:
    return Scheduler(max_num_seqs=4, max_num_batched_tokens=16, block_size=runner.block_size,
                     num_kv_blocks=runner.num_kv_blocks, max_model_len=runner.max_model_len,
                     vocab_size=runner.vocab_size)


def test_a_scheduled_step_is_read_only_and_unchanged_by_the_next_schedule() -> None:
    runner = FakeRunner()
    sched = make_sched(runner)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    sched.add_request([1, 2, 3], params, seed=7, req_id=0)
    first = sched.schedule()
    before = (first.req_ids.tolist(), first.num_computed.tolist(), first.query_lens.tolist(),
              first.token_ids.tolist(), first.sample.tolist(), first.requests)
    sched.add_request([4, 5], params, req_id=1)
    second = sched.schedule()  # the request of `first` advances (a decode on its placeholder), 1 is admitted
    assert second.req_ids.tolist() == [0, 1] and second.num_computed.tolist() == [3, 0]
    assert (first.req_ids.tolist(), first.num_computed.tolist(), first.query_lens.tolist(),
            first.token_ids.tolist(), first.sample.tolist(), first.requests) == before
    assert first.requests == (RequestSnapshot(params, 7, (1, 2, 3)),)
    assert not any(isinstance(r, Request) for r in first.requests + second.requests)
    for array in (first.req_ids, first.slots, first.num_computed, first.query_lens, first.sample, first.token_ids):
        with pytest.raises(ValueError, match="read-only"):
            array[0] = 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.requests[0].seed = 8  # type: ignore[misc]


class FailingRunner(FakeRunner):
    """Steps from ``fail_from`` on raise, naming their step id."""

    def __init__(self, fail_from: int) -> None:
        super().__init__()
        self.fail_from = fail_from

    def step(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        if sched.num_reqs and sched.step_id >= self.fail_from:
            raise RuntimeError(f"step {sched.step_id} failed")
        return super().step(sched)


def test_a_step_in_flight_that_fails_after_the_loop_failed_is_a_note_on_the_first_error() -> None:
    runner = FailingRunner(fail_from=2)
    sched = make_sched(runner)
    sched.add_request([1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True))
    executor = ForwardExecutor(num_threads=1)
    try:
        with pytest.raises(RuntimeError, match="step 2 failed") as caught:
            run_steps(sched, runner, executor=executor, step_timeout_s=30)
    finally:
        executor.close()
    notes = getattr(caught.value, "__notes__", [])
    assert len(notes) == 1 and notes[0].startswith("a step still in flight when the loop stopped failed too")


def test_finish_raises_the_error_of_a_step_left_in_flight() -> None:
    runner = FailingRunner(fail_from=1)
    sched = make_sched(runner)
    sched.add_request([1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True))
    executor = ForwardExecutor(num_threads=1)
    try:
        loop = make_step_loop(sched, runner, executor=executor, step_timeout_s=30)
        assert loop.step()  # launched; its failure is on the executor, not read yet
        with pytest.raises(RuntimeError, match="step 1 failed"):
            loop.finish()
    finally:
        executor.close()
