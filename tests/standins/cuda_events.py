"""A CPU stand-in for the slice of ``torch.cuda`` the CUDA-clock tracer and the emulated link use.

It simulates a GPU timeline so span times are known exactly: every stream has a time ``t`` at which its
queued work finishes; work enqueued on a stream starts when both the stream and the host have reached it
(``max(stream.t, host)``), as on a GPU that never runs ahead of the launch. The host clock ``host`` is
driven by the test (``cuda.host = 2.0``), and GPU work is queued with ``cuda.run(seconds)`` (a kernel on the
current stream), ``cuda.wait_ns(ns)`` (the emulated link's wait kernel) or ``cuda._sleep(cycles)``
(``CYCLES_PER_SECOND`` cycles a second). Events follow ``torch.cuda.Event``: ``record(stream=None)``,
``synchronize()``, ``query()``, ``elapsed_time(other)`` in milliseconds, which raises when either event was not
recorded or was made without ``enable_timing`` (CUDA refuses both). Recording a timing event while
``capturing`` is set raises, as ``cudaEventRecord`` of a timing event does inside a stream capture.

Tests pass an instance explicitly (``TraceRecorder(clock="cuda", cuda_module=cuda)``,
``EmulatedLink(..., cuda_module=cuda)``); nothing selects it at run time.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any


class FakeStream:
    """A stream on the simulated timeline: ``t`` is when the work queued on it so far finishes."""

    _ids = itertools.count()

    def __init__(self, cuda: FakeCuda, name: str = "") -> None:
        self.cuda = cuda
        self.t = 0.0
        self.name = name or f"stream{next(FakeStream._ids)}"
        self.device = "cuda:0"

    def enqueue(self, seconds: float) -> tuple[float, float]:
        """Queue ``seconds`` of work; returns when it starts and ends on the simulated GPU."""
        if seconds < 0:
            raise ValueError(f"GPU work must take >= 0 s, got {seconds}")
        start = max(self.t, self.cuda.host)
        self.t = start + seconds
        return start, self.t

    def wait_event(self, event: FakeEvent) -> None:
        if event.time is not None:  # an unrecorded event is complete already (CUDA's rule)
            self.t = max(self.t, event.time)

    def wait_stream(self, other: FakeStream) -> None:
        self.t = max(self.t, other.t)

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event if event is not None else FakeEvent(self.cuda)
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.cuda.host = max(self.cuda.host, self.t)

    def query(self) -> bool:
        return self.cuda.host >= self.t

    def __repr__(self) -> str:
        return f"FakeStream({self.name!r})"


class FakeEvent:
    """``torch.cuda.Event`` on the simulated timeline: it fires when its stream's earlier work is done."""

    def __init__(self, cuda: FakeCuda, enable_timing: bool = False) -> None:
        self.cuda = cuda
        self.enable_timing = enable_timing
        self.time: float | None = None
        self.stream: FakeStream | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        if self.enable_timing and self.cuda.capturing:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing "
                               "(a timing event was recorded inside a CUDA-graph capture)")
        stream = stream if stream is not None else self.cuda.current_stream()
        self.stream = stream
        self.time = stream.enqueue(0.0)[1]
        self.cuda.num_records += 1

    def synchronize(self) -> None:
        if self.time is not None:
            self.cuda.host = max(self.cuda.host, self.time)
        self.cuda.num_syncs += 1

    def query(self) -> bool:
        return self.time is None or self.cuda.host >= self.time

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'")
        if self.time is None or end.time is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time")
        return (end.time - self.time) * 1e3


class FakeCuda:
    """The ``torch.cuda`` names the tracer and the link call: ``Event``, ``Stream``, ``stream``,
    ``current_stream``, ``set_stream``, ``synchronize``, ``_sleep``, ``is_current_stream_capturing``."""

    CYCLES_PER_SECOND = 1e9

    def __init__(self) -> None:
        self.host = 0.0
        self.capturing = False
        self.default_stream = FakeStream(self, "default")
        self.streams: list[FakeStream] = [self.default_stream]
        self._local = threading.local()
        self.num_records = 0
        self.num_syncs = 0

    # -- the torch.cuda API --------------------------------------------------------------------------------
    def Event(self, enable_timing: bool = False) -> FakeEvent:
        return FakeEvent(self, enable_timing)

    def Stream(self, device: Any = None) -> FakeStream:
        s = FakeStream(self)
        self.streams.append(s)
        return s

    def current_stream(self, device: Any = None) -> FakeStream:
        return getattr(self._local, "stream", self.default_stream)

    def set_stream(self, s: FakeStream) -> None:
        self._local.stream = s

    @contextlib.contextmanager
    def stream(self, s: FakeStream | None) -> Iterator[None]:
        if s is None:
            yield
            return
        previous = self.current_stream()
        self.set_stream(s)
        try:
            yield
        finally:
            self.set_stream(previous)

    def synchronize(self, device: Any = None) -> None:
        self.host = max([self.host, *(s.t for s in self.streams)])
        self.num_syncs += 1

    def _sleep(self, cycles: int) -> None:
        self.current_stream().enqueue(cycles / self.CYCLES_PER_SECOND)

    def wait_ns(self, ns: int) -> None:
        """The emulated link's device wait kernel (``device_wait.wait_ns``): ``ns`` nanoseconds on the current
        stream."""
        self.current_stream().enqueue(ns * 1e-9)

    def is_current_stream_capturing(self) -> bool:
        return self.capturing

    # -- test helpers ---------------------------------------------------------------------------------------
    def run(self, seconds: float, stream: FakeStream | None = None) -> tuple[float, float]:
        """A kernel of ``seconds`` on ``stream`` (default: the current one); returns its start and end."""
        return (stream if stream is not None else self.current_stream()).enqueue(seconds)
