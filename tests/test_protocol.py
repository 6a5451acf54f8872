"""The ping-pong protocol through the public wrapper: ordering, hooks, aborts, timeouts, thread hygiene."""
from __future__ import annotations

import functools
import threading
import time

import pytest
import torch

from ubatch import (
    DBOTimeoutError,
    DBOYieldMismatchError,
    UBatchConfig,
    UBatchSlice,
    UBatchWrapper,
    dbo_current_ubatch_id,
    dbo_enabled,
    dbo_maybe_run_recv_hook,
    dbo_register_recv_hook,
    dbo_yield,
    set_forward_context,
)


@pytest.fixture(params=["greenlet", "threads"])
def executor(request: pytest.FixtureRequest) -> str:
    return request.param


def even_slices(num_tokens: int, n: int) -> list[UBatchSlice]:
    step = num_tokens // n
    bounds = [i * step for i in range(n)] + [num_tokens]
    return [UBatchSlice(slice(bounds[i], bounds[i + 1]), slice(bounds[i], bounds[i + 1])) for i in range(n)]


def run(wrapper: UBatchWrapper, x: torch.Tensor, **kwargs: object) -> torch.Tensor:
    """One step of ``wrapper`` over ``x`` split evenly; every model here returns one tensor."""
    with set_forward_context(ubatch_slices=even_slices(x.shape[0], wrapper.config.num_ubatches)):
        return wrapper(x, **kwargs)


@pytest.mark.parametrize("n,yields", [(2, 1), (2, 4), (3, 1), (3, 3), (4, 2)])
def test_ring_order(n: int, yields: int, executor: str) -> None:
    trace: list[tuple[int, int]] = []

    def model(x: torch.Tensor) -> torch.Tensor:
        for k in range(yields):
            trace.append((dbo_current_ubatch_id(), k))
            dbo_yield()
        trace.append((dbo_current_ubatch_id(), yields))
        return x * 2

    w = UBatchWrapper(model, UBatchConfig(num_ubatches=n, executor=executor))
    x = torch.arange(12.0)
    out = run(w, x)
    assert torch.equal(out, x * 2)
    assert trace == [(u, k) for k in range(yields + 1) for u in range(n)]
    assert w.last_yield_counts == [yields] * n
    w.close()


def test_only_one_ubatch_runs_at_a_time(executor: str) -> None:
    running = []
    overlap = []

    def model(x: torch.Tensor) -> torch.Tensor:
        for _ in range(5):
            running.append(1)
            if len(running) > 1:
                overlap.append(True)
            time.sleep(0.001)  # releases the GIL: a second runner would show up here
            running.pop()
            dbo_yield()
        return x

    w = UBatchWrapper(model, UBatchConfig(num_ubatches=3, executor=executor))
    run(w, torch.zeros(9))
    assert overlap == []
    w.close()


def test_recv_hook_runs_in_next_ubatch_before_its_send(executor: str) -> None:
    events: list[tuple[str, int, int]] = []

    def model(x: torch.Tensor) -> torch.Tensor:
        me = dbo_current_ubatch_id()
        for layer in range(2):
            dbo_maybe_run_recv_hook()
            events.append(("send", me, layer))
            dbo_register_recv_hook(functools.partial(events.append, ("recv", me, layer)))
            dbo_yield()
            events.append(("use", me, layer))
        return x

    w = UBatchWrapper(model, UBatchConfig(executor=executor))
    run(w, torch.zeros(4))
    # ubatch 0's receive is launched by ubatch 1 right before ubatch 1's own send ...
    assert events[:3] == [("send", 0, 0), ("recv", 0, 0), ("send", 1, 0)]
    # ... and ubatch 1's receive by ubatch 0 before its next send; the last one on exit.
    assert events[3:6] == [("use", 0, 0), ("recv", 1, 0), ("send", 0, 1)]
    for who, layer in [(0, 0), (1, 0), (0, 1), (1, 1)]:
        assert events.index(("recv", who, layer)) < events.index(("use", who, layer))
    w.close()


def test_hook_thread_is_the_peer(executor: str) -> None:
    ran_in: list[int] = []

    def model(x: torch.Tensor) -> torch.Tensor:
        dbo_register_recv_hook(lambda: ran_in.append(dbo_current_ubatch_id()))
        dbo_yield()
        return x

    w = UBatchWrapper(model, UBatchConfig(executor=executor))
    run(w, torch.zeros(4))
    # ubatch 0 resumes first and drains ubatch 1's hook on exit; then ubatch 1 drains ubatch 0's
    assert ran_in == [0, 1]
    w.close()


