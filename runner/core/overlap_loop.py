"""The engine's step loop: synchronous, or overlapped as SGLang's overlap scheduler and vLLM's async scheduling.

Overlapped, ``schedule N+1 -> launch N+1 -> read N's results -> process N -> schedule N+2``: steps are launched
in order (``runner.launch``), in the scheduling thread where the runner queues them on a device, on one executor
thread where the forward computes on the host (``make_step_launcher``); a launch never reads a result, so the
device always has the next step queued while the host works; the runner resolves placeholders for tokens still
in flight from the steps it launched before. Every wait is bounded by ``step_timeout_s``; ``LoopStats`` records
the launches that had to wait and why. Design: docs/design_notes.md, "Engine core: scheduler and step loops".
"""
from __future__ import annotations

import abc
import collections
import functools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar, Union, cast

import torch

from runner.core.runner_output import ModelRunnerOutput, PendingStep
from runner.core.runner_protocol import ModelRunnerProtocol
from runner.core.scheduler import Request, Scheduler
from runner.core.scheduler_output import SchedulerOutput
from ubatch import trace

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
OnResults = Callable[[SchedulerOutput, ModelRunnerOutput, list[Request]], None]


class Launch(Protocol[T_co]):
    """A submitted launch: ``result(timeout)`` returns what it returned, or raises what it raised (a
    ``concurrent.futures.Future`` is one)."""

    def result(self, timeout: float | None = None) -> T_co: ...


class StepLauncher(abc.ABC):
    """Runs the overlap loop's step launches in order and times them: ``busy_s`` accumulates the time spent
    launching, ``busy_cpu_s`` the launching thread's CPU time in it (``time.thread_time``: without the waits for
    the GIL that ``busy_s`` also counts). ``submit(fn)`` returns a :class:`Launch` of ``fn()``."""

    name = "launcher"

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.busy_cpu_s = 0.0

    def _timed(self, fn: Callable[[], T]) -> T:
        """``fn()``, its time added to ``busy_s`` / ``busy_cpu_s`` whether it returns or raises."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn()
        finally:
            self.busy_s += time.perf_counter() - t0  # before the result: a waiter then sees the total
            self.busy_cpu_s += time.thread_time() - c0

    @property
    def thread_id(self) -> int | None:
        """The ``threading.get_ident()`` of a thread of the launcher's own (None: launches run in the caller's)."""
        return None

    @abc.abstractmethod
    def submit(self, fn: Callable[[], T]) -> Launch[T]:
        """Launch ``fn`` after every step submitted before it."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop what the launcher started."""


class _Done(Generic[T]):
    """A launch that already ran: its value, or the exception it raised."""

    def __init__(self, value: T | None = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error

    def result(self, timeout: float | None = None) -> T:
        if self._error is not None:
            raise self._error
        return cast(T, self._value)


class InlineLauncher(StepLauncher):
    """Launches a step at once, in the scheduling thread: for a runner that queues its steps on a device (a GPU,
    the emulated device), whose launch only builds inputs and queues work. The scheduling thread launches N+1,
    then reads N, so the device still has the next step queued, with no hand-off between threads and no second
    thread taking the GIL at every torch call: vLLM's single-process executor does the same (``UniProcExecutor``
    runs ``execute_model`` in the engine core's thread and hands back a completed Future; only the read of the
    sampled ids waits for the device). On CUDA the calling thread is made current on the runner's device."""

    name = "inline"

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__()
        self._cuda_index: int | None = None
        if device is not None and torch.device(device).type == "cuda":
            self._cuda_index = torch.device(device).index or 0

    def submit(self, fn: Callable[[], T]) -> Launch[T]:
        if self._cuda_index is not None and torch.cuda.current_device() != self._cuda_index:
            torch.cuda.set_device(self._cuda_index)
        try:
            return _Done(self._timed(fn))
        except BaseException as exc:  # noqa: BLE001 - raised by result(), where the loop reads the launch
            return _Done(error=exc)

    def close(self) -> None:
        """Nothing to stop: launches ran in the caller's thread."""


class ForwardExecutor(StepLauncher):
    """One persistent thread that runs submitted steps in order: for a forward computed on the CPU, whose torch
    kernels release the GIL, so the scheduling thread's Python can run beside them.

    A new Python thread ignores the process's ``torch.set_num_threads`` (and, on CUDA, the current device),
    so both are set inside it.
    """

    def __init__(self, num_threads: int | None = None, device: torch.device | None = None,
                 name: str = "ubatch-forward") -> None:
        super().__init__()
        self.num_threads = num_threads if num_threads is not None else torch.get_num_threads()
        self.device = device
        self.name = name
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        torch.set_num_threads(self.num_threads)
        if self.device is not None and torch.device(self.device).type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            job = self._queue.get()
            if job is None:
                return
            job()

    @property
    def thread_id(self) -> int | None:
        """The executor thread's ``threading.get_ident()`` (set once ``start()`` has returned)."""
        return self._thread.ident

    def submit(self, fn: Callable[[], T]) -> Launch[T]:
        if not self._thread.is_alive():
            raise RuntimeError("the forward executor is closed")
        fut: Future[T] = Future()
        self._queue.put(functools.partial(self._run, fn, fut))
        return fut

    def _run(self, fn: Callable[[], T], fut: Future[T]) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            result = self._timed(fn)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting CPU thread
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=30)


