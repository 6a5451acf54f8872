"""The cuda trace clock: spans from device events, comm spans for the link and the collectives, metrics.

On CPU the device is ``tests/standins/cuda_events.py``: a ``torch.cuda`` stand-in whose streams have a
simulated timeline, so every span's device time is known and the metrics are checked against hand-worked
numbers. The ``cuda``-marked test at the end runs the engine on a real GPU.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fake_runner import FakeRunner
from runner import tracing
from runner.config import RunnerConfig
from standins.cuda_events import FakeCuda
from ubatch import trace
from ubatch.forward_context import ForwardContext, override_forward_context, set_forward_context
from ubatch.modular_moe.prepare_finalize.emulated_link import EmulatedLink, LinkSpec
from ubatch.modular_moe.prepare_finalize.torch_ll import TorchLowLatency
from ubatch.testing.thread_ranks import run_thread_ranks
from ubatch.trace_metrics import format_metrics, is_cpu_track, overlap_metrics, spans_from_chrome

MS = 1e-3


def fresh_cuda() -> FakeCuda:
    """A stand-in device at time 0 (the link's wait kernel counts nanoseconds: nothing to calibrate)."""
    return FakeCuda()


def on_ubatch(ubatch: int) -> Any:
    return override_forward_context(ForwardContext(ubatch_id=ubatch))


def gpu_spans(rec: trace.TraceRecorder) -> dict[tuple[str, str], tuple[float, float]]:
    """(track, name) -> (start, end) in ms after the recorder's t0, for the device-timed spans."""
    spans, _ = rec.resolved()
    out = {}
    for s in spans:
        if s.track.startswith(("gpu", "comm")):
            assert (s.track, s.name) not in out, f"{s.track}/{s.name} recorded twice"
            out[(s.track, s.name)] = ((s.start - rec.t0) / MS, (s.end - rec.t0) / MS)
    return out


# ---- the emulated link's side stream and per-ubatch compute -------------------------------------------
def test_link_wait_kernel_and_ubatch_compute_give_known_spans_and_metrics() -> None:
    """A0 [0,3] ms, dispatch0 sent after it flies 1 ms while A1 [3,5] runs; E0 [5,6] waits for it; combine0
    [6,7] has no compute after it. So comm 2 ms, hidden 1 ms (the dispatch), exposed 1 ms (the combine)."""
    cuda = fresh_cuda()
    link = EmulatedLink(LinkSpec(latency_us=1000), cuda_module=cuda)
    rec = trace.TraceRecorder(clock="cuda", cuda_module=cuda)
    with trace.recording(rec):
        with on_ubatch(0), trace.compute_span("attention", "A", layer=0):
            cuda.run(3 * MS)
        dispatch = link.transfer(4096, label="dispatch0")
        with on_ubatch(1), trace.compute_span("attention", "A", layer=0):
            cuda.run(2 * MS)
        dispatch.wait()  # the compute stream now waits for the wait kernel's end
        with on_ubatch(0), trace.compute_span("experts", "E"):
            cuda.run(1 * MS)
        link.transfer(4096, label="combine0").wait()
    got = gpu_spans(rec)
    expected = {("gpu0", "attention"): (0, 3), ("gpu1", "attention"): (3, 5), ("gpu0", "experts"): (5, 6),
                ("comm0", "dispatch0"): (3, 4), ("comm0", "combine0"): (6, 7)}
    assert set(got) == set(expected)
    for key, (a, b) in expected.items():
        assert got[key] == pytest.approx((a, b), abs=1e-5), key
    host = [s for s in rec.spans if s.track.startswith("ubatch")]
    assert sorted((s.track, s.name, s.cat) for s in host) == [("ubatch0", "attention", "launch"),
                                                               ("ubatch0", "experts", "launch"),
                                                               ("ubatch1", "attention", "launch")]
    assert all(isinstance(s.start, float) for s in host)  # the host side stays on the host clock
    comm = [s for s in rec.spans if s.cat == "comm"]
    assert {s.start.stream for s in comm} == {s.end.stream for s in comm} == {link._side_stream}
    assert [s.args["bytes"] for s in comm] == [4096, 4096]

    m = overlap_metrics(trace.to_chrome_trace(rec))
    assert (m.compute_us, m.comm_us, m.hidden_us, m.exposed_us) == pytest.approx((6000, 2000, 1000, 1000), abs=0.05)
    assert m.hidden_pct == pytest.approx(50, abs=0.01)
    assert m.layers[0].comm_us == pytest.approx(2000, abs=0.05)  # the comm spans took the ubatch's layer
    assert m.graph_replays == 0


def test_gpu_link_queues_transfers_on_its_side_stream_not_on_the_host_clock() -> None:
    """Each transfer waits its own latency + bytes / bandwidth, after the previous one on the side stream: two
    sent at once end 1.1 ms apart. Its length owes nothing to the host's send times (the host runs ahead of
    the GPU; a queue computed from them would add the first transfer's time to the second's wait as well)."""
    cuda = fresh_cuda()
    link = EmulatedLink(LinkSpec(latency_us=100, gbps=1.0), cuda_module=cuda)  # 1 MB: 1 ms on the wire
    cuda.run(2 * MS)  # compute before the sends: the transfers start after it
    first, second = link.transfer(1_000_000), link.transfer(1_000_000)
    first.wait()
    assert cuda.current_stream().t == pytest.approx(3.1 * MS)
    second.wait()
    assert cuda.current_stream().t == pytest.approx(4.2 * MS)
    assert (link.num_transfers, link.total_bytes, cuda.num_syncs) == (2, 2_000_000, 0)


def test_nothing_synchronises_until_the_spans_are_resolved() -> None:
    cuda = fresh_cuda()
    link = EmulatedLink(LinkSpec(latency_us=500), cuda_module=cuda)
    rec = trace.TraceRecorder(clock="cuda", cuda_module=cuda)
    syncs = cuda.num_syncs
    with trace.recording(rec):
        with trace.compute_span("attention", "A"):
            cuda.run(1 * MS)
        link.transfer(100, label="dispatch0").wait()
    assert cuda.num_syncs == syncs and cuda.host == 0.0  # recording only recorded events
    rec.resolved()
    assert cuda.num_syncs > syncs


# ---- a CUDA-graph capture records no timing event -----------------------------------------------------
def test_capture_records_no_timing_event_and_drops_device_spans() -> None:
    cuda = fresh_cuda()
    link = EmulatedLink(LinkSpec(latency_us=500), cuda_module=cuda)
    rec = trace.TraceRecorder(clock="cuda", cuda_module=cuda)
    with trace.recording(rec):
        cuda.capturing = True  # a timing event recorded now raises, as CUDA does
        with trace.compute_span("attention", "A"):
            cuda.run(1 * MS)
        link.transfer(100, label="dispatch0").wait()
        assert rec.device_stamp() is None
        cuda.capturing = False
        with trace.compute_span("graph_replay", "G"):  # what the replay of that graph records
            cuda.run(2 * MS)
    assert [(s.track, s.name, s.cat) for s in rec.spans] == [("ubatch0", "attention", "launch"),
                                                              ("ubatch0", "graph_replay", "launch"),
                                                              ("gpu0", "graph_replay", "compute")]
    m = overlap_metrics(rec)
    assert m.graph_replays == 1 and m.comm_us == 0
    assert "graph replays" in format_metrics(m)


# ---- a real collective without a modelled link --------------------------------------------------------
def dispatch_and_combine(pf: Any, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                         before_hook: Any = None) -> None:
    """One layer's all-to-all through ``pf``'s hook protocol: post, (``before_hook``), hook, receive, and the
    same for the combine."""
    hook, receive = pf.prepare_async(hidden, weights, ids)
    if before_hook is not None:
        before_hook()
    hook()
    tokens, state = receive()
    out_hook, receive_out = pf.finalize_async(tokens.hidden, state)
    out_hook()
    receive_out()


def ll_step(cuda: FakeCuda, rec: trace.TraceRecorder, link_for: Any = None) -> None:
    """Both ranks (threads, gloo) dispatch and combine 4 tokens through ``torch_ll`` once, traced."""

    def rank_main(rank: int, groups: list[Any]) -> None:
        link = link_for() if link_for is not None else None
        pf = TorchLowLatency(num_experts=4, ep_rank=rank, ep_size=2, groups=groups[:1],
                             max_dispatch_tokens_per_rank=8, link=link)
        g = torch.Generator().manual_seed(rank)
        hidden = torch.randn(4, 8, generator=g)
        ids = torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1]])
        weights = torch.full((4, 2), 0.5)
        with set_forward_context(trace_rank=rank):
            dispatch_and_combine(pf, hidden, weights, ids)

    with trace.recording(rec):
        run_thread_ranks(2, rank_main, num_groups=1, timeout_s=60)