@pytest.mark.parametrize("n", [2, 3])
def test_exception_at_every_yield_position_surfaces_and_next_call_works(n: int, executor: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The error reaches the caller through the abort path, not by waiting the peers out: no handoff timeout
    fires (none is even constructed) and no worker is left stuck and replaced (the thread count holds)."""
    yields = 3
    plan: dict[str, int] = {}
    timeouts: list[tuple[object, ...]] = []
    original_init = DBOTimeoutError.__init__

    def counting_init(self: DBOTimeoutError, *args: object) -> None:
        timeouts.append(args)
        original_init(self, *args)

    monkeypatch.setattr(DBOTimeoutError, "__init__", counting_init)

    def model(x: torch.Tensor) -> torch.Tensor:
        me = dbo_current_ubatch_id()
        for k in range(yields + 1):
            if plan.get("ubatch") == me and plan.get("at") == k:
                raise KeyError(f"boom in ubatch {me} at {k}")
            if k < yields:
                dbo_yield()
        return x + 1

    # a peer left waiting would time out after 10 s: far past any scheduling noise, and it fails the test
    w = UBatchWrapper(model, UBatchConfig(num_ubatches=n, handoff_timeout_s=10, executor=executor))
    x = torch.arange(6.0)
    threads = threading.active_count()
    for u in range(n):
        for at in range(yields + 1):
            plan.update(ubatch=u, at=at)
            with pytest.raises(KeyError, match=f"boom in ubatch {u} at {at}") as info:
                run(w, x)
            assert timeouts == [], f"ubatch {u} failing at {at}: a handoff timed out instead of aborting"
            assert threading.active_count() == threads, "a worker was stuck and replaced"
            assert any(tb.name == "model" for tb in info.traceback)  # the original traceback is kept
            plan.clear()
            assert torch.equal(run(w, x), x + 1)
    w.close()


def test_missing_peer_times_out_with_diagnostic(executor: str) -> None:
    release = threading.Event()

    def model(x: torch.Tensor) -> torch.Tensor:
        if dbo_current_ubatch_id() == 1:
            release.wait(10)  # never yields back in time
        dbo_yield()
        return x

    w = UBatchWrapper(model, UBatchConfig(handoff_timeout_s=0.3, executor=executor))
    with pytest.raises(DBOTimeoutError, match=r"ubatch 0 waited 0\.3s at yield #1 for control back from ubatch 1"):
        run(w, torch.zeros(4))
    release.set()
    # the stuck worker was replaced: the wrapper still works
    assert torch.equal(run(w, torch.ones(4)), torch.ones(4))
    w.close()


def test_yield_count_mismatch_is_reported(executor: str) -> None:
    def model(x: torch.Tensor) -> torch.Tensor:
        for _ in range(1 + dbo_current_ubatch_id()):
            dbo_yield()
        return x

    w = UBatchWrapper(model, UBatchConfig(handoff_timeout_s=5, executor=executor))
    with pytest.raises(DBOYieldMismatchError, match=r"\[1, 2\]"):
        run(w, torch.zeros(4))
    w.close()


def test_no_thread_leak_over_10000_calls(executor: str) -> None:
    def model(x: torch.Tensor) -> torch.Tensor:
        dbo_yield()
        return x

    before = threading.active_count()
    w = UBatchWrapper(model, UBatchConfig(executor=executor))
    x = torch.zeros(4)
    with set_forward_context(ubatch_slices=even_slices(4, 2)):
        for _ in range(10_000):
            w(x)
        assert threading.active_count() == before + (2 if executor == "threads" else 1)
    w.close()
    assert threading.active_count() == before


def test_threads_set_their_torch_thread_count(executor: str) -> None:
    seen: list[int] = []

    def model(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return x

    w = UBatchWrapper(model, UBatchConfig(num_threads_per_ubatch=1, executor=executor))
    run(w, torch.zeros(4))
    assert seen == [1, 1]
    w.close()


def test_dbo_calls_are_noops_outside_ubatch_threads() -> None:
    assert not dbo_enabled()
    assert dbo_current_ubatch_id() == 0
    dbo_yield()
    dbo_maybe_run_recv_hook()
    ran = []
    dbo_register_recv_hook(lambda: ran.append(1))
    assert ran == [1]  # outside DBO the receive half runs inline


def test_bad_config_raises() -> None:
    with pytest.raises(ValueError, match="num_ubatches must be an integer >= 2, got 1"):
        UBatchConfig(num_ubatches=1)
    with pytest.raises(ValueError, match="handoff_timeout_s must be a finite number > 0, got -1"):
        UBatchConfig(handoff_timeout_s=-1)
    with pytest.raises(ValueError, match="unknown ubatch executor 'fibers'"):
        UBatchConfig(executor="fibers")
