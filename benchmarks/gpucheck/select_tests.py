"""pytest plugin (``-p gpucheck.select_tests``): which tests the GPU check runs, and each outcome as it happens.

- ``GPU_CHECK_TEST_FILES`` (space-separated paths relative to the rootdir): keep the tests in those files
  and every ``cuda``-marked test anywhere; deselect the rest. Unset: keep everything.
- ``GPU_CHECK_TEST_LOG`` (a path): append one JSON line per test phase report and per failed collection,
  flushed at once, so a run killed at its timeout still leaves the outcomes so far (``parts.count_tests``).
  Under pytest-xdist (``-n``) the controller writes them, as the workers' reports reach it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest


def selected(nodeid_path: str, has_cuda_marker: bool, files: set[str]) -> bool:
    return has_cuda_marker or nodeid_path in files


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    spec = os.environ.get("GPU_CHECK_TEST_FILES")
    if spec is None:
        return
    files = {Path(f).as_posix() for f in spec.split()}
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        (keep if selected(path, item.get_closest_marker("cuda") is not None, files) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _record(entry: dict[str, Any]) -> None:
    """Append ``entry`` to the log; not in a pytest-xdist worker, whose reports the controller records."""
    path = os.environ.get("GPU_CHECK_TEST_LOG")
    if path and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(path, "a") as fh:
            fh.write(json.dumps(entry) + "\n")


def _message(report: Any) -> str:
    """The failure's one-line summary (pytest's "crash" message, e.g. ``RuntimeError: fixture``)."""
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return crash.message.splitlines()[0][:300]
    lines = [line for line in str(getattr(report, "longrepr", "") or "").splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _record({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
             "message": _message(report) if report.failed else ""})


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _record({"nodeid": report.nodeid, "when": "collect", "outcome": "failed", "message": _message(report)})
