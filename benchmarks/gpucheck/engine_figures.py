"""Per-step figures of an engine run (``engine_run``'s JSON), from the engine's own counters.

- ``wall_ms``: the step loop's wall time per step (``LoopStats.wall_s / num_steps``);
- ``gpu_ms``: the GPU's busy time per step, the union of its kernels, copies and memsets in the profiled run;
- ``cpu_thread_ms``: the CPU thread's scheduling and result processing per step (``LoopStats.cpu_work_s``);
- ``forward_host_ms``: the launches' own work per step, ``(forward_busy_s - read_wait_s) / num_steps``: input
  and metadata preparation, launches, the step's Python, less its wait for the sampled ids (``LoopStats.
  read_wait_s``, the step's one host read; 0 since the step loop reads the results after launching the next
  step). On a GPU the scheduling thread launches each step itself (``InlineLauncher``); a run that launched on a
  forward thread counts that thread's busy time. A run without that counter falls back to
  ``max(0, forward_busy_s / num_steps - gpu_ms)``, which also counted launch-bound waits as host work;
- ``forward_cpu_ms``: the launching thread's CPU time in the same calls per step (``LoopStats.forward_cpu_s``,
  ``time.thread_time``). ``forward_host_ms`` is wall time: with a forward thread it also counts the waits for the
  GIL while the CPU thread runs Python, so ``forward_host_ms - forward_cpu_ms`` is the time lost to the other
  thread (launched inline, only what other processes take from the core);
- ``host_ms = cpu_thread_ms + forward_host_ms``: the host's work for one step. Both terms are wall times that
  count the GIL waits of their thread, so the time one thread waits for the other is in both. When it is below
  ``gpu_ms`` the host can keep the GPU busy (the overlap loop runs the CPU thread's share beside the GPU). Every
  per-step figure is over all the call's steps, its prefill steps too, not its decode steps alone;
- ``gpu_idle_pct``: the share of the wall time the GPU was idle, ``100 * (1 - gpu_ms / wall_ms)``;
- ``first_call_tokens_per_s``: with ``--repeats`` above 1, the first measured call's output tok/s (it pays
  one-time costs); every other figure is the last call's, the engine's steady state.
"""
from __future__ import annotations

from typing import Any


def engine_figures(data: dict[str, Any]) -> dict[str, Any]:
    """Figures available in ``data`` (missing parts are left out; an unmeasured run gives ``{}``)."""
    measured = data.get("measured")
    if not measured:
        return {}
    fig: dict[str, Any] = {"output_tokens_per_s": measured["output_tokens_per_s"],
                           "num_steps": measured["num_steps"], "num_errors": measured["num_errors"],
                           "num_ubatched_steps": measured["num_ubatched_steps"]}
    runs = data.get("measured_runs") or []
    if len(runs) > 1:
        fig["first_call_tokens_per_s"] = runs[0]["output_tokens_per_s"]
    loop = measured.get("loop")
    steps = loop["num_steps"] if loop else 0
    if steps:
        fig.update(wall_ms=1e3 * loop["wall_s"] / steps, cpu_thread_ms=1e3 * loop["cpu_work_s"] / steps,
                   forward_ms=1e3 * loop["forward_busy_s"] / steps)
    profiled = data.get("profiled")
    if profiled and profiled.get("num_steps"):
        fig["gpu_ms"] = 1e3 * profiled["gpu_busy_s"] / profiled["num_steps"]
        if "forward_ms" in fig:
            if "read_wait_s" in loop:
                fig["forward_host_ms"] = 1e3 * (loop["forward_busy_s"] - loop["read_wait_s"]) / steps
                if "forward_cpu_s" in loop:
                    fig["forward_cpu_ms"] = 1e3 * loop["forward_cpu_s"] / steps
            else:
                fig["forward_host_ms"] = max(0.0, fig["forward_ms"] - fig["gpu_ms"])
            fig["host_ms"] = fig["cpu_thread_ms"] + fig["forward_host_ms"]
            fig["gpu_idle_pct"] = max(0.0, 100 * (1 - fig["gpu_ms"] / fig["wall_ms"])) if fig["wall_ms"] else None
    graphs = (data.get("engine") or {}).get("graphs") or {}
    if graphs.get("graph_bytes") is not None:
        fig["graph_mib"] = graphs["graph_bytes"] / 2**20
    return fig
