"""The engine's host time per step: everything a step costs outside the model's forward.

A Qwen3-MoE shrunk until its forward costs almost nothing, so what is left is scheduling, KV bookkeeping, the
DP vote, inputs, sampling and outputs. Workloads ``decode N`` (N requests decoding together) and ``mixed``
(continuous batching), at DP 1 and 2, synchronous and overlap loops alternating on one engine: wall/step,
forward/step, host/step = wall - forward, and, in a second instrumented run, CPU time per phase. Outputs of the
two loops are compared token for token. Usage: ``python benchmarks/bench_host_overhead.py [--requests 64 256
1024] [--dp 1 2] [--repeats 3] [--decode-tokens 48] [--no-mixed] [--output CSV]``.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, empty_prefix_cache, write_csv
from runner.models.loader import TINY_MODELS

# this benchmark reads the in-process engine (its runner, core or loop statistics): the engine core stays here
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

MODEL = "bench-host-qwen3-moe"
MODEL_CONFIG = {**TINY_MODELS["tiny-qwen3-moe"], "hidden_size": 16, "intermediate_size": 32,
                "moe_intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                "num_key_value_heads": 1, "head_dim": 8, "num_experts": 2, "num_experts_per_tok": 1}
TINY_MODELS.setdefault(MODEL, MODEL_CONFIG)  # at import: spawned DP ranks resolve it too (temporary cache only)
PROMPT_LEN = 4
MIXED = dict(requests=1024, seats=256, budget=512, prompt_len=48, min_tokens=8, max_tokens=56)
PHASES = ("schedule", "kv_alloc", "dp_vote", "inputs", "sampling", "outputs", "future_map")
LOOPS = ("sync", "overlap")


@dataclass(frozen=True)
class Workload:
    name: str
    num_requests: int  # per rank
    max_num_seqs: int
    max_num_batched_tokens: int
    prompt_len: int
    output_lens: tuple[int, ...]  # per request

    @property
    def running(self) -> int:
        return self.max_num_seqs


def workloads(requests: list[int], decode_tokens: int, mixed: bool) -> list[Workload]:
    out = [Workload(f"decode {n}", n, n, max(512, n * PROMPT_LEN), PROMPT_LEN, (decode_tokens,) * n)
           for n in requests]
    if mixed:
        rng = random.Random(3)
        m = MIXED
        out.append(Workload("mixed", m["requests"], m["seats"], m["budget"], m["prompt_len"],
                            tuple(rng.randint(m["min_tokens"], m["max_tokens"]) for _ in range(m["requests"]))))
    return out


# ---------------------------------------------------------------------------------------------------- timers
class Intervals:
    """(start, end) of every call of something, on the perf_counter clock."""

    def __init__(self) -> None:
        self.intervals: list[tuple[float, float]] = []

    def busy_in(self, t0: float, t1: float) -> tuple[float, int]:
        """Seconds of it inside [t0, t1], and how many calls started in it."""
        busy, n = 0.0, 0
        for a, b in self.intervals:
            busy += max(0.0, min(b, t1) - max(a, t0))
            n += t0 <= a < t1
        return busy, n


class ForwardClock(Intervals):
    """Forward hooks on the model: every forward's (start, end)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self._start = threading.local()
        self._handles = [model.register_forward_pre_hook(self._pre), model.register_forward_hook(self._post)]

    def _pre(self, *_: Any) -> None:
        self._start.t = time.perf_counter()

    def _post(self, *_: Any) -> None:
        self.intervals.append((self._start.t, time.perf_counter()))

    def close(self) -> None:
        for h in self._handles:
            h.remove()


class SamplingClock(Intervals):
    """Every ``ModelRunner._launch_sampling`` call's (start, end): the sampler, which another part of the engine owns,
    reported apart from the rest of the host's work. Two clock reads per step."""

    def __init__(self) -> None:
        super().__init__()
        from runner.worker.model_runner import ModelRunner

        self._owner, self._orig = ModelRunner, ModelRunner._launch_sampling
        orig, intervals = self._orig, self.intervals

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                intervals.append((t0, time.perf_counter()))

        ModelRunner._launch_sampling = timed  # type: ignore[method-assign]

    def close(self) -> None:
        self._owner._launch_sampling = self._orig  # type: ignore[method-assign]