@dataclass
class LoopStats:
    """One generate() call's loop. ``forward_idle_fraction``: share of the wall time the forward side was not
    running or launching a step (waiting for the CPU to schedule / process), ``1 - forward_busy_s / wall_s``.
    With a runner that queues its steps on a device the forward side's busy time is its launches (host work);
    the wait for the device is then the CPU thread's ``copy_wait_s``."""

    overlap: bool
    wall_s: float = 0.0
    forward_busy_s: float = 0.0
    cpu_work_s: float = 0.0  # CPU thread: schedule + process results (not waiting for copy_done)
    copy_wait_s: float = 0.0  # CPU thread blocked on copy_done
    # Forward side: part of forward_busy_s spent in the step's one host read of sampled ids, i.e. waiting for the
    # device (Sampler.read_back_s); forward_busy_s - read_wait_s is the forward side's own host work. With the
    # overlap loop the forward side reads only the steps a runner computed at launch (a ready PendingStep, a
    # stand-in); the model runner's steps are read on the CPU thread, inside copy_wait_s.
    read_wait_s: float = 0.0
    # Forward side's CPU time in the same calls (time.thread_time): its own work, without the waits for the GIL
    # (held by the CPU thread) that forward_busy_s counts too.
    forward_cpu_s: float = 0.0
    num_steps: int = 0  # launched steps with work somewhere (including this rank's dummy steps)
    num_overlapped_steps: int = 0  # launched while the previous step's results were still unprocessed
    num_placeholders_resolved: int = 0  # inputs the runner took from its future-token map
    sync_reasons: collections.Counter = field(default_factory=collections.Counter)
    # Steps (0-based launch order, steps with work) whose launch began only after the previous step's results
    # had been read on the host: with the pipelined loop only after a sync point (sync_reasons) or when the host
    # fell behind the device; with the synchronous loop every step after the first.
    launches_after_read: list[int] = field(default_factory=list)

    @property
    def forward_idle_s(self) -> float:
        return max(0.0, self.wall_s - self.forward_busy_s)

    @property
    def forward_idle_fraction(self) -> float:
        return self.forward_idle_s / self.wall_s if self.wall_s > 0 else 0.0


StepLoop = Union["SyncStepLoop", "OverlapStepLoop"]


def read_back_seconds(runner: ModelRunnerProtocol) -> float:
    """The runner's sampler's time in its host read so far."""
    return runner.sampler.read_back_s


