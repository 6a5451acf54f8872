"""The ping-pong protocol: N micro-batch threads, exactly one running Python at a time.

Each ubatch thread owns a :class:`UBatchContext`. ``dbo_yield()`` hands control to the next ubatch in ring
order and blocks until control comes back, so while one thread enqueues compute the other's all-to-all is
in flight. Contexts are found through a thread-local, so a thread that is not a ubatch (the scheduler, a
metrics thread) sees DBO as off instead of tripping over another thread's state.

Handoff primitive: each context owns a ``threading.Lock`` used as a binary semaphore (acquired = "not my
turn"). Releasing the next context's lock and blocking on our own costs ~2.4 µs here, against ~40 µs for
a ``threading.Event`` pair when the woken thread sits on an idle core (benchmarks/bench_handoff.py).

Failure rules (vLLM has none of these): an exception in any ubatch aborts the step and wakes every peer
blocked in a handoff (they raise :class:`DBOAbortedError`); a handoff that waits longer than the timeout
raises :class:`DBOTimeoutError` naming the ubatch, its yield number and whom it waited for; a finished
ubatch passes control on, so unequal yield counts never hang and are reported after the step.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

from ubatch import streams, trace

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
    """What the ubatches of one step share: who finished, the first error, yield counts, completion."""

    def __init__(self, num_ubatches: int) -> None:
        self.num_ubatches = num_ubatches
        self.lock = threading.Lock()
        self.finished = [False] * num_ubatches
        self.yield_counts = [0] * num_ubatches
        self.error: BaseException | None = None
        self.error_ubatch: int | None = None
        self.aborted = False
        self.contexts: list[UBatchContext] = []
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
        for ctx in self.contexts:
            ctx._wake_up()

    def mark_done(self) -> None:
        with self.lock:
            self._remaining -= 1
            done = self._remaining == 0
        if done:
            self._all_done.set()

    def wait_done(self, timeout_s: float) -> bool:
        """Wait for every ubatch; once an error is recorded, give the others a short grace to unwind."""
        deadline = time.monotonic() + timeout_s
        while not self._all_done.wait(timeout=min(0.05, max(0.0, deadline - time.monotonic()))):
            if self.aborted:
                return self._all_done.wait(timeout=min(2.0, max(0.0, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                return False
        return True

    def next_unfinished(self, after: int) -> int:
        """Ring successor of ``after`` that has not finished yet (``after`` itself if all others have)."""
        n = self.num_ubatches
        for step in range(1, n + 1):
            candidate = (after + step) % n
            if not self.finished[candidate]:
                return candidate
        return after


class UBatchContext:
    """One micro-batch's view of the step: its turn lock, streams, events, forward context and recv hooks."""

    def __init__(self, id: int, step: StepState, compute_stream: streams.Stream, comm_stream: streams.Stream,
                 forward_context: Any, handoff_timeout_s: float) -> None:
        self.id = id
        self.step = step
        self.compute_stream = compute_stream
        self.comm_stream = comm_stream
        self.current_stream = compute_stream
        self.forward_context = forward_context
        self.handoff_timeout_s = handoff_timeout_s
        self.gpu_compute_done_event = streams.new_event("cpu" if isinstance(compute_stream, streams.NullStream) else None)
        self.gpu_comm_done_event = streams.new_event("cpu" if isinstance(compute_stream, streams.NullStream) else None)
        self.recv_hooks: list[Callable[[], Any]] = []
        self._turn = threading.Lock()
        self._turn.acquire()  # acquired == "not my turn"

    # ---- control transfer -------------------------------------------------------------------------
    def _wake_up(self) -> None:
        try:
            self._turn.release()
        except RuntimeError:  # already released: a handoff and an abort raced, both mean "run"
            pass

    def _wait_for_turn(self, what: str) -> None:
        rec = trace.active()
        start = time.perf_counter() if rec is not None else 0.0
        got_it = self._turn.acquire(timeout=self.handoff_timeout_s)
        if rec is not None:
            rec.span("wait", "wait", self.id, start, time.perf_counter(), what=what)
        if self.step.aborted:
            raise DBOAbortedError(f"ubatch {self.id} aborted because ubatch {self.step.error_ubatch} failed")
        if not got_it:
            raise DBOTimeoutError(
                f"ubatch {self.id} waited {self.handoff_timeout_s:.1f}s at yield #{self.step.yield_counts[self.id]} "
                f"for {what}; the peer never handed control back (stuck collective, or a yield on one side only?)")
        streams.set_current_stream(self.current_stream)
        _local.ctx = self

    def _pass_control(self) -> int:
        target = self.step.next_unfinished(self.id)
        if target != self.id:
            self.step.contexts[target]._wake_up()
        return target

    def start(self) -> None:
        """Give this ubatch the first turn (called by the launcher, not by a ubatch thread)."""
        self._wake_up()

    def __enter__(self) -> "UBatchContext":
        _local.ctx = self
        self.current_stream = self.compute_stream
        self._wait_for_turn("its first turn")
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            if exc is None:
                self.maybe_run_recv_hook()  # drain the previous ubatch's last all-to-all
        finally:
            _local.ctx = None
            with self.step.lock:
                self.step.finished[self.id] = True
            if exc is None and not self.step.aborted:
                self._pass_control()

    # ---- the protocol -----------------------------------------------------------------------------
    def yield_(self) -> None:
        if self.step.aborted:
            raise DBOAbortedError(f"ubatch {self.id} aborted because ubatch {self.step.error_ubatch} failed")
        self.step.yield_counts[self.id] += 1
        self.current_stream = streams.current_stream("cpu" if isinstance(self.compute_stream, streams.NullStream)
                                                     else self.compute_stream.device)
        rec = trace.active()
        if rec is not None:
            rec.instant("yield", "yield", self.id, n=self.step.yield_counts[self.id])
        target = self._pass_control()
        if target == self.id:
            return  # every peer already finished: nobody to hand to
        self._wait_for_turn(f"control back from ubatch {(self.id - 1) % self.step.num_ubatches}")

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


def make_ubatch_contexts(num_micro_batches: int, compute_stream: streams.Stream, comm_stream: streams.Stream,
                         forward_contexts: Sequence[Any], handoff_timeout_s: float = 300.0) -> list[UBatchContext]:
    """Fresh contexts for one step (cheap: a lock each). Ubatch 0 runs first once ``contexts[0].start()``."""
    if num_micro_batches < 2:
        raise ValueError(f"num_micro_batches must be >= 2, got {num_micro_batches}")
    if len(forward_contexts) != num_micro_batches:
        raise ValueError(f"got {len(forward_contexts)} forward contexts for {num_micro_batches} micro-batches")
    if handoff_timeout_s <= 0:
        raise ValueError(f"handoff_timeout_s must be > 0, got {handoff_timeout_s}")
    step = StepState(num_micro_batches)
    step.contexts = [UBatchContext(i, step, compute_stream, comm_stream, forward_contexts[i], handoff_timeout_s)
                     for i in range(num_micro_batches)]
    return step.contexts


# ---- free functions: vLLM's names; all are cheap no-ops outside a ubatch thread -----------------------
def current_ubatch_context() -> UBatchContext | None:
    return getattr(_local, "ctx", None)


def dbo_enabled() -> bool:
    """True only on a ubatch thread (not "some thread somewhere is ubatching", as in vLLM)."""
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


dbo_yield = _on_context(UBatchContext.yield_)
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
