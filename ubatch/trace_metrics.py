"""How much all-to-all time DBO hid, read off a recorded timeline (a ``TraceRecorder`` or a Chrome trace).

Per rank, as unions of span intervals (so overlaps never count twice): compute ``C`` (cat ``compute``), comm
``M`` (cat ``comm``), hidden ``|M ∩ C|`` (link time during which any ubatch computes), exposed, bubble
(``wall - |C|``), recv-hook, copy and link waits, per-layer figures, phases per span name, and unattributed
time (wall less every CPU-track span but handoff waits). On the cuda clock the same definitions read device
time; a graph replay adds compute but no comm. The interval helpers are pure functions.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

Interval = tuple[float, float]
GRAPH_REPLAY = "graph_replay"  # the compute span a CUDA-graph replay records


# ---- interval arithmetic -------------------------------------------------------------------------------
def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points; empty ones (``end <= start``) dropped."""
    out: list[Interval] = []
    for a, b in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def length(intervals: Iterable[Interval]) -> float:
    return sum(b - a for a, b in union(intervals))


def intersect(x: Iterable[Interval], y: Iterable[Interval]) -> list[Interval]:
    """Points in both ``x`` and ``y`` (each may overlap itself)."""
    xs, ys, out = union(x), union(y), []
    i = j = 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if b > a:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(x: Iterable[Interval], y: Iterable[Interval]) -> list[Interval]:
    """Points in ``x`` but not in ``y``."""
    out: list[Interval] = []
    ys = union(y)
    for a, b in union(x):
        for c, d in ys:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if b > a:
            out.append((a, b))
    return out


# ---- spans from either source --------------------------------------------------------------------------
@dataclass(frozen=True)
class TimedSpan:
    """A span as the metrics and the plot see it: µs since the trace start, on a named track."""

    name: str
    cat: str
    track: str
    start: float
    end: float
    args: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


def spans_from_chrome(trace: dict[str, Any], pid: int | None = None) -> tuple[int, list[TimedSpan]]:
    """The "X" events of one process with their thread names; ``pid=None`` needs a single-process trace."""
    pids = trace_pids(trace)
    if pid is None:
        if len(pids) > 1:
            raise ValueError(f"the trace holds ranks {pids}; pass pid= to pick one")
        pid = pids[0] if pids else 0
    try:
        events = trace["traceEvents"]
        names = {e["tid"]: e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("pid") == pid}
        spans = [TimedSpan(e["name"], e.get("cat", ""), names.get(e["tid"], f"tid{e['tid']}"), float(e["ts"]),
                           float(e["ts"]) + float(e["dur"]), dict(e.get("args", {})))
                 for e in events if e.get("ph") == "X" and e.get("pid") == pid]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"not a Chrome trace: malformed event ({type(exc).__name__}: {exc})") from None
    return pid, spans


def trace_pids(trace: dict[str, Any]) -> list[int]:
    """The processes (ranks) that have spans in a Chrome-trace dict."""
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise ValueError("not a Chrome trace: expected a dict with a 'traceEvents' list")
    try:
        return sorted({e["pid"] for e in events if e.get("ph") == "X"})
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a Chrome trace: malformed event ({type(exc).__name__}: {exc})") from None


def timed_spans(source: Any, pid: int | None = None) -> tuple[int, list[TimedSpan]]:
    """Accepts a ``TraceRecorder`` (exported first, so both sources share one code path) or a Chrome dict."""
    if isinstance(source, dict):
        return spans_from_chrome(source, pid)
    from ubatch.trace import to_chrome_trace

    return spans_from_chrome(to_chrome_trace(source), pid)


# ---- the metrics ---------------------------------------------------------------------------------------
class _CommSplit:
    """``exposed_us`` / ``hidden_pct`` from ``comm_us`` and ``hidden_us``: shared by the step and per-layer views."""

    comm_us: float
    hidden_us: float

    @property
    def exposed_us(self) -> float:
        return self.comm_us - self.hidden_us

    @property
    def hidden_pct(self) -> float:
        return 100.0 * self.hidden_us / self.comm_us if self.comm_us > 0 else 0.0


@dataclass
class LayerOverlap(_CommSplit):
    compute_us: float
    comm_us: float
    hidden_us: float



@dataclass
class OverlapMetrics(_CommSplit):
    pid: int
    wall_us: float
    compute_us: float
    comm_us: float
    hidden_us: float
    bubble_us: float
    recv_wait_us: float
    layers: dict[int, LayerOverlap] = field(default_factory=dict)
    attributed_us: float = 0.0
    copy_wait_us: float = 0.0
    link_wait_us: float = 0.0
    num_handoffs: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    graph_replays: int = 0  # CUDA-graph replays: their comm is inside their compute span, not counted as comm

    @property
    def unattributed_us(self) -> float:
        return max(0.0, self.wall_us - self.attributed_us)

    @property
    def unattributed_pct(self) -> float:
        return 100.0 * self.unattributed_us / self.wall_us if self.wall_us > 0 else 0.0


