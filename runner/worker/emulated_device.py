"""An emulated accelerator for machines without one: every step has a device time, run asynchronously.

``--emulate-device step_us=S,us_per_token=T`` gives each step of the model runner a device time of
``S + T x tokens`` microseconds on an emulated stream: launching a step returns at once, the steps complete one
after the other in launch order (a step starts when it is launched and the one before it has completed), and
reading a step's results waits until it has completed. Like the emulated link
(``ubatch/modular_moe/prepare_finalize/emulated_link.py``) the model is a deadline per step on the host's clock,
kept by the launcher: the in-flight time uses no CPU (a reader sleeps until the deadline), and the real work
still runs underneath (on the CPU, at launch), so tokens stay exact; the model only decides *when* a step's
results may be observed. With it a CPU run sees what a GPU run sees: a loop that waits for each step's results
before launching the next pays host + device per step, a pipelined one max(host, device).

The stream counts what the host cost it: ``idle_launches`` are launches that found the stream drained (the
device waited for the host), ``idle_s`` the device time lost that way.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

# A step is waited for while the run holds its collectives open: one second per step is already slower than any
# real forward, so larger values only hang the run.
MAX_STEP_US = 1e6
MAX_US_PER_TOKEN = 1e4
KEYS = ("step_us", "us_per_token")


@dataclass(frozen=True)
class DeviceSpec:
    """``step_us`` (per step) in [0, MAX_STEP_US] and ``us_per_token`` in [0, MAX_US_PER_TOKEN], microseconds."""

    step_us: float = 0.0
    us_per_token: float = 0.0

    def __post_init__(self) -> None:
        for key, bound in (("step_us", MAX_STEP_US), ("us_per_token", MAX_US_PER_TOKEN)):
            value = getattr(self, key)
            if not math.isfinite(value) or value < 0 or value > bound:
                raise ValueError(f"emulated device {key} must lie in [0, {bound:g}] microseconds, got {value!r}")

    def seconds(self, num_tokens: int) -> float:
        return (self.step_us + self.us_per_token * num_tokens) * 1e-6

    def to_text(self) -> str:
        """The ``--emulate-device`` spelling (``parse`` reads it back)."""
        return f"step_us={self.step_us:g},us_per_token={self.us_per_token:g}"

    @classmethod
    def parse(cls, text: str) -> DeviceSpec:
        """``"step_us=3000,us_per_token=0"`` (the ``--emulate-device`` syntax); both keys optional, one needed."""
        if not isinstance(text, str):
            raise ValueError(f"--emulate-device spec must be a string like 'step_us=3000,us_per_token=2', "
                             f"got {text!r}")
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, raw = part.partition("=")
            key = key.strip()
            if not sep or key not in KEYS:
                raise ValueError(f"bad --emulate-device item {part!r}; expected step_us=<float>,us_per_token=<float>")
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(f"bad --emulate-device value {raw.strip()!r} for {key}; expected a number") from None
            if key in values:
                raise ValueError(f"--emulate-device names {key} twice in {text!r}")
            values[key] = value
        if not values:
            raise ValueError(f"empty --emulate-device spec {text!r}; expected step_us=<float>,us_per_token=<float>")
        return cls(**values)


class DeviceWaitTimeout(TimeoutError):
    """A step's results were not ready within the reader's timeout."""


class EmulatedDevice:
    """One rank's emulated stream: ``launch(num_tokens)`` queues a step and returns its completion time;
    ``wait(deadline)`` sleeps until then. Thread-safe (steps are launched on one thread, read on another)."""

    def __init__(self, spec: DeviceSpec) -> None:
        self.spec = spec
        self._lock = threading.Lock()
        self._busy_until = 0.0
        self.num_launches = 0
        self.idle_launches = 0  # launches that found the stream drained: the device had waited for the host
        self.idle_s = 0.0  # device time lost that way (from the second launch on)
        self.busy_s = 0.0  # modelled device time of every launched step

    def launch(self, num_tokens: int) -> float:
        """Queue a step of ``num_tokens`` tokens; returns when (``time.perf_counter``) it completes."""
        duration = self.spec.seconds(num_tokens)
        now = time.perf_counter()
        with self._lock:
            if now >= self._busy_until:
                if self.num_launches:
                    self.idle_s += now - self._busy_until
                self.idle_launches += 1
                start = now
            else:
                start = self._busy_until
            self._busy_until = start + duration
            self.num_launches += 1
            self.busy_s += duration
            return self._busy_until

    @staticmethod
    def wait(deadline: float, timeout_s: float | None = None) -> None:
        """Sleep until ``deadline``; :class:`DeviceWaitTimeout` if that is more than ``timeout_s`` away."""
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            return
        if timeout_s is not None and remaining > timeout_s:
            raise DeviceWaitTimeout(f"an emulated step completes in {remaining:.3f} s, more than the reader's "
                                    f"timeout of {timeout_s:g} s")
        time.sleep(remaining)