def test_collective_span_runs_from_the_post_to_an_event_on_the_tracing_stream() -> None:
    cuda = fresh_cuda()
    rec = trace.TraceRecorder(clock="cuda", cuda_module=cuda)
    ll_step(cuda, rec)
    for pid in (0, 1):
        comm = [s for s in rec.spans if s.cat == "comm" and s.pid == pid]
        assert [(s.name, s.track) for s in comm] == [("dispatch0", "comm0"), ("combine0", "comm0")]
        for s in comm:
            assert s.start.stream is cuda.default_stream  # recorded on the issuing stream, before the post
            assert s.end.stream is rec.side_stream("comm0")  # after that stream waited for the collective
        computed = {s.name for s in rec.spans if s.cat == "compute" and s.pid == pid}
        assert computed == {"pack", "unpack", "combine_sum"} and \
            {s.track for s in rec.spans if s.cat == "compute"} == {"gpu0"}
    spans, _ = rec.resolved()
    assert all(s.end >= s.start for s in spans)


def test_a_modelled_link_is_the_only_comm_span_of_its_transfer() -> None:
    cuda = fresh_cuda()
    rec = trace.TraceRecorder(clock="cuda", cuda_module=cuda)
    ll_step(cuda, rec, link_for=lambda: EmulatedLink(LinkSpec(latency_us=200), cuda_module=cuda))
    for pid in (0, 1):
        comm = [s for s in rec.spans if s.cat == "comm" and s.pid == pid]
        assert [s.name for s in comm] == ["dispatch0", "combine0"]
        assert all(s.start.stream is s.end.stream and s.start.stream is not cuda.default_stream for s in comm)


