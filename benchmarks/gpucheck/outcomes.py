"""Test counts from the JSON lines ``select_tests`` records: pytest's own rules, read per test id.

A failure in a test's setup or teardown, or in collecting a module, is an *error*; in its call a *failure*;
a skip in any phase (an xfail too) a *skip*; a test whose call passed and nothing else failed *passed*.
Lines that are not JSON (a run killed mid-write) are ignored.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

MAX_LISTED = 40


def count_tests(lines: Iterable[str]) -> dict[str, Any]:
    """``{"passed", "failed", "errors", "skipped", "failures": [{"nodeid", "outcome", "message"}]}``."""
    status: dict[str, str] = {}
    messages: dict[str, str] = {}
    rank = {"passed": 0, "skipped": 1, "failed": 2, "errors": 3}  # the worst phase decides
    for line in lines:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        nodeid, when, outcome = entry["nodeid"], entry["when"], entry["outcome"]
        if outcome == "failed":
            kind = "failed" if when == "call" else "errors"
            messages.setdefault(nodeid, entry.get("message", ""))
        elif outcome == "skipped":
            kind = "skipped"
        elif when == "call":
            kind = "passed"
        else:
            continue  # a passed setup or teardown says nothing by itself
        if rank[kind] >= rank[status.get(nodeid, "passed")] or nodeid not in status:
            status[nodeid] = kind
    counts: dict[str, Any] = {k: sum(1 for s in status.values() if s == k) for k in rank}
    bad = [n for n, s in status.items() if s in ("failed", "errors")]
    counts["failures"] = [{"nodeid": n, "outcome": "error" if status[n] == "errors" else "failed",
                           "message": messages.get(n, "")} for n in bad[:MAX_LISTED]]
    return counts
