"""Opt-in timeline recorder for DBO steps: per-ubatch compute, waits, yields and all-to-alls in flight.

Near-free when off (one module-global read per instrumented point). ``clock="cpu"`` stamps ``perf_counter``;
``clock="cuda"`` stamps device work with CUDA events on the stream it runs on (compute on ``gpu<u>`` tracks,
its host side as ``launch`` spans on the ubatch track, comm on ``comm<u>``), resolved at export through one
reference event, so recording never synchronises. Nothing is recorded inside a capture; a replay is one
``graph_replay`` span. Spans find their rank and ubatch from the forward context. Metrics:
``ubatch.trace_metrics``.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from ubatch.forward_context import maybe_get_forward_context

_ACTIVE: TraceRecorder | None = None

Stamp = Any  # float seconds on the perf_counter clock, or an event with record/synchronize/elapsed_time


@dataclass(slots=True)
class Span:
    name: str
    cat: str  # "compute", "comm", "wait", "hook": what trace_metrics and the plot key on
    track: str  # "ubatch0", "comm0", ...: one Chrome-trace thread each
    start: Stamp
    end: Stamp
    args: dict[str, Any] = field(default_factory=dict)
    pid: int = 0


@dataclass(slots=True)
class Instant:
    name: str
    cat: str
    track: str
    ts: Stamp
    args: dict[str, Any] = field(default_factory=dict)
    pid: int = 0


_UBATCH_TRACKS = tuple(f"ubatch{i}" for i in range(16))  # no string formatting on the recording path
_GPU_TRACKS = {f"ubatch{i}": f"gpu{i}" for i in range(16)}
_COMM_TRACKS = tuple(f"comm{i}" for i in range(16))


def track_name(ubatch: int | str) -> str:
    """``0`` -> ``"ubatch0"``; a string is taken as the track name itself (e.g. ``"comm0"``)."""
    if isinstance(ubatch, str):
        return ubatch
    return _UBATCH_TRACKS[ubatch] if 0 <= ubatch < 16 else f"ubatch{ubatch}"


def comm_track(ubatch: int) -> str:
    """``0`` -> ``"comm0"``: where that ubatch's transfers go."""
    return _COMM_TRACKS[ubatch] if 0 <= ubatch < 16 else f"comm{ubatch}"


def gpu_track(track: str) -> str:
    """Where the device side of a host track's compute goes: ``"ubatch1"`` -> ``"gpu1"``, else ``"gpu_<track>"``."""
    gpu = _GPU_TRACKS.get(track)
    if gpu is not None:
        return gpu
    u = ubatch_of_track(track) if track.startswith("ubatch") else None
    return f"gpu{u}" if u is not None else f"gpu_{track}"


def ubatch_of_track(track: str) -> int | None:
    """``"ubatch1"``/``"gpu1"``/``"comm1"`` -> 1; ``None`` for tracks that belong to no ubatch."""
    digits = track[len(track.rstrip("0123456789")):]
    return int(digits) if digits and track[: -len(digits)] in ("ubatch", "comm", "gpu") else None


class _ThreadPid(threading.local):
    pid = 0  # a class default: reading it never raises (a missing attribute costs an exception)


_thread_pid = _ThreadPid()


def current_pid() -> int:
    """The rank whose spans this thread records (see the module docstring).

    Remembered per OS thread once seen: a ubatch worker thread only ever serves one rank's wrapper, and a
    span may be recorded in a moment without a forward context (a greenlet resuming before it reinstalls
    its own, right after a finished peer cleared the thread's).
    """
    fc = maybe_get_forward_context()
    rank = fc.trace_rank if fc is not None else None
    if rank is None:
        return _thread_pid.pid
    _thread_pid.pid = rank = int(rank)
    return rank


@dataclass(slots=True)
class Mark:
    """A moment on both clocks (``TraceRecorder.mark`` on the cuda clock): host seconds and a device event.

    ``device`` is ``None`` inside a CUDA-graph capture, where no timing event can be recorded.
    """

    host: float
    device: Any


