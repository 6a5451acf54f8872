"""``--trace-file`` for the engine: record a ``generate()`` call, merge the DP ranks, save, summarise.

Each rank records its own run with ``ubatch.trace.recording()`` (the model runner tags spans with its DP
rank through ``set_forward_context(..., trace_rank=rank)``). At the end of ``generate()`` the resolved spans
travel with the outputs' all-gather, and rank 0 writes **one** Chrome trace with one process (``pid``) per
rank, so the ranks' steps line up in one view (chrome://tracing, https://ui.perfetto.dev). Spans are stamped
with ``time.perf_counter()``, the host's monotonic clock, which every process on a host shares; ranks on
different hosts would be offset by their clocks' difference. A rank's spans get that rank as pid whatever
thread recorded them (a link-completion thread may never have seen a forward context).

Recording is opt-in: without ``trace_file`` nothing is recorded and nothing extra is gathered.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from ubatch import trace
from ubatch.trace_metrics import OverlapMetrics, format_metrics, overlap_metrics, trace_pids

RankSpans = tuple[list[trace.Span], list[trace.Instant]]


@contextlib.contextmanager
def record(path: str | None) -> Iterator[trace.TraceRecorder | None]:
    """``trace.recording()`` around the block when ``path`` is set, else nothing (yields None)."""
    if path is None:
        yield None
        return
    with trace.recording() as rec:
        yield rec


def local_spans(rec: trace.TraceRecorder | None) -> RankSpans | None:
    """This rank's spans and instants with plain-seconds stamps (picklable, ready to gather); None if off."""
    return None if rec is None else rec.resolved()


@dataclass
class TraceResult:
    """What rank 0 wrote: the file and each rank's DBO overlap metrics."""

    path: str
    metrics: list[OverlapMetrics]

    def report(self) -> str:
        if not self.metrics:
            return f"trace written to {self.path} (no spans: nothing traced ran, e.g. no MoE layer or link)"
        return "\n".join([f"trace written to {self.path}"] + [format_metrics(m) for m in self.metrics])


def merge(per_rank: Sequence[RankSpans | None]) -> trace.TraceRecorder:
    """One recorder holding every rank's spans, each under its rank's pid."""
    merged = trace.TraceRecorder()
    for rank, item in enumerate(per_rank):
        if item is None:
            continue
        spans, instants = item
        merged.spans.extend(dataclasses.replace(s, pid=rank) for s in spans)
        merged.instants.extend(dataclasses.replace(i, pid=rank) for i in instants)
    return merged


def export(path: str, per_rank: Sequence[RankSpans | None], rank: int) -> TraceResult | None:
    """On rank 0: write the merged Chrome trace to ``path`` and compute the metrics; other ranks: None."""
    if rank != 0:
        return None
    data = trace.to_chrome_trace(merge(per_rank))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)
    return TraceResult(path, [overlap_metrics(data, pid=p) for p in trace_pids(data)])


def result_to_json(result: Any) -> dict[str, Any] | None:
    """What the CLI's rank side sends back to the reporting process."""
    if result is None:
        return None
    return {"path": result.path, "report": result.report()}
