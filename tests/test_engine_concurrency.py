"""One LLM, several threads: serialised calls return exactly the tokens sequential calls do, or a clear error.

Before the lock, three threads sharing one LLM got other threads' tokens back (10 of 15 results wrong with
the overlap loop, all 15 without it): they shared the runner's persistent input buffers and forward thread.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from fake_runner import FakeRunner
from runner.config import RunnerConfig
from runner.core.runner_output import ModelRunnerOutput
from runner.core.scheduler_output import SchedulerOutput
from runner.entrypoints.llm import LLM
from runner.sampling_params import SamplingParams

THREADS, PROMPTS = 3, 5
JOIN_TIMEOUT_S = 120.0


def _prompts(t: int) -> list[list[int]]:
    return [[(t * 37 + i * 11 + j) % 500 for j in range(5 + i)] for i in range(PROMPTS)]


def _run_threads(target: Callable[[int], None], n: int) -> None:
    threads = [threading.Thread(target=target, args=(t,), name=f"generate-{t}") for t in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(JOIN_TIMEOUT_S)
        assert not th.is_alive(), f"test waited {JOIN_TIMEOUT_S:.0f} s for {th.name} to return from generate"


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap-loop", "synchronous"])
def test_concurrent_generate_returns_each_callers_own_tokens(overlap: bool) -> None:
    llm = LLM(model="tiny-qwen3-moe", disable_overlap_schedule=not overlap)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    want = {t: [o.outputs[0].token_ids for o in llm.generate(_prompts(t), sp, use_tqdm=False)] for t in range(THREADS)}
    assert len({str(v) for v in want.values()}) == THREADS  # different prompts, different tokens: a mix-up shows
    got: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []

    def call(t: int) -> None:
        torch.set_num_threads(1)
        try:
            got[t] = [o.outputs[0].token_ids for o in llm.generate(_prompts(t), sp, use_tqdm=False)]
        except BaseException as e:  # noqa: BLE001 - reported below, with the thread's index
            errors.append(e)

    for _ in range(2):  # twice: the calls start together, so whichever runs first differs
        got.clear()
        _run_threads(call, THREADS)
        assert not errors, errors
        assert got == want
    llm.close()


class GatedRunner(FakeRunner):
    """A fake runner on "DP rank 0 of 2" whose first step waits until the test opens the gate."""

    rank, world_size = 0, 2

    def __init__(self) -> None:
        super().__init__(vocab_size=64)
        self.entered, self.gate = threading.Event(), threading.Event()

    def step(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        self.entered.set()
        assert self.gate.wait(JOIN_TIMEOUT_S), "test never opened the gate"
        return super().step(sched)


def test_concurrent_generate_with_dp_raises_instead_of_mismatching_ranks() -> None:
    runner = GatedRunner()
    llm = LLM(RunnerConfig(data_parallel_size=2), runner=runner)
    # the peer had nothing: no prompt problems (a list is gathered), then no results
    llm._all_gather = lambda obj: [obj, [] if isinstance(obj, list) else ([], 0, 0.0, None, [], 0, 0)]  # type: ignore[method-assign]
    results: list = []

    def first_call() -> None:
        torch.set_num_threads(1)
        results.append(llm.generate([[1, 2]], SamplingParams(max_tokens=2)))

    first = threading.Thread(target=first_call)
    first.start()
    assert runner.entered.wait(JOIN_TIMEOUT_S)
    with pytest.raises(RuntimeError, match="another thread while a call is running on DP rank 0.*one thread per rank"):
        llm.generate([[3]], SamplingParams(max_tokens=1))
    with pytest.raises(RuntimeError, match=r"close\(\) called while generate\(\) is running in another thread"):
        llm.close()
    runner.gate.set()
    first.join(JOIN_TIMEOUT_S)
    assert not first.is_alive() and len(results[0]) == 1 and len(results[0][0].outputs[0].token_ids) == 2
    assert len(llm.generate([[3]], SamplingParams(max_tokens=1))) == 1  # free again once the first call returned
    llm.close()


@pytest.mark.parametrize("overlap", [True, False], ids=["from-the-forward-thread", "from-the-calling-thread"])
def test_generate_from_inside_generate_raises_instead_of_waiting_for_itself(overlap: bool) -> None:
    llm: LLM

    class ReentrantRunner(FakeRunner):
        def step(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
            llm.generate([[1]], SamplingParams(max_tokens=1))
            return super().step(sched)

    llm = LLM(RunnerConfig(disable_overlap_schedule=not overlap), runner=ReentrantRunner(vocab_size=64))
    with pytest.raises(RuntimeError, match=r"LLM.generate called again from inside a generate\(\) call"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2))
    llm.close()  # the lock was released: close does not find a call running
