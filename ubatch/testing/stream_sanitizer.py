"""Stream-order sanitizer for the CPU stream layer: a missing wait fails on CPU, not first on a GPU.

On CPU every op runs at once in program order, so a missing cross-stream wait gives the right answer and no
test sees it. This replays CUDA's ordering rules over the CPU run as ``torch/cuda/_sanitizer.py`` does (vector
clocks per stream over a ``TorchDispatchMode``), with memory keyed by storage byte range, each process group's
collectives on a stream of their own, and every thread started while it is on observed. A violation raises
:class:`StreamOrderError` naming both accesses (or is collected, :meth:`StreamSanitizer.collecting`). Host
reads that bypass the dispatcher and allocator block reuse are not modelled. Test tooling: nothing in the
product imports it; tests turn it on with :func:`enable` / :func:`sanitizing` or pytest ``--stream-sanitizer``,
whose child processes see ``UBATCH_STREAM_SANITIZER=1`` (``tests/stream_sanitizer_site/sitecustomize.py``).
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from ubatch import streams
from ubatch.forward_context import maybe_get_forward_context

ENV_VAR = "UBATCH_STREAM_SANITIZER"
_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = __file__.removesuffix("c")  # .pyc -> .py
_STREAMS_FILE = streams.__file__.removesuffix("c")
_CWD = os.getcwd() + os.sep
# Ops whose output is fresh, uninitialised memory: an allocation starts a history, it is not a write.
_ALLOCATORS = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
                         "empty_permuted"})
_SKIP = frozenset({"record_stream"})


class StreamOrderError(RuntimeError):
    """Two accesses to overlapping memory from different streams with no happens-before edge."""

    def __init__(self, current: Access, previous: Access) -> None:
        self.current, self.previous = current, previous
        hazard = {(False, True): "read-after-write", (True, True): "write-after-write",
                  (True, False): "write-after-read"}[(current.write, previous.write)]
        super().__init__(
            f"stream-order race ({hazard}) on {current.storage_label}, bytes {current.overlap(previous)}:\n"
            f"  now:    {current.describe()}\n"
            f"  before: {previous.describe()}\n"
            f"no event wait / wait_stream / synchronize orders stream {current.stream.name!r} after "
            f"stream {previous.stream.name!r}'s access; on a GPU these two kernels may run in either order")


class Access:
    """One op's read or write of a byte range of one storage (``where``: the issuing line, formatted lazily)."""

    __slots__ = ("op", "write", "stream", "seq", "ubatch", "thread", "where", "start", "end", "storage_label")

    def __init__(self, op: str, write: bool, stream: streams.NullStream, seq: int, ubatch: int | None, thread: str,
                 where: tuple[str, int, str], start: int, end: int, storage_label: str) -> None:
        self.op, self.write, self.stream, self.seq, self.ubatch = op, write, stream, seq, ubatch
        self.thread, self.where, self.start, self.end, self.storage_label = thread, where, start, end, storage_label

    def describe(self) -> str:
        who = "outside DBO" if self.ubatch is None else f"ubatch {self.ubatch}"
        filename, line, func = self.where
        if filename.startswith(_CWD):
            filename = os.path.relpath(filename, _CWD)
        return (f"{'write' if self.write else 'read'} by {self.op} on stream {self.stream.name!r} ({who}, "
                f"thread {self.thread!r}) at {filename}:{line} ({func})")

    def overlap(self, other: Access) -> str:
        return f"[{max(self.start, other.start)}, {min(self.end, other.end)})"


