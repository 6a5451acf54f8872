"""What feeds the DBO cost model: each step's forward time and how it executed.

On CUDA the time is the forward's *device* time: a timing event before and after it on the step's stream,
read one step later with ``query()`` (never a sync), so host work that is the same with DBO and without --
building inputs, sampling, the host running ahead or behind the GPU -- does not blur the comparison. On CPU
there is no device clock, and the forward's host time is what a step costs. Both timers have one interface
(:class:`StepTimer`); tests drive the CUDA one with the CPU stand-in of ``torch.cuda``.

:class:`MeasuredDBO` ties the cost model, the timer and the captured graphs together for ``ModelRunner``:
its vote names how the step would execute (a graph replay with DBO and without, eager both ways, or not the
same way, see ``runner.worker.dbo_cost_model``), and a step is recorded with how it actually ran. What it
decided is in the run summary, the server's ``/metrics`` and, when a trace is recording, the trace.
"""
from __future__ import annotations

import collections
import time
from typing import Any, Protocol

import torch

from cudagraph.dispatch import BatchKind, select_graph
from cudagraph.manager import GraphRunner
from runner.worker.dbo_cost_model import BucketDecision, DBOCostModel, Execution, StepRecord
from ubatch import trace


class StepTimer(Protocol):
    """Times a step's forward: ``start()`` before it, ``stop(step)`` after it; ``finished()`` hands back the
    steps whose time is known by now, oldest first, without waiting for any."""

    def start(self) -> None: ...
    def stop(self, step: StepRecord) -> None: ...
    def finished(self) -> list[tuple[StepRecord, float]]: ...


class HostStepTimer:
    """The forward's host time (``time.perf_counter``): known as soon as the step returns."""

    def __init__(self) -> None:
        self._start: float | None = None
        self._done: list[tuple[StepRecord, float]] = []

    def start(self) -> None:
        self._start = time.perf_counter()

    def stop(self, step: StepRecord) -> None:
        if self._start is None:
            raise RuntimeError("HostStepTimer.stop() without start()")
        self._done.append((step, time.perf_counter() - self._start))
        self._start = None

    def finished(self) -> list[tuple[StepRecord, float]]:
        done, self._done = self._done, []
        return done


class CudaEventStepTimer:
    """The forward's device time: timing events on the current stream around it, collected once the GPU has
    passed the second one (``query()``), so the host never waits for a measurement. Collected events are reused
    (no event is created or destroyed per step).

    ``cuda``: ``torch.cuda``, or the CPU stand-in a test passes.
    """

    # Any: torch.cuda (a module, whose Event torch types loosely) or a test's stand-in with the same Event API
    def __init__(self, cuda: Any = torch.cuda) -> None:
        self.cuda = cuda
        self._start: Any = None  # Any: an event of ``cuda`` (torch.cuda.Event or the stand-in's), None between steps
        self._pending: collections.deque[tuple[StepRecord, Any, Any]] = collections.deque()
        self._free: list[Any] = []  # events whose times were read

    def _event(self) -> Any:
        return self._free.pop() if self._free else self.cuda.Event(enable_timing=True)

    def start(self) -> None:
        self._start = self._event()
        self._start.record()

    def stop(self, step: StepRecord) -> None:
        if self._start is None:
            raise RuntimeError("CudaEventStepTimer.stop() without start()")
        end = self._event()
        end.record()
        self._pending.append((step, self._start, end))
        self._start = None

    def finished(self) -> list[tuple[StepRecord, float]]:
        done = []
        while self._pending and self._pending[0][2].query():  # stream order: the oldest finishes first
            step, start, end = self._pending.popleft()
            done.append((step, start.elapsed_time(end) * 1e-3))
            self._free += (start, end)
        return done


def make_step_timer(device: torch.device) -> StepTimer:
    """Device time on a CUDA device, host time elsewhere."""
    return CudaEventStepTimer() if torch.device(device).type == "cuda" else HostStepTimer()


def replays(graph_runner: GraphRunner | None, num_tokens: int, is_uniform_decode: bool) -> tuple[bool, bool]:
    """Whether a step of ``num_tokens`` tokens on this rank alone would replay a graph without DBO and with it."""
    if graph_runner is None:
        return False, False
    kind = BatchKind.UNIFORM_DECODE if is_uniform_decode else BatchKind.MIXED
    plain, dbo = (select_graph(kind, num_tokens, ubatch, graph_runner.graphs, num_ubatches=graph_runner.num_ubatches,
                               min_real_tokens=num_tokens if ubatch else None).replay for ubatch in (False, True))
    return plain, dbo


