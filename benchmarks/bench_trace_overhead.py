"""What the timeline tracer costs: per-yield handoff through UBatchWrapper with tracing off vs on.

Tracing on records, per handoff, a "yield" instant and a "wait" span (two perf_counter reads, a forward-
context lookup, a locked list append). Off, the runtime only reads one module global. Off and on runs are
interleaved and reported as medians of repeated runs, side by side, for both executors; the last rows
time a ``trace.compute_span`` block (a shared no-op context when off).
Usage: ``python benchmarks/bench_trace_overhead.py [--handoffs 2000] [--repeats 15]``.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_csv
from ubatch import UBatchConfig, UBatchSlice, UBatchWrapper, dbo_yield, set_forward_context, trace

SLICES = [UBatchSlice(slice(0, 1), slice(0, 1)), UBatchSlice(slice(1, 2), slice(1, 2))]


def handoff_us(wrapper: UBatchWrapper, handoffs: int, traced: bool) -> float:
    """µs per handoff of one ubatched step whose model only yields (the wrapper's threads already warm)."""
    wrapper.runnable.yields = handoffs // 2  # type: ignore[attr-defined]
    x = torch.zeros(2)
    with set_forward_context(ubatch_slices=SLICES):
        rec = trace.TraceRecorder() if traced else None
        t0 = time.perf_counter()
        if rec is None:
            wrapper(x)
        else:
            with trace.recording(rec):
                wrapper(x)
        dt = time.perf_counter() - t0
    if rec is not None:
        assert len(rec.instants) == 2 * (handoffs // 2), "tracing did not record the yields"
    return dt / (2 * (handoffs // 2)) * 1e6


class YieldOnly:
    yields = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.yields):
            dbo_yield()
        return x


def compute_span_us(calls: int, traced: bool) -> float:
    """µs per ``with trace.compute_span(...)`` block outside DBO (the recorder drops nothing, so small N)."""
    rec = trace.TraceRecorder() if traced else None
    with trace.recording(rec) if rec is not None else contextlib.nullcontext():
        t0 = time.perf_counter()
        for _ in range(calls):
            with trace.compute_span("attention", "A", layer=0):
                pass
        dt = time.perf_counter() - t0
    return dt / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--handoffs", type=int, default=2000, help="per step: a traced step of a real model has hundreds")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--csv", default=str(Path(__file__).parent / "results" / "trace_overhead.csv"))
    args = ap.parse_args()
    torch.set_num_threads(1)

    cases: dict[str, Callable[[bool], float]] = {}
    wrappers = []
    for executor in ("greenlet", "threads"):
        w = UBatchWrapper(YieldOnly(), UBatchConfig(executor=executor))
        wrappers.append(w)
        handoff_us(w, 1000, False)  # warm the worker threads
        cases[f"handoff, executor={executor}"] = functools.partial(handoff_us, w, args.handoffs)
    cases["compute_span block, no DBO"] = lambda traced: compute_span_us(args.handoffs, traced)

    samples: dict[tuple[str, bool], list[float]] = {(c, t): [] for c in cases for t in (False, True)}
    for _ in range(args.repeats):  # interleaved, so drift hits off and on alike
        for name, fn in cases.items():
            for traced in (False, True):
                samples[(name, traced)].append(fn(traced))
    for w in wrappers:
        w.close()

    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}; median of {args.repeats} runs x "
          f"{args.handoffs} handoffs (or compute_span blocks)")
    header = f"{'what':28s} | {'off us':>8s} | {'on us':>8s} | {'on - off us':>11s} | {'on / off':>8s}"
    print(header + "\n" + "-" * len(header))
    rows = []
    for name in cases:
        off, on = (statistics.median(samples[(name, t)]) for t in (False, True))
        rows.append({"what": name, "off_us": round(off, 3), "on_us": round(on, 3), "added_us": round(on - off, 3),
                     "on_over_off": round(on / off, 2)})
        print(f"{name:28s} | {off:8.3f} | {on:8.3f} | {on - off:11.3f} | {on / off:7.2f}x")
    write_csv(rows, args.csv)


if __name__ == "__main__":
    main()