class PhaseTimers:
    """Wraps methods with exclusive-time timers (a per-thread stack subtracts nested timed calls), counted
    only while ``active``. The model's forward is a nested child, so it is excluded from its caller's phase.
    The clock is the calling thread's CPU time: what the phase costs, not how long other processes on a
    shared machine kept it off a core."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.active = False
        self._local = threading.local()
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, name: str, phase: str | None) -> None:
        """``owner``: a class (its own method is replaced) or an instance (an attribute shadows the method).
        ``phase`` None: timed as a child only (subtracted from the caller, counted nowhere)."""
        is_class = isinstance(owner, type)
        if is_class and name not in vars(owner) or not is_class and not hasattr(owner, name):
            raise AttributeError(f"{owner.__name__ if is_class else type(owner).__name__} has no {name!r} to "
                                 "time: update the benchmark's phase map")
        orig = vars(owner)[name] if is_class else getattr(owner, name)
        timers = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            stack = getattr(timers._local, "stack", None)
            if stack is None:
                stack = timers._local.stack = []
            stack.append(0.0)
            t0 = time.thread_time()
            try:
                return orig(*args, **kwargs)
            finally:
                dt = time.thread_time() - t0
                child = stack.pop()
                if stack:
                    stack[-1] += dt
                if phase is not None and timers.active:
                    timers.totals[phase] += dt - child

        setattr(owner, name, timed)
        self._undo.append((lambda: setattr(owner, name, orig)) if is_class else (lambda: delattr(owner, name)))

    def unwrap(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def instrument(llm: Any, core: Any) -> PhaseTimers:
    """The phase map: which entry point is which phase (see the module docstring)."""
    from runner.core import engine_core, kv_blocks, scheduler
    from runner.worker import device_future_map, model_runner

    t = PhaseTimers()
    t.wrap(scheduler.Scheduler, "schedule", "schedule")
    t.wrap(kv_blocks.BlockPool, "allocate", "kv_alloc")
    t.wrap(kv_blocks.BlockPool, "free", "kv_alloc")
    t.wrap(model_runner.ModelRunner, "decide", "dp_vote")
    t.wrap(model_runner.ModelRunner, "launch", "inputs")
    t.wrap(model_runner.ModelRunner, "_launch_sampling", "sampling")
    t.wrap(scheduler.Scheduler, "update", "outputs")
    t.wrap(engine_core.EngineCore, "_on_results", "outputs")
    t.wrap(engine_core.EngineCore, "take_outputs", "outputs")
    t.wrap(device_future_map.DeviceFutureMap, "resolve_", "future_map")
    t.wrap(device_future_map.DeviceFutureMap, "store_", "future_map")
    model = llm.runner.model
    t.wrap(model, "forward", None)  # the forward itself: excluded from "inputs"
    return t


# ---------------------------------------------------------------------------------------------------- one run
def one_run(llm: Any, core: Any, wl: Workload, loop: str, prompts: list[list[int]], clock: ForwardClock,
            sampling: SamplingClock, timers: PhaseTimers | None, measure: bool = True) -> dict[str, Any] | None:
    from runner.core.requests import EngineCoreRequest
    from runner.sampling_params import SamplingParams

    empty_prefix_cache(core)  # the mixed workload's 48-token prompts run again would be cache hits
    core.cfg = core.cfg.replace(disable_overlap_schedule=loop == "sync")
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=wl.output_lens[i], ignore_eos=True)
        core.add_request(EngineCoreRequest(i, p, params))
    tokens: dict[int, list[int]] = defaultdict(list)
    collected: list[list[Any]] = []
    calls: list[tuple[float, float, int, int]] = []  # (start, end, running after, waiting after)
    decode = wl.name.startswith("decode")
    n_steps = wl.output_lens[0] if decode else 0
    window: tuple[int, int] | None = (2, n_steps - 2) if decode else None  # call indices [a, b)
    clock.intervals.clear()
    sampling.intervals.clear()
    k = 0
    while True:
        if timers is not None:
            timers.active = (window[0] <= k < window[1]) if window is not None else (k >= 10 and core.num_waiting > 0)
        t0 = time.perf_counter()
        step = core.step()
        t1 = time.perf_counter()
        calls.append((t0, t1, core.num_running, core.num_waiting))
        collected.append(step.outputs)  # read after the run: the client's work is not the engine's step
        k += 1
        if not step.running:
            break
    if timers is not None:
        timers.active = False
    for outputs in collected:
        for o in outputs:
            tokens[o.request_id].extend(o.new_token_ids)
    if not measure:
        return None
    if decode:
        a, b = window  # type: ignore[misc]
        sel = calls[a:b]
        if len(sel) < 4:
            raise ValueError(f"{wl.name}: only {len(sel)} steady decode steps; raise --decode-tokens")
    else:  # mixed: the calls while requests still waited for a seat, past the first ten
        sel = [c for i, c in enumerate(calls) if i >= 10 and c[3] > 0]
    t_start, t_end = sel[0][0], sel[-1][1]
    busy, starts = clock.busy_in(t_start, t_end)
    steps = len(sel)
    wall = (t_end - t_start) / steps
    forward = busy / steps
    sample = sampling.busy_in(t_start, t_end)[0] / steps
    return {"wall_ms": 1e3 * wall, "forward_ms": 1e3 * forward, "host_ms": 1e3 * (wall - forward),
            "sampling_ms": 1e3 * sample, "host_excl_sampling_ms": 1e3 * (wall - forward - sample),
            "forwards_per_step": starts / steps, "steps": steps, "tokens": [tokens[i] for i in range(len(prompts))]}


def run_rank(requests: list[int], dp: int, repeats: int, decode_tokens: int, mixed: bool, cache_dir: str,
             phases: bool) -> list[dict[str, Any]] | None:
    """One rank's body (both ranks run it with DP=2); rank 0 returns the rows."""
    import torch

    from runner.core.engine_core import EngineCore
    from runner.entrypoints.llm import LLM

    torch.set_num_threads(1)
    rows = []
    for wl in workloads(requests, decode_tokens, mixed):
        max_len = wl.prompt_len + max(wl.output_lens) + 8
        llm = LLM(model=MODEL, cache_dir=cache_dir, device="cpu", max_num_seqs=wl.max_num_seqs,
                  max_num_batched_tokens=wl.max_num_batched_tokens, max_model_len=max_len,
                  data_parallel_size=dp, dist_timeout_s=600.0)
        core = EngineCore(llm.cfg, llm.runner)
        rng = random.Random(11 + llm.rank)
        prompts = [[rng.randrange(llm.runner.vocab_size) for _ in range(wl.prompt_len)]
                   for _ in range(wl.num_requests)]
        clock, sampling = ForwardClock(llm.model_runner.model), SamplingClock()
        try:
            warm = Workload(wl.name, min(8, wl.num_requests), wl.max_num_seqs, wl.max_num_batched_tokens,
                            wl.prompt_len, wl.output_lens[:8])
            for loop in LOOPS:  # warm-up: first-call costs, the executor thread
                one_run(llm, core, warm, loop, prompts[:warm.num_requests], clock, sampling, None, measure=False)
            runs: dict[str, list[dict[str, Any]]] = {loop: [] for loop in LOOPS}
            for _ in range(repeats):
                for loop in LOOPS:
                    r = one_run(llm, core, wl, loop, prompts, clock, sampling, None)
                    assert r is not None
                    runs[loop].append(r)
            split: dict[str, dict[str, float]] = {}
            if phases:
                for loop in LOOPS:
                    timers = instrument(llm, core)
                    try:
                        r = one_run(llm, core, wl, loop, prompts, clock, sampling, timers)
                    finally:
                        timers.unwrap()
                    assert r is not None
                    split[loop] = {p: 1e3 * timers.totals.get(p, 0.0) / r["steps"] for p in PHASES}
        finally:
            clock.close()
            sampling.close()
            core.close()
            llm.close()
        reference = runs["sync"][0]["tokens"]
        identical = all(r["tokens"] == reference for rs in runs.values() for r in rs)
        for loop in LOOPS:
            med = {key: statistics.median(r[key] for r in runs[loop])
                   for key in ("wall_ms", "forward_ms", "host_ms", "sampling_ms", "host_excl_sampling_ms",
                               "forwards_per_step", "steps")}
            row = {"workload": wl.name, "running": wl.running, "dp": dp, "loop": loop,
                   "wall_ms": round(med["wall_ms"], 3), "forward_ms": round(med["forward_ms"], 3),
                   "host_ms": round(med["host_ms"], 3), "sampling_ms": round(med["sampling_ms"], 3),
                   "host_excl_sampling_ms": round(med["host_excl_sampling_ms"], 3), "steps": int(med["steps"]),
                   "forwards_per_step": round(med["forwards_per_step"], 2)}
            for p in PHASES:  # thread CPU time (the columns above are wall clock)
                row[f"cpu_{p}_ms"] = round(split[loop][p], 3) if phases else ""
            row.update({"same_tokens": identical, "repeats": repeats})
            rows.append(row)
        print(f"rank {llm.rank}: done {wl.name} dp={dp}", file=sys.stderr)
    return rows if llm.rank == 0 else None