class TraceRecorder:
    """Collects spans from every thread. No lock: ``list.append`` and ``list(...)`` are atomic in CPython
    (the GIL, or per-object locks in free-threaded builds), and a lock pair would cost more than the record.

    ``clock="cuda"`` stamps device work with CUDA events (module docstring). ``cuda_module`` replaces
    ``torch.cuda`` (its ``Event``, ``Stream``, ``stream``, ``synchronize``, ``is_current_stream_capturing``):
    tests pass a stand-in with a simulated timeline (``tests/standins/cuda_events.py``). ``event_factory``
    alone replaces only ``torch.cuda.Event(enable_timing=True)``.
    """

    def __init__(self, clock: str = "cpu", event_factory: Callable[[], Any] | None = None,
                 cuda_module: Any = None) -> None:
        if clock not in ("cpu", "cuda"):
            raise ValueError(f"trace clock must be 'cpu' or 'cuda', got {clock!r}")
        if clock == "cpu" and (event_factory is not None or cuda_module is not None):
            raise ValueError("event_factory / cuda_module only apply to clock='cuda'")
        self.clock = clock
        self.spans: list[Span] = []
        self.instants: list[Instant] = []
        self._layers: dict[tuple[int, str], int] = {}  # (pid, track) -> layer its ubatch is in, for "layer"
        self._event_factory = event_factory
        self._ref_event: Any = None
        self._cuda: Any = None
        self._capturing: Callable[[], bool] = _never
        self._side_streams: dict[str, Any] = {}
        if clock == "cuda":
            if cuda_module is None:
                import torch

                cuda_module = torch.cuda
                if event_factory is not None and not torch.cuda.is_available():
                    cuda_module = None  # a fake event on a machine without CUDA: nothing can be capturing
            self._cuda = cuda_module
            if cuda_module is not None:
                self._capturing = cuda_module.is_current_stream_capturing
            if event_factory is None:
                cuda_module.synchronize()  # the device is idle: the reference event fires at (almost) t0
                self._event_factory = lambda: cuda_module.Event(enable_timing=True)
            self._ref_event = self.now()
        self.t0 = time.perf_counter()

    def now(self, stream: Any = None) -> Stamp:
        """A stamp for "now": CPU seconds, or (cuda clock) an event on ``stream`` (default: the current one),
        i.e. when the device gets there, not when the host issued it. ``None`` inside a CUDA-graph capture."""
        if self._event_factory is None:
            return time.perf_counter()
        if self._capturing():
            return None
        event = self._event_factory()
        if stream is None:
            event.record()
        else:
            event.record(stream)
        return event

    def device_stamp(self, stream: Any = None) -> Any:
        """An event on ``stream`` with the cuda clock; ``None`` with the cpu clock or inside a capture.

        What comm-span sources call: on the cpu clock they keep their host-side timing.
        """
        return None if self._event_factory is None else self.now(stream)

    def mark(self) -> float | Mark:
        """Start or end of a compute phase: host seconds (cpu clock) or a ``Mark`` on both clocks (cuda)."""
        if self._event_factory is None:
            return time.perf_counter()
        host = time.perf_counter()
        return Mark(host, self.now())

    def side_stream(self, key: str) -> Any:
        """A tracing-only stream per ``key`` (one per comm track), made to wait for a collective before an
        end event is recorded on it. One per ubatch, so a transfer's end never waits for another's."""
        s = self._side_streams.get(key)
        if s is None:
            if self._cuda is None:
                raise RuntimeError("side streams need clock='cuda' with a CUDA module")
            s = self._side_streams[key] = self._cuda.Stream()
        return s

    def on_stream(self, stream: Any) -> Any:
        """``with rec.on_stream(s):`` makes ``s`` the current stream of the recorder's CUDA module."""
        return self._cuda.stream(stream)

    def span(self, name: str, cat: str, ubatch: int | str, start: Stamp, end: Stamp, *, pid: int | None = None,
             **args: Any) -> None:
        """``pid``: the rank the span belongs to, taken when the work was posted, for a span closed later from a
        moment whose thread or forward context may not be that rank's (a transfer's completion)."""
        self._add(name, cat, track_name(ubatch), start, end, args, current_pid() if pid is None else pid)

    def _add(self, name: str, cat: str, track: str, start: Stamp, end: Stamp, args: dict[str, Any], pid: int) -> None:
        if "layer" not in args:
            layer = self._layers.get((pid, track))
            if layer is not None:
                args["layer"] = layer
        if isinstance(start, Mark) or isinstance(end, Mark):
            if not (isinstance(start, Mark) and isinstance(end, Mark)):
                raise ValueError(f"span {name!r}: start and end must both be marks, got {start!r} and {end!r}")
            # host side on the host track (cat "launch" for compute), device side on the GPU track
            self.spans.append(Span(name, "launch" if cat == "compute" else cat, track, start.host, end.host,
                                   args, pid))
            if start.device is None or end.device is None:
                return  # inside a CUDA-graph capture: no device timing
            start, end, track, args = start.device, end.device, gpu_track(track), dict(args)
        elif start is None or end is None:
            return  # a device stamp taken inside a CUDA-graph capture: nothing to time
        self.spans.append(Span(name, cat, track, start, end, args, pid))

    def instant(self, name: str, cat: str, ubatch: int | str, **args: Any) -> None:
        ts = time.perf_counter()  # always the CPU clock: an instant marks a host-side moment (a yield)
        self.instants.append(Instant(name, cat, track_name(ubatch), ts, args, current_pid()))

    def set_layer(self, ubatch: int, layer: int, pid: int | None = None) -> None:
        """Spans of this ubatch (and its comm track) recorded from now on carry ``layer`` unless they name one."""
        pid = current_pid() if pid is None else pid
        self._layers[(pid, f"ubatch{ubatch}")] = self._layers[(pid, f"comm{ubatch}")] = layer

    def resolve(self, stamp: Stamp) -> float:
        """A stamp in perf_counter seconds; a CUDA event must have completed (``resolved`` synchronises)."""
        if isinstance(stamp, (int, float)):
            return float(stamp)
        if self._ref_event is None:
            raise ValueError("an event stamp was recorded by a recorder without clock='cuda'")
        return self.t0 + self._ref_event.elapsed_time(stamp) * 1e-3

    def resolved(self) -> tuple[list[Span], list[Instant]]:
        """Copies of the spans and instants with every stamp in seconds (waits for pending GPU events)."""
        spans, instants = list(self.spans), list(self.instants)
        for s in spans:
            if not isinstance(s.end, (int, float)):
                s.end.synchronize()
        return ([replace(s, start=self.resolve(s.start), end=self.resolve(s.end)) for s in spans],
                [replace(i, ts=self.resolve(i.ts)) for i in instants])