def use_overlap_loop(disable_overlap_schedule: bool | None, device: torch.device | None,
                     emulated_device: bool = False) -> bool:
    """Whether the engine runs the overlap loop: as ``--disable-overlap-schedule`` says when it is set; by
    default (None) unless the forward runs on the CPU without ``--emulate-device`` (with it, the steps have a
    device time that runs asynchronously to the host, as on a GPU).

    On a GPU the forward's kernels run asynchronously to the host thread, so the host's work for step N+1 fits
    inside step N. On the CPU the forward is host work too, and both threads are Python under one GIL: the
    scheduling thread's work is paid inside the forward instead of next to it, plus the hand-offs, so the
    synchronous loop is faster there (measured: ``docs/benchmarks.md``, engine host time per step). A runner
    that names no device (a test stand-in) gets the overlap loop.
    """
    if disable_overlap_schedule is not None:
        return not disable_overlap_schedule
    if device is None or emulated_device:
        return True
    return torch.device(device).type != "cpu"


def make_step_launcher(device: torch.device | None, emulated_device: bool = False) -> StepLauncher:
    """Where the overlap loop launches its steps: in the scheduling thread (:class:`InlineLauncher`) where the
    runner queues them on a device (a GPU, or the CPU with ``--emulate-device``, whose forward stands for a GPU
    launch's host work); on a thread of its own (:class:`ForwardExecutor`) where the forward is computed on the
    host (the CPU, a stand-in runner that names no device), so that its GIL-free kernels run beside the
    scheduling thread's work."""
    if device is not None and (emulated_device or torch.device(device).type != "cpu"):
        return InlineLauncher(device)
    return ForwardExecutor(device=device)


def make_step_loop(sched: Scheduler, runner: ModelRunnerProtocol, *, executor: StepLauncher | None = None,
                   consecutive_prefill_overlap: bool = True, before_launch: Callable[[int], None] | None = None,
                   on_results: OnResults | None = None, step_timeout_s: float | None = None) -> StepLoop:
    """A loop over ``sched`` that runs one iteration per :meth:`step` call: overlapped on ``executor``, or
    synchronously in the caller's thread when it is None.

    ``step()`` returns False once no DP rank had work (every rank sees that in the same step; nothing of this
    rank is in flight then); requests may be added to ``sched`` between calls and join the next step.
    ``finish()`` waits for any step still in flight (after an error too) and returns the loop's stats.
    ``before_launch(k)`` runs before the k-th step is scheduled; ``on_results(out, output, finished)`` after
    each step's results are applied (outputs, progress, streaming). ``step_timeout_s``: how long the CPU
    thread waits for one step on the executor before a :class:`StepTimeoutError` (None: forever)."""
    if executor is None:
        return SyncStepLoop(sched, runner, before_launch, on_results)
    return OverlapStepLoop(sched, runner, executor, consecutive_prefill_overlap, before_launch, on_results,
                           step_timeout_s)


class SyncStepLoop:
    """Schedule, run, process: one step at a time in the caller's thread."""

    def __init__(self, sched: Scheduler, runner: ModelRunnerProtocol, before_launch: Callable[[int], None] | None,
                 on_results: OnResults | None) -> None:
        self.sched, self.runner = sched, runner
        self.before_launch, self.on_results = before_launch, on_results
        self.stats = LoopStats(overlap=False)
        self._start = time.perf_counter()
        self._read0 = read_back_seconds(runner)
        self._resolved0 = runner.num_placeholders_resolved

    def step(self) -> bool:
        stats, sched = self.stats, self.sched
        if self.before_launch is not None:
            self.before_launch(stats.num_steps)
        t0 = time.perf_counter()
        with trace.region("schedule", "step", track="scheduler"):
            out = sched.schedule()
        t1, c1 = time.perf_counter(), time.thread_time()
        output = self.runner.step(out)
        t2 = time.perf_counter()
        stats.forward_busy_s += t2 - t1
        stats.forward_cpu_s += time.thread_time() - c1
        if output is None:  # no DP rank had work: every rank leaves the loop in this same step
            stats.cpu_work_s += t1 - t0
            return False
        if stats.num_steps:  # launched after the previous step's results were read, by construction
            stats.launches_after_read.append(stats.num_steps)
        stats.num_steps += 1
        with trace.region("update", "step", track="scheduler"):
            done = sched.update(out, output.sampled_token_ids)
        if self.on_results is not None:
            self.on_results(out, output, done)
        stats.cpu_work_s += (t1 - t0) + (time.perf_counter() - t2)
        return True

    def finish(self) -> LoopStats:
        self.stats.wall_s = time.perf_counter() - self._start
        self.stats.read_wait_s = read_back_seconds(self.runner) - self._read0
        self.stats.num_placeholders_resolved = self.runner.num_placeholders_resolved - self._resolved0
        return self.stats