# ---------------------------------------------------------------------------------------------------- report
def print_table(rows: list[dict[str, Any]]) -> None:
    """One line per (workload, DP), the two loops side by side; then the phase split."""
    by = {(r["workload"], r["dp"], r["loop"]): r for r in rows}
    keys = list(dict.fromkeys((r["workload"], r["dp"]) for r in rows))
    head = ["workload", "DP", "wall sync", "fwd", "host", "(-sampl)", "wall ovl", "fwd", "host", "(-sampl)",
            "same"]
    widths = [11, 3, 10, 7, 7, 8, 9, 7, 7, 8, 5]
    print("ms per step (median of repeats); host = wall - forward; (-sampl): host less ModelRunner._launch_sampling")
    print(" | ".join(f"{h:>{w}}" for h, w in zip(head, widths, strict=True)))
    for wl, dp in keys:
        s, o = by[(wl, dp, "sync")], by[(wl, dp, "overlap")]
        cells = [wl, dp, s["wall_ms"], s["forward_ms"], s["host_ms"], s["host_excl_sampling_ms"], o["wall_ms"],
                 o["forward_ms"], o["host_ms"], o["host_excl_sampling_ms"], "yes" if s["same_tokens"] else "NO"]
        print(" | ".join(f"{c:>{w}.3f}" if isinstance(c, float) else f"{c!s:>{w}}"
                         for c, w in zip(cells, widths, strict=True)))
    if rows[0]["cpu_schedule_ms"] == "":
        return
    print()
    print("host phases, CPU ms per step (instrumented run; exclusive thread CPU time, both threads)")
    head = ["workload", "DP", "loop", *PHASES]
    widths = [11, 3, 8] + [max(8, len(p)) for p in PHASES]
    print(" | ".join(f"{h:>{w}}" for h, w in zip(head, widths, strict=True)))
    for wl, dp in keys:
        for loop in LOOPS:
            r = by[(wl, dp, loop)]
            cells = [wl, dp, loop, *[r[f"cpu_{p}_ms"] for p in PHASES]]
            print(" | ".join(f"{c:>{w}.3f}" if isinstance(c, float) else f"{c!s:>{w}}"
                             for c, w in zip(cells, widths, strict=True)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, nargs="+", default=[64, 256, 1024],
                   help="running decode requests per rank (one workload each)")
    p.add_argument("--dp", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=48, help="output tokens per request (decode workloads)")
    p.add_argument("--no-mixed", action="store_true", help="skip the mixed prefill/decode workload")
    p.add_argument("--no-phases", action="store_true", help="skip the instrumented run")
    p.add_argument("--output", default=str(RESULTS_DIR / "host_overhead.csv"))
    args = p.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ubatch-bench-host-") as cache_dir:
        for dp in args.dp:
            body = (args.requests, dp, args.repeats, args.decode_tokens, not args.no_mixed, cache_dir,
                    not args.no_phases)
            if dp == 1:
                got = run_rank(*body)
            else:
                from runner.distributed.launch import launch

                got = launch(run_rank, dp, body, timeout_s=600.0, device="cpu")[0]
            assert got is not None
            rows.extend(got)
    print_table(rows)
    write_csv(rows, args.output)


if __name__ == "__main__":
    main()
