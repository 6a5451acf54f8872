"""What the engine core calls and reads on a model runner: the one contract between ``runner/core`` and a runner.

The engine core owns it, with the step's inputs (:class:`~runner.core.scheduler_output.SchedulerOutput`) and
outputs (:class:`~runner.core.runner_output.ModelRunnerOutput`, :class:`~runner.core.runner_output.PendingStep`);
the real :class:`~runner.worker.model_runner.ModelRunner` implements it, as do the tests' stand-ins
(``tests/fake_runner.py``). The overlap loop launches every step with :meth:`ModelRunnerProtocol.launch` and reads
its output later; the synchronous loop calls :meth:`ModelRunnerProtocol.step`.
"""
from __future__ import annotations

from collections.abc import Set as AbstractSet
from typing import Protocol

import torch

from runner.core.runner_output import ModelRunnerOutput, PendingStep
from runner.core.scheduler_output import SchedulerOutput
from runner.worker.dbo_step_timing import MeasuredDBO
from runner.worker.sampler import Sampler


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

    @property
    def num_placeholders_resolved(self) -> int:
        """Placeholders (tokens of a step still in flight, ``runner/core/slots.py``) this runner has resolved
        so far."""

    def launch(self, sched: SchedulerOutput) -> PendingStep | None:
        """Start one step, its placeholders unresolved (the runner resolves them from the steps it launched
        before), and return without waiting for its output; None when no DP rank had work (the same on every
        rank). A runner that computes the step here returns :meth:`PendingStep.ready`."""

    def step(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        """Launch one step and wait for its output (the synchronous loop: no placeholders); None when no DP rank
        had work."""

    def close(self) -> None:
        """Release what the runner holds (graphs, ubatch threads)."""
