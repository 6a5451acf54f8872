"""The ping-pong protocol: N micro-batches ("ubatches"), exactly one running Python at a time.

Each ubatch owns a :class:`UBatchContext`. ``dbo_yield()`` hands control to the next ubatch in ring order
and returns when control comes back, so while one ubatch enqueues compute the other's all-to-all is in
flight. Two executors run the ubatches (``UBatchConfig.executor``): ``greenlet`` (the default) runs every
ubatch as a greenlet on one persistent worker thread, so a handoff is a stack switch; ``threads`` gives
each ubatch its own OS thread parked on a ``threading.Lock`` used as a binary semaphore (vLLM's model).
What each handoff costs, against vLLM's ``threading.Event`` pair, is measured by
``benchmarks/bench_handoff.py`` and reported in docs/benchmarks.md.

Contexts are found through a thread-local, so a thread that is not running a ubatch (the scheduler, a
metrics thread) sees DBO as off instead of tripping over another thread's state.

Failure rules (vLLM has none of these): an exception in any ubatch aborts the step and wakes every peer
blocked in a handoff (they raise :class:`DBOAbortedError`); a handoff that waits longer than the timeout
raises :class:`DBOTimeoutError` naming the ubatch, its yield number and whom it waited for; a finished
ubatch passes control on, so unequal yield counts never hang and are reported after the step.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ubatch import streams, trace
from ubatch.forward_context import set_thread_forward_context

_local = threading.local()


class DBOError(RuntimeError):
    """Base class of protocol errors."""


class DBOTimeoutError(DBOError):
    """A handoff (or the whole step) waited longer than the configured timeout."""


class DBOAbortedError(DBOError):
    """Raised in a peer ubatch when another ubatch failed; the caller sees the original exception instead."""


class DBOYieldMismatchError(DBOError):
    """Ubatches yielded a different number of times: a data-dependent yield that would deadlock on GPU."""


class StepState:
    """What the ubatches of one step share: who finished, the first error, yield counts, progress."""

    def __init__(self, num_ubatches: int, executor: str) -> None:
        self.num_ubatches = num_ubatches
        self.executor = executor
        self.lock = threading.Lock()
        self.finished = [False] * num_ubatches
        self.yield_counts = [0] * num_ubatches
        self.error: BaseException | None = None
        self.error_ubatch: int | None = None
        self.aborted = False
        self.contexts: list[UBatchContext] = []
        self.running: int | None = None  # who holds control now
        self.handed_by: int | None = None  # who handed it over (and now waits)
        self.progress = 0  # bumped at every resume; the caller watches it to detect a stall
        self.last_finished = 0
        self.done_at = 0.0  # perf_counter when the last ubatch finished (the caller's wake-up is traced from it)
        self.first_resume_at = 0.0  # when the first ubatch started running (the worker's wake-up ends there)
        self.handoff_at = 0.0  # when control last left a ubatch (traced: the switch ends when the next resumes)
        self._remaining = num_ubatches
        self._all_done = threading.Event()

    def fail(self, ubatch_id: int, exc: BaseException) -> None:
        """Record the first real error and wake every peer parked in a handoff."""
        with self.lock:
            if self.error is None and not isinstance(exc, DBOAbortedError):
                self.error, self.error_ubatch = exc, ubatch_id
            if self.aborted:
                return
            self.aborted = True
        if self.executor == "threads":
            for ctx in self.contexts:
                ctx._wake_up()
        # greenlet executor: the driver throws into the parked greenlets (run_greenlet_step)

    def mark_done(self) -> None:
        with self.lock:
            self._remaining -= 1
            done = self._remaining == 0
        if done:
            self.done_at = time.perf_counter()
            self._all_done.set()

    def mark_all_done(self) -> None:
        self.done_at = time.perf_counter()
        self._all_done.set()

    def wait_done(self, timeout_s: float) -> bool:
        """Wait for the step; give up only after ``timeout_s`` without a single handoff (a long step with
        steady progress is fine). Once an error is recorded, give the others a short grace to unwind."""
        seen, since = self.progress, time.monotonic()
        while not self._all_done.wait(timeout=0.05):
            if self.aborted:
                return self._all_done.wait(timeout=min(2.0, timeout_s))
            now = time.monotonic()
            if self.progress != seen:
                seen, since = self.progress, now
            elif now - since > timeout_s + 0.5:
                return False
        return True

    def stall_message(self, timeout_s: float) -> str:
        waiter, runner = self.handed_by, self.running
        if waiter is None or runner is None:
            return f"ubatched step made no progress for {timeout_s:.1f}s (yield counts {self.yield_counts})"
        return (f"ubatch {waiter} waited {timeout_s:.1f}s at yield #{self.yield_counts[waiter]} for control back "
                f"from ubatch {runner}; ubatch {runner} never handed control back (stuck in a collective, or a "
                f"yield on one side only?) - yield counts {self.yield_counts}")

    def next_unfinished(self, after: int) -> int:
        """Ring successor of ``after`` that has not finished yet (``after`` itself if all others have)."""
        n = self.num_ubatches
        for step in range(1, n + 1):
            candidate = (after + step) % n
            if not self.finished[candidate]:
                return candidate
        return after


class UBatchContext:
    """One micro-batch's view of the step: its turn, streams, events, forward context and recv hooks.

    Two executors share this protocol. ``threads``: each ubatch is an OS thread parked on its own Lock
    (vLLM's model). ``greenlet``: every ubatch is a greenlet on one OS thread and a handoff is a direct
    stack switch, with no thread to wake (costs compared in docs/benchmarks.md, "Handoff cost").
    """

    def __init__(self, id: int, step: StepState, compute_stream: streams.Stream, comm_stream: streams.Stream,
                 forward_context: Any, handoff_timeout_s: float) -> None:
        self.id = id
        self.step = step
        self.compute_stream = compute_stream
        self.comm_stream = comm_stream
        self.current_stream = compute_stream
        self.forward_context = forward_context
        self.handoff_timeout_s = handoff_timeout_s
        device = "cpu" if isinstance(compute_stream, streams.NullStream) else compute_stream.device
        self.gpu_compute_done_event = streams.new_event(device)
        self.gpu_comm_done_event = streams.new_event(device)
        self._get_current_stream = streams.stream_getter(compute_stream)
        self.recv_hooks: list[Callable[[], Any]] = []
        self.glet: Any = None  # this ubatch's greenlet (greenlet executor)
        self._ring_next = (id + 1) % step.num_ubatches
        self._set_stream = streams.stream_setter(compute_stream)
        self._turn = threading.Lock()
        self._turn.acquire()  # acquired == "not my turn" (threads executor)

    # ---- control transfer -------------------------------------------------------------------------
    def _wake_up(self) -> None:
        try:  # noqa: SIM105 - a handoff's hot path: contextlib.suppress costs ~0.9 us more per call
            self._turn.release()
        except RuntimeError:  # already released: a handoff and an abort raced, both mean "run"
            pass

    def _resume(self, now: float = 0.0) -> None:
        """Back in control: re-check the abort flag and re-install this ubatch's per-thread state.

        ``now``: when control came back, if the caller timed it (so the traced switch nests in its wait)."""
        step = self.step
        if step.aborted:
            raise DBOAbortedError(f"ubatch {self.id} aborted because ubatch {step.error_ubatch} failed")
        step.running = self.id
        step.progress += 1
        self._set_stream(self.current_stream)
        _local.ctx = self
        set_thread_forward_context(self.forward_context)
        rec = trace._ACTIVE
        if rec is not None and step.handoff_at:  # the switch itself, filed under the ubatch it hands to
            rec.span("handoff", "handoff", self.id, step.handoff_at, now or time.perf_counter())
            step.handoff_at = 0.0

    def _handoff(self) -> None:
        """Give control to the next unfinished ubatch and return when it is our turn again."""
        step = self.step
        target = self._ring_next
        if step.finished[target]:
            target = step.next_unfinished(self.id)
            if target == self.id:
                return  # every peer already finished: nobody to hand to
        rec = trace._ACTIVE
        start = time.perf_counter() if rec is not None else 0.0
        step.handoff_at = start
        step.handed_by = self.id
        peer = step.contexts[target]
        if step.executor == "greenlet":
            peer.glet.switch()
        else:
            peer._wake_up()
            self._wait_turn(f"control back from ubatch {target}")
        end = time.perf_counter() if rec is not None else 0.0
        self._resume(end)  # first: the span must be filed under this ubatch's restored rank/forward context
        if rec is not None:
            rec.span("wait", "wait", self.id, start, end, peer=target)

    def _wait_turn(self, what: str) -> None:
        got_it = self._turn.acquire(timeout=self.handoff_timeout_s)
        if not got_it and not self.step.aborted:
            raise DBOTimeoutError(
                f"ubatch {self.id} waited {self.handoff_timeout_s:.1f}s at yield #{self.step.yield_counts[self.id]} "
                f"for {what}; the peer never handed control back (stuck in a collective, or a yield on one side "
                f"only?) - yield counts {self.step.yield_counts}")

    def start(self) -> None:
        """Give this ubatch the first turn (threads executor; called by the launcher, not a ubatch thread)."""
        self._wake_up()

    def __enter__(self) -> UBatchContext:
        _local.ctx = self
        self.current_stream = self.compute_stream
        if self.step.executor == "threads":
            self._wait_turn("its first turn")
        if not self.step.first_resume_at:
            self.step.first_resume_at = time.perf_counter()
        self._resume()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            if exc is None:
                self.maybe_run_recv_hook()  # drain the previous ubatch's last all-to-all
        finally:
            _local.ctx = None
            step = self.step
            with step.lock:
                step.finished[self.id] = True
                step.last_finished = self.id
            if trace._ACTIVE is not None:
                step.handoff_at = time.perf_counter()  # the next unfinished ubatch resumes from here
            step.progress += 1
            if exc is None and not step.aborted and step.executor == "threads":
                target = step.next_unfinished(self.id)
                if target != self.id:
                    step.contexts[target]._wake_up()

    # ---- the protocol -----------------------------------------------------------------------------
    def yield_(self) -> None:
        if self.step.aborted:
            raise DBOAbortedError(f"ubatch {self.id} aborted because ubatch {self.step.error_ubatch} failed")
        self.step.yield_counts[self.id] += 1
        self.current_stream = self._get_current_stream()
        rec = trace._ACTIVE
        if rec is not None:
            rec.instant("yield", "yield", self.id, n=self.step.yield_counts[self.id])
        self._handoff()

    def register_recv_hook(self, hook: Callable[[], Any]) -> None:
        """Park ``hook`` on the next ubatch, which runs it just before its own send (or on exit)."""
        target = self.step.next_unfinished(self.id)
        if target == self.id:
            hook()
        else:
            self.step.contexts[target].recv_hooks.append(hook)

    def maybe_run_recv_hook(self) -> None:
        while self.recv_hooks:
            hook = self.recv_hooks.pop(0)
            rec = trace.active()
            if rec is None:
                hook()
                continue
            start = time.perf_counter()
            hook()
            rec.span("recv_hook", "hook", self.id, start, time.perf_counter())

    def switch_to_comm(self) -> None:
        self._switch(self.comm_stream)

    def switch_to_compute(self) -> None:
        self._switch(self.compute_stream)

    def switch_to_comm_sync(self) -> None:
        streams.record(self.gpu_compute_done_event, self.compute_stream)
        self._switch(self.comm_stream)
        streams.wait(self.gpu_compute_done_event, self.comm_stream)

    def switch_to_compute_sync(self) -> None:
        streams.record(self.gpu_comm_done_event, self.comm_stream)
        self._switch(self.compute_stream)
        streams.wait(self.gpu_comm_done_event, self.compute_stream)

    def yield_and_switch_from_compute_to_comm(self) -> None:
        """Record compute-done *before* yielding so the event covers only this ubatch's compute."""
        self._assert_current(self.compute_stream, "compute")
        streams.record(self.gpu_compute_done_event, self.compute_stream)
        self.yield_()
        self._switch(self.comm_stream)
        streams.wait(self.gpu_compute_done_event, self.comm_stream)

    def yield_and_switch_from_comm_to_compute(self) -> None:
        self._assert_current(self.comm_stream, "comm")
        streams.record(self.gpu_comm_done_event, self.comm_stream)
        self.yield_()
        self._switch(self.compute_stream)
        streams.wait(self.gpu_comm_done_event, self.compute_stream)

    def get_previous_event(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` (e.g. DeepEP ``Buffer.capture``) on the compute stream so its event covers only our compute."""
        with streams.stream(self.compute_stream):
            return fn(*args, **kwargs)

    def _switch(self, s: streams.Stream) -> None:
        self.current_stream = s
        streams.set_current_stream(s)

    def _assert_current(self, s: streams.Stream, name: str) -> None:
        if self.current_stream is not s:
            raise DBOError(f"ubatch {self.id}: expected the {name} stream to be current, found {self.current_stream!r}")


EXECUTORS = ("greenlet", "threads")


def check_protocol_settings(num_micro_batches: int, executor: str, handoff_timeout_s: float) -> None:
    """The one validation of the protocol's settings (``UBatchConfig`` and ``make_ubatch_contexts`` call it)."""
    if executor not in EXECUTORS:
        raise ValueError(f"unknown ubatch executor {executor!r}; choose one of {EXECUTORS}")
    if isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, int) or num_micro_batches < 2:
        raise ValueError(f"num_ubatches must be an integer >= 2, got {num_micro_batches!r}")
    if not handoff_timeout_s > 0 or handoff_timeout_s == float("inf"):
        raise ValueError(f"handoff_timeout_s must be a finite number > 0, got {handoff_timeout_s!r}")


def make_ubatch_contexts(num_micro_batches: int, compute_stream: streams.Stream, comm_stream: streams.Stream,
                         forward_contexts: Sequence[Any], handoff_timeout_s: float = 300.0,
                         executor: str = "threads") -> list[UBatchContext]:
    """Fresh contexts for one step (cheap: a lock each). Ubatch 0 runs first: ``contexts[0].start()`` for
    the threads executor, :func:`run_greenlet_step` for the greenlet one."""
    check_protocol_settings(num_micro_batches, executor, handoff_timeout_s)
    if len(forward_contexts) != num_micro_batches:
        raise ValueError(f"got {len(forward_contexts)} forward contexts for {num_micro_batches} micro-batches")
    step = StepState(num_micro_batches, executor)
    step.contexts = [UBatchContext(i, step, compute_stream, comm_stream, forward_contexts[i], handoff_timeout_s)
                     for i in range(num_micro_batches)]
    return step.contexts


def run_greenlet_step(contexts: Sequence[UBatchContext], bodies: Sequence[Callable[[], None]]) -> None:
    """Drive one step on the calling thread: ubatch ``i`` runs ``bodies[i]`` in its own greenlet.

    A body that finishes returns control here and the next unfinished ubatch (ring order) continues, just
    as a finishing thread wakes its successor. After a failure every parked greenlet gets a
    :class:`DBOAbortedError` thrown in at its handoff, so its ``finally`` blocks run.
    """
    from greenlet import getcurrent, greenlet

    step = contexts[0].step
    driver = getcurrent()
    for ctx, body in zip(contexts, bodies, strict=True):
        ctx.glet = greenlet(body, parent=driver)
    try:
        contexts[0].glet.switch()
        while not all(step.finished) and not step.aborted:
            nxt = step.next_unfinished(step.last_finished)
            if step.finished[nxt]:
                break
            contexts[nxt].glet.switch()
        if step.aborted:
            for ctx in contexts:
                if ctx.glet:  # started and suspended
                    why = f"ubatch {ctx.id} aborted because ubatch {step.error_ubatch} failed"
                    ctx.glet.throw(DBOAbortedError(why))
    finally:
        for ctx in contexts:
            ctx.glet = None
        step.mark_all_done()


# ---- free functions: vLLM's names; all are cheap no-ops outside a running ubatch -----------------------
def current_ubatch_context() -> UBatchContext | None:
    return getattr(_local, "ctx", None)


def dbo_enabled() -> bool:
    """True only while a ubatch runs on this thread (not "some thread somewhere is ubatching", as in vLLM)."""
    return getattr(_local, "ctx", None) is not None


def dbo_current_ubatch_id() -> int:
    ctx = getattr(_local, "ctx", None)
    return 0 if ctx is None else ctx.id


def dbo_num_ubatches() -> int:
    ctx = getattr(_local, "ctx", None)
    return 1 if ctx is None else ctx.step.num_ubatches


def _on_context(method: Callable[..., Any]) -> Callable[..., None]:
    def call(*args: Any, **kwargs: Any) -> None:
        ctx = getattr(_local, "ctx", None)
        if ctx is not None:
            method(ctx, *args, **kwargs)
    call.__name__ = f"dbo_{method.__name__.strip('_')}"
    call.__doc__ = method.__doc__
    return call


def dbo_yield() -> None:
    """Hand control to the next ubatch and block until it comes back (no-op outside DBO); the hot path."""
    ctx = getattr(_local, "ctx", None)
    if ctx is not None:
        ctx.yield_()


dbo_maybe_run_recv_hook = _on_context(UBatchContext.maybe_run_recv_hook)
dbo_switch_to_comm = _on_context(UBatchContext.switch_to_comm)
dbo_switch_to_compute = _on_context(UBatchContext.switch_to_compute)
dbo_switch_to_comm_sync = _on_context(UBatchContext.switch_to_comm_sync)
dbo_switch_to_compute_sync = _on_context(UBatchContext.switch_to_compute_sync)
dbo_yield_and_switch_from_compute_to_comm = _on_context(UBatchContext.yield_and_switch_from_compute_to_comm)
dbo_yield_and_switch_from_comm_to_compute = _on_context(UBatchContext.yield_and_switch_from_comm_to_compute)


def dbo_register_recv_hook(hook: Callable[[], Any]) -> None:
    """Under DBO park the hook on the next ubatch; outside DBO run it now (the receive happens inline)."""
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        hook()
    else:
        ctx.register_recv_hook(hook)


def dbo_get_previous_event(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn`` run on the ubatch's compute stream under DBO; ``None`` outside DBO (nothing to order against)."""
    ctx = getattr(_local, "ctx", None)
    return None if ctx is None else ctx.get_previous_event(fn, *args, **kwargs)