class VectorClocks:
    """Happens-before between streams, as ``StreamSynchronizations`` in ``torch/cuda/_sanitizer.py``.

    Every access ticks a global sequence number and stores it as its stream's own entry; a stream's
    vector says, per other stream, up to which sequence number that stream's work is ordered before
    this stream's next op. Recording an event snapshots the recording stream's vector; waiting merges it.
    """

    def __init__(self) -> None:
        self.streams: dict[int, dict[int, int]] = {}
        self.events: dict[int, dict[int, int]] = {}
        self.host: dict[int, int] = {}  # what the host has synchronised with: new streams start from it
        self.seq = 0

    def vector(self, stream_id: int) -> dict[int, int]:
        vc = self.streams.get(stream_id)
        if vc is None:
            vc = self.streams[stream_id] = dict(self.host)
        return vc

    def tick(self, stream_id: int) -> int:
        self.seq += 1
        self.vector(stream_id)[stream_id] = self.seq
        return self.seq

    def ordered(self, stream_id: int, earlier_stream_id: int, earlier_seq: int) -> bool:
        return earlier_seq <= self.vector(stream_id).get(earlier_stream_id, 0)

    def record(self, event_id: int, stream_id: int) -> None:
        self.events[event_id] = dict(self.vector(stream_id))

    def wait_event(self, stream_id: int, event_id: int) -> None:
        _merge(self.vector(stream_id), self.events.get(event_id, {}))  # never recorded: a no-op, as CUDA

    def wait_stream(self, stream_id: int, other_id: int) -> None:
        _merge(self.vector(stream_id), dict(self.vector(other_id)))

    def host_waits(self, state: dict[int, int]) -> None:
        """The host waited for ``state``: everything it enqueues from now on, on any stream, is after it."""
        _merge(self.host, state)
        for vc in self.streams.values():
            _merge(vc, state)

    def sync_device(self) -> None:
        self.host_waits({sid: vc.get(sid, 0) for sid, vc in self.streams.items()})


def _merge(into: dict[int, int], other: dict[int, int]) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


@dataclass
class _Storage:
    ref: StorageWeakRef
    cdata: int
    label: str
    accesses: list[Access] = field(default_factory=list)


@dataclass(frozen=True, eq=False)
class _OpPlan:
    """Per op overload, from its schema: which arguments are read, written or only looked at."""

    name: str
    arg_kinds: tuple[tuple[str, str], ...]  # (argument name, "read" | "write" | "meta")
    by_name: dict[str, str]
    output: str
    skip: bool  # "write" | "alloc" | "skip"


def _plan(func: Any) -> _OpPlan:
    schema = func._schema
    name = schema.name.split("::")[-1]
    factory = name.startswith("new_") or name.endswith("_like")
    kinds = []
    for arg in schema.arguments:
        alias = arg.alias_info
        if alias is not None and alias.is_write:
            kinds.append((arg.name, "write"))
        elif factory or alias is not None:
            kinds.append((arg.name, "meta"))  # a view's base, or a factory's template: metadata only
        else:
            kinds.append((arg.name, "read"))
    returns = schema.returns
    if name in _ALLOCATORS:
        output = "alloc"
    elif returns and all(r.alias_info is None for r in returns):
        output = "write"
    else:
        output = "skip"  # views alias an input; in-place ops return the argument already counted as written
    return _OpPlan(schema.name.removeprefix("aten::"), tuple(kinds), dict(kinds), output, name in _SKIP)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _where() -> tuple[str, int, str]:
    """The innermost frame outside torch and this layer: the line that issued the op."""
    f: FrameType | None = sys._getframe(2)
    while f is not None:
        code = f.f_code
        name = code.co_filename
        if not (name.startswith(_TORCH_DIR) or name in (_THIS_FILE, _STREAMS_FILE)):
            return name, f.f_lineno, code.co_name
        f = f.f_back
    return "<unknown>", 0, ""


class _Mode(TorchDispatchMode):
    """The dispatch mode: every aten op on CPU tensors becomes one "kernel" on the current null stream."""

    def __init__(self, sanitizer: StreamSanitizer) -> None:
        super().__init__()
        self.sanitizer = sanitizer
        self.plans: dict[Any, _OpPlan] = {}


