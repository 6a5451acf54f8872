"""The timeline tracer: the DBO ping-pong it records, the overlap metrics, the Chrome export, the plot CLI."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tracemalloc
from typing import Any

import pytest
import torch
from torch import nn

from moe_harness import StackWeights, halves
from ubatch import UBatchConfig, UBatchWrapper, set_forward_context, trace
from ubatch.modular_moe.config import MoEParallelConfig
from ubatch.modular_moe.layer import FusedMoE
from ubatch.modular_moe.runtime import MoERuntime
from ubatch.plot import main as plot_main
from ubatch.testing.thread_ranks import run_thread_ranks
from ubatch.trace_metrics import (
    TimedSpan,
    format_metrics,
    intersect,
    length,
    overlap_metrics,
    spans_from_chrome,
    subtract,
    union,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- (a) a traced DBO step follows the ping-pong protocol -----------------------------------------------
class AttnMoE(nn.Module):
    """Per layer: a marked matmul "attention", then a FusedMoE with shared experts (A, D, E, C, S)."""

    def __init__(self, weights: StackWeights, parallel: MoEParallelConfig) -> None:
        super().__init__()
        experts, two_inter, hidden = weights.w13[0].shape
        inter = two_inter // 2
        self.attn = [torch.eye(hidden) * 0.5 for _ in weights.gates]
        self.gates = weights.gates
        self.layers = nn.ModuleList()
        runtime = MoERuntime(parallel)  # one link for every layer, as in a model
        for w13, w2 in zip(weights.w13, weights.w2, strict=True):
            shared = nn.Linear(hidden, hidden, bias=False)
            layer = FusedMoE(experts, weights.top_k, hidden, inter, runtime=runtime, shared_experts=shared)
            layer.load_fused_experts(w13, w2)
            self.layers.append(layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, (attn, gate, moe) in enumerate(zip(self.attn, self.gates, self.layers, strict=True)):
            with trace.compute_span("attention", "A", layer=i):
                x = x + x @ attn
            x = x + moe(x, x @ gate.t())
        return x


LAYERS = 2
SCHEDULE_PHASES = "AEDCS"  # attention, experts, dispatch, combine, shared experts


def traced_dbo_step(executor: str) -> trace.TraceRecorder:
    weights = StackWeights.random(layers=LAYERS)
    rec = trace.TraceRecorder()

    def rank_main(rank: int, groups: list[Any]) -> None:
        parallel = MoEParallelConfig(ep_rank=rank, ep_size=2, all2all_backend="torch_ll", ep_groups=groups,
                                     max_dispatch_tokens_per_rank=8, emulate_link="latency_us=300,gbps=1")
        model = AttnMoE(weights, parallel)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
        wrapper = UBatchWrapper(model, UBatchConfig(num_ubatches=2, handoff_timeout_s=30, executor=executor))
        try:
            with torch.no_grad(), set_forward_context(ubatch_slices=halves(8), trace_rank=rank):
                wrapper(x)
        finally:
            wrapper.close()

    with trace.recording(rec):
        run_thread_ranks(2, rank_main, num_groups=2, timeout_s=60)
    return rec


@pytest.fixture(scope="module", params=["greenlet", "threads"])
def dbo_trace(request: pytest.FixtureRequest) -> dict[str, Any]:
    return trace.to_chrome_trace(traced_dbo_step(request.param))


def ubatch_of(track: str) -> int:
    """The ubatch a compute or comm track belongs to (every such track has one)."""
    u = trace.ubatch_of_track(track)
    assert u is not None, track
    return u


def by_key(spans: list[TimedSpan]) -> dict[tuple[str, int, int], TimedSpan]:
    """(phase letter, ubatch, layer) -> the one span; asserts each appears exactly once."""
    out: dict[tuple[str, int, int], TimedSpan] = {}
    for s in spans:
        if s.cat not in ("compute", "comm"):
            continue
        phase = s.args.get("phase") or {"dispatch": "D", "combine": "C"}[s.name.rstrip("0123456789")]
        if phase not in SCHEDULE_PHASES:  # route, pack, unpack: CPU work inside the MoE, checked elsewhere
            continue
        key = (phase, ubatch_of(s.track), s.args["layer"])
        assert key not in out, f"{key} recorded twice"
        out[key] = s
    return out


@pytest.mark.parametrize("pid", [0, 1])
def test_dbo_step_follows_the_ping_pong_schedule(dbo_trace: dict[str, Any], pid: int) -> None:
    _, spans = spans_from_chrome(dbo_trace, pid)
    seg = by_key(spans)
    assert set(seg) == {(p, u, L) for p in "AEDCS" for u in (0, 1) for L in range(LAYERS)}

    # One ubatch computes at a time, in the protocol's order: A0 A1 | E0 S0 | E1 S1, layer after layer.
    compute = sorted((s for s in spans if s.cat == "compute"), key=lambda s: s.start)
    order = [(s.args["phase"], trace.ubatch_of_track(s.track), s.args["layer"]) for s in compute
             if s.args["phase"] in SCHEDULE_PHASES]
    per_layer = [("A", 0), ("A", 1), ("E", 0), ("S", 0), ("E", 1), ("S", 1)]
    expected = [(p, u, L) for L in range(LAYERS) for p, u in per_layer]
    assert order == expected
    assert all(a.end <= b.start for a, b in zip(compute, compute[1:], strict=False))  # neighbouring pairs
    per_ubatch = [[(s.start, s.end) for s in compute if s.track == f"ubatch{u}"] for u in (0, 1)]
    assert intersect(*per_ubatch) == []

    # A ubatch computes only while the other is parked in a handoff -- except before the other first ran
    # (ubatch 0's first segment) and after it finished (ubatch 1's last).
    waits = {u: [(s.start, s.end) for s in spans if s.cat == "wait" and s.track == f"ubatch{u}"] for u in (0, 1)}
    alive = {u: (min(s.start for s in spans if s.track == f"ubatch{u}"),
                 max(s.end for s in spans if s.track == f"ubatch{u}")) for u in (0, 1)}
    for s in (s for s in compute if alive[1 - ubatch_of(s.track)][0] <= s.start < alive[1 - ubatch_of(s.track)][1]):
        other = 1 - ubatch_of(s.track)
        assert any(a <= s.start and s.end <= b for a, b in waits[other]), f"{s} ran while ubatch {other} was not parked"

    for L in range(LAYERS):
        for u in (0, 1):
            assert seg["A", u, L].end <= seg["D", u, L].start  # dispatch is sent after its attention
            assert seg["D", u, L].end <= seg["E", u, L].start  # experts only once the tokens have landed
            assert seg["E", u, L].end <= seg["C", u, L].start  # combine ships the experts' output
            assert seg["C", u, L].start <= seg["S", u, L].start  # shared experts overlap their own combine
            if L + 1 < LAYERS:
                assert seg["C", u, L].end <= seg["A", u, L + 1].start  # next layer needs the combined output
        # The cross-ubatch overlap: each all-to-all is sent before the other ubatch's next compute starts.
        assert seg["D", 0, L].start <= seg["A", 1, L].start  # D0 in flight during A1
        assert seg["A", 1, L].end <= seg["D", 1, L].start <= seg["E", 0, L].start  # D1 in flight during E0/S0
        assert seg["C", 0, L].start <= seg["E", 1, L].start  # C0 in flight during E1/S1
        if L + 1 < LAYERS:
            assert seg["C", 1, L].start <= seg["A", 0, L + 1].start  # C1 in flight during the next A0

    yields = [e for e in dbo_trace["traceEvents"] if e["ph"] == "i" and e["name"] == "yield" and e["pid"] == pid]
    assert len(yields) == 2 * 2 * LAYERS  # 2 per MoE layer per ubatch (low-latency shape)


# ---- (b) metrics from synthetic traces ----------------------------------------------------------------
@pytest.mark.parametrize("fn,x,y,expected", [
    (union, [(5, 6), (0, 2), (1, 3), (3, 4), (7, 7)], None, [(0, 4), (5, 6)]),
    (union, [], None, []),
    (intersect, [(0, 10)], [(2, 3), (5, 12)], [(2, 3), (5, 10)]),
    (intersect, [(0, 2), (1, 5)], [(4, 6), (8, 9)], [(4, 5)]),
    (intersect, [(0, 1)], [(1, 2)], []),
    (subtract, [(0, 10)], [(2, 3), (5, 12)], [(0, 2), (3, 5)]),
    (subtract, [(0, 4), (6, 8)], [(-1, 1), (3, 7)], [(1, 3), (7, 8)]),
    (subtract, [(0, 4)], [], [(0, 4)]),
])
def test_interval_arithmetic(fn: Any, x: list, y: list | None, expected: list) -> None:
    assert (fn(x) if y is None else fn(x, y)) == expected


def test_length_counts_overlaps_once() -> None:
    assert length([(0, 4), (2, 6), (10, 11)]) == 7


Span = tuple[str, str, float, float, dict[str, Any]]  # track, cat, start_us, end_us, args


def chrome(*spans: Span) -> dict[str, Any]:
    """A hand-written trace: (track, cat, start_us, end_us, args) per span."""
    tracks = sorted({s[0] for s in spans})
    events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": i + 1, "args": {"name": t}}
              for i, t in enumerate(tracks)]
    events += [{"name": cat, "cat": cat, "ph": "X", "ts": a, "dur": b - a, "pid": 0, "tid": tracks.index(t) + 1,
                "args": args} for t, cat, a, b, args in spans]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


METRIC_CASES: dict[str, tuple[list[Span], float, float, float, float, float, float]] = {
    # name: (spans, wall, compute, comm, hidden, bubble, recv_wait)
    "fully hidden": ([("ubatch0", "compute", 0, 100, {}), ("comm1", "comm", 10, 60, {})], 100, 100, 50, 50, 0, 0),
    "partly hidden": ([("ubatch0", "compute", 0, 100, {}), ("ubatch1", "compute", 150, 200, {}),
                       ("comm0", "comm", 50, 180, {})], 200, 150, 130, 80, 50, 0),
    "no overlap": ([("ubatch0", "compute", 0, 40, {}), ("comm0", "comm", 40, 100, {})], 100, 40, 60, 0, 60, 0),
    "bubble in a recv hook": ([("ubatch0", "compute", 0, 30, {}), ("ubatch1", "hook", 30, 50, {}),
                               ("ubatch1", "compute", 50, 80, {}), ("ubatch0", "wait", 30, 80, {}),
                               ("comm0", "comm", 20, 45, {})], 80, 60, 25, 10, 20, 20),
    "both ubatches' comm counted once": ([("ubatch0", "compute", 0, 100, {}), ("comm0", "comm", 0, 50, {}),
                                          ("comm1", "comm", 25, 75, {})], 100, 100, 75, 75, 0, 0),
    "no comm": ([("ubatch0", "compute", 10, 20, {}), ("ubatch1", "compute", 30, 40, {})], 30, 20, 0, 0, 10, 0),
}


@pytest.mark.parametrize("case", list(METRIC_CASES))
def test_overlap_metrics_equal_hand_computed_values(case: str) -> None:
    spans, wall, compute, comm, hidden, bubble, recv_wait = METRIC_CASES[case]
    m = overlap_metrics(chrome(*spans))
    assert (m.wall_us, m.compute_us, m.comm_us, m.hidden_us, m.bubble_us, m.recv_wait_us) == \
        pytest.approx((wall, compute, comm, hidden, bubble, recv_wait))
    assert m.exposed_us == pytest.approx(comm - hidden)
    assert m.hidden_pct == pytest.approx(100 * hidden / comm if comm else 0.0)
    assert "DBO overlap, rank 0" in format_metrics(m)


def test_per_layer_breakdown_and_recorder_input() -> None:
    rec = trace.TraceRecorder()  # same numbers through the recorder path (seconds in, µs out)
    t = rec.t0
    rec.span("attention", "compute", 0, t, t + 100e-6, phase="A", layer=0)
    rec.span("dispatch0", "comm", "comm0", t + 50e-6, t + 150e-6, layer=0)
    rec.span("experts", "compute", 1, t + 120e-6, t + 200e-6, phase="E", layer=1)
    rec.span("combine1", "comm", "comm1", t + 190e-6, t + 300e-6, layer=1)
    m = overlap_metrics(rec)
    assert (m.wall_us, m.comm_us, m.hidden_us) == pytest.approx((300, 210, 50 + 30 + 10))
    assert sorted(m.layers) == [0, 1]
    assert (m.layers[0].compute_us, m.layers[0].comm_us, m.layers[0].hidden_us) == pytest.approx((100, 100, 80))
    assert (m.layers[1].compute_us, m.layers[1].comm_us, m.layers[1].hidden_us) == pytest.approx((80, 110, 10))
    assert m.layers[1].hidden_pct == pytest.approx(100 * 10 / 110)
    assert "layer  compute_ms" in format_metrics(m)


def test_metrics_need_a_rank_when_the_trace_holds_several(dbo_trace: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"the trace holds ranks \[0, 1\]; pass pid="):
        overlap_metrics(dbo_trace)
    assert overlap_metrics(dbo_trace, pid=1).pid == 1
    assert overlap_metrics({"traceEvents": []}).wall_us == 0.0


# ---- (c) the export is valid Chrome trace event format ----------------------------------------------
def validate_chrome_trace(d: Any) -> None:
    """The subset of the Trace Event Format we emit, as Perfetto / chrome://tracing read it."""
    assert isinstance(d, dict) and set(d) == {"traceEvents", "displayTimeUnit"}
    assert d["displayTimeUnit"] in ("ms", "ns") and isinstance(d["traceEvents"], list)
    named_threads, named_procs, used = set(), set(), set()
    by_thread: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for e in d["traceEvents"]:
        assert isinstance(e.get("name"), str) and e.get("ph") in ("X", "i", "M"), e
        assert type(e.get("pid")) is int and type(e.get("tid")) is int, e
        assert isinstance(e.get("args", {}), dict), e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name", "process_sort_index", "thread_sort_index"), e
            key = "name" if e["name"].endswith("_name") else "sort_index"
            assert isinstance(e["args"][key], str if key == "name" else int), e
            if e["name"] == "thread_name":
                named_threads.add((e["pid"], e["tid"]))
            if e["name"] == "process_name":
                named_procs.add(e["pid"])
            continue
        assert isinstance(e.get("cat"), str), e
        assert isinstance(e.get("ts"), (int, float)) and e["ts"] >= 0, e
        used.add((e["pid"], e["tid"]))
        if e["ph"] == "X":
            assert isinstance(e.get("dur"), (int, float)) and e["dur"] >= 0, e
            by_thread.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
        else:
            assert e.get("s") in ("g", "p", "t"), e
    assert used <= named_threads and {p for p, _ in used} <= named_procs
    for ivs in by_thread.values():  # slices on one thread nest or follow each other (no partial overlap)
        stack: list[float] = []
        for a, b in sorted(ivs, key=lambda iv: (iv[0], -iv[1])):
            while stack and stack[-1] <= a:
                stack.pop()
            # 1e-6 us: the export rounds stamps to 1 ns, so a child ending with its parent may sit one ulp past it
            assert not stack or b <= stack[-1] + 1e-6, f"slice {(a, b)} partially overlaps its parent"
            stack.append(b)


