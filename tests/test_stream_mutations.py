"""Mutation test of the stream choreography: remove one wait edge at a time; the sanitizer must report it.

``DATA_EDGES`` lists each edge with a program in which it carries data (DBO switches and yields, DeepEP HT/LL,
SBO, ``torch_ll``/``torch_ht`` collectives). ``REDUNDANT_EDGES`` must *not* be reported: HT ``previous_event``
and the compute->comm wait of ``yield_and_switch_from_compute_to_comm`` each order the comm stream after the
same compute (removing both is reported), and SBO's ``TwoStreamCombine.before_receive`` only keeps the receive
from competing for SMs. An edge is removed by skipping the wait issued from inside the named function, so the
code under test is not copied or edited.
"""
from __future__ import annotations

import contextlib
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import pytest
import torch

from moe_harness import StackWeights, run_ep
from standin_harness import bf16_inputs, bf16_weights, run_standin_ep
from ubatch import streams
from ubatch.context import UBatchContext, make_ubatch_contexts, run_greenlet_step
from ubatch.forward_context import ForwardContext
from ubatch.modular_moe.comm import WorkHandle
from ubatch.modular_moe.prepare_finalize import deepep
from ubatch.modular_moe.two_stream import TwoStreamCombine
from ubatch.sbo import SboFlags
from ubatch.testing import stream_sanitizer
from ubatch.testing.thread_ranks import run_thread_ranks

CS = SboFlags(combine_shared_experts=True)


@contextlib.contextmanager
def without_waits_in(*functions: Callable[..., Any], skipped: list[str] | None = None) -> Iterator[list[str]]:
    """Skip every null-stream ``wait``/``wait_stream`` issued from inside ``functions``; yields (and fills,
    while the block runs) the list of skipped waits."""
    codes = {fn.__code__ for fn in functions}
    event_wait, stream_wait = streams.NullEvent.wait, streams.NullStream.wait_stream
    skipped = [] if skipped is None else skipped

    def caller() -> Any:
        f: FrameType | None = sys._getframe(2)
        while f is not None and f.f_code.co_filename == streams.__file__:
            f = f.f_back
        return f.f_code if f is not None else None

    def wait(self: streams.NullEvent, stream: Any = None) -> None:
        code = caller()
        if code in codes:
            skipped.append(code.co_qualname)
            return
        event_wait(self, stream)

    def wait_stream(self: streams.NullStream, other: Any) -> None:
        code = caller()
        if code in codes:
            skipped.append(code.co_qualname)
            return
        stream_wait(self, other)

    streams.NullEvent.wait, streams.NullStream.wait_stream = wait, wait_stream  # type: ignore[method-assign]
    try:
        yield skipped
    finally:
        streams.NullEvent.wait, streams.NullStream.wait_stream = event_wait, stream_wait  # type: ignore[method-assign]