def test_deepep_low_latency_span_runs_from_the_send_to_the_receive_hook() -> None:
    from standin_harness import CAPACITY, EXPERTS, HIDDEN
    from standins import deep_ep as standin
    from ubatch.modular_moe.prepare_finalize.deepep import DeepEPLowLatency

    cuda = fresh_cuda()
    rec = trace.TraceRecorder(clock="cuda", cuda_module=cuda)

    def rank_main(rank: int, groups: list[Any]) -> None:
        pf = DeepEPLowLatency(EXPERTS, rank, 2, groups, HIDDEN, CAPACITY, deep_ep_module=standin)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(4, HIDDEN, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:2] for _ in range(4)])
        def later() -> None:  # the receive hook runs later (on the other ubatch, under DBO)
            cuda.host += 1 * MS

        with set_forward_context(trace_rank=rank):
            dispatch_and_combine(pf, x, torch.full((4, 2), 0.5), ids, before_hook=later)

    with trace.recording(rec):
        run_thread_ranks(2, rank_main, num_groups=1, timeout_s=60)
    spans, _ = rec.resolved()
    for pid in (0, 1):
        comm = [s for s in spans if s.cat == "comm" and s.pid == pid]
        assert [(s.name, s.track) for s in comm] == [("dispatch0", "comm0"), ("combine0", "comm0")]
    (first,) = [s for s in spans if s.name == "dispatch0" and s.pid == 0]
    assert first.end - first.start >= 1 * MS - 1e-9  # it ends with the hook, not with the send


def test_cpu_clock_backends_record_no_device_stamps() -> None:
    rec = trace.TraceRecorder()
    assert rec.device_stamp() is None
    pf = TorchLowLatency(num_experts=4, ep_rank=0, ep_size=1, groups=[object()], max_dispatch_tokens_per_rank=8)
    assert pf.comm_start() is None  # tracing off
    with trace.recording(rec):
        assert pf.comm_start() is None  # cpu clock


