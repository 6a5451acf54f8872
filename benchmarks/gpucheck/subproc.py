"""Run one part's subprocess under a timeout, its output appended to the check's log.

The child starts a process group of its own, so a timeout ends everything it started (pytest's child
processes, spawned DP ranks, a server), not only the child: SIGTERM to the group, then SIGKILL after a grace
period. Output goes to the log file rather than a pipe, so a chatty child never blocks and the whole log
survives; the tail is returned for the report.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

KILL_GRACE_S = 5.0
TAIL_CHARS = 3000


@dataclass
class ProcResult:
    """``returncode`` is None when the process was killed at its timeout (``timed_out``)."""

    returncode: int | None
    timed_out: bool
    seconds: float
    tail: str  # the last TAIL_CHARS characters it printed


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=KILL_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


def run_logged(cmd: Sequence[str], *, timeout_s: float, log_path: Path, title: str,
               env: Mapping[str, str] | None = None, cwd: Path | None = None) -> ProcResult:
    """Run ``cmd``; stdout and stderr go to ``log_path`` (appended, under a header naming ``title``)."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"\n===== {title}: {' '.join(cmd)} (timeout {timeout_s:.0f} s)\n".encode())
        log.flush()
        start_offset = log.tell()
        t0 = time.monotonic()
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=dict(env) if env is not None else None, cwd=cwd, start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            timed_out = True
        seconds = time.monotonic() - t0
        end = f"===== {title}: " + (f"killed after {seconds:.0f} s (timeout)" if timed_out
                                     else f"exit {proc.returncode} after {seconds:.1f} s")
        log.write(f"\n{end}\n".encode())
    with open(log_path, "rb") as fh:
        fh.seek(max(start_offset, os.path.getsize(log_path) - TAIL_CHARS * 4))
        tail = fh.read().decode(errors="replace")[-TAIL_CHARS:]
    return ProcResult(None if timed_out else proc.returncode, timed_out, seconds, tail)