@contextlib.contextmanager
def without_previous_event(skipped: list[str] | None = None) -> Iterator[list[str]]:
    """The DeepEP HT adapter passes no ``previous_event`` (DeepEP then waits for the current stream)."""
    original = deepep.dbo_get_previous_event
    skipped = [] if skipped is None else skipped

    def none(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        skipped.append("previous_event")
        return None

    deepep.dbo_get_previous_event = none
    try:
        yield skipped
    finally:
        deepep.dbo_get_previous_event = original


@contextlib.contextmanager
def without_compute_to_dispatch_edges() -> Iterator[list[str]]:
    """Both paths that order DeepEP's dispatch after this ubatch's compute: ``previous_event`` and the wait
    in ``yield_and_switch_from_compute_to_comm``."""
    skipped: list[str] = []
    with without_previous_event(skipped), without_waits_in(UBatchContext.yield_and_switch_from_compute_to_comm,
                                                           skipped=skipped):
        yield skipped


# ---- programs ------------------------------------------------------------------------------------------
def dbo_program(there: str, back: str) -> Callable[[], object]:
    """Two greenlet ubatches, each: write on compute, ``there`` (to comm), read it on comm into a new
    tensor, ``back`` (to compute), read that on compute. Every cross-stream read needs the primitive's wait."""
    def run() -> None:
        compute, comm = streams.current_stream("cpu"), streams.new_stream("cpu", name="comm")
        streams.wait_stream(comm, compute)
        ctxs = make_ubatch_contexts(2, compute, comm, [ForwardContext(ubatch_id=i) for i in range(2)],
                                    executor="greenlet")

        def body(ctx: UBatchContext) -> Callable[[], None]:
            def ubatch() -> None:
                with ctx:
                    x = torch.full((64,), float(ctx.id))
                    getattr(ctx, there)()
                    y = x * 2
                    getattr(ctx, back)()
                    assert float(y.sum()) == 128.0 * ctx.id
            return ubatch

        run_greenlet_step(ctxs, [body(c) for c in ctxs])

    # On a thread of its own, as the wrapper's worker: a ubatch leaves its forward context installed there.
    return lambda: run_thread_ranks(1, lambda rank, groups: run(), num_groups=0)


NO_SBO = SboFlags()  # frozen: the default for moe_program


def moe_program(backend: str, sbo: SboFlags = NO_SBO) -> Callable[[], object]:
    if backend.startswith("deepep"):
        return lambda: run_standin_ep(bf16_weights(), bf16_inputs(2), backend, dbo=True, sbo=sbo, shared=sbo.enabled)
    weights = StackWeights.random(seed=0)
    inputs = [torch.randn(12, 16, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    return lambda: run_ep(weights, inputs, backend, dbo=True)


@dataclass(frozen=True)
class Mutation:
    edge: str
    remove: Callable[[], Any]  # a context manager factory yielding the list of what it skipped
    program: Callable[[], object]  # its result is not used


C = UBatchContext
DATA_EDGES = [
    Mutation("dbo:switch_to_comm_sync", lambda: without_waits_in(C.switch_to_comm_sync),
             dbo_program("switch_to_comm_sync", "switch_to_compute_sync")),
    Mutation("dbo:switch_to_compute_sync", lambda: without_waits_in(C.switch_to_compute_sync),
             dbo_program("switch_to_comm_sync", "switch_to_compute_sync")),
    Mutation("dbo:yield_and_switch_from_compute_to_comm",
             lambda: without_waits_in(C.yield_and_switch_from_compute_to_comm),
             dbo_program("yield_and_switch_from_compute_to_comm", "yield_and_switch_from_comm_to_compute")),
    Mutation("dbo:yield_and_switch_from_comm_to_compute",
             lambda: without_waits_in(C.yield_and_switch_from_comm_to_compute),
             dbo_program("yield_and_switch_from_compute_to_comm", "yield_and_switch_from_comm_to_compute")),
    Mutation("ht:dispatch->experts(switch_to_compute_sync)", lambda: without_waits_in(C.switch_to_compute_sync),
             moe_program("deepep_high_throughput")),
    Mutation("ht:combine->output(yield_and_switch_from_comm_to_compute)",
             lambda: without_waits_in(C.yield_and_switch_from_comm_to_compute), moe_program("deepep_high_throughput")),
    Mutation("ht:compute->dispatch(previous_event+yield_and_switch_from_compute_to_comm)",
             without_compute_to_dispatch_edges,
             moe_program("deepep_high_throughput")),
    Mutation("sbo:launch_combine(alt waits ready)", lambda: without_waits_in(TwoStreamCombine.launch_combine),
             moe_program("deepep_low_latency", CS)),
    Mutation("sbo:after_receive(main waits alt)", lambda: without_waits_in(TwoStreamCombine.after_receive),
             moe_program("deepep_low_latency", CS)),
    Mutation("collective:torch_ll(WorkHandle.wait)", lambda: without_waits_in(WorkHandle.wait),
             moe_program("torch_ll")),
    Mutation("collective:torch_ht(WorkHandle.wait)", lambda: without_waits_in(WorkHandle.wait),
             moe_program("torch_ht")),
]
REDUNDANT_EDGES = [
    Mutation("ht:previous_event alone", without_previous_event, moe_program("deepep_high_throughput")),
    Mutation("ht:yield_and_switch_from_compute_to_comm alone",
             lambda: without_waits_in(C.yield_and_switch_from_compute_to_comm), moe_program("deepep_high_throughput")),
    Mutation("sbo:before_receive(scheduling only)", lambda: without_waits_in(TwoStreamCombine.before_receive),
             moe_program("deepep_low_latency", CS)),
]


def run_mutation(m: Mutation) -> tuple[list[Any], list[str]]:
    """The program with the edge removed, under the sanitizer: (races reported, waits skipped)."""
    with m.remove() as skipped, stream_sanitizer.sanitizing() as races:
        m.program()
    return list(races), list(skipped)


@pytest.mark.parametrize("program", [dbo_program("switch_to_comm_sync", "switch_to_compute_sync"),
                                     dbo_program("yield_and_switch_from_compute_to_comm",
                                                 "yield_and_switch_from_comm_to_compute"),
                                     moe_program("deepep_high_throughput"), moe_program("deepep_low_latency", CS),
                                     moe_program("torch_ll"), moe_program("torch_ht")],
                         ids=["dbo_sync", "dbo_yield", "deepep_ht", "deepep_ll_sbo", "torch_ll", "torch_ht"])
def test_the_programs_are_race_free_as_written(program: Callable[[], object]) -> None:
    with stream_sanitizer.sanitizing() as races:
        program()
    assert races == [], str(races[0])


@pytest.mark.parametrize("mutation", DATA_EDGES, ids=[m.edge for m in DATA_EDGES])
def test_removing_a_data_edge_is_reported(mutation: Mutation) -> None:
    races, skipped = run_mutation(mutation)
    assert skipped, f"the mutation of {mutation.edge} removed nothing: the program never took that edge"
    assert races, f"removing {mutation.edge} ({len(skipped)} waits skipped) went unreported"
    assert all("stream-order race" in str(r) for r in races)


@pytest.mark.parametrize("mutation", REDUNDANT_EDGES, ids=[m.edge for m in REDUNDANT_EDGES])
def test_removing_a_redundant_or_scheduling_edge_is_not_a_race(mutation: Mutation) -> None:
    races, skipped = run_mutation(mutation)
    assert skipped, f"the mutation of {mutation.edge} removed nothing"
    assert races == [], str(races[0])


def test_every_wait_in_the_choreography_is_mutated() -> None:
    """Each function of the DBO, SBO and HT choreography that issues a wait is in the tables above, so a new
    wait cannot be added without a mutation that shows the sanitizer depends on it."""
    covered = {"switch_to_comm_sync", "switch_to_compute_sync", "yield_and_switch_from_compute_to_comm",
               "yield_and_switch_from_comm_to_compute", "launch_combine", "after_receive", "before_receive"}
    waiting = set()
    for cls in (UBatchContext, TwoStreamCombine):
        for name, fn in inspect.getmembers(cls, inspect.isfunction):
            if re.search(r"streams\.wait\(|\.wait_stream\(|\.wait_event\(", inspect.getsource(fn)):
                waiting.add(name)
    assert waiting == covered
    ht = inspect.getsource(deepep.DeepEPHighThroughput)
    used = set(re.findall(r"\b(dbo_(?:switch_to_\w+|yield_and_switch_\w+|get_previous_event))\(", ht))
    assert used == {"dbo_get_previous_event", "dbo_yield_and_switch_from_compute_to_comm", "dbo_switch_to_compute_sync",
                    "dbo_switch_to_compute", "dbo_switch_to_comm", "dbo_yield_and_switch_from_comm_to_compute"}
