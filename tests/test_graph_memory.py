"""CUDA-graph memory on CPU: a capture that runs out of memory drops sizes instead of failing (through the graph
backend interface and through the engine's entry point), DP ranks drop the same sizes, the capture report
carries graph memory per size, and clear() releases what capture() made (no autograd state kept, outputs and
graphs freed, the capture stream reused).

Out of memory is injected the way it arrives on a GPU: ``torch.cuda.OutOfMemoryError`` raised inside the
capture (by the backend after the step ran, or from a MoE layer in the middle of a DBO step on a ubatch
worker thread). Replays still equal eager, checked with ``check_replay_equals_eager``.
"""
from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

import runner.worker.cuda_graphs as cuda_graphs
from cudagraph import GraphKey, Why
from cudagraph.backends import EagerReplayBackend, is_out_of_memory
from cudagraph.manager import CaptureAgreement, CaptureReport
from step_numerics import assert_bit_equal, assert_steps_close
from test_cudagraph_dispatch import DecodeBatches, check_replay_equals_eager, make_runner
from ubatch.modular_moe.layer import FusedMoE

SIZES = [1, 2, 4, 8, 12, 16]  # with DBO at threshold 4: plain 1, 2, 3; DBO 4, 8, 12, 16
REPLAYED = (1, 3, 4, 6, 8)


def oom(what: str = "graph") -> torch.cuda.OutOfMemoryError:
    return torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB ({what})")


class OomAbove(EagerReplayBackend):
    """The eager stand-in, but a capture whose output has more than ``limit`` rows runs out of memory (after the
    step ran, as a real capture's allocation fails part-way). Records the forward captures it tried (a head's
    output, the sampled ids, has one dimension) and what it released."""

    def __init__(self, limit: int, fail: Callable[[int], bool] | None = None) -> None:
        self.fail = fail or (lambda rows: rows > limit)
        self.attempts: list[int] = []
        self.released: list[Any] = []

    def capture(self, fn: Any, pool: Any, stream: Any) -> tuple[Any, torch.Tensor]:
        graph, out = super().capture(fn, pool, stream)
        if out.dim() == 2:
            self.attempts.append(out.shape[0])
        if self.fail(out.shape[0]):
            raise oom(f"capture of {out.shape[0]} tokens")
        return graph, out

    def release(self, graph: Any) -> None:
        self.released.append(graph)


@pytest.fixture
def runner():
    r = make_runner()
    yield r
    r.close()


def graph_runner(r, backend, **kw):
    return cuda_graphs.make_graph_runner(r, sizes=SIZES, backend=backend, num_warmups=1, progress=False, **kw)


def test_out_of_memory_drops_the_sizes_above_and_replays_still_equal_eager(runner, caplog) -> None:
    batches = DecodeBatches(runner, num_reqs=16)
    backend = OomAbove(8)
    gr = graph_runner(runner, backend)
    with caplog.at_level(logging.WARNING, logger="ubatch.cudagraph"):
        report = gr.capture()
    assert backend.attempts == [16, 12, 8, 4, 3, 2, 1]  # largest first; the smaller ones still tried
    assert sorted(gr.graphs) == [GraphKey(1), GraphKey(2), GraphKey(3), GraphKey(4, (2, 2)), GraphKey(8, (4, 4))]
    assert report.dropped == [GraphKey(16, (8, 8)), GraphKey(12, (6, 6))] and report.first_oom == GraphKey(16, (8, 8))
    assert ("CUDA graphs: out of memory capturing 16 (DBO 8+8); dropped sizes 16, 12; batches above 8 run eager"
            in caplog.text)
    check_replay_equals_eager(runner, batches, gr, dbo=True, link=None, sizes=REPLAYED)
    _, ref = batches.step(13)
    _, out = batches.step(13, gr)  # above the largest kept graph: eager
    assert gr.stats[Why.TOO_LARGE] == 1
    assert_bit_equal(out, ref, "13 tokens eager")


def test_a_size_in_the_middle_is_dropped_alone_and_its_batches_pad_up(runner, caplog) -> None:
    batches = DecodeBatches(runner, num_reqs=16)
    gr = graph_runner(runner, OomAbove(0, fail=lambda rows: rows == 8))
    with caplog.at_level(logging.WARNING, logger="ubatch.cudagraph"):
        report = gr.capture()
    assert report.dropped == [GraphKey(8, (4, 4))]
    assert "dropped sizes 8; their batches pad to the next captured size" in caplog.text
    _, ref = batches.step(7)
    padded, out = batches.step(7, gr)  # 7 (6 would leave 12's second ubatch all padding: eager)
    assert padded == 12 and gr.stats[Why.REPLAY] == 1
    assert_steps_close(out, ref, "7 tokens padded to 12")


