"""Liveness between the built-in spawner and its ranks: heartbeats up, death of the parent down.

Up: each rank stamps the time (and its step count) into its row of a shared-memory board, so the parent can
tell a *dead* rank from a *silent* one (stopped, or frozen in native code) and name it, rather than the peer
whose collective timed out. Down: a rank must not outlive its parent (``PR_SET_PDEATHSIG``, and a parent check
in the heartbeat thread), or orphans would spin until their collectives time out.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time
from typing import Any

BEAT_INTERVAL_S = 0.5
# A rank that sent nothing for this long while a peer failed is named as the likely cause (a few beats missed).
STALE_S = 4 * BEAT_INTERVAL_S + 1.0
_FIELDS = 3  # per rank: last beat, last reported step + 1 (0: none yet), when that step was reported
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_board: Any = None  # this rank's shared board (spawned ranks only)
_row = 0


def new_board(ctx: Any, nprocs: int) -> Any:
    """Shared memory for ``nprocs`` rows, all zero (no beat yet); ``ctx`` is the multiprocessing context."""
    return ctx.RawArray("d", nprocs * _FIELDS)


def last_beat(board: Any, rank: int) -> float | None:
    t = board[rank * _FIELDS]
    return t if t > 0 else None


def progress(board: Any, rank: int) -> tuple[int, float] | None:
    """(last step the rank reported, when) or None before its first report."""
    step = board[rank * _FIELDS + 1]
    return (int(step) - 1, board[rank * _FIELDS + 2]) if step > 0 else None


def report_progress(step: int) -> None:
    """Record that this rank reached ``step`` (a no-op outside a rank spawned by ``runner.distributed.launch``)."""
    if _board is not None:
        _board[_row * _FIELDS + 2] = time.monotonic()
        _board[_row * _FIELDS + 1] = step + 1


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux); exit now if the parent is already
    gone (it may have died before the request was made)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    if os.getppid() != parent_pid:
        os._exit(1)


def start_heartbeat(board: Any, rank: int, parent_pid: int, interval_s: float = BEAT_INTERVAL_S) -> None:
    """Beat into ``board[rank]`` every ``interval_s`` from a daemon thread, until the process ends; kill this
    process if the parent that spawned it is gone (the portable half of :func:`die_with_parent`).

    The thread runs no torch code (torch may not even be imported yet), so it leaves torch's thread settings
    alone."""
    global _board, _row
    _board, _row = board, rank

    def beat() -> None:
        while True:
            board[rank * _FIELDS] = time.monotonic()
            if os.getppid() != parent_pid:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(interval_s)

    board[rank * _FIELDS] = time.monotonic()
    heartbeat = threading.Thread(target=beat, name=f"ubatch-heartbeat-{rank}", daemon=True)
    heartbeat.touches_no_tensors = True  # type: ignore[attr-defined]  # the stream sanitizer leaves it alone
    heartbeat.start()


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (``R``, ``S``, ``D``, ``T`` stopped, ``Z``...), None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


_STATES = {"T": "its process is stopped (SIGSTOP or a debugger)", "t": "its process is stopped by a debugger",
           "D": "its process is blocked in uninterruptible I/O", "Z": "its process has exited (zombie)"}


def describe_silence(board: Any, rank: int, pid: int, since: float, now: float) -> str:
    """Why the parent thinks ``rank`` is silent: how long, its process state, where it last got to."""
    quiet = silence(board, rank, since, now)
    text = f"stopped responding: no heartbeat for {quiet:.1f} s" if last_beat(board, rank) is not None else \
        f"stopped responding: no heartbeat in the {quiet:.1f} s since it was started"
    state = _STATES.get(process_state(pid) or "")
    if state:
        text += f"; {state}"
    prog = progress(board, rank)
    if prog is not None:
        text += f"; last progress: step {prog[0]}, {now - prog[1]:.1f} s ago"
    return text


def silence(board: Any, rank: int, since: float, now: float) -> float:
    """Seconds since ``rank``'s last beat (since ``since``, its start, before the first one)."""
    beat = last_beat(board, rank)
    return now - (beat if beat is not None else since)
