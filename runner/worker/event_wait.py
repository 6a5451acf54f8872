"""Waiting for a CUDA event with a timeout, without polling under the GIL.

The step loop's CPU thread reads a step's sampled ids once the event after their copy has completed, while the
step thread launches the next step. Polling ``event.query()`` between short sleeps wakes the CPU thread every
0.1 ms or so, and each wake-up takes the GIL from the step thread at one of its torch calls (each releases the
GIL), so the two threads hand it back and forth while the step thread should be launching. Here one daemon
thread blocks in ``event.synchronize()``, which releases the GIL (as vLLM's async output copy waits), and then
sets a ``threading.Event`` that the caller waits on with its timeout: one wake-up of each thread per step, and
the caller never waits longer than it asked (a stuck device leaves only the daemon thread waiting).
"""
from __future__ import annotations

import queue
import threading

import torch


class _Wait:
    """One wait: set once its event has completed, with the error if synchronizing on it raised."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None


class EventWaiter:
    """One daemon thread that completes waits in the order they are asked for (events complete in stream order).
    ``device``: the CUDA device the events are recorded on, made the thread's current device (a new thread's is
    device 0, whose context a CUDA call would otherwise create)."""

    def __init__(self, device: torch.device, name: str = "ubatch-event-wait") -> None:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._queue: queue.SimpleQueue[tuple[torch.cuda.Event, _Wait] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        failure: BaseException | None = None
        if self.device.type == "cuda":
            try:
                torch.cuda.set_device(self.device)
            except BaseException as exc:  # noqa: BLE001 - every wait then raises it
                failure = exc
        while True:
            item = self._queue.get()
            if item is None:
                return
            event, wait = item
            try:
                if failure is not None:
                    raise failure
                event.synchronize()
            except BaseException as exc:  # noqa: BLE001 - a device error: raised by the waiting caller
                wait.error = exc
            finally:
                wait.done.set()

    def close(self) -> None:
        """Stop the thread once the waits asked for before have completed (it is a daemon: nothing waits here)."""
        self._queue.put(None)

    def wait(self, event: torch.cuda.Event, timeout_s: float | None) -> None:
        """Return once ``event`` has completed; ``TimeoutError`` after ``timeout_s`` seconds (None: no limit), and
        the device's error if the wait for it failed."""
        if event.query():
            return
        wait = _Wait()
        self._queue.put((event, wait))
        if not wait.done.wait(timeout_s):
            raise TimeoutError(f"a step's sampled ids were not on the host after {timeout_s:g} s")
        if wait.error is not None:
            raise wait.error
