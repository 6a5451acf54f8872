"""The one device layer: streams and events on CUDA, documented no-ops on CPU.

Everything else in the project goes through this module, so the ping-pong protocol runs unchanged on a
CPU-only machine. On CPU every kernel runs synchronously in program order, so "stream order" is already
total: recording, waiting and synchronising have nothing to do. We still keep a per-thread *current
stream* on CPU, because the protocol's stream switching (compute <-> comm) is logic worth testing there.

Why not ``torch.cpu.Stream`` / ``torch.Event("cpu")``: ``torch.Event("cpu").record()`` raises
("cpu backend doesn't support events") and ``torch.Stream("cpu").wait_stream`` too; ``torch.cpu.Stream``
has no ``query``/``synchronize``. Our null classes give every call the same surface as CUDA.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Callable, Iterator, Union

import torch

_null_ids = itertools.count(1)


class NullEvent:
    """A CPU event: work before ``record`` is already done when ``record`` returns."""

    def record(self, stream: "Stream | None" = None) -> None:
        return None

    def wait(self, stream: "Stream | None" = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class NullStream:
    """A CPU stream: a name and an identity, so stream-switching logic can be asserted on CPU."""

    def __init__(self, name: str = "") -> None:
        self.stream_id = next(_null_ids)
        self.name = name or f"cpu-stream-{self.stream_id}"

    def wait_stream(self, other: "Stream") -> None:
        return None

    def wait_event(self, event: "Event") -> None:
        return None

    def record_event(self, event: "Event | None" = None) -> "Event":
        return event if event is not None else NullEvent()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"NullStream({self.name!r})"


Stream = Union["torch.cuda.Stream", NullStream]
Event = Union["torch.cuda.Event", NullEvent]

_DEFAULT_CPU_STREAM = NullStream("cpu-default")
_cpu_state = threading.local()


def resolve_device(device: torch.device | str | None = None) -> torch.device:
    """``None`` means the accelerator when there is one, else the CPU."""
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


def stream_getter(like: Stream) -> "Callable[[], Stream]":
    """A cheap zero-argument ``current_stream`` for the device of ``like`` (the yield path calls it)."""
    if isinstance(like, NullStream):
        return lambda: getattr(_cpu_state, "stream", _DEFAULT_CPU_STREAM)
    device = like.device
    return lambda: torch.cuda.current_stream(device)


def stream_setter(like: Stream) -> "Callable[[Stream], None]":
    """A cheap ``set_current_stream`` specialised for the device of ``like`` (the yield path calls it)."""
    if isinstance(like, NullStream):
        def set_cpu(s: Stream) -> None:
            _cpu_state.stream = s
        return set_cpu
    return torch.cuda.set_stream


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
        return
    event.record(s) if s is not None else event.record()


def wait(event: Event, s: Stream | None = None) -> None:
    """Make stream ``s`` (default: current) wait for ``event``; never blocks the CPU."""
    if isinstance(event, NullEvent):
        return
    (s if s is not None else torch.cuda.current_stream()).wait_event(event)


def synchronize(device: torch.device | str | None = None) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(resolve_device(device))
