"""Draw a recorded DBO step like the schedule diagram of the design doc: a compute and a comm row per ubatch.

    python -m ubatch.plot TRACE.json -o timeline.png [--pid 0] [--title "..."]

Segments are coloured by schedule letter (A attention, E experts, S shared experts, D dispatch, C combine),
handoff waits and recv-hook stalls are hatched, and the title carries the hidden-comm share from
``trace_metrics``, so one picture answers "did the all-to-all hide behind the other ubatch's compute?".
Uses the Agg backend: no display needed.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from ubatch import trace
from ubatch.trace_metrics import TimedSpan, overlap_metrics, spans_from_chrome, trace_pids

COLORS = {"A": "#4C72B0", "E": "#DD8452", "S": "#55A868", "D": "#8172B3", "C": "#C44E52", "compute": "#8C8C8C"}
HATCHED = {"wait": ("//", "#BBBBBB"), "recv": ("xx", "#937860")}
LEGEND = [("A", "attention"), ("E", "experts"), ("S", "shared experts"), ("D", "dispatch in flight"),
          ("C", "combine in flight"), ("wait", "waiting for its turn"),
          ("recv", "recv hook (waiting for an all-to-all)")]
_SUB = str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉")


def phase_of(span: TimedSpan) -> str:
    """The diagram letter of a span: its ``phase`` arg, else inferred from its name/category."""
    if span.args.get("phase"):
        return str(span.args["phase"])
    if span.cat == "comm":
        return "D" if span.name.startswith("dispatch") else "C" if span.name.startswith("combine") else "comm"
    return {"wait": "wait", "hook": "recv"}.get(span.cat, span.cat or "compute")


def _rows(spans: Sequence[TimedSpan]) -> list[str]:
    """ubatch0, gpu0, comm0, ubatch1, ...; then any other track. ``gpu<u>`` (a CUDA trace's device-side
    compute) exists only where it was recorded."""
    tracks = {s.track for s in spans}
    ubatches = sorted({trace.ubatch_of_track(t) for t in tracks} - {None})  # type: ignore[type-var]
    rows = [r for u in ubatches for r in (f"ubatch{u}", f"gpu{u}", f"comm{u}")
            if not r.startswith("gpu") or r in tracks]
    return rows + sorted(tracks - set(rows))


def _layer_starts(spans: Sequence[TimedSpan]) -> dict[int, float]:
    """Where each layer's first compute segment starts (µs): the dotted separators of the picture."""
    starts: dict[int, float] = {}
    for s in spans:
        layer = s.args.get("layer")
        if s.cat == "compute" and isinstance(layer, int):
            starts[layer] = min(starts.get(layer, s.start), s.start)
    return starts


def render(chrome: dict[str, Any], out_path: str, pid: int | None = None, title_prefix: str | None = None) -> str:
    """Write the timeline PNG of rank ``pid`` (default: the lowest) of a Chrome-trace dict; returns the path."""
    pids = trace_pids(chrome)
    if pid is None:
        pid = pids[0] if pids else None
    elif pid not in pids:
        held = f"it holds rank{'s' if len(pids) > 1 else ''} {', '.join(map(str, pids))}" if pids else \
            "it holds no spans"
        raise ValueError(f"no rank {pid} in the trace ({held}); pick one with --pid")
    pid, spans = spans_from_chrome(chrome, pid)
    if not spans:
        raise ValueError("the trace has no spans to draw (was anything run inside trace.recording()?)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    metrics = overlap_metrics(chrome, pid)
    rows = _rows(spans)
    fig, ax = plt.subplots(figsize=(13, 1.0 + 0.6 * len(rows)))
    total_ms = max(s.end for s in spans) / 1000
    for y, row in enumerate(rows):
        for s in (s for s in spans if s.track == row):
            phase, left, width = phase_of(s), s.start / 1000, (s.end - s.start) / 1000
            if phase in HATCHED:
                hatch, edge = HATCHED[phase]
                ax.barh(y, width, left=left, height=0.5, color="white", edgecolor=edge, hatch=hatch, linewidth=0.5)
                continue
            ax.barh(y, width, left=left, height=0.7, color=COLORS.get(phase, COLORS["compute"]),
                    edgecolor="black", linewidth=0.5)
            if width > 0.02 * total_ms:
                u = trace.ubatch_of_track(s.track)
                label = phase + (str(u).translate(_SUB) if u is not None else "")
                ax.text(left + width / 2, y, label, ha="center", va="center", fontsize=8, color="white")
    for layer, start in _layer_starts(spans).items():
        ax.axvline(start / 1000, color="black", linestyle=":", linewidth=0.8)
        ax.text(start / 1000, -0.85, f" layer {layer}", fontsize=8, va="top")
    ax.set_yticks(range(len(rows)), [r.replace("ubatch", "ubatch ").replace("comm", "comm ") for r in rows])
    ax.set_ylim(len(rows) - 0.5, -0.9)  # inverted (first row on top), headroom for the layer labels
    ax.set_xlabel("time since first event (ms)")
    ax.set_xlim(0, total_ms * 1.01)
    ax.grid(axis="x", alpha=0.3)
    hidden = f"{metrics.hidden_pct:.0f}% of comm hidden behind compute" if metrics.comm_us else "no comm recorded"
    title = (f"rank {pid}: {hidden}; exposed comm {metrics.exposed_us / 1000:.3f} ms, "
             f"bubble {100 * metrics.bubble_us / metrics.wall_us:.0f}% of {metrics.wall_us / 1000:.3f} ms")
    ax.set_title(f"{title_prefix}\n{title}" if title_prefix else f"DBO timeline, {title}", fontsize=10)
    handles = [Patch(facecolor="white", edgecolor=HATCHED[k][1], hatch=HATCHED[k][0], label=text) if k in HATCHED
               else Patch(facecolor=COLORS[k], edgecolor="black", label=f"{k}: {text}") for k, text in LEGEND]
    handles.append(Patch(facecolor="white", edgecolor="none", label="blank: untraced CPU work (routing, packing)"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=4, fontsize=8, frameon=False)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    fig.savefig(out_path, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return out_path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ubatch.plot", description="Draw a DBO Chrome trace as a timeline PNG.")
    p.add_argument("trace", help="Chrome trace JSON written by ubatch.trace.save")
    p.add_argument("-o", "--output", help="PNG path (default: the trace path with .png)")
    p.add_argument("--pid", type=int, help="rank to draw (default: the lowest in the trace)")
    p.add_argument("--title", help="first title line")
    args = p.parse_args(argv)
    out = args.output or os.path.splitext(args.trace)[0] + ".png"
    try:
        render(trace.load(args.trace), out, args.pid, args.title)
    except (FileNotFoundError, ValueError) as exc:
        print(f"python -m ubatch.plot: error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
