"""``--trace-file`` for the engine: record a ``generate()`` call, merge the DP ranks, save, summarise.

Each rank records its run (opt-in: nothing is recorded without a trace file) and the spans travel with the
outputs' all-gather; rank 0 writes one Chrome trace with a process per rank on the host's shared
``perf_counter`` clock. On CUDA device work is timed with CUDA events (``ubatch/trace.py``). Each rank also
measures its threads' CPU time (``ubatch.thread_cpu``), so gloo's copying threads show as the real transfers'
CPU. Design: docs/design_notes.md, "Tracing, benchmarks and the GPU check".
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

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
                lines.append(f"  real-transfer CPU    {cpu.other_s * 1e3:9.3f} ms  "
                             f"{100 * cpu.other_s / cpu.total_s:5.1f}% "
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
