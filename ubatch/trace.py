"""Opt-in timeline recorder for DBO steps: per-ubatch compute, waits, yields and all-to-alls in flight.

Off by default and near-free when off: instrumented code does one module-global read (``active()``) and
allocates nothing. Timestamps are ``time.perf_counter()`` seconds (CPU wall clock).
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

_ACTIVE: "TraceRecorder | None" = None


@dataclass
class Span:
    name: str
    cat: str
    track: str
    start: float
    end: float
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class Instant:
    name: str
    cat: str
    track: str
    ts: float
    args: dict[str, Any] = field(default_factory=dict)


def track_name(ubatch: int | str) -> str:
    """``0`` -> ``"ubatch0"``; a string is taken as the track name itself (e.g. ``"comm0"``)."""
    return ubatch if isinstance(ubatch, str) else f"ubatch{ubatch}"


class TraceRecorder:
    """Collects spans from every thread; appends are guarded by a lock (they happen at yield granularity)."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.instants: list[Instant] = []
        self.t0 = time.perf_counter()
        self._lock = threading.Lock()

    def span(self, name: str, cat: str, ubatch: int | str, start: float, end: float, **args: Any) -> None:
        with self._lock:
            self.spans.append(Span(name, cat, track_name(ubatch), start, end, args))

    def instant(self, name: str, cat: str, ubatch: int | str, **args: Any) -> None:
        ts = time.perf_counter()
        with self._lock:
            self.instants.append(Instant(name, cat, track_name(ubatch), ts, args))


def active() -> TraceRecorder | None:
    return _ACTIVE


@contextlib.contextmanager
def recording(recorder: TraceRecorder | None = None) -> Iterator[TraceRecorder]:
    """Record everything the runtime does inside the block: ``with trace.recording() as rec: ...``."""
    global _ACTIVE
    rec = recorder if recorder is not None else TraceRecorder()
    previous, _ACTIVE = _ACTIVE, rec
    try:
        yield rec
    finally:
        _ACTIVE = previous
