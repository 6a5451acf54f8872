"""``--trace-file`` for the engine: record a ``generate()`` call, merge the DP ranks, save, summarise.

Each rank records its own run with ``ubatch.trace.recording()`` (the model runner tags spans with its DP
rank through ``set_forward_context(..., trace_rank=rank)``). At the end of ``generate()`` the resolved spans
travel with the outputs' all-gather, and rank 0 writes **one** Chrome trace with one process (``pid``) per
rank, so the ranks' steps line up in one view (chrome://tracing, https://ui.perfetto.dev). Spans are placed
on ``time.perf_counter()``, the host's monotonic clock, which every process on a host shares; ranks on
different hosts would be offset by their clocks' difference. A rank's spans get that rank as pid whatever
thread recorded them (a link-completion thread may never have seen a forward context).

The clock follows the model's device (``clock_for``): on CUDA the recorder times device work with CUDA
events (compute on the ubatches' streams, the link's delay kernel, the collectives) and resolves them to
host seconds only in ``local_spans``, after the run, so recording never synchronises; the engine's own CPU
phases (DP vote, inputs, sampling) stay on the host clock (``ubatch/trace.py`` explains how both share one
timeline). On CPU everything is host time, as it is where the work runs.

Recording is opt-in: without ``trace_file`` nothing is recorded and nothing extra is gathered.

Each rank also measures the CPU time of its threads over the call (``ubatch.thread_cpu``): on a CPU
machine the real all-to-all is gloo's C++ threads copying bytes, invisible on the Python timeline (the
ubatch thread is just descheduled meanwhile). The report shows it as the real transfers' CPU, apart from
the modelled link's time, so a DBO loss can be told from a link loss.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from ubatch import thread_cpu, trace
from ubatch.trace_metrics import OverlapMetrics, format_metrics, overlap_metrics, trace_pids


@dataclass
class RankTrace:
    """One rank's recording, picklable for the gather: spans/instants in seconds and its threads' CPU."""

    spans: list[trace.Span]
    instants: list[trace.Instant]
    cpu: thread_cpu.CpuSplit


@dataclass
class Recording:
    recorder: trace.TraceRecorder
    cpu_before: dict[int, float]


def clock_for(device: Any) -> str:
    """The trace clock for a model on ``device``: ``"cuda"`` for a CUDA device, else ``"cpu"``."""
    if device is None:
        return "cpu"
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"cannot trace on device {device!r}: {exc}") from None
    return "cuda" if kind == "cuda" else "cpu"


def new_recorder(device: Any, cuda_module: Any = None) -> trace.TraceRecorder:
    """A recorder on the clock of ``device`` (``cuda_module``: a ``torch.cuda`` stand-in, for tests)."""
    if clock_for(device) == "cuda":
        return trace.TraceRecorder(clock="cuda", cuda_module=cuda_module)
    return trace.TraceRecorder()


@contextlib.contextmanager
def record(path: str | None, device: Any = None) -> Iterator[Recording | None]:
    """``trace.recording()`` around the block when ``path`` is set, else nothing (yields None).

    ``device``: where the model runs (the model runner's ``device``); a CUDA device gets the cuda clock.
    """
    if path is None:
        yield None
        return
    with trace.recording(new_recorder(device)) as rec:
        yield Recording(rec, thread_cpu.snapshot())


def local_spans(rec: Recording | None) -> RankTrace | None:
    """This rank's spans, instants and thread CPU (picklable, ready to gather); None if off."""
    if rec is None:
        return None
    spans, instants = rec.recorder.resolved()
    return RankTrace(spans, instants, thread_cpu.split_since(rec.cpu_before))


@dataclass
class TraceResult:
    """What rank 0 wrote: the file and each rank's DBO overlap metrics."""

    path: str
    metrics: list[OverlapMetrics]
    cpu: list[thread_cpu.CpuSplit | None] = dataclasses.field(default_factory=list)  # per rank
    error: str | None = None  # why the file could not be written (the metrics below still hold)

    def report(self) -> str:
        head = f"trace NOT written ({self.error})" if self.error else f"trace written to {self.path}"
        if not self.metrics:
            return f"{head} (no spans: nothing traced ran, e.g. no MoE layer or link)"
        lines = [head]
        for m in self.metrics:
            lines.append(format_metrics(m))
            cpu = self.cpu[m.pid] if m.pid < len(self.cpu) else None
            if cpu is not None and m.wall_us > 0:
                lines.append(f"  real-transfer CPU    {cpu.other_s * 1e3:9.3f} ms  {100 * cpu.other_s / cpu.total_s:5.1f}% "
                             f"of the rank's CPU (gloo's own threads, not on the timeline; the Python threads used "
                             f"{cpu.python_s * 1e3:.1f} ms)" if cpu.total_s > 0 else "  real-transfer CPU    n/a")
        return "\n".join(lines)


def merge(per_rank: Sequence[RankTrace | None]) -> trace.TraceRecorder:
    """One recorder holding every rank's spans, each under its rank's pid."""
    merged = trace.TraceRecorder()
    for rank, item in enumerate(per_rank):
        if item is None:
            continue
        merged.spans.extend(dataclasses.replace(s, pid=rank) for s in item.spans)
        merged.instants.extend(dataclasses.replace(i, pid=rank) for i in item.instants)
    return merged


def export(path: str, per_rank: Sequence[RankTrace | None], rank: int, *,
           exclusive: bool = False) -> TraceResult | None:
    """On rank 0: write the merged Chrome trace to ``path`` and compute the metrics; other ranks: None.
    ``exclusive``: ``path`` must not exist yet and is never a link followed (a server's profile files)."""
    if rank != 0:
        return None
    data = trace.to_chrome_trace(merge(per_rank))
    result = TraceResult(path, [overlap_metrics(data, pid=p) for p in trace_pids(data)],
                         [item.cpu if item is not None else None for item in per_rank])
    try:  # the directory is not created: the front ends checked the path before the run
        flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL | os.O_NOFOLLOW if exclusive else os.O_TRUNC)
        with os.fdopen(os.open(path, flags, 0o600 if exclusive else 0o666), "w", encoding="utf-8") as f:
            json.dump(data, f)
    except OSError as e:  # costs the file, not the run: the metrics are still reported
        result.error = f"could not write the trace to {path}: {e.strerror or e}"
    return result


def result_to_json(result: Any) -> dict[str, Any] | None:
    """What the CLI's rank side sends back to the reporting process."""
    if result is None:
        return None
    return {"path": result.path, "report": result.report(), "error": result.error}