def test_out_of_memory_mid_step_on_a_ubatch_thread_is_dropped_too(runner, monkeypatch, caplog) -> None:
    """The OOM raised by a MoE layer on the ubatch worker thread, inside the DBO capture of 16 tokens."""
    batches = DecodeBatches(runner, num_reqs=16)
    state = {"capturing": False, "raised": 0}

    class Flagging(EagerReplayBackend):
        def capture(self, fn: Any, pool: Any, stream: Any) -> tuple[Any, torch.Tensor]:
            state["capturing"] = True
            try:
                return super().capture(fn, pool, stream)
            finally:
                state["capturing"] = False

    original = FusedMoE.forward

    def forward(self: FusedMoE, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if state["capturing"] and hidden.shape[0] == 8:  # a ubatch of the 16-token DBO graph
            state["raised"] += 1
            raise oom("experts")
        return original(self, hidden, logits)

    monkeypatch.setattr(FusedMoE, "forward", forward)
    gr = graph_runner(runner, Flagging())
    with caplog.at_level(logging.WARNING, logger="ubatch.cudagraph"):
        report = gr.capture()
    assert state["raised"] == 1 and report.dropped == [GraphKey(16, (8, 8))]
    assert "batches above 12 run eager" in caplog.text
    check_replay_equals_eager(runner, batches, gr, dbo=True, link=None, sizes=REPLAYED)


def test_every_size_out_of_memory_leaves_no_graph_and_steps_run_eager(runner, caplog) -> None:
    batches = DecodeBatches(runner, num_reqs=16)
    gr = graph_runner(runner, OomAbove(0))
    with caplog.at_level(logging.WARNING, logger="ubatch.cudagraph"):
        report = gr.capture()
    assert not gr.graphs and report.keys == [] and len(report.dropped) == 7
    assert "no graph is left, every step runs eager" in caplog.text
    _, ref = batches.step(4)
    _, out = batches.step(4, gr)
    assert gr.stats[Why.TOO_LARGE] == 1
    assert_bit_equal(out, ref, "4 tokens eager")


def test_any_other_capture_error_is_still_fatal_and_clears(runner) -> None:
    class Broken(OomAbove):
        def capture(self, fn: Any, pool: Any, stream: Any) -> tuple[Any, torch.Tensor]:
            raise RuntimeError("operation not permitted when stream is capturing")

    gr = graph_runner(runner, Broken(0))
    with pytest.raises(RuntimeError, match=r"graph for 16\[dbo 8\+8\] failed: operation not permitted"):
        gr.capture()
    assert not gr.graphs and gr.pool is None


def test_dp_ranks_drop_the_sizes_any_rank_could_not_capture(runner, caplog) -> None:
    """This rank captured everything; the vote says a peer failed at 12: the local 12 graph is released too."""
    votes: list[bool] = []

    def agree(captured: bool) -> bool:
        votes.append(captured)
        return captured and len(votes) != 2  # the second size planned (12) failed on a peer

    backend = OomAbove(100)
    gr = graph_runner(runner, backend)
    gr.agree = agree
    with caplog.at_level(logging.WARNING, logger="ubatch.cudagraph"):
        report = gr.capture()
    assert votes == [True] * 7 and report.dropped == [GraphKey(12, (6, 6))] and report.first_oom is None
    assert len(backend.released) == 5 and GraphKey(12, (6, 6)) not in gr.graphs  # its forward and head graphs
    assert "another DP rank ran out of memory capturing; dropped sizes 12" in caplog.text


def test_a_warmup_out_of_memory_with_dp_peers_is_fatal_and_names_the_size(runner, monkeypatch) -> None:
    """An eager warm-up ran real collectives: a DP peer cannot unwind them, so it is not dropped silently."""
    original = FusedMoE.forward

    def forward(self: FusedMoE, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] == 8:
            raise oom("warm-up")
        return original(self, hidden, logits)

    monkeypatch.setattr(FusedMoE, "forward", forward)
    gr = graph_runner(runner, EagerReplayBackend())
    gr.agree = lambda captured: captured  # DP peers (the runner passes its gloo group's vote)
    with pytest.raises(RuntimeError, match=r"eager warm-up of the CUDA graph for 16\[dbo 8\+8\].*--gpu-memory-util"):
        gr.capture()
    assert not gr.graphs


def test_capture_agreement_is_one_sum_of_failures_over_the_dp_group() -> None:
    class Group:
        def __init__(self, peer_failures: int) -> None:
            self.peer_failures, self.calls = peer_failures, 0

        def rank(self) -> int:
            return 0

        def allreduce(self, tensors: list[torch.Tensor]) -> Any:
            self.calls += 1
            tensors[0] += self.peer_failures
            return type("Work", (), {"wait": lambda self: None})()

    def agreement(group: Group) -> CaptureAgreement:
        agree = cuda_graphs.capture_agreement(group)  # type: ignore[arg-type]  # a stand-in for torch's ProcessGroup
        assert agree is not None
        return agree

    assert cuda_graphs.capture_agreement(None) is None
    ok, failed = Group(0), Group(1)
    assert agreement(ok)(True) is True
    assert agreement(ok)(False) is False
    assert agreement(failed)(True) is False and failed.calls == 1


@pytest.mark.triton_interpreter  # a capturable experts backend: the entry point refuses torch's (a host sync)
def test_the_engine_entry_point_drops_sizes_out_of_memory(caplog) -> None:
    """On CPU tensors, where the interpreter runs the Triton experts, on a GPU machine too."""
    r = make_runner(cuda_graph_sizes=[1, 2, 4, 8], experts_backend="triton", device="cpu")
    try:
        with caplog.at_level(logging.WARNING, logger="ubatch.cudagraph"):
            gr = cuda_graphs.maybe_make_graph_runner(r, backend=OomAbove(3))
        assert gr is not None and sorted(gr.graphs) == [GraphKey(1), GraphKey(2), GraphKey(3)]
        assert "out of memory capturing 8 (DBO 4+4); dropped sizes 8, 4; batches above 3 run eager" in caplog.text
        batches = DecodeBatches(r, num_reqs=3)
        check_replay_equals_eager(r, batches, gr, dbo=False, link=None, sizes=(1, 2, 3))
    finally:
        r.close()


def test_is_out_of_memory_walks_the_exception_chain() -> None:
    assert is_out_of_memory(oom())
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert is_out_of_memory(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)"))
    try:
        try:
            raise oom()
        except torch.cuda.OutOfMemoryError:
            capture_error = "CUDA error: operation failed due to a previous error during capture"
            raise RuntimeError(capture_error)  # noqa: B904  (the implicit chain is what this test walks)
    except RuntimeError as chained:
        assert is_out_of_memory(chained)
    assert not is_out_of_memory(RuntimeError("operation not permitted when stream is capturing"))
    assert not is_out_of_memory(ValueError("out of range"))


# ---- graph memory per size ------------------------------------------------------------------------------
def test_the_report_carries_graph_memory_per_size(runner) -> None:
    class Metered(EagerReplayBackend):
        """Device memory falls by 1000 bytes per captured token of a forward graph and 100 per row of each of its
        four heads (a stand-in for the driver's free memory): a size's figure holds all five."""

        def __init__(self) -> None:
            self.free = 10**9

        def capture(self, fn: Any, pool: Any, stream: Any) -> tuple[Any, torch.Tensor]:
            graph, out = super().capture(fn, pool, stream)
            self.free -= (1000 if out.dim() == 2 else 100) * out.shape[0]
            return graph, out

        def free_memory(self) -> int:
            return self.free

    report = graph_runner(runner, Metered()).capture()
    assert report.memory_table() == [("16[dbo 8+8]", 22400), ("12[dbo 6+6]", 16800), ("8[dbo 4+4]", 11200),
                                     ("4[dbo 2+2]", 5600), ("3", 4200), ("2", 2800), ("1", 1400)]
    assert report.graph_bytes == 64400 == sum(report.bytes_by_key.values())


def test_dropped_message_wording() -> None:
    big, mid = GraphKey(512, (256, 256)), GraphKey(496, (248, 248))
    report = CaptureReport([GraphKey(480, (240, 240))], 1.0, 0, dropped=[big, mid], first_oom=big)
    assert report.dropped_message() == ("CUDA graphs: out of memory capturing 512 (DBO 256+256); dropped sizes "
                                        "512, 496; batches above 480 run eager")
    assert CaptureReport([big], 1.0, 0).dropped_message() is None


# ---- clear() releases what capture() made -----------------------------------------------------------------
@pytest.mark.parametrize("executor", ["greenlet", "threads"])
def test_clear_releases_outputs_graphs_and_autograd_state(executor: str) -> None:
    """Captured with grad enabled (as ModelRunner.__init__ does): no output may carry an autograd graph (it would
    keep every saved activation of the step alive in the graph pool) and the KV cache's in-place writes must not
    chain one capture's activations to the next. After clear() the outputs and graphs are gone; the capture
    stream, the comm stream and the warmed worker threads are reused by the next capture, not made anew."""
    r = make_runner(executor)
    try:
        assert torch.is_grad_enabled()
        gr = cuda_graphs.make_graph_runner(r, sizes=[2, 8], backend=EagerReplayBackend(), num_warmups=1,
                                           progress=False)
        caches = [m.kv_cache for m in r.model.modules() if isinstance(getattr(m, "kv_cache", None), torch.Tensor)]
        streams_before = (gr.capture_stream, r.wrapper.comm_stream)
        for cycle in range(2):
            gr.capture()
            outputs = [weakref.ref(e.output) for e in gr.graphs.values()]
            graphs = [weakref.ref(e.graph[0]) for e in gr.graphs.values()]  # the stand-in's graph: (step, out)
            assert all(not e.output.requires_grad and e.output.grad_fn is None for e in gr.graphs.values())
            assert caches and all(c.grad_fn is None and not c.requires_grad for c in caches)
            threads = set(gr.warmed_threads)
            gr.clear()
            gc.collect()
            assert [o() for o in outputs] == [None] * 3 and [g() for g in graphs] == [None] * 3
            assert gr.pool is None and gr.report is None and not gr.graphs
            assert (gr.capture_stream, r.wrapper.comm_stream) == streams_before
            assert len(threads) == (2 if executor == "threads" else 1) and gr.warmed_threads == threads, cycle
    finally:
        r.close()