@dataclass
class _Launched:
    out: SchedulerOutput
    # set by the executor once the step is launched (its PendingStep)
    launched: Launch[PendingStep | None] | None = None
    launch_started: float = 0.0  # perf_counter when the executor began launching it
    pending: PendingStep | None = None  # once launched: its results, read by the CPU thread


class StepTimeoutError(TimeoutError):
    """The forward executor neither finished nor failed a step within the loop's ``step_timeout_s``."""


class OverlapStepLoop:
    """Schedule N+1 and launch it, then process N while N+1 runs (module docstring)."""

    def __init__(self, sched: Scheduler, runner: ModelRunnerProtocol, executor: StepLauncher,
                 consecutive_prefill_overlap: bool, before_launch: Callable[[int], None] | None,
                 on_results: OnResults | None, step_timeout_s: float | None = None) -> None:
        self.sched, self.runner, self.executor = sched, runner, executor
        self.step_timeout_s = step_timeout_s
        self.consecutive_prefill_overlap = consecutive_prefill_overlap
        self.before_launch, self.on_results = before_launch, on_results
        self.stats = LoopStats(overlap=True)
        self._inflight: _Launched | None = None  # launched, results not yet processed
        self._launched: _Launched | None = None  # launched in the current iteration, not yet handed on
        self._busy0, self._start = executor.busy_s, time.perf_counter()
        self._cpu0 = executor.busy_cpu_s
        self._forward_read_s = 0.0  # the host reads of steps the runner computed at launch (on the executor)
        self._resolved0 = runner.num_placeholders_resolved
        self._previous: _Launched | None = None  # the last step with work whose results were read
        self._failed: BaseException | None = None  # what step() raised, if it did

    def _launch(self, out: SchedulerOutput) -> _Launched:
        item = _Launched(out)

        def launch() -> PendingStep | None:  # on the executor thread
            item.launch_started = time.perf_counter()
            read0 = read_back_seconds(self.runner)
            pending = self.runner.launch(out)
            if pending is not None and pending.read_at_launch:  # read here, not by the CPU thread
                self._forward_read_s += read_back_seconds(self.runner) - read0
            return pending

        item.launched = self.executor.submit(launch)
        return item

    def _wait(self, launched: _Launched) -> ModelRunnerOutput | None:
        """The step's output (or its exception): its launch on the executor, then its results, each waited for
        at most ``step_timeout_s``."""
        assert launched.launched is not None
        try:
            pending = launched.launched.result(timeout=self.step_timeout_s)
        except FutureTimeoutError:
            raise StepTimeoutError(
                f"the engine's CPU thread waited {self.step_timeout_s:g} s for a step of {launched.out.num_reqs} "
                f"chunks on the forward executor thread {self.executor.name!r}, which neither finished nor failed "
                "it (raise --dist-timeout-s if one step legitimately takes longer)") from None
        if pending is None:
            return None
        launched.pending = pending
        try:
            with trace.region("read", "step", track="scheduler"):  # waits for the device, the next step queued
                return pending.result(self.step_timeout_s)
        except TimeoutError as exc:
            raise StepTimeoutError(f"the results of a step of {launched.out.num_reqs} chunks were not on the host "
                                   f"after {self.step_timeout_s:g} s: {exc}") from None

    def _count_wait(self, launched: _Launched) -> None:
        """Whether ``launched`` began launching only after the previous step's results had been read."""
        prev, self._previous = self._previous, launched
        if prev is None or prev.pending is None or prev.pending.read_at is None:
            return
        if prev.pending.read_at <= launched.launch_started:
            self.stats.launches_after_read.append(self.stats.num_steps - 1)

    def _process(self, launched: _Launched) -> None:
        t0 = time.perf_counter()
        output = self._wait(launched)  # the only CPU wait
        t1 = time.perf_counter()
        self.stats.copy_wait_s += t1 - t0
        if output is None:
            raise RuntimeError(f"model runner reported no work for a step of {launched.out.num_reqs} chunks")
        self._count_wait(launched)
        with trace.region("update", "step", track="scheduler"):
            done = self.sched.update(launched.out, output.sampled_token_ids)
            if self.on_results is not None:
                self.on_results(launched.out, output, done)
        self.stats.cpu_work_s += time.perf_counter() - t1

    def _process_inflight(self, reason: str | None = None) -> None:
        inflight, self._inflight = self._inflight, None
        assert inflight is not None
        self._process(inflight)
        if reason is not None:
            self.stats.sync_reasons[reason] += 1

    def _schedule(self) -> SchedulerOutput:
        t0 = time.perf_counter()
        with trace.region("schedule", "step", track="scheduler"):
            out = self.sched.schedule()
        self.stats.cpu_work_s += time.perf_counter() - t0
        return out

    def step(self) -> bool:
        try:
            return self._step()
        except BaseException as exc:
            self._failed = exc
            raise

    def _step(self) -> bool:
        stats, sched = self.stats, self.sched
        if self.before_launch is not None:
            self.before_launch(stats.num_steps)
        if self._inflight is not None and sched.wants_sync:
            self._process_inflight("preemption")
        out = self._schedule()
        if self._inflight is not None and not out.num_reqs:
            self._process_inflight("nothing_to_schedule")
            carried = out.finished_req_ids
            out = self._schedule().with_finished_before(carried)
        elif self._inflight is not None and not self.consecutive_prefill_overlap and out.has_prefill \
                and self._inflight.out.has_prefill:
            self._process_inflight("consecutive_prefill")
        self._launched = self._launch(out)
        if self._inflight is not None:
            stats.num_overlapped_steps += 1
            self._process_inflight()  # N-1's results while N runs
        if out.num_reqs:
            self._inflight, self._launched = self._launched, None
            stats.num_steps += 1
            return True
        # Empty here (dummy step, or the end): nothing is in flight, nothing to overlap.
        launched, self._launched = self._launched, None
        output = self._wait(launched)
        if output is None:
            return False
        stats.num_steps += 1
        stats.sync_reasons["dummy"] += 1
        sched.update(out, output.sampled_token_ids)
        return True

    def finish(self) -> LoopStats:
        """Wait for the steps already handed to the executor before anyone reuses the runner. After ``step()``
        raised, that error is the one to report: a step in flight that failed too is added to it as a note;
        otherwise (the caller stopped stepping) its error is raised here."""
        errors: list[Exception] = []
        for pending in (self._inflight, self._launched):
            if pending is not None:
                try:
                    self._wait(pending)
                except Exception as exc:  # noqa: BLE001 - the step's own error (or a StepTimeoutError), reported below
                    errors.append(exc)
        self._inflight = self._launched = None
        stats = self.stats
        stats.wall_s = time.perf_counter() - self._start
        stats.forward_busy_s = self.executor.busy_s - self._busy0
        stats.forward_cpu_s = self.executor.busy_cpu_s - self._cpu0
        stats.read_wait_s = self._forward_read_s
        stats.num_placeholders_resolved = self.runner.num_placeholders_resolved - self._resolved0
        if errors and self._failed is not None:
            for err in errors:
                self._failed.add_note(f"a step still in flight when the loop stopped failed too: {err!r}")
        elif errors:
            raise errors[0]
        return stats