def _dispatch(self: _Mode, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
    kwargs = kwargs or {}
    out = func(*args, **kwargs)
    san = self.sanitizer
    if not san.enabled:
        return out
    plan = self.plans.get(func)
    if plan is None:
        plan = self.plans[func] = _plan(func)
    if plan.skip:
        return out
    reads: list[torch.Tensor] = []
    writes: list[torch.Tensor] = []
    fresh: list[torch.Tensor] = []
    # the call may pass fewer positional args than the schema has (the rest default or come as kwargs)
    for (_, kind), value in zip(plan.arg_kinds, args, strict=False):
        if kind != "meta":
            if type(value) is torch.Tensor or isinstance(value, torch.Tensor):
                (writes if kind == "write" else reads).append(value)
            elif isinstance(value, (list, tuple)):
                (writes if kind == "write" else reads).extend(_tensors(value))
    if kwargs:
        by_name = plan.by_name
        for name, value in kwargs.items():
            kind = by_name.get(name, "meta")
            if kind != "meta":
                (writes if kind == "write" else reads).extend(_tensors(value))
    if plan.output != "skip":
        fresh.extend(_tensors(out))
    if reads or writes or fresh:
        if plan.output == "alloc":
            san.kernel(plan.name, streams._cpu_current(), reads, writes, allocs=fresh)
        else:
            san.kernel(plan.name, streams._cpu_current(), reads, writes, outputs=fresh)
    return out


# Assigned after the class body on purpose: TorchDispatchMode wraps a ``__torch_dispatch__`` defined in the
# body in ``torch._disable_dynamo``, which costs microseconds per op and guards nothing here (no compile).
_Mode.__torch_dispatch__ = _dispatch  # type: ignore[method-assign, assignment]  # torch types it per mode class


class StreamSanitizer:
    """The process's sanitizer state; one instance (:func:`get`), turned on and off by :func:`enable`."""

    def __init__(self) -> None:
        self.enabled = False
        self.raise_errors = True
        self.errors: list[StreamOrderError] = []
        self.mode = _Mode(self)
        self._lock = threading.RLock()
        self._tls = threading.local()
        self._clocks = VectorClocks()
        self._storages: dict[int, _Storage] = {}
        self._new_storages = 0
        self._collective_streams: weakref.WeakKeyDictionary[Any, streams.NullStream] = weakref.WeakKeyDictionary()
        self._collective_streams_by_id: dict[int, tuple[Any, streams.NullStream]] = {}
        self._previous_profile: Callable[..., Any] | None = None
        self.num_kernels = 0

    # ---- lifetime ----------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every access and clock (between tests); errors already gathered are kept."""
        with self._lock:
            self._clocks = VectorClocks()
            self._storages.clear()

    def push_on_this_thread(self) -> None:
        if not getattr(self._tls, "pushed", False):
            self.mode.__enter__()
            self._tls.pushed = True

    def _pop_from_this_thread(self) -> None:
        if getattr(self._tls, "pushed", False):
            self.mode.__exit__(None, None, None)
            self._tls.pushed = False

    def _thread_started(self, frame: Any, event: str, arg: Any) -> None:
        """``threading.setprofile`` hook: runs once at the start of every new thread, enters the mode
        there (dispatch modes are per thread), then removes itself from that thread.

        Skipped: threads of a ``Thread`` subclass (library housekeeping such as tqdm's monitor) and threads
        marked ``touches_no_tensors`` (the launcher's heartbeat). They run no tensor op, and they are daemon
        threads still alive at interpreter exit, where a dispatch mode on their thread-local mode stack
        aborts the process ("terminate called without an active exception") as the thread is torn down.
        """
        sys.setprofile(self._previous_profile)
        thread = threading.current_thread()
        if type(thread) is not threading.Thread or getattr(thread, "touches_no_tensors", False):
            return
        if self.enabled:
            self.push_on_this_thread()

    # ---- what ubatch.streams reports -----------------------------------------------------------------
    def on_record(self, event: streams.NullEvent, stream: Any) -> None:
        if isinstance(stream, streams.NullStream):
            with self._lock:
                self._clocks.record(event.event_id, stream.stream_id)

    def on_wait(self, stream: Any, event: Any) -> None:
        if isinstance(stream, streams.NullStream) and isinstance(event, streams.NullEvent):
            with self._lock:
                self._clocks.wait_event(stream.stream_id, event.event_id)

    def on_wait_stream(self, stream: Any, other: Any) -> None:
        if isinstance(stream, streams.NullStream) and isinstance(other, streams.NullStream):
            with self._lock:
                self._clocks.wait_stream(stream.stream_id, other.stream_id)

    def on_sync_event(self, event: streams.NullEvent) -> None:
        with self._lock:
            self._clocks.host_waits(dict(self._clocks.events.get(event.event_id, {})))

    def on_sync_stream(self, stream: streams.NullStream) -> None:
        with self._lock:
            self._clocks.host_waits(dict(self._clocks.vector(stream.stream_id)))

    def on_sync_device(self) -> None:
        with self._lock:
            self._clocks.sync_device()

    def collective(self, name: str, group: Any, reads: Sequence[torch.Tensor],
                   writes: Sequence[torch.Tensor]) -> streams.NullEvent:
        """A collective posted now (see ``ubatch.streams.collective_posted``); returns its completion event."""
        done = streams.NullEvent()
        with self._lock:
            cs = self._collective_stream(group)
            self._clocks.wait_stream(cs.stream_id, streams._cpu_current().stream_id)
            self.kernel(name, cs, reads, writes)
            self._clocks.record(done.event_id, cs.stream_id)
        return done

    def _collective_stream(self, group: Any) -> streams.NullStream:
        try:
            s = self._collective_streams.get(group)
            if s is None:
                s = streams.NullStream(f"collectives:{threading.current_thread().name}")
                self._collective_streams[group] = s
            return s
        except TypeError:  # a group that cannot be weakly referenced: keep it alive with its stream
            entry = self._collective_streams_by_id.get(id(group))
            if entry is None:
                entry = self._collective_streams_by_id[id(group)] = (
                    group, streams.NullStream(f"collectives:{threading.current_thread().name}"))
            return entry[1]

    # ---- the analysis --------------------------------------------------------------------------------
    def kernel(self, op: str, stream: Any, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor],
               allocs: Sequence[torch.Tensor] = (), outputs: Sequence[torch.Tensor] = ()) -> None:
        """One kernel on ``stream``: check its accesses against the recorded ones, then record them.

        ``allocs`` are fresh uninitialised tensors (no access), ``outputs`` fresh tensors the kernel wrote
        (their storage is new, so there is no history to check)."""
        if not isinstance(stream, streams.NullStream):
            return
        fc = maybe_get_forward_context()  # a running ubatch installs its forward context on every resume
        ubatch = None if fc is None else fc.ubatch_id
        thread = threading.current_thread().name
        where = _where()
        with self._lock:
            self.num_kernels += 1
            seq = self._clocks.tick(stream.stream_id)
            for t in allocs:
                self._fresh(t, None)
            if reads:
                written = {id(t) for t in writes}
                for t in reads:
                    if id(t) not in written:
                        self._access(t, False, op, stream, seq, ubatch, thread, where)
            for t in writes:
                self._access(t, True, op, stream, seq, ubatch, thread, where)
            for t in outputs:
                self._fresh(t, (op, stream, seq, ubatch, thread, where))

    def _fresh(self, t: torch.Tensor, write: tuple | None) -> None:
        """A new storage: start its history (with the write that produced it, if any)."""
        span = _span(t)
        if span is None:
            return
        st, base, start, end = span
        rec = self._storages[base] = _Storage(StorageWeakRef(st), st._cdata,
                                              f"storage 0x{base:x} ({st.nbytes()} bytes)")
        if write is not None:
            rec.accesses.append(Access(write[0], True, write[1], write[2], write[3], write[4], write[5], start, end,
                                       rec.label))
        self._new_storages += 1
        if self._new_storages % 4096 == 0:
            self._sweep()

    def _sweep(self) -> None:
        for base in [b for b, r in self._storages.items() if r.ref.expired()]:
            del self._storages[base]

    def _access(self, t: torch.Tensor, write: bool, op: str, stream: streams.NullStream, seq: int,
                ubatch: int | None, thread: str, where: tuple[str, int, str]) -> None:
        span = _span(t)
        if span is None:
            return
        st, base, start, end = span
        rec = self._storages.get(base)
        if rec is None or rec.cdata != st._cdata or rec.ref.expired():  # new, or a dead one's address reused
            rec = self._storages[base] = _Storage(StorageWeakRef(st), st._cdata,
                                                  f"storage 0x{base:x} ({st.nbytes()} bytes)")
        now = Access(op, write, stream, seq, ubatch, thread, where, start, end, rec.label)
        clocks = self._clocks
        kept: list[Access] = []
        for prev in rec.accesses:
            if not (prev.start < end and start < prev.end):
                kept.append(prev)
                continue
            if ((write or prev.write) and prev.stream is not stream
                    and not clocks.ordered(stream.stream_id, prev.stream.stream_id, prev.seq)):
                self._report(StreamOrderError(now, prev))
            covered = start <= prev.start and prev.end <= end
            superseded = covered and (write or (not prev.write and prev.stream is stream))
            if not superseded:
                kept.append(prev)
        kept.append(now)
        rec.accesses = kept

    def _report(self, error: StreamOrderError) -> None:
        if self.raise_errors:
            raise error
        self.errors.append(error)

    @contextlib.contextmanager
    def collecting(self) -> Iterator[list[StreamOrderError]]:
        """Gather errors instead of raising them inside the block; yields the list they are added to."""
        with self._lock:
            previous, self.raise_errors = self.raise_errors, False
            gathered: list[StreamOrderError] = []
            saved, self.errors = self.errors, gathered
        try:
            yield gathered
        finally:
            with self._lock:
                self.raise_errors = previous
                self.errors = saved


