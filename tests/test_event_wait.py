"""The CPU thread's wait for a step's copy of sampled ids (``runner/worker/event_wait.py``), with stand-in events:
it returns once the event completes, raises ``TimeoutError`` when it does not in time and the device's error when
the wait failed, and serves waits in order."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from runner.worker.event_wait import EventWaiter


class FakeEvent:
    """``query``/``synchronize`` like a CUDA event that completes when ``release()`` is called."""

    def __init__(self, done: bool = False) -> None:
        self._done = threading.Event()
        if done:
            self._done.set()
        self.synchronized = 0

    def release(self) -> None:
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self.synchronized += 1
        self._done.wait(10)


def test_a_completed_event_returns_without_the_waiter_thread() -> None:
    ev = FakeEvent(done=True)
    EventWaiter(torch.device("cpu")).wait(ev, 1.0)  # type: ignore[arg-type]
    assert ev.synchronized == 0


def test_the_wait_returns_once_the_event_completes() -> None:
    waiter, ev = EventWaiter(torch.device("cpu")), FakeEvent()
    threading.Timer(0.05, ev.release).start()
    t0 = time.perf_counter()
    waiter.wait(ev, 5.0)  # type: ignore[arg-type]
    assert ev.query() and ev.synchronized == 1 and time.perf_counter() - t0 < 5.0


def test_an_event_that_does_not_complete_in_time_raises_and_later_waits_still_work() -> None:
    waiter, stuck, later = EventWaiter(torch.device("cpu")), FakeEvent(), FakeEvent()
    with pytest.raises(TimeoutError, match="not on the host after 0.05 s"):
        waiter.wait(stuck, 0.05)  # type: ignore[arg-type]
    stuck.release()  # the stuck wait completes; the next one is served after it, in order
    threading.Timer(0.02, later.release).start()
    waiter.wait(later, 5.0)  # type: ignore[arg-type]
    assert later.synchronized == 1
    waiter.close()
    waiter._thread.join(5)
    assert not waiter._thread.is_alive()


def test_a_failed_wait_raises_its_error_in_the_caller() -> None:
    class Broken(FakeEvent):
        def synchronize(self) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        EventWaiter(torch.device("cpu")).wait(Broken(), 5.0)  # type: ignore[arg-type]


@pytest.mark.cuda
def test_cuda_event_wait_returns_after_the_copy() -> None:
    x = torch.randn(4096, 4096, device="cuda")
    y = x @ x @ x  # queued work for the copy to wait behind
    host = torch.empty(4096, pin_memory=True)
    host.copy_(y[0], non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    EventWaiter(torch.device("cuda")).wait(event, 60.0)
    assert event.query() and torch.equal(host, y[0].cpu())