def _never() -> bool:
    return False


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


# ---- compute spans from model code -------------------------------------------------------------------
class _NullSpan:
    """Shared, stateless: what ``compute_span`` returns while tracing is off (no allocation per call)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        return False


_NULL_SPAN = _NullSpan()


class _Region:
    __slots__ = ("rec", "name", "cat", "phase", "layer", "pid", "track", "start", "clock")

    def __init__(self, rec: TraceRecorder, name: str, cat: str, phase: str | None, layer: int | None,
                 track: str | None) -> None:
        self.rec, self.name, self.cat, self.phase, self.layer, self.track = rec, name, cat, phase, layer, track
        # Compute is timed on the recorder's clock (host and device marks in "cuda" mode); a host-side wait
        # or CPU phase always on the CPU clock, since that is where it happens.
        self.clock = rec.mark if cat == "compute" else time.perf_counter

    def __enter__(self) -> None:
        self.pid = current_pid()
        if self.track is None:
            fc = maybe_get_forward_context()
            ubatch = (fc.ubatch_id or 0) if fc is not None else 0
            self.track = track_name(ubatch)
            if self.layer is not None:
                self.rec.set_layer(ubatch, self.layer, self.pid)
        self.start = self.clock()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        end = self.clock()
        args: dict[str, Any] = {}
        if self.phase is not None:
            args["phase"] = self.phase
        if self.layer is not None:
            args["layer"] = self.layer
        assert self.track is not None  # named by __enter__
        self.rec._add(self.name, self.cat, self.track, self.start, end, args, self.pid)
        return False


def compute_span(name: str, phase: str, layer: int | None = None) -> Any:
    """``with trace.compute_span("attention", "A", layer=i): ...`` marks a compute segment of this ubatch.

    ``phase`` is the schedule letter (A attention, E experts, S shared experts, R route, P pack, U unpack,
    ...). Giving ``layer`` also tags the ubatch's later spans (experts, its dispatch/combine) with that
    layer until the next one, which is what the per-layer breakdown of ``trace_metrics`` groups by. Off:
    returns one shared null context.
    """
    rec = _ACTIVE
    if rec is None:
        return _NULL_SPAN
    return _Region(rec, name, "compute", phase, layer, None)


def region(name: str, cat: str, track: str | None = None) -> Any:
    """``with trace.region("counts", "copy"): ...`` marks any named phase that is not model compute.

    ``cat``: ``"copy"`` (blocked on a real transfer), ``"link"`` (blocked on the modelled link),
    ``"step"`` (per-step CPU work of the engine: schedule, DP vote, input prep, sampling), ... ``track``
    defaults to the running ubatch's (``"ubatch0"`` outside DBO); the engine files step work under
    ``"step"`` and the scheduler's under ``"scheduler"``. Off: one shared null context.
    """
    rec = _ACTIVE
    if rec is None:
        return _NULL_SPAN
    return _Region(rec, name, cat, None, None, track)


# ---- Chrome trace export (chrome://tracing, https://ui.perfetto.dev) ----------------------------------
def _track_order(track: str) -> tuple[int, int, str]:
    """Each ubatch's host row, then its GPU row, then its comm row, like the DBO schedule diagram."""
    u = ubatch_of_track(track)
    kind = 0 if track.startswith("ubatch") else 1 if track.startswith("gpu") else 2 if track.startswith("comm") else 3
    return (u if u is not None else 1 << 30, kind, track)