def test_chrome_export_is_valid_and_round_trips(dbo_trace: dict[str, Any], tmp_path: Any) -> None:
    validate_chrome_trace(dbo_trace)
    assert json.loads(json.dumps(dbo_trace)) == dbo_trace
    assert min(e["ts"] for e in dbo_trace["traceEvents"] if e["ph"] != "M") == 0
    names = {(e["pid"], e["args"]["name"]) for e in dbo_trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {(p, t) for p in (0, 1) for t in ("ubatch0", "ubatch1", "comm0", "comm1", "step")}
    rec = trace.TraceRecorder()
    rec.span("x", "compute", 0, rec.t0, rec.t0 + 1e-3, obj=object())  # odd arg values become strings
    path = trace.save(rec, tmp_path / "sub" / "t.json", pid=0)
    loaded = trace.load(path)
    validate_chrome_trace(loaded)
    assert [e["dur"] for e in loaded["traceEvents"] if e["ph"] == "X"] == [1000.0]


class FakeEvent:
    """A CUDA event look-alike on a hand-driven clock: what the cuda path of the recorder relies on."""

    clock = 0.0

    def record(self) -> None:
        self.t = FakeEvent.clock

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.t - self.t) * 1e3  # ms, like torch.cuda.Event


def test_gpu_event_stamps_are_resolved_at_export() -> None:
    FakeEvent.clock = 5.0
    rec = trace.TraceRecorder(clock="cuda", event_factory=FakeEvent)  # reference event at GPU time 5.0 = t0
    with trace.recording(rec):
        FakeEvent.clock = 5.002
        with trace.compute_span("attention", "A", layer=0):
            FakeEvent.clock = 5.0025
    spans, _ = rec.resolved()
    (host,) = [s for s in spans if s.track == "ubatch0"]  # the launch, on the host clock
    (span,) = [s for s in spans if s.track == "gpu0"]  # the device's time, from the events
    assert (host.cat, span.cat) == ("launch", "compute")
    assert span.start == pytest.approx(rec.t0 + 0.002) and span.end == pytest.approx(rec.t0 + 0.0025)
    (x,) = [e for e in trace.to_chrome_trace(rec)["traceEvents"] if e["ph"] == "X" and e["cat"] == "compute"]
    assert x["dur"] == pytest.approx(500.0) and x["args"] == {"phase": "A", "layer": 0}
    with pytest.raises(ValueError, match="clock must be 'cpu' or 'cuda'"):
        trace.TraceRecorder(clock="gpu")
    with pytest.raises(ValueError, match="only apply to clock='cuda'"):
        trace.TraceRecorder(event_factory=FakeEvent)


