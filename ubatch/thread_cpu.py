"""CPU time per OS thread of this process, split into Python threads and the others (Linux ``/proc``).

On a CPU machine a real all-to-all (gloo over loopback) is CPU work done by gloo's own C++ threads, which
the Python timeline cannot see: while they copy, the ubatch thread is simply descheduled. The CPU time of
the threads Python did not start is that work (torch's intra-op pool is a single thread in the engine's
ranks), so the engine reports it next to the trace metrics as the real transfers' CPU share, apart from
the modelled link's time. Where ``/proc/self/task`` does not exist the snapshot is empty and the split
reads zero; it is a measurement, never an input to a decision.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _thread_cpu_s(tid: int) -> float | None:
    try:
        with open(f"/proc/self/task/{tid}/stat", "rb") as f:
            stat = f.read().decode()
    except OSError:  # the thread exited, or no /proc
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3 of the man page
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime + stime


def snapshot() -> dict[int, float]:
    """``{native thread id: CPU seconds so far}`` for every thread of this process."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return {}
    out = {}
    for tid in tids:
        cpu = _thread_cpu_s(tid)
        if cpu is not None:
            out[tid] = cpu
    return out


@dataclass(frozen=True)
class CpuSplit:
    """CPU seconds between two snapshots: in Python threads, and in the others (gloo, OpenMP, ...)."""

    python_s: float
    other_s: float

    @property
    def total_s(self) -> float:
        return self.python_s + self.other_s


def split_since(before: dict[int, float]) -> CpuSplit:
    """CPU used since ``before``, by Python threads and by the rest (threads born since count from zero)."""
    after = snapshot()
    python_ids = {t.native_id for t in threading.enumerate() if t.native_id is not None}
    python = other = 0.0
    for tid, cpu in after.items():
        used = cpu - before.get(tid, 0.0)
        if tid in python_ids:
            python += used
        else:
            other += used
    return CpuSplit(python, other)