def _jsonable(args: dict[str, Any]) -> dict[str, Any]:
    return {k: v if isinstance(v, (bool, int, float, str)) or v is None else str(v) for k, v in args.items()}


def to_chrome_trace(rec: TraceRecorder, pid: int | None = None) -> dict[str, Any]:
    """Trace Event Format dict: "X" spans and "i" instants (µs since the first event), "M" names.

    One process per rank (``pid``; ``pid=`` keeps one rank), one thread per track, ordered ubatch0,
    gpu0, comm0, ubatch1, ... (``gpu<u>`` only in a cuda-clock trace). Span args (``phase``, ``layer``,
    ``bytes``, ...) are kept as event args.
    """
    spans, instants = rec.resolved()
    if pid is not None:
        spans, instants = [s for s in spans if s.pid == pid], [i for i in instants if i.pid == pid]
    events: list[dict[str, Any]] = []
    stamps = [s.start for s in spans] + [i.ts for i in instants]
    first = min(stamps) if stamps else 0.0

    def us(t: float) -> float:
        return round((t - first) * 1e6, 3)

    tracks: dict[int, set[str]] = {}
    for span in spans:
        tracks.setdefault(span.pid, set()).add(span.track)
    for instant in instants:
        tracks.setdefault(instant.pid, set()).add(instant.track)
    tids: dict[tuple[int, str], int] = {}
    for p in sorted(tracks):
        events.append({"name": "process_name", "ph": "M", "pid": p, "tid": 0, "args": {"name": f"rank {p}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": p, "tid": 0, "args": {"sort_index": p}})
        for tid, track in enumerate(sorted(tracks[p], key=_track_order), start=1):
            tids[(p, track)] = tid
            events.append({"name": "thread_name", "ph": "M", "pid": p, "tid": tid, "args": {"name": track}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": p, "tid": tid,
                           "args": {"sort_index": tid}})
    for s in sorted(spans, key=lambda s: s.start):
        ts = us(s.start)
        events.append({"name": s.name, "cat": s.cat, "ph": "X", "ts": ts, "dur": max(0.0, round(us(s.end) - ts, 3)),
                       "pid": s.pid, "tid": tids[(s.pid, s.track)], "args": _jsonable(s.args)})
    for i in sorted(instants, key=lambda i: i.ts):
        events.append({"name": i.name, "cat": i.cat, "ph": "i", "s": "t", "ts": us(i.ts), "pid": i.pid,
                       "tid": tids[(i.pid, i.track)], "args": _jsonable(i.args)})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def save(rec: TraceRecorder, path: str | os.PathLike[str], pid: int | None = None) -> str:
    """Write ``to_chrome_trace(rec, pid)`` as JSON (parent folders created); returns the path."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(to_chrome_trace(rec, pid), f)
    return path


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a Chrome trace written by ``save`` (or any JSON-object trace); clear errors for anything else."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"trace file {path!r} not found")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path!r} is not a Chrome trace: not JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"{path!r} is not a Chrome trace: expected a JSON object with a 'traceEvents' list")
    return data