# ---- (d) tracing off costs nothing ---------------------------------------------------------------------
def test_compute_span_is_a_shared_no_op_when_off() -> None:
    assert trace.active() is None
    first = trace.compute_span("attention", "A")
    assert trace.compute_span("experts", "E", layer=3) is first
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(10_000):
            with trace.compute_span("attention", "A", layer=1):
                pass
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grown = [d for d in after.compare_to(before, "filename") if d.traceback[0].filename == trace.__file__]
    assert sum(d.size_diff for d in grown) <= 0


def test_compute_span_records_on_the_current_ubatch_and_tags_later_spans() -> None:
    with trace.recording() as rec:
        with trace.compute_span("attention", "A", layer=4):
            pass
        rec.span("experts", "compute", 0, 1.0, 2.0, phase="E")  # no layer given: inherits 4
        rec.span("dispatch0", "comm", "comm0", 1.0, 2.0)
        rec.span("other", "compute", "main", 1.0, 2.0)
    assert [(s.track, s.args.get("layer")) for s in rec.spans] == [("ubatch0", 4), ("ubatch0", 4), ("comm0", 4),
                                                                    ("main", None)]
    assert trace.active() is None


# ---- (e) the plot CLI ---------------------------------------------------------------------------------
def test_plot_cli_writes_a_png(tmp_path: Any) -> None:
    src = tmp_path / "t.json"
    src.write_text(json.dumps(chrome(*METRIC_CASES["bubble in a recv hook"][0])))
    out = tmp_path / "timeline.png"
    proc = subprocess.run([sys.executable, "-m", "ubatch.plot", str(src), "-o", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 5000


@pytest.mark.parametrize("content,message", [
    (None, "trace file .* not found"),
    ("not json {", "is not a Chrome trace: not JSON"),
    ('{"events": []}', "is not a Chrome trace: expected a JSON object with a 'traceEvents' list"),
    ('{"traceEvents": [{"ph": "X"}]}', "not a Chrome trace: malformed event"),
    ('{"traceEvents": []}', "the trace has no spans to draw"),
])
def test_plot_cli_errors_clearly(tmp_path: Any, capsys: pytest.CaptureFixture[str], content: str | None,
                                 message: str) -> None:
    src = tmp_path / "bad.json"
    if content is not None:
        src.write_text(content)
    assert plot_main([str(src), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m ubatch.plot: error: ")
    assert re.search(message, err), err
    assert not (tmp_path / "x.png").exists()
