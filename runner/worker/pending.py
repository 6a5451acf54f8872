"""A launched step whose results the host has not read yet, and the runner that launches steps that way.

A model runner that is a :class:`LaunchingRunner` splits a step in two: :meth:`LaunchingRunner.launch` does the
host's work and queues the step on the device (placeholders for the previous step's tokens are resolved there),
and returns at once with a :class:`PendingStep`; :meth:`PendingStep.result` waits for the device and reads the
sampled ids. The step loop launches step N+1 before it reads step N's results
(``runner/core/overlap_loop.py``), so the device always has the next step queued while the host works.
"""
from __future__ import annotations

import abc
import time
from typing import Callable

from runner.worker.outputs import ModelRunnerOutput
from runner.worker.scheduled_batch import SchedulerOutput

ReadResult = Callable[[float | None], ModelRunnerOutput]


class PendingStep:
    """``result(timeout_s)`` reads the step's output once (later calls return it again); ``read_at`` is the
    ``time.perf_counter()`` at which the read returned (None before)."""

    def __init__(self, read: ReadResult) -> None:
        self._read: ReadResult | None = read
        self._output: ModelRunnerOutput | None = None
        self.read_at: float | None = None

    @classmethod
    def ready(cls, output: ModelRunnerOutput) -> PendingStep:
        """A step whose output is already on the host (a runner that computes it at launch)."""
        return cls(lambda _timeout: output)

    def result(self, timeout_s: float | None = None) -> ModelRunnerOutput:
        if self._read is not None:
            read, self._read = self._read, None
            self._output = read(timeout_s)
            self.read_at = time.perf_counter()
        assert self._output is not None
        return self._output


class LaunchingRunner(abc.ABC):
    """A model runner whose steps are launched without waiting for their results; its future-token map is on
    the device, so the step loop hands it steps with placeholders as they are."""

    @abc.abstractmethod
    def launch(self, sched: SchedulerOutput) -> PendingStep | None:
        """Queue ``sched`` (placeholders unresolved); None when no DP rank had work (the same on every rank)."""

    @property
    @abc.abstractmethod
    def num_placeholders_resolved(self) -> int:
        """Placeholders this runner's future-token map has resolved so far."""

    def step(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        """Launch ``sched`` and wait for its output: one step at a time (the synchronous loop)."""
        pending = self.launch(sched)
        return None if pending is None else pending.result()
