"""The stream-order sanitizer (``ubatch.testing.stream_sanitizer``) on small programs whose answer is known.

Each race case has a twin with the edge that orders it, which must pass: so the sanitizer neither misses a
missing wait nor reports a correct program. Every test runs under ``stream_sanitizer.sanitizing()``, so it
checks the sanitizer whether or not the session runs with ``--stream-sanitizer``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from stream_sanitizer_plugin import sanitize_child_processes
from ubatch import streams
from ubatch.context import make_ubatch_contexts, run_greenlet_step
from ubatch.forward_context import ForwardContext
from ubatch.modular_moe.comm import AllToAll, WorkHandle
from ubatch.testing import stream_sanitizer
from ubatch.testing.stream_sanitizer import StreamOrderError
from ubatch.testing.thread_ranks import run_thread_ranks


def fork(x: torch.Tensor) -> tuple[torch.Tensor, streams.NullStream, streams.NullStream]:
    """``x`` and two side streams forked from the current stream after ``x`` was made (as on a GPU, a new
    stream is not ordered after work already enqueued elsewhere: the fork is what orders it)."""
    a, b = streams.new_stream("cpu", name="A"), streams.new_stream("cpu", name="B")
    here = streams.current_stream("cpu")
    assert isinstance(a, streams.NullStream) and isinstance(b, streams.NullStream)  # "cpu": CPU streams
    a.wait_stream(here)
    b.wait_stream(here)
    return x, a, b


def races(body: Callable[[], Any]) -> list[StreamOrderError]:
    with stream_sanitizer.sanitizing() as errors:
        body()
    return list(errors)


def test_read_after_write_on_another_stream_is_reported_with_both_ops() -> None:
    def body() -> None:
        x, a, b = fork(torch.zeros(8))
        with streams.stream(a):
            x.add_(1)
        with streams.stream(b):
            x.mul(2)

    errors = races(body)
    assert len(errors) == 1
    msg = str(errors[0])
    assert "read-after-write" in msg and "read by aten.mul" not in msg  # op names without the aten:: prefix
    assert "read by mul on stream 'B'" in msg and "write by add_ on stream 'A'" in msg
    assert "outside DBO" in msg and "test_stream_sanitizer.py" in msg  # ubatch and the issuing lines


@pytest.mark.parametrize("edge", ["event", "wait_stream", "stream_sync", "event_sync", "device_sync"])
def test_each_kind_of_edge_orders_the_read(edge: str) -> None:
    def body() -> None:
        x, a, b = fork(torch.zeros(8))
        with streams.stream(a):
            x.add_(1)
        if edge == "event":
            ev = streams.new_event("cpu")
            streams.record(ev, a)
            streams.wait(ev, b)
        elif edge == "wait_stream":
            b.wait_stream(a)
        elif edge == "stream_sync":
            a.synchronize()
        elif edge == "event_sync":
            a.record_event().synchronize()
        else:
            streams.synchronize("cpu")
        with streams.stream(b):
            x.mul(2)

    assert races(body) == []


def test_event_recorded_before_the_write_does_not_order_it() -> None:
    def body() -> None:
        x, a, b = fork(torch.zeros(8))
        ev = streams.new_event("cpu")
        with streams.stream(a):
            ev.record()  # too early: the write below comes after it
            x.add_(1)
        with streams.stream(b):
            ev.wait()
            x.mul(2)

    assert len(races(body)) == 1


def test_write_after_read_is_reported() -> None:
    def body() -> None:
        x, a, b = fork(torch.zeros(8))
        with streams.stream(a):
            x.sum()
        with streams.stream(b):
            x.fill_(3)

    errors = races(body)
    assert len(errors) == 1 and "write-after-read" in str(errors[0])


def test_views_conflict_only_where_their_bytes_overlap() -> None:
    def disjoint() -> None:
        x, a, b = fork(torch.zeros(10))
        with streams.stream(a):
            x[:5].fill_(1)
        with streams.stream(b):
            x[5:].sum()

    def overlapping() -> None:
        x, a, b = fork(torch.zeros(10))
        with streams.stream(a):
            x[:5].fill_(1)
        with streams.stream(b):
            x[4:].sum()

    assert races(disjoint) == []
    errors = races(overlapping)
    assert len(errors) == 1 and "bytes [16, 20)" in str(errors[0])  # element 4 of float32


def test_a_new_tensor_at_a_reused_address_has_no_history() -> None:
    def body() -> None:
        _, a, b = fork(torch.zeros(1))
        for _ in range(20):  # malloc hands the same address back: a fresh tensor must not race with a dead one
            with streams.stream(a):
                x = torch.ones(64) * 2
            del x
            with streams.stream(b):
                y = torch.ones(64) * 3
            del y

    assert races(body) == []


def test_collective_output_is_ordered_by_the_work_wait_only() -> None:
    """A gloo all-to-all writes its output on the group's collective stream; reading it is ordered only by
    ``WorkHandle.wait`` (CPU execution finished long before: the model is what a GPU would do)."""

    def program(wait: bool) -> Callable[[], Any]:
        def rank_main(rank: int, groups: list[Any]) -> None:
            out, inp = torch.empty(4), torch.full((4,), float(rank))
            handle = AllToAll(groups[0]).all_to_all(out, inp)
            assert isinstance(handle, WorkHandle)  # gloo: a collective's work
            handle.work.wait()  # the CPU has the data either way
            if wait:
                handle.wait()
            out.sum()

        return lambda: run_thread_ranks(2, rank_main, num_groups=1, timeout_s=60)

    errors = races(program(wait=False))
    assert len(errors) == 2 and all("collectives:rank-" in str(e) for e in errors)  # one per rank thread
    assert races(program(wait=True)) == []


def test_ubatches_on_one_greenlet_thread_are_told_apart() -> None:
    """Two greenlet ubatches: ubatch 0 writes on the comm stream and yields; ubatch 1 reads it on compute.
    The report names both ubatches and streams, so what each one re-installed on resume was attributed."""
    shared = torch.zeros(4)

    def body() -> None:
        compute, comm = streams.current_stream("cpu"), streams.new_stream("cpu", name="comm")
        streams.wait_stream(comm, compute)
        ctxs = make_ubatch_contexts(2, compute, comm, [ForwardContext(ubatch_id=i) for i in range(2)],
                                    executor="greenlet")

        def ubatch0() -> None:
            with ctxs[0]:
                ctxs[0].switch_to_comm()
                shared.add_(1)
                ctxs[0].yield_()
                ctxs[0].switch_to_compute()

        def ubatch1() -> None:
            with ctxs[1]:
                shared.sum()
                ctxs[1].yield_()

        run_greenlet_step(ctxs, [ubatch0, ubatch1])

    # On a thread of its own, as the wrapper's worker: a ubatch leaves its forward context installed there.
    errors = races(lambda: run_thread_ranks(1, lambda rank, groups: body(), num_groups=0))
    assert len(errors) == 1
    assert "on stream 'cpu-default' (ubatch 1" in str(errors[0]) and "on stream 'comm' (ubatch 0" in str(errors[0])


def test_raises_at_the_access_outside_collecting() -> None:
    was_on = stream_sanitizer.active() is not None
    san = stream_sanitizer.enable()
    previous, san.raise_errors = san.raise_errors, True
    try:
        x, a, b = fork(torch.zeros(8))
        with streams.stream(a):
            x.add_(1)
        with pytest.raises(StreamOrderError, match="read by sum on stream 'B'"), streams.stream(b):
            x.sum()
    finally:
        san.raise_errors = previous
        if not was_on:
            stream_sanitizer.disable()


def test_nothing_is_observed_when_off() -> None:
    if stream_sanitizer.active() is not None:
        pytest.skip("the session runs under --stream-sanitizer")
    assert streams._observer is None
    x, a, b = fork(torch.zeros(8))
    with streams.stream(a):
        x.add_(1)
    with streams.stream(b):
        assert float(x.sum()) == 8.0  # no error, no observer: the null streams are plain no-ops


@pytest.mark.parametrize("value,expect_race", [("1", True), ("0", False)])
def test_environment_variable_turns_it_on_in_a_fresh_process(value: str, expect_race: bool) -> None:
    code = ("import torch\nfrom ubatch import streams\n"
            "a, b = streams.new_stream('cpu', name='A'), streams.new_stream('cpu', name='B')\n"
            "x = torch.zeros(4)\n"
            "with streams.stream(a):\n    x.add_(1)\n"
            "with streams.stream(b):\n    x.sum()\n"
            "print('finished')\n")
    # What ``--stream-sanitizer`` gives child processes: the variable and the tests' ``sitecustomize``.
    env = sanitize_child_processes(dict(os.environ))
    env["UBATCH_STREAM_SANITIZER"] = value
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if expect_race:
        assert proc.returncode != 0 and "StreamOrderError" in proc.stderr and "finished" not in proc.stdout
    else:
        assert proc.returncode == 0 and "finished" in proc.stdout, proc.stderr


def test_eager_graph_stand_in_captures_on_the_capture_stream_and_syncs_like_cuda() -> None:
    """The CPU double of the graph backend (``cudagraph.backends.EagerReplayBackend``): its capture runs on
    the capture stream, as ``torch.cuda.graph(stream=)`` does, and its ``synchronize`` is a device-wide sync
    (it was a no-op, so the graph manager's warm-up -> capture hand-off looked like a race)."""
    from cudagraph.backends import EagerReplayBackend

    backend = EagerReplayBackend()
    capture_stream = streams.new_stream("cpu", name="graph-capture")
    seen: list[streams.Stream] = []

    def capture_body() -> torch.Tensor:
        seen.append(streams.current_stream("cpu"))
        return torch.zeros(1)

    backend.capture(capture_body, None, capture_stream)
    assert seen == [capture_stream] and streams.current_stream("cpu") is not capture_stream

    def body() -> None:
        x, a, b = fork(torch.zeros(8))
        with streams.stream(a):
            x.add_(1)
        backend.synchronize()
        with streams.stream(b):
            x.sum()

    assert races(body) == []


def test_the_mode_is_entered_in_project_threads_but_not_in_library_housekeeping_threads() -> None:
    """A daemon thread still alive at interpreter exit with the mode on its stack aborts the process (tqdm's
    monitor did, at the end of a sanitised run), so only plain threads not marked ``touches_no_tensors``
    get it."""
    import threading

    from torch.utils._python_dispatch import _get_current_dispatch_mode

    seen: dict[str, bool] = {}

    def probe(key: str) -> None:
        seen[key] = _get_current_dispatch_mode() is not None

    class Housekeeping(threading.Thread):
        def run(self) -> None:
            probe("subclass")

    with stream_sanitizer.sanitizing():
        marked = threading.Thread(target=probe, args=("marked",))
        marked.touches_no_tensors = True  # type: ignore[attr-defined]
        threads = [threading.Thread(target=probe, args=("plain",)), marked, Housekeeping()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
    assert seen == {"plain": True, "marked": False, "subclass": False}
