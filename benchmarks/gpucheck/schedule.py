"""Run the check's parts in order, each under its own time budget and the check's deadline.

A part is a function of a :class:`Context` that returns its outcome: ``status`` (``ok``, ``failed``,
``timeout``, ``not available``), ``data`` (its figures, possibly partial), ``error`` and ``tail`` (the end
of its output) where something went wrong. Its timeout is the smaller of its own budget and the time left
before the deadline; a part that would start with less than ``MIN_START_S`` left is ``skipped``, and one
that raises is recorded as ``error``: either way the next part still runs. After every part the goals are
re-evaluated and ``save`` is called, so results.json and report.md always hold everything measured so far.
"""
from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpucheck.goals import evaluate

MIN_START_S = 10.0
STATUSES = ("ok", "failed", "timeout", "error", "skipped", "not available")


@dataclass
class Context:
    """What every part needs: where things go, which Python runs the children, and its own timeout."""

    repo: Path
    out_dir: Path
    work_dir: Path  # scratch files the check reads back (not copied into the report directory)
    log_path: Path  # every child's output, appended
    cache_dir: Path  # where the benchmark model's checkpoint is written once
    python: str
    options: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 0.0


@dataclass(frozen=True)
class Part:
    name: str
    title: str
    budget_s: float
    run: Callable[[Context], dict[str, Any]]
    optional: bool = False  # run only when named in --parts (too long for the check's default time limit)


def run_parts(parts: Sequence[Part], ctx: Context, results: dict[str, Any], *, deadline: float,
              save: Callable[[dict[str, Any]], None], clock: Callable[[], float] = time.monotonic,
              say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run ``parts`` in order into ``results["parts"]``; ``deadline`` is on ``clock``'s scale."""
    results.setdefault("parts", {})
    for part in parts:
        left = deadline - clock()
        if left < MIN_START_S:
            outcome: dict[str, Any] = {"status": "skipped",
                                       "error": f"no time left: {max(left, 0):.0f} s of the check's time limit "
                                                "remained when it was due"}
            timeout = 0.0
        else:
            timeout = min(part.budget_s, left)
            say(f"gpu-check: {part.name} ({part.title}), up to {timeout:.0f} s ...")
            t0 = clock()
            try:
                outcome = part.run(dataclasses.replace(ctx, timeout_s=timeout))
            except Exception as exc:  # noqa: BLE001 - the check's own bug: recorded, the next part runs
                outcome = {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                           "tail": traceback.format_exc()[-3000:]}
            outcome["seconds"] = round(clock() - t0, 1)
        if outcome.get("status") not in STATUSES:
            outcome = {**outcome, "status": "error", "error": f"part returned status {outcome.get('status')!r}"}
        outcome.update(title=part.title, budget_s=part.budget_s, timeout_s=round(timeout, 1))
        results["parts"][part.name] = outcome
        results["goals"] = evaluate(results["parts"])
        say(f"gpu-check: {part.name}: {outcome['status']}" +
            (f" ({outcome['error']})" if outcome.get("error") else "") +
            (f" in {outcome['seconds']} s" if "seconds" in outcome else ""))
        save(results)
    return results


def write_outputs(results: dict[str, Any], out_dir: Path) -> None:
    """results.json and report.md, each replaced atomically."""
    from common import write_json
    from gpucheck.report import render

    write_json(results, out_dir / "results.json")
    tmp = out_dir / ".report.md.tmp"
    tmp.write_text(render(results))
    tmp.replace(out_dir / "report.md")