def _span(t: torch.Tensor) -> tuple[torch.UntypedStorage, int, int, int] | None:
    """``(storage, base address, first byte, end byte)`` a CPU tensor covers (its strided hull), or ``None``."""
    if not t.is_cpu:
        return None
    n = t.numel()
    if n == 0:
        return None
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested, storage-less tensors
        return None
    base = st.data_ptr()
    if not base:
        return None
    item = t.element_size()
    start = int(t.storage_offset()) * item
    if t.is_contiguous():
        return st, base, start, start + n * item
    extent = 1 + sum((int(size) - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True))
    return st, base, start, start + extent * item


_SANITIZER: StreamSanitizer | None = None


def get() -> StreamSanitizer:
    """The process's sanitizer (created on first use, off until :func:`enable`)."""
    global _SANITIZER
    if _SANITIZER is None:
        _SANITIZER = StreamSanitizer()
    return _SANITIZER


def active() -> StreamSanitizer | None:
    """The sanitizer if it is on, else ``None``."""
    return _SANITIZER if _SANITIZER is not None and _SANITIZER.enabled else None


def enable() -> StreamSanitizer:
    """Turn the sanitizer on: this thread and every thread started from now on, until :func:`disable`."""
    san = get()
    if san.enabled:
        san.push_on_this_thread()
        return san
    san.enabled = True
    san._previous_profile = threading.getprofile()
    threading.setprofile(san._thread_started)
    streams.set_observer(san)
    san.push_on_this_thread()
    return san


def disable() -> None:
    """Turn it off. Threads that started under it keep a pass-through mode until they end."""
    san = _SANITIZER
    if san is None or not san.enabled:
        return
    san.enabled = False
    streams.set_observer(None)
    threading.setprofile(san._previous_profile)
    san._pop_from_this_thread()
    san.reset()


@contextlib.contextmanager
def sanitizing() -> Iterator[list[StreamOrderError]]:
    """The sanitizer on (fresh state) for the block, gathering errors; restores the previous state after."""
    was_on = active() is not None
    san = enable()
    if not was_on:
        san.reset()
    try:
        with san.collecting() as errors:
            yield errors
    finally:
        if not was_on:
            disable()
