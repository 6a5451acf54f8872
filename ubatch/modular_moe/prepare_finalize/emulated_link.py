"""A modelled interconnect: each transfer completes at ``start + latency + bytes / bandwidth``.

Its in-flight time uses no CPU, like a NIC, so overlap can be measured on one machine where loopback gloo burns
CPU for every byte; the real transfer still happens underneath (results stay exact) and the model decides when
it may be observed. A rank's transfers queue on one wire (``busy_until``). On a GPU each transfer is a wait
kernel on the GPU's nanosecond timer on the rank's side stream, so the step stays capturable. ``cuda_module``
replaces ``torch.cuda`` in tests. Design: docs/design_notes.md, "MoE layer and the DBO runtime".
"""
from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ubatch import streams, trace
from ubatch.modular_moe.comm import Handle
from ubatch.modular_moe.prepare_finalize import device_wait

# Bounds of a modelled link. A transfer is waited for while the run holds its collectives open, so a latency
# of minutes (latency_us=1e9) only hangs the run: 1 s per transfer is already slower than any real network.
# Below 1 MB/s a step's all-to-all would take minutes too.
MAX_LATENCY_US = 1e6
MIN_GBPS = 1e-3


@dataclass(frozen=True)
class LinkSpec:
    """``latency_us`` in [0, MAX_LATENCY_US]; ``gbps`` (gigabytes per second) at least MIN_GBPS, or infinite
    (the default: no bandwidth limit; the ``--emulate-link`` text omits gbps for that)."""

    latency_us: float = 0.0
    gbps: float = float("inf")  # gigabytes per second

    def __post_init__(self) -> None:
        if not math.isfinite(self.latency_us):
            raise ValueError(f"emulated link latency_us must be a finite number, got {self.latency_us}")
        if self.latency_us < 0:
            raise ValueError(f"emulated link latency_us must be >= 0, got {self.latency_us}")
        if self.latency_us > MAX_LATENCY_US:
            raise ValueError(f"emulated link latency_us must be <= {MAX_LATENCY_US:.0f} (1 s per transfer), got "
                             f"{self.latency_us:g}")
        if math.isnan(self.gbps):
            raise ValueError(f"emulated link gbps must be a number, got {self.gbps}")
        if self.gbps <= 0:
            raise ValueError(f"emulated link gbps must be > 0, got {self.gbps}")
        if self.gbps < MIN_GBPS:
            raise ValueError(f"emulated link gbps must be >= {MIN_GBPS:g} (1 MB/s), got {self.gbps:g}")

    def seconds(self, nbytes: int) -> float:
        return self.latency_us * 1e-6 + nbytes / (self.gbps * 1e9)

    @classmethod
    def calibrated(cls, nbytes: int, transfers: int, seconds: float, latency_us: float = 20.0) -> LinkSpec:
        """The link on which ``transfers`` transfers of ``nbytes`` bytes in all take ``seconds`` one after the
        other: each pays ``latency_us`` once and the bandwidth carries the bytes in what is left (benchmarks set
        the link relative to a measured compute time this way)."""
        gbps = nbytes / max(seconds - transfers * latency_us * 1e-6, 1e-6) / 1e9
        return cls(latency_us=latency_us, gbps=max(gbps, MIN_GBPS))

    def to_text(self) -> str:
        """The ``--emulate-link`` spelling (``parse`` reads it back)."""
        return f"latency_us={self.latency_us:g}" + ("" if math.isinf(self.gbps) else f",gbps={self.gbps:.6g}")

    @classmethod
    def parse(cls, text: str) -> LinkSpec:
        """``"latency_us=50,gbps=10"`` (the ``--emulate-link`` syntax); both keys optional."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, raw = part.partition("=")
            if not sep or key.strip() not in ("latency_us", "gbps"):
                raise ValueError(f"bad --emulate-link item {part!r}; expected latency_us=<float>,gbps=<float>")
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(f"bad --emulate-link value {raw!r} for {key.strip()}; expected a number") from None
            if not math.isfinite(value):
                raise ValueError(f"bad --emulate-link value {raw.strip()!r} for {key.strip()}; expected a finite "
                                 "number (omit gbps for a link without a bandwidth limit)")
            values[key.strip()] = value
        if not values:
            raise ValueError(f"empty --emulate-link spec {text!r}; expected latency_us=<float>,gbps=<float>")
        return cls(**values)


class _DeadlineHandle:
    def __init__(self, inner: Handle | None, deadline: float, on_done: Callable[[float], None] | None,
                 link: EmulatedLink) -> None:
        self.inner, self.deadline, self.on_done, self.link = inner, deadline, on_done, link

    def wait(self) -> None:
        if self.inner is not None:
            self.inner.wait()
        remaining = self.deadline - time.perf_counter()
        if remaining > 0:
            with trace.region("link_wait", "link"):  # blocked on the modelled wire, not on CPU work
                time.sleep(remaining)
            self.link.add_exposed(remaining)
        if self.on_done is not None:
            self.on_done(self.deadline)


class _DeviceWaitHandle:

    def __init__(self, inner: Handle | None, done_event: Any, cuda: Any) -> None:
        self.inner, self.done_event, self.cuda = inner, done_event, cuda

    def wait(self) -> None:
        if self.inner is not None:
            self.inner.wait()
        self.cuda.current_stream().wait_event(self.done_event)


class EmulatedLink:
    """Per-rank link model shared by every ubatch and layer of that rank."""

    def __init__(self, spec: LinkSpec, device: torch.device | str | None = None, cuda_module: Any = None) -> None:
        self.spec = spec
        self._cuda = cuda_module if cuda_module is not None else torch.cuda
        self._wait_ns: Callable[[int], None] | None = None  # the device wait kernel (GPU path only)
        if cuda_module is not None:  # a stand-in device: the GPU path on its simulated timeline
            self.device = torch.device("cuda", 0)
            self._side_stream = cuda_module.Stream()
            self._wait_ns = cuda_module.wait_ns
        else:
            self.device = streams.resolve_device(device)
            self._side_stream = streams.new_stream(self.device, name="emulated-link") \
                if self.device.type == "cuda" else None
            if self._side_stream is not None:
                with torch.cuda.stream(self._side_stream):
                    device_wait.prepare()  # compiled now, never inside a CUDA-graph capture
                self._wait_ns = device_wait.wait_ns
        self._lock = threading.Lock()
        self._busy_until = 0.0
        self.total_bytes = 0
        self.num_transfers = 0
        # CPU path only (a GPU's waits happen on the device): modelled in-flight time of every transfer, and the
        # part a waiter spent asleep on it, i.e. not hidden behind compute. Cheap enough to keep always on.
        self.in_flight_s = 0.0
        self.exposed_s = 0.0

    def add_exposed(self, seconds: float) -> None:
        with self._lock:
            self.exposed_s += seconds

    def transfer(self, nbytes: int, inner: Handle | None = None, label: str = "a2a") -> Handle:
        """Model sending ``nbytes`` now; ``inner`` is the real transfer to complete underneath."""
        now = time.perf_counter()
        if self._side_stream is not None:  # the GPU serialises transfers on the side stream (module doc)
            with self._lock:
                self.total_bytes += nbytes
                self.num_transfers += 1
            return self._cuda_transfer(self.spec.seconds(nbytes), inner, trace.active(), label, nbytes, now)
        with self._lock:
            start = max(now, self._busy_until)
            wire_done = start + nbytes / (self.spec.gbps * 1e9)
            self._busy_until = wire_done
            self.total_bytes += nbytes
            self.num_transfers += 1
        deadline = wire_done + self.spec.latency_us * 1e-6
        with self._lock:
            self.in_flight_s += deadline - now
        rec = trace.active()
        on_done: Callable[[float], None] | None = None
        if rec is not None:
            track, pid = _comm_track(), trace.current_pid()  # the posting rank's, as the wait may run elsewhere
            # called with the transfer's end: rec.span(label, "comm", track, now, end, ...)
            on_done = functools.partial(rec.span, label, "comm", track, now, pid=pid, bytes=nbytes)
        return _DeadlineHandle(inner, deadline, on_done, self)

    def _cuda_transfer(self, seconds: float, inner: Handle | None, rec: trace.TraceRecorder | None, label: str,
                       nbytes: int, now: float) -> Handle:
        cuda, wait_ns = self._cuda, self._wait_ns
        if wait_ns is None:
            raise RuntimeError("the emulated link has a side stream but no device wait kernel")
        ready = cuda.Event()
        ready.record()
        done = cuda.Event()
        start = end = None
        with cuda.stream(self._side_stream):
            self._side_stream.wait_event(ready)
            if rec is not None:
                start = rec.device_stamp(self._side_stream)  # None: cpu clock, or inside a capture
            wait_ns(max(1, round(seconds * 1e9)))
            if rec is not None and start is not None:
                end = rec.device_stamp(self._side_stream)
            done.record()
        if rec is not None:
            if start is not None:
                rec.span(label, "comm", _comm_track(), start, end, bytes=nbytes)
            elif rec.clock == "cpu" and not cuda.is_current_stream_capturing():
                rec.span(label, "comm", _comm_track(), now, now + seconds, bytes=nbytes)  # the modelled interval
        return _DeviceWaitHandle(inner, done, cuda)


def _comm_track() -> str:
    from ubatch.context import dbo_current_ubatch_id  # local: context imports nothing from here

    return trace.comm_track(dbo_current_ubatch_id())


def parse_link(spec: str | LinkSpec | None) -> LinkSpec | None:
    if spec is None or isinstance(spec, LinkSpec):
        return spec
    return LinkSpec.parse(spec)


class AllHandles:
    """Several transfers completed together; ``handles`` stays readable (the tracer waits on them from a
    tracing stream, ``prepare_finalize/base.py``)."""

    def __init__(self, handles: Sequence[Handle]) -> None:
        self.handles = list(handles)

    def wait(self) -> None:
        for h in self.handles:
            h.wait()


def sum_handles(handles: Sequence[Handle]) -> Handle:
    return AllHandles(handles)
