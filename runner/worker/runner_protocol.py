"""What the engine core calls and reads on a model runner: the one contract between ``runner/core`` and a runner.

The real :class:`~runner.worker.model_runner.ModelRunner` implements it, as do the tests' stand-ins
(``tests/fake_runner.py``). A runner that is also a :class:`~runner.worker.pending.LaunchingRunner` has its steps
launched without waiting for their results; any other runner's :meth:`ModelRunnerProtocol.step` computes a step on
the host. The step's inputs are :class:`~runner.worker.scheduled_batch.SchedulerOutput`, its outputs
:class:`~runner.worker.outputs.ModelRunnerOutput`.
"""
from __future__ import annotations

from typing import AbstractSet, Protocol

import torch

from runner.worker.dbo_step_timing import MeasuredDBO
from runner.worker.outputs import ModelRunnerOutput
from runner.worker.sampler import Sampler
from runner.worker.scheduled_batch import SchedulerOutput


class ModelRunnerProtocol(Protocol):
    """One DP rank's model runner as the engine core, the offline ``LLM`` and the engine-core process see it."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def device(self) -> torch.device | None:
        """Where the steps run (the forward thread is bound to it); None for a stand-in that names none."""

    # cache geometry and vocabulary: the scheduler's budgets (Scheduler.from_runner)
    @property
    def vocab_size(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def num_kv_blocks(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def eos_token_ids(self) -> AbstractSet[int]: ...

    # counters and measurements the engine reports
    @property
    def num_steps(self) -> int:
        """Steps run with work on some rank so far."""

    @property
    def num_ubatched_steps(self) -> int:
        """Of those, the steps split into micro-batches (DBO)."""

    @property
    def sampler(self) -> Sampler:
        """The batched sampler; its ``read_back_s`` is the time spent in the host read of sampled ids."""

    @property
    def cost_model(self) -> MeasuredDBO | None:
        """The measured DBO cost model (None without ``--dbo-cost-model measured``)."""

    def link_times(self) -> tuple[float, float] | None:
        """(modelled all-to-all seconds in flight, seconds of it a ubatch waited for) so far; None without an
        emulated link."""

    def step(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step and return its output; None when no DP rank had work (the same on every rank)."""

    def close(self) -> None:
        """Release what the runner holds (graphs, ubatch threads)."""