def is_cpu_track(track: str) -> bool:
    """Host tracks: every track but the transfers' (``comm0``, ...) and the device's (``gpu0``, ``gpu_step``, ...)."""
    return not track.startswith(("comm", "gpu"))



def _ivs(spans: Sequence[TimedSpan], cat: str, layer: int | None = None) -> list[Interval]:
    return [(s.start, s.end) for s in spans if s.cat == cat and (layer is None or s.args.get("layer") == layer)]


def overlap_metrics(source: Any, pid: int | None = None) -> OverlapMetrics:
    """Overlap metrics of one rank of a ``TraceRecorder`` or Chrome-trace dict (definitions: module doc)."""
    pid, spans = timed_spans(source, pid)
    if not spans:
        return OverlapMetrics(pid, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    compute, comm = union(_ivs(spans, "compute")), union(_ivs(spans, "comm"))
    wall = max(s.end for s in spans) - min(s.start for s in spans)
    layers: dict[int, LayerOverlap] = {}
    for layer in sorted({s.args["layer"] for s in spans if isinstance(s.args.get("layer"), int)}):
        layer_comm = _ivs(spans, "comm", layer)
        layers[layer] = LayerOverlap(length(_ivs(spans, "compute", layer)), length(layer_comm),
                                     length(intersect(layer_comm, compute)))
    cpu = [s for s in spans if is_cpu_track(s.track) and s.cat != "wait"]
    phases: dict[str, list[Interval]] = {}
    for s in cpu:
        phases.setdefault(s.name, []).append((s.start, s.end))
    return OverlapMetrics(pid=pid, wall_us=wall, compute_us=length(compute), comm_us=length(comm),
                          hidden_us=length(intersect(comm, compute)), bubble_us=wall - length(compute),
                          recv_wait_us=length(subtract(_ivs(spans, "hook"), compute)), layers=layers,
                          attributed_us=length((s.start, s.end) for s in cpu),
                          copy_wait_us=length(subtract(_ivs(spans, "copy"), compute)),
                          link_wait_us=length(subtract(_ivs(spans, "link"), compute)),
                          num_handoffs=sum(s.cat == "wait" for s in spans),
                          graph_replays=sum(s.name == GRAPH_REPLAY and s.cat == "compute" for s in spans),
                          phases=dict(sorted(((n, length(iv)) for n, iv in phases.items()), key=lambda kv: -kv[1])))


def format_metrics(m: OverlapMetrics) -> str:
    """A short human-readable report (ms), the per-layer table when spans carried ``layer``."""
    def ms(us: float) -> str:
        return f"{us / 1000:9.3f} ms"

    def pct(part: float, whole: float) -> str:
        return f"{100 * part / whole:5.1f}%" if whole > 0 else "  n/a"

    hidden = f"{m.hidden_pct:5.1f}% of comm" if m.comm_us > 0 else "n/a (no comm)"
    lines = [f"DBO overlap, rank {m.pid}",
             f"  wall time            {ms(m.wall_us)}",
             f"  compute (union)      {ms(m.compute_us)}  {pct(m.compute_us, m.wall_us)} of wall",
             f"  comm in flight       {ms(m.comm_us)}",
             f"  comm hidden          {ms(m.hidden_us)}  {hidden}",
             f"  comm exposed         {ms(m.exposed_us)}",
             f"  bubble (no compute)  {ms(m.bubble_us)}  {pct(m.bubble_us, m.wall_us)} of wall",
             f"    in recv hooks      {ms(m.recv_wait_us)}  (blocked on an all-to-all)",
             f"  blocked on copies    {ms(m.copy_wait_us)}  (real gloo/NCCL transfer not done yet)",
             f"  blocked on the link  {ms(m.link_wait_us)}  (modelled wire still busy)",
             f"  handoffs             {m.num_handoffs:9d}     (ubatch switches)",
             f"  unattributed         {ms(m.unattributed_us)}  {pct(m.unattributed_us, m.wall_us)} of wall "
             f"(no named phase)"]
    if m.graph_replays:
        lines.append(f"  graph replays        {m.graph_replays:9d}     (their link/all-to-all time is inside the "
                     "replay's compute span, not counted as comm)")
    if m.phases:
        lines.append("  phase                    ms   % of wall")
        for name, us in m.phases.items():
            lines.append(f"  {name:<18} {us / 1000:9.3f}  {pct(us, m.wall_us)}")
    if m.layers:
        lines.append("  layer  compute_ms  comm_ms  hidden_ms  exposed_ms  hidden%")
        for layer, lo in m.layers.items():
            lines.append(f"  {layer:5d}  {lo.compute_us / 1000:10.3f}  {lo.comm_us / 1000:7.3f}  "
                         f"{lo.hidden_us / 1000:9.3f}  {lo.exposed_us / 1000:10.3f}  {lo.hidden_pct:6.1f}")
    return "\n".join(lines)
