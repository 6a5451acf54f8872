"""Faults during a real DP=2 ``python -m runner generate``: signals to the parent, SIGKILL and SIGSTOP of a rank.

For each: the exit code, a message naming the rank(s), the time from the fault to the exit (at most
``--dist-timeout-s`` + 5 s, the bound the launcher promises; a generous one, the only timing asserted), and no
process of the run left afterwards, checked with ``ps``. Also the launcher's network footprint: nothing the
parent or its ranks listen on is reachable beyond loopback, and the private rendezvous directory is gone
after the run (after a normal exit: tests/test_e2e_dp.py's CLI run). Faults are injected by
``tests/fault_injection.py`` through the engine loop's own ``before_launch`` hook.
"""
from __future__ import annotations

import os
import queue
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from devices import device_args
from proc_sockets import alive_per_ps, descendants, is_loopback, listening_addresses

ROOT = Path(__file__).resolve().parents[1]
DIST_TIMEOUT_S = 10
CLI = ["generate", "-dp", "2", "--enable-expert-parallel", "--enable-dbo", "--dbo-decode-token-threshold", "2",
       "--dbo-prefill-token-threshold", "8", "--dbo-cost-model", "off", "--num-prompts", "4", "--max-tokens", "6",
       "--ignore-eos", "--dist-timeout-s", str(DIST_TIMEOUT_S), *device_args(2)]

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")]


def _default_signals() -> None:
    """In the child before exec: signals at their defaults, whatever this test runner ignores (a background job
    ignores SIGINT, nohup SIGHUP), so the run handles them as a user's terminal would deliver them."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


class Run:
    """``tests/fault_injection.py FAULT -- CLI`` as a subprocess; stderr lines are read on a thread as they come."""

    def __init__(self, fault: list[str], tmp_path: Path) -> None:
        env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fault_injection.py"), *fault, "--", *CLI],
                                     cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     preexec_fn=_default_signals)
        self.err_lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: str, count: int = 1, timeout_s: float = 120.0) -> float:
        """Block until ``count`` stderr lines match ``pattern``; returns when the last one was seen."""
        deadline = time.monotonic() + timeout_s
        seen = sum(len(re.findall(pattern, ln)) for ln in self.err_lines)
        while seen < count:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.proc.kill()
                raise AssertionError(f"test waited {timeout_s:.0f} s for {count} stderr lines matching {pattern!r}; "
                                     f"got:\n{''.join(self.err_lines)}") from None
            if line is None:
                raise AssertionError(f"the run ended before {count} stderr lines matched {pattern!r}:\n"
                                     f"{''.join(self.err_lines)}")
            self.err_lines.append(line)
            seen += len(re.findall(pattern, line))
        return time.monotonic()

    def finish(self, timeout_s: float = 120.0) -> tuple[int, str, str]:
        """(exit code, stdout, stderr); a run still going after ``timeout_s`` is killed and fails the test."""
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"the run did not exit within {timeout_s:.0f} s:\n{''.join(self.err_lines)}") from None
        assert self.proc.stdout is not None
        out = self.proc.stdout.read()
        self._reader.join(10)
        while True:
            line = self._queue.get_nowait() if not self._queue.empty() else None
            if line is None:
                break
            self.err_lines.append(line)
        return self.proc.returncode, out, "".join(self.err_lines)


def assert_nothing_left(pids: set[int], what: str) -> None:
    """No process of ``pids`` is listed by ``ps`` (a moment allowed for the kernel to reap a dying one)."""
    deadline = time.monotonic() + 3.0
    left = alive_per_ps(pids)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = alive_per_ps(pids)
    assert not left, f"{what}: processes left: {left}"


def rendezvous_dirs(tmp_path: Path) -> list[Path]:
    return sorted(tmp_path.glob("ubatch-rdzv-*"))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_signal_to_the_parent_stops_every_rank(sig: signal.Signals, tmp_path: Path) -> None:
    """Mid-run (both ranks held at step 2, their process group up), first the network footprint: the launcher
    listens on nothing, its ranks only on loopback, the rendezvous directory is private. Then the signal."""
    run = Run(["all", "2", f"hold:{tmp_path / 'never'}"], tmp_path)
    run.wait_for(r"fault: rank \d step 2", count=2)
    parent = run.proc.pid
    tree = descendants(parent)
    listening = {pid: listening_addresses(pid) for pid in {parent} | tree}
    modes = [stat.S_IMODE(d.stat().st_mode) for d in rendezvous_dirs(tmp_path)]
    os.kill(parent, sig)
    rc, _, err = run.finish()
    assert rc == 128 + sig, err[-3000:]
    assert f"error: interrupted by {sig.name}: stopped rank 0 and rank 1" in err, err[-3000:]
    assert "Timed out" not in err, err[-3000:]  # stopped by the signal, not by a collective's timeout
    assert_nothing_left(tree | {parent}, f"after {sig.name} to the parent")
    assert listening[parent] == [], f"the launcher itself listens on {listening[parent]}"
    bound = [(pid, addr, port) for pid, socks in listening.items() for addr, port in socks]
    assert bound, "no rank listens at all: the socket scan found nothing to check"
    assert all(is_loopback(addr) for _, addr, _ in bound), f"listening beyond loopback: {bound}"
    assert modes == [0o700], modes  # one private rendezvous directory while it ran ...
    assert rendezvous_dirs(tmp_path) == []  # ... removed once it ended


def test_ranks_die_with_a_parent_killed_outright(tmp_path: Path) -> None:
    run = Run(["all", "2", f"hold:{tmp_path / 'never'}"], tmp_path)
    run.wait_for(r"fault: rank \d step 2", count=2)
    parent = run.proc.pid
    tree = descendants(parent)
    assert len(tree) >= 2, tree
    os.kill(parent, signal.SIGKILL)  # no chance to stop its ranks: they must go by themselves
    rc, _, _ = run.finish()
    assert rc == -signal.SIGKILL
    assert_nothing_left(tree, "after SIGKILL to the parent")


def test_killed_rank_is_named_and_the_run_ends(tmp_path: Path) -> None:
    run = Run(["1", "3", "SIGKILL"], tmp_path)
    run.wait_for(r"fault: rank 1 step 3 SIGKILL")
    tree = descendants(run.proc.pid)
    rc, _, err = run.finish()
    assert rc == 1, err[-3000:]
    assert "error: rank 1 exited with signal SIGKILL" in err, err[-3000:]
    # failed fast: no collective waited out --dist-timeout-s (gloo: "Timed out waiting ...ms"), no ubatch handoff
    assert "Timed out" not in err and "DBOTimeoutError" not in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]  # one summary, no traceback without --debug
    assert_nothing_left(tree | {run.proc.pid}, "after SIGKILL of rank 1")
    assert rendezvous_dirs(tmp_path) == []  # removed after a killed rank too


def test_stopped_rank_is_named_as_silent(tmp_path: Path) -> None:
    run = Run(["1", "3", "SIGSTOP"], tmp_path)
    run.wait_for(r"fault: rank 1 step 3 SIGSTOP")
    tree = descendants(run.proc.pid)
    rc, _, err = run.finish()
    assert rc == 1, err[-3000:]
    summary = next(ln for ln in err.splitlines() if ln.startswith("error: "))
    # the stopped rank is named first, as the cause, not the peer whose collective timed out waiting for it
    assert summary.startswith("error: rank 1 stopped responding: no heartbeat for "), summary
    assert "its process is stopped" in summary and "last progress: step 3" in summary, summary
    assert_nothing_left(tree | {run.proc.pid}, "after SIGSTOP of rank 1")
    assert rendezvous_dirs(tmp_path) == []