class MeasuredDBO:
    """The measured cost model as ``ModelRunner`` uses it: ``vote`` before a step that the thresholds let
    ubatch (recording the steps whose time has come in first), ``start``/``stop`` around the forward's device
    work -- after the step's inputs are built, so a GPU waiting for the host's input work is not counted as the
    forward's time. Only the steps the cost model needs are timed (``DBOCostModel.needs_time``).
    ``graph_runner`` is set once the graphs are captured (``None``: every step runs eager)."""

    def __init__(self, model: DBOCostModel, timer: StepTimer) -> None:
        self.model, self.timer = model, timer
        self._graph_runner: GraphRunner | None = None
        self._executions: dict[tuple[int, bool], Execution | None] = {}  # per (tokens, prefill), for these graphs
        self._voted: tuple[int, bool, Execution | None] | None = None  # the step the last vote was for
        self._timing = False  # whether the step between start() and stop() is being timed
        self._traced: dict[str, tuple[int, bool]] = {}  # bucket -> (recorder, DBO on) last marked in a trace
        self._traced_recorder: int | None = None  # the recording trace every current decision is marked in

    @property
    def graph_runner(self) -> GraphRunner | None:
        return self._graph_runner

    @graph_runner.setter
    def graph_runner(self, graph_runner: GraphRunner | None) -> None:
        self._graph_runner = graph_runner
        self._executions.clear()

    def execution(self, num_tokens: int, is_prefill: bool) -> Execution | None:
        """How the step would run with DBO and without, when that is the same; ``None`` when it is not (looked up
        once per size: the captured graphs do not change while they serve). A size whose step ran otherwise than
        this said (a ubatch split the DBO graph was not captured with runs eager) is ``None`` from then on."""
        key = (num_tokens, is_prefill)
        if key not in self._executions:
            plain, dbo = replays(self._graph_runner, num_tokens, not is_prefill)
            self._executions[key] = None if plain != dbo else Execution.REPLAYED if plain else Execution.EAGER
        return self._executions[key]

    def vote(self, num_tokens: int, is_prefill: bool) -> bool:
        self.collect()
        execution = self.execution(num_tokens, is_prefill)
        self._voted = (num_tokens, is_prefill, execution)
        return self.model.vote(num_tokens, is_prefill, execution)

    def collect(self) -> None:
        """Record every step whose time is known by now; a bucket's decision, when it is new to the recording
        trace, is marked there (an instant on the ``step`` track with the bucket, DBO on or off and the ratio).
        Decisions change only when a step is recorded, so they are looked at only then or for a new trace."""
        done = self.timer.finished()
        for step, seconds in done:
            self.model.record(step, seconds)
        rec = trace.active()
        if rec is None or (not done and self._traced_recorder == id(rec)):
            return
        self._traced_recorder = id(rec)
        for d in self.model.decisions():
            if self._traced.get(d.label) != (id(rec), d.dbo_on):
                self._traced[d.label] = (id(rec), d.dbo_on)
                rec.instant("dbo_cost_model", "decision", "step", bucket=d.label, dbo="on" if d.dbo_on else "off",
                            speedup=round(d.ratio, 3))

    def start(self, num_tokens: int, is_prefill: bool, ubatched: bool) -> None:
        """Just before the forward's device work: times it if this step was voted for and its figure is needed."""
        voted = self._voted
        self._timing = voted is not None and voted[:2] == (num_tokens, is_prefill) and \
            self.model.needs_time(num_tokens, is_prefill, voted[2], ubatched)
        if self._timing:
            self.timer.start()

    def stop(self, num_tokens: int, is_prefill: bool, ubatched: bool) -> None:
        """After the forward: how it ran is the graph runner's last dispatch (eager without graphs)."""
        voted, self._voted = self._voted, None
        if voted is None or voted[:2] != (num_tokens, is_prefill):
            return  # not voted for: the thresholds kept it from ubatching, nothing to compare
        replayed = self._graph_runner is not None and self._graph_runner.last_replayed
        ran = Execution.REPLAYED if replayed else Execution.EAGER
        key = (num_tokens, is_prefill)
        if self._executions.get(key, ran) != ran:
            self._executions[key] = None  # the two choices do not execute alike at this size: never compared
        if self._timing:
            self._timing = False
            self.timer.stop(StepRecord(num_tokens, is_prefill, ubatched, ran))

    def decisions(self) -> list[BucketDecision]:
        return self.model.decisions()
