"""The one device layer: streams and events on CUDA, documented no-ops on CPU.

Everything else in the project goes through this module, so the ping-pong protocol runs unchanged on a
CPU-only machine. On CPU every kernel runs synchronously in program order, so "stream order" is already
total: recording, waiting and synchronising have nothing to do. We still keep a per-thread *current
stream* on CPU, because the protocol's stream switching (compute <-> comm) is logic worth testing there.

Why not ``torch.cpu.Stream`` / ``torch.Event("cpu")``: ``torch.Event("cpu").record()`` raises
("cpu backend doesn't support events") and ``torch.Stream("cpu").wait_stream`` too; ``torch.cpu.Stream``
has no ``query``/``synchronize``. Our null classes give every call the same surface as CUDA.

Null streams and events still have identities, and every record / wait / synchronize is reported to an
observer when one is installed: the tests' stream-order sanitizer (:mod:`ubatch.testing.stream_sanitizer`)
turns them into happens-before edges, so a missing wait that CPU execution hides is still caught. Without an
observer they cost one global read and do nothing.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Union, cast

import torch

_null_ids = itertools.count(1)
_event_ids = itertools.count(1)
# The stream-order sanitizer while it is enabled (``ubatch.testing.stream_sanitizer``), else None. It only observes:
# CPU execution is the same with or without it.
_observer: Any = None


def set_observer(observer: Any) -> None:
    """Install (or with ``None`` remove) the object told about every null-stream record, wait and sync."""
    global _observer
    _observer = observer


class NullEvent:
    """A CPU event: work before ``record`` is already done when ``record`` returns.

    ``event_id`` names it to the sanitizer, for which ``record`` and ``wait`` are real happens-before edges.
    """

    def __init__(self) -> None:
        self.event_id = next(_event_ids)

    def record(self, stream: Stream | None = None) -> None:
        obs = _observer
        if obs is not None:
            obs.on_record(self, stream if stream is not None else _cpu_current())

    def wait(self, stream: Stream | None = None) -> None:
        obs = _observer
        if obs is not None:
            obs.on_wait(stream if stream is not None else _cpu_current(), self)

    def synchronize(self) -> None:
        obs = _observer
        if obs is not None:
            obs.on_sync_event(self)

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"NullEvent(#{self.event_id})"


class NullStream:
    """A CPU stream: a name and an identity, so stream-switching logic can be asserted on CPU."""

    def __init__(self, name: str = "") -> None:
        self.stream_id = next(_null_ids)
        self.name = name or f"cpu-stream-{self.stream_id}"

    def wait_stream(self, other: Stream) -> None:
        obs = _observer
        if obs is not None:
            obs.on_wait_stream(self, other)

    def wait_event(self, event: Event) -> None:
        obs = _observer
        if obs is not None:
            obs.on_wait(self, event)

    def record_event(self, event: NullEvent | None = None) -> NullEvent:
        event = event if event is not None else NullEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        obs = _observer
        if obs is not None:
            obs.on_sync_stream(self)

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"NullStream({self.name!r})"


Stream = Union["torch.cuda.Stream", NullStream]
Event = Union["torch.cuda.Event", NullEvent]

_DEFAULT_CPU_STREAM = NullStream("cpu-default")
_cpu_state = threading.local()


def _cpu_current() -> NullStream:
    return getattr(_cpu_state, "stream", _DEFAULT_CPU_STREAM)


def device_of(obj: Any) -> torch.device | None:
    """The device ``obj``'s work runs on: its first parameter's or buffer's (a module), its own (a tensor),
    else None. What a wrapper around a model should follow, rather than whether CUDA happens to be present:
    a CPU model on a machine with a GPU (``--device cpu``) must get CPU streams."""
    if isinstance(obj, torch.Tensor):
        return obj.device
    if isinstance(obj, torch.nn.Module):
        for tensor in itertools.chain(obj.parameters(), obj.buffers()):
            return tensor.device
    return None


def resolve_device(device: torch.device | str | None = None) -> torch.device:
    """``None`` means the accelerator when there is one, else the CPU: only for callers that know no device
    (code running a model passes the model's, see :func:`device_of`)."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {device} requested but CUDA is not available on this machine")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"unsupported device type {device.type!r}; ubatch runs on 'cuda' or 'cpu'")
    return device


def is_cuda(device: torch.device | str | None = None) -> bool:
    return resolve_device(device).type == "cuda"


def new_stream(device: torch.device | str | None = None, name: str = "") -> Stream:
    dev = resolve_device(device)
    return torch.cuda.Stream(device=dev) if dev.type == "cuda" else NullStream(name)


def new_event(device: torch.device | str | None = None, enable_timing: bool = False) -> Event:
    dev = resolve_device(device)
    return torch.cuda.Event(enable_timing=enable_timing) if dev.type == "cuda" else NullEvent()


def current_stream(device: torch.device | str | None = None) -> Stream:
    dev = resolve_device(device)
    if dev.type == "cuda":
        return torch.cuda.current_stream(dev)
    return getattr(_cpu_state, "stream", _DEFAULT_CPU_STREAM)


def stream_getter(like: Stream) -> Callable[[], Stream]:
    """A cheap zero-argument ``current_stream`` for the device of ``like`` (the yield path calls it)."""
    if isinstance(like, NullStream):
        return lambda: getattr(_cpu_state, "stream", _DEFAULT_CPU_STREAM)
    device = like.device
    return lambda: torch.cuda.current_stream(device)


def stream_setter(like: Stream) -> Callable[[Stream], None]:
    """A cheap ``set_current_stream`` specialised for the device of ``like`` (the yield path calls it)."""
    if isinstance(like, NullStream):
        def set_cpu(s: Stream) -> None:
            _cpu_state.stream = s
        return set_cpu
    return cast("Callable[[Stream], None]", torch.cuda.set_stream)  # a CUDA stream's setter gets CUDA streams


def set_current_stream(s: Stream) -> None:
    """Make ``s`` this thread's current stream (PyTorch's current stream is per thread on CUDA too)."""
    if isinstance(s, NullStream):
        _cpu_state.stream = s
    else:
        torch.cuda.set_stream(s)


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    """Run a block with ``s`` current; ``None`` leaves the current stream alone (as ``torch.cuda.stream``)."""
    if s is None:
        yield
        return
    previous = current_stream("cpu" if isinstance(s, NullStream) else s.device)
    set_current_stream(s)
    try:
        yield
    finally:
        set_current_stream(previous)


def record(event: Event, s: Stream | None = None) -> None:
    if isinstance(event, NullEvent):
        event.record(s)
        return
    assert not isinstance(s, NullStream), "a CUDA event is recorded on a CUDA stream"
    event.record(s) if s is not None else event.record()


def wait_stream(waiter: Stream, other: Stream) -> None:
    """Make ``waiter`` wait for the work queued on ``other`` so far; both are CPU or both CUDA streams."""
    if isinstance(waiter, NullStream):
        waiter.wait_stream(other)
        return
    assert not isinstance(other, NullStream), "a CUDA stream waits for a CUDA stream"
    waiter.wait_stream(other)


def wait(event: Event, s: Stream | None = None) -> None:
    """Make stream ``s`` (default: current) wait for ``event``; never blocks the CPU."""
    if isinstance(event, NullEvent):
        event.wait(s)
        return
    (s if s is not None else torch.cuda.current_stream()).wait_event(event)


def synchronize(device: torch.device | str | None = None) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(resolve_device(device))
    elif _observer is not None:
        _observer.on_sync_device()


def collective_posted(name: str, group: Any, reads: Sequence[torch.Tensor],
                      writes: Sequence[torch.Tensor]) -> Event | None:
    """Tell the sanitizer a collective was just posted on CPU tensors; the returned event is what the
    waiter must make its stream wait for (``wait``) once the collective completed. ``None`` when nothing
    is observing, or for CUDA tensors: NCCL already orders its own stream against the caller's.

    The model is NCCL's: the collective runs on a stream of its own (one per ``group``) that first waits
    for the issuing stream, reads ``reads`` and writes ``writes`` there, and ``work.wait()`` makes the
    waiter's current stream wait for it. So reading a receive buffer, or refilling a send buffer, before
    the wait is a reported race even though gloo on CPU happened to finish in time.
    """
    obs = _observer
    if obs is None or any(t.device.type != "cpu" for t in (*reads, *writes)):
        return None
    return obs.collective(name, group, reads, writes)