# ---- metrics on what the cuda clock produces ----------------------------------------------------------
def test_metrics_count_gpu_tracks_as_compute_and_host_tracks_for_attribution() -> None:
    """Host launches on ubatch tracks (cat launch), device compute on gpu tracks overlapping comm."""
    names = ["ubatch0", "gpu0", "comm0", "ubatch1", "gpu1", "step"]
    spans = [("ubatch0", "launch", 0, 10), ("ubatch1", "launch", 10, 20), ("step", "step", 20, 30),
             ("gpu0", "compute", 5, 40), ("gpu1", "compute", 40, 60), ("comm0", "comm", 30, 70)]
    events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": i + 1, "args": {"name": t}}
              for i, t in enumerate(names)]
    events += [{"name": cat, "cat": cat, "ph": "X", "ts": a, "dur": b - a, "pid": 0, "tid": names.index(t) + 1,
                "args": {}} for t, cat, a, b in spans]
    m = overlap_metrics({"traceEvents": events})
    assert (m.wall_us, m.compute_us, m.comm_us, m.hidden_us, m.exposed_us) == (70, 55, 40, 30, 10)
    assert m.attributed_us == 30 and m.unattributed_us == 40  # host phases only: gpu/comm are device time
    assert [t for t in names if is_cpu_track(t)] == ["ubatch0", "ubatch1", "step"]
    assert trace.ubatch_of_track("gpu1") == 1 and trace.gpu_track("ubatch1") == "gpu1"
    assert trace.gpu_track("step") == "gpu_step" and trace.ubatch_of_track("gpu_step") is None
    assert trace.gpu_track("ubatch20") == "gpu20" and trace.ubatch_of_track("gpu20") == 20


# ---- the engine's choice of clock ---------------------------------------------------------------------
@pytest.mark.parametrize("device,clock", [(torch.device("cuda", 0), "cuda"), ("cuda", "cuda"),
                                          (torch.device("cpu"), "cpu"), (None, "cpu")])
def test_clock_follows_the_model_device(device: Any, clock: str) -> None:
    assert tracing.clock_for(device) == clock


def test_clock_for_a_bad_device_names_it() -> None:
    with pytest.raises(ValueError, match="cannot trace on device 'gpu0'"):
        tracing.clock_for("gpu0")


@pytest.mark.parametrize("device,clock", [(torch.device("cuda", 0), "cuda"), (torch.device("cpu"), "cpu")])
def test_engine_traces_on_the_clock_of_its_runners_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          device: torch.device, clock: str) -> None:
    from runner.entrypoints.llm import LLM
    from runner.sampling_params import SamplingParams

    made: list[tuple[Any, trace.TraceRecorder]] = []
    real = tracing.new_recorder

    def spy(dev: Any, cuda_module: Any = None) -> trace.TraceRecorder:
        rec = real(dev, FakeCuda() if tracing.clock_for(dev) == "cuda" else None)  # no GPU here: the stand-in
        made.append((dev, rec))
        return rec

    monkeypatch.setattr(tracing, "new_recorder", spy)
    runner = FakeRunner(vocab_size=32)
    # no overlap loop: its forward thread would make the (stand-in) CUDA device current
    llm = LLM(RunnerConfig(trace_file=str(tmp_path / "t.json"), disable_overlap_schedule=True, dist_timeout_s=30),
              runner=runner)
    runner.device = device
    try:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.close()
    assert [(d, r.clock) for d, r in made] == [(device, clock)]
    data = json.loads((tmp_path / "t.json").read_text())
    _, spans = spans_from_chrome(data, 0)
    assert {s.track for s in spans} == {"scheduler"}  # the fake runner's steps record nothing of their own
    assert made[0][1].spans and all(isinstance(s.start, float) for s in made[0][1].spans)  # host phases: host clock


# ---- on a GPU ------------------------------------------------------------------------------------------
@pytest.mark.cuda
def test_engine_on_cuda_traces_comm_and_hides_some_of_it(tmp_path: Path) -> None:
    from runner.entrypoints.llm import LLM
    from runner.sampling_params import SamplingParams

    out = tmp_path / "trace.json"
    llm = LLM(model="tiny-qwen3-moe", cache_dir=str(tmp_path / "cache"), enable_dbo=True, dbo_cost_model="off",
              dbo_decode_token_threshold=2, dbo_prefill_token_threshold=2,
              emulate_link="latency_us=300,gbps=1", trace_file=str(out))
    try:
        device = llm.runner.device
        assert device is not None and device.type == "cuda"
        prompts = [[(7 * i + j) % 100 for j in range(16)] for i in range(8)]
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert llm.last_stats is not None and llm.last_stats.num_ubatched_steps > 0
        m = llm.last_trace.metrics[0]
    finally:
        llm.close()
    _, spans = spans_from_chrome(json.loads(out.read_text()), 0)
    comm = [s for s in spans if s.cat == "comm"]
    assert comm and all(s.track in ("comm0", "comm1") for s in comm)
    assert {s.track for s in spans if s.cat == "compute"} >= {"gpu0", "gpu1"}
    assert m.comm_us > 0 and m.hidden_pct > 0 and m.exposed_us >= 0
