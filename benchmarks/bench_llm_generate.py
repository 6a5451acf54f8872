"""The host's time per decode step through the public path, ``LLM.generate``, with the front end included.

``bench_host_overhead.py``'s near-null model with a vocabulary of 64 (``MODEL``: hidden 16, one layer, two experts)
on the emulated device (zero time, 3 ms and 10 ms per step by default), 256 and 1024 requests of 1-token prompts,
greedy, ``max_num_batched_tokens`` 1024. Four engines per (requests, device time), alive together and measured in
turn so that the machine's drift hits all alike: the engine core in its own process (``mp``, the default:
``VLLM_ENABLE_V1_MULTIPROCESSING=1``) or in this one (``inproc``), each with its default loop (pipelined on the
emulated device) and with the synchronous loop (``disable_overlap_schedule=True``, one step at a time).

Wall per decode step: a call of ``--decode-tokens + 1`` tokens minus a call of 1 token (prefill and call set-up
removed), divided by the steps the longer call took in addition; the median over ``--repeats``. The prompts are
short enough for the whole wave to prefill in one step, so every decode step carries every request
(``steps_per_token`` 1: with 4-token prompts and 1024 requests on a 1024-token budget, the scheduler, which
serves running decodes first, admits the wave over many steps and the decode steps are 1.7 per token, most of
them part-full). The synchronous loop pays host + device per step, so its host time is its wall less the device
time; the default loop should take max(host, device). The host time at 256 and 1024 requests is split into a
fixed part and a per-request part (a line through the two points). ``same_tokens``: every engine's tokens
equal the in-process synchronous loop's. ``--logprobs N``: every request also asks for N log-probabilities per
token (the engine's rows as arrays, the front's vLLM dicts per token).

``--profile`` adds, at each request count on the zero-time device (where the host sets the pace), the default
engine in its own process with a cProfile of this (the front) process, the engine process's CPU per thread and
its trace of the host phases, and a cProfile of the in-process default engine; long call less short call,
medians of ``--repeats``.

Usage: ``python benchmarks/bench_llm_generate.py [--requests 256 1024] [--device-ms 0 3 10] [--repeats 3]
[--decode-tokens 32] [--max-num-batched-tokens 1024] [--prompt-len 1] [--logprobs N] [--profile] [--output CSV]``.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_host_overhead import MODEL_CONFIG
from common import RESULTS_DIR, empty_prefix_cache, write_csv
from runner.models.loader import TINY_MODELS

# bench_host_overhead's near-null model with the vocabulary of 64 that the host-time goals were set on (its own is
# 512): on a GPU the LM head is device time; here the CPU computes it, per request
MODEL = "bench-llm-qwen3-moe"
TINY_MODELS.setdefault(MODEL, {**MODEL_CONFIG, "vocab_size": 64})
PLACEMENTS = ("mp", "inproc")  # the engine core in its own process (the default) | in this process
LOOPS = ("default", "sync")  # the engine's default loop (pipelined on the emulated device) | one step at a time
ENGINES = tuple((p, loop) for p in PLACEMENTS for loop in LOOPS)
MP_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
REFERENCE = ("inproc", "sync")
# the engine trace's host phases (runner/entrypoints/profiling.py HOST_PHASES)
HOST_PHASES = ("schedule", "update", "dp_vote", "inputs", "sample", "resolve", "store")
PROFILE_TOP = 12  # functions per profiled process, by own time


def open_engine(placement: str, loop: str, model_dir: str, requests: int, budget: int, max_len: int,
                device_ms: float, trace_file: str | None = None) -> Any:
    from runner.entrypoints.llm import LLM

    before = os.environ.get(MP_ENV)
    os.environ[MP_ENV] = "1" if placement == "mp" else "0"
    try:
        return LLM(model=model_dir, device="cpu", max_num_seqs=requests, max_num_batched_tokens=budget,
                   max_model_len=max_len, emulate_device=f"step_us={device_ms * 1e3:g}",
                   disable_overlap_schedule=True if loop == "sync" else None, trace_file=trace_file)
    finally:
        if before is None:
            os.environ.pop(MP_ENV)
        else:
            os.environ[MP_ENV] = before


def engine_thread_cpu_s(llm: Any) -> dict[tuple[int, int], float]:
    """CPU seconds used so far by each thread (process id, thread id) of the engine-core processes of ``llm``,
    from the kernel's nanosecond ``schedstat``; none with the core in this process."""
    pids = getattr(llm.engine_client, "pids", [])
    return {(pid, int(task.name)): int((task / "schedstat").read_text().split()[0]) * 1e-9
            for pid in pids for task in Path(f"/proc/{pid}/task").iterdir()}


def engine_cpu_s(llm: Any) -> float:
    """CPU seconds used so far by the engine-core processes of ``llm``, every thread; 0 with the core in this
    process, whose CPU ``time.process_time`` counts."""
    return sum(engine_thread_cpu_s(llm).values())


@dataclass(frozen=True)
class Call:
    wall_s: float
    steps: int
    front_cpu_s: float  # this process, every thread
    engine_cpu_s: float  # the engine-core processes
    tokens: list[list[int]]


def timed(llm: Any, prompts: list[list[int]], tokens: int, *, cold: bool = True, logprobs: int | None = None
          ) -> Call:
    """One call: its wall and CPU seconds, the engine steps it took, and every request's tokens. CPU time is
    what the host's work costs whatever else the machine runs; wall time is what a user waits. ``cold``: the
    prefix cache is emptied first, untimed, so that every call computes its prompts (the same prompts run again
    would be cache hits from ``--prompt-len`` 17 on). ``logprobs``: every request asks for that many."""
    from runner.sampling_params import SamplingParams

    if cold:
        empty_prefix_cache(llm)

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=logprobs)
    e0, c0, t0 = engine_cpu_s(llm), time.process_time(), time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu, engine = time.perf_counter() - t0, time.process_time() - c0, engine_cpu_s(llm) - e0
    return Call(wall, llm.last_stats.num_steps, cpu, engine, [list(o.outputs[0].token_ids) for o in outs])


def prompts_for(requests: int, prompt_len: int) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(64) for _ in range(prompt_len)] for _ in range(requests)]


FIGURES = ("wall_ms", "front_cpu_ms", "engine_cpu_ms", "steps_per_token")


def measure(model_dir: str, prompts: list[list[int]], budget: int, device_ms: float, repeats: int,
            decode_tokens: int, logprobs: int | None = None) -> tuple[dict[tuple[str, str], dict[str, float]], bool]:
    """Every engine's :data:`FIGURES` per decode step (medians of repeats), and whether all their tokens
    agreed."""
    requests = len(prompts)
    max_len = len(prompts[0]) + decode_tokens + 8
    engines = {}
    try:
        for placement, loop in ENGINES:
            engines[(placement, loop)] = open_engine(placement, loop, model_dir, requests, budget, max_len,
                                                     device_ms)
        for llm in engines.values():  # warm-up: first-call costs, threads, the engine process's first steps
            timed(llm, prompts[:8], 4)
        figures: dict[tuple[str, str], dict[str, list[float]]] = {key: {f: [] for f in FIGURES} for key in ENGINES}
        tokens: dict[tuple[str, str], list[list[list[int]]]] = {key: [] for key in ENGINES}
        for _ in range(repeats):
            for key, llm in engines.items():
                short = timed(llm, prompts, 1, logprobs=logprobs)
                long = timed(llm, prompts, decode_tokens + 1, logprobs=logprobs)
                steps = long.steps - short.steps
                got = figures[key]
                got["wall_ms"].append(1e3 * (long.wall_s - short.wall_s) / steps)
                got["front_cpu_ms"].append(1e3 * (long.front_cpu_s - short.front_cpu_s) / steps)
                got["engine_cpu_ms"].append(1e3 * (long.engine_cpu_s - short.engine_cpu_s) / steps)
                got["steps_per_token"].append(steps / decode_tokens)
                tokens[key].append(long.tokens)
    finally:
        for llm in engines.values():
            llm.close()
    reference = tokens[REFERENCE][0]
    same = all(t == reference for runs in tokens.values() for t in runs)
    return {key: {f: statistics.median(v) for f, v in got.items()} for key, got in figures.items()}, same


def run(requests: list[int], device_ms: list[float], repeats: int, decode_tokens: int, budget: int,
        prompt_len: int, model_dir: str, logprobs: int | None = None) -> list[dict[str, Any]]:
    rows = []
    for n in requests:
        prompts = prompts_for(n, prompt_len)
        for ms in device_ms:
            med, same = measure(model_dir, prompts, budget, ms, repeats, decode_tokens, logprobs)
            for placement in PLACEMENTS:
                d, s = med[(placement, "default")], med[(placement, "sync")]
                default, sync = d["wall_ms"], s["wall_ms"]
                host = max(sync - ms, 0.0)  # the synchronous loop pays host + device per step
                rows.append({"requests": n, "device_ms": ms, "placement": placement,
                             "default_ms": round(default, 3), "sync_ms": round(sync, 3),
                             "sync_host_ms": round(host, 3), "default_over_sync": round(default / sync, 3),
                             "default_over_max_host_device": round(default / max(host, ms), 3),
                             "default_front_cpu_ms": round(d["front_cpu_ms"], 3),
                             "default_engine_cpu_ms": round(d["engine_cpu_ms"], 3),
                             "sync_front_cpu_ms": round(s["front_cpu_ms"], 3),
                             "sync_engine_cpu_ms": round(s["engine_cpu_ms"], 3),
                             "steps_per_token": round(max(med[(placement, loop)]["steps_per_token"]
                                                          for loop in LOOPS), 3),
                             "same_tokens": same, "repeats": repeats, "decode_tokens": decode_tokens,
                             "prompt_len": prompt_len, "max_num_batched_tokens": budget,
                             "logprobs": "" if logprobs is None else logprobs})
            print(f"done: {n} requests, device {ms:g} ms", file=sys.stderr)
    return rows


def host_split(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Host µs per step = fixed + per_request x requests, through the lowest and highest request counts, for
    each device time, placement and loop: from the CPU time of both processes (what the host's work costs,
    however loaded the machine), and from the wall time on the zero-time device (where the host alone sets the
    pace; the synchronous loop's wall less the device time on the others)."""
    counts = sorted({r["requests"] for r in rows})
    if len(counts) < 2:
        return []
    lo, hi = counts[0], counts[-1]
    by = {(r["requests"], r["device_ms"], r["placement"]): r for r in rows}

    def cpu(r: dict[str, Any], loop: str) -> float:
        return float(r[f"{loop}_front_cpu_ms"] + r[f"{loop}_engine_cpu_ms"])

    def wall(r: dict[str, Any], loop: str) -> float:
        return float(r["default_ms"] if loop == "default" else r["sync_host_ms"])

    out = []
    for ms in sorted({r["device_ms"] for r in rows}):
        for placement in PLACEMENTS:
            a, b = by.get((lo, ms, placement)), by.get((hi, ms, placement))
            if a is None or b is None:
                continue
            for loop in LOOPS:
                kinds = [("cpu", cpu)] + ([("wall", wall)] if ms == 0 or loop == "sync" else [])
                for kind, figure in kinds:
                    h_lo, h_hi = 1e3 * figure(a, loop), 1e3 * figure(b, loop)
                    per_req = (h_hi - h_lo) / (hi - lo)
                    out.append({"device_ms": ms, "placement": placement, "loop": loop, "measure": kind,
                                "requests_lo": lo, "requests_hi": hi, "host_us_lo": round(h_lo, 1),
                                "host_us_hi": round(h_hi, 1), "fixed_us": round(h_lo - per_req * lo, 1),
                                "per_request_us": round(per_req, 2),
                                "ratio_hi_over_lo": round(h_hi / h_lo, 3) if h_lo > 0 else ""})
    return out


# ---------------------------------------------------------------------------------------------------- profile
Entry = tuple[float, float, float]  # calls, own seconds, cumulative seconds
ROOT = str(Path(__file__).resolve().parents[1]) + os.sep
WAITS = ("acquire", "poll", "sleep", "select", "wait")  # blocking waits (near 0 on the thread's CPU clock)
# the front's and the engine's entry points: their cumulative time says which side a function's time belongs to
ENTRY_POINTS = (("runner/engine/output_processor.py", "process_outputs"),
                ("runner/engine/output_processor.py", "add_request"),
                ("runner/entrypoints/llm.py", "_prompt_inputs"),
                ("runner/engine/mp_client.py", "_on_outputs"),
                ("runner/core/engine_core.py", "step"),
                ("runner/core/scheduler.py", "schedule"),
                ("runner/core/scheduler.py", "update"),
                ("runner/worker/model_runner.py", "launch"))


def profiled(llm: Any, prompts: list[list[int]], tokens: int) -> dict[tuple[str, int, str], Entry]:
    """One call under cProfile: (calls, own s, cumulative s) per function, on the calling thread's CPU clock, so
    that neither the other thread holding the GIL nor the other processes on the machine count as its time."""
    prof = cProfile.Profile(time.thread_time)
    empty_prefix_cache(llm)  # outside the profile: every call computes its prompts
    prof.enable()
    timed(llm, prompts, tokens, cold=False)
    prof.disable()
    entries = pstats.Stats(prof).stats  # type: ignore[attr-defined]  # pstats keeps its table here, untyped
    return {key: (float(nc), tt, ct) for key, (_cc, nc, tt, ct, _callers) in entries.items()}


def difference(long: dict[tuple[str, int, str], Entry], short: dict[tuple[str, int, str], Entry]
               ) -> dict[tuple[str, int, str], Entry]:
    """Per function, the long call less the short one: the decode steps without the call's set-up and prefill."""
    zero = (0.0, 0.0, 0.0)
    return {key: (a[0] - b[0], a[1] - b[1], a[2] - b[2])
            for key, a in long.items() for b in [short.get(key, zero)]}


def function_rows(diff: dict[tuple[str, int, str], Entry], steps: int, requests: int, placement: str,
                  process: str) -> list[dict[str, Any]]:
    """The process's total own time per step, its blocking waits, the entry points' cumulative time and the
    functions with the most own time (waits left out)."""
    def name(key: tuple[str, int, str]) -> str:
        filename, line, func = key
        return f"{filename.removeprefix(ROOT)}:{line}({func})"

    def row(function: str, calls: float | str, own: float | str, cum: float | str) -> dict[str, Any]:
        def per(v: float | str) -> float | str:
            return round(1e6 * v / steps, 1) if isinstance(v, float) else v

        return {"requests": requests, "placement": placement, "process": process, "function": function,
                "calls_per_step": round(calls / steps, 2) if isinstance(calls, float) else calls,
                "own_us_per_step": per(own), "cum_us_per_step": per(cum)}

    waits = {k: v for k, v in diff.items() if any(w in k[2] for w in WAITS)}
    work = {k: v for k, v in diff.items() if k not in waits}
    rows = [row("TOTAL thread CPU (waits excluded)", "", sum(v[1] for v in work.values()), ""),
            row("blocking waits (poll, lock acquire, sleep)", "", sum(v[1] for v in waits.values()), "")]
    for suffix, func in ENTRY_POINTS:
        for key, v in diff.items():
            if key[0].endswith(suffix) and key[2] == func and v[0] > 0:
                rows.append(row(f"entry {name(key)}", v[0], v[1], v[2]))
    for key, v in sorted(work.items(), key=lambda kv: kv[1][1], reverse=True)[:PROFILE_TOP]:
        rows.append(row(name(key), v[0], v[1], v[2]))
    return rows


def engine_phases(llm: Any, prompts: list[list[int]], tokens: int) -> tuple[dict[str, float], float]:
    """The engine process's host phases (µs, summed over the call) and its traced wall (µs), from its trace."""
    timed(llm, prompts, tokens)
    result = llm.last_trace
    if result is None or not result.metrics:
        raise RuntimeError(f"the engine process recorded no trace ({len(prompts)} requests)")
    m = result.metrics[0]
    return dict(m.phases), m.wall_us


def median_entries(runs: list[dict[tuple[str, int, str], Entry]]) -> dict[tuple[str, int, str], Entry]:
    """Per function, the median of each figure over the runs (a function absent from a run counts 0 there)."""
    zero = (0.0, 0.0, 0.0)
    keys = {k for run in runs for k in run}
    return {k: (statistics.median(r.get(k, zero)[0] for r in runs), statistics.median(r.get(k, zero)[1] for r in runs),
                statistics.median(r.get(k, zero)[2] for r in runs)) for k in keys}


ENGINE_THREADS_SHOWN = 3


def engine_thread_rows(llm: Any, prompts: list[list[int]], decode_tokens: int, repeats: int
                       ) -> list[dict[str, Any]]:
    """CPU µs per decode step of each of the engine process's busiest threads (long call less short call, median
    of ``repeats``): its main thread runs the step loop (schedule, results, outputs sent), the others are the
    forward thread (inputs, model, sampler) and library threads."""
    per: dict[tuple[int, int], list[float]] = {}
    for _ in range(repeats):
        s0 = engine_thread_cpu_s(llm)
        timed(llm, prompts, 1)
        s1 = engine_thread_cpu_s(llm)
        timed(llm, prompts, decode_tokens + 1)
        s2 = engine_thread_cpu_s(llm)
        for key in s2:
            short = s1.get(key, 0.0) - s0.get(key, 0.0)
            per.setdefault(key, []).append(s2[key] - s1.get(key, 0.0) - short)
    medians = {key: statistics.median(v) for key, v in per.items()}
    rows = []
    for (pid, tid), cpu in sorted(medians.items(), key=lambda kv: kv[1], reverse=True)[:ENGINE_THREADS_SHOWN]:
        what = "main thread (step loop)" if tid == pid else f"thread {tid}"
        rows.append({"requests": len(prompts), "placement": "mp", "process": "engine core (thread CPU)",
                     "function": what, "calls_per_step": "", "own_us_per_step": round(1e6 * cpu / decode_tokens, 1),
                     "cum_us_per_step": ""})
    return rows


def profile(requests: list[int], decode_tokens: int, budget: int, prompt_len: int, repeats: int, model_dir: str,
            trace_dir: str) -> list[dict[str, Any]]:
    """Where the host time goes on the zero-time device (the host sets the pace), per decode step: the long
    call less the short one, as for the step times, median of ``repeats``. With the core in its own process,
    cProfile of this process (the front end) and the engine's trace of its host phases; in process, cProfile of
    the calling thread, which runs both the front end and the engine core's loop (the forward thread, which
    launches the model, is not in it)."""
    rows: list[dict[str, Any]] = []
    for n in requests:
        prompts = prompts_for(n, prompt_len)
        max_len = prompt_len + decode_tokens + 8
        for placement in PLACEMENTS:
            llm = open_engine(placement, "default", model_dir, n, budget, max_len, 0.0)
            try:
                timed(llm, prompts[:8], 4)
                diffs = [difference(profiled(llm, prompts, decode_tokens + 1), profiled(llm, prompts, 1))
                         for _ in range(repeats)]
                process = "front" if placement == "mp" else "front + engine core"
                rows.extend(function_rows(median_entries(diffs), decode_tokens, n, placement, process))
                if placement == "mp":
                    rows.extend(engine_thread_rows(llm, prompts, decode_tokens, repeats))
                    llm.cfg = llm.cfg.replace(trace_file=os.path.join(trace_dir, f"trace-{n}.json"))
                    phases: dict[str, list[float]] = {p: [] for p in ("traced wall", *HOST_PHASES)}
                    for _ in range(repeats):
                        p_short, w_short = engine_phases(llm, prompts, 1)
                        p_long, w_long = engine_phases(llm, prompts, decode_tokens + 1)
                        phases["traced wall"].append(w_long - w_short)
                        for phase in HOST_PHASES:
                            phases[phase].append(p_long.get(phase, 0.0) - p_short.get(phase, 0.0))
                    for name, values in phases.items():
                        rows.append({"requests": n, "placement": placement, "process": "engine core (trace)",
                                     "function": name if name == "traced wall" else f"phase {name}",
                                     "calls_per_step": "",
                                     "own_us_per_step": round(statistics.median(values) / decode_tokens, 1),
                                     "cum_us_per_step": ""})
            finally:
                llm.close()
        print(f"profiled: {n} requests", file=sys.stderr)
    return rows


# ---------------------------------------------------------------------------------------------------- report
def goals(rows: list[dict[str, Any]], split: list[dict[str, Any]]) -> list[str]:
    """The CPU goals for the public path, each with where it stands."""
    by = {(r["requests"], r["device_ms"], r["placement"]): r for r in rows}
    lines = []
    for n, ms in ((256, 3.0), (1024, 10.0)):
        for placement in PLACEMENTS:
            r = by.get((n, ms, placement))
            if r is not None:
                v = r["default_over_max_host_device"]
                lines.append(f"{n} req / {ms:g} ms, {placement}: default / max(sync host, device) = {v} "
                             f"(goal <= 1.1: {'met' if v <= 1.1 else 'NOT met'})")
    for (n, ms, placement), r in sorted(by.items()):
        if ms == 0:
            v = r["default_over_sync"]
            lines.append(f"{n} req / zero-time device, {placement}: default / sync = {v} "
                         f"(goal <= 1.05: {'met' if v <= 1.05 else 'NOT met'})")
    for s in split:
        if s["device_ms"] == 0 and s["ratio_hi_over_lo"] != "":
            v = s["ratio_hi_over_lo"]
            lines.append(f"host per step ({s['measure']}), {s['placement']} {s['loop']}: {s['requests_hi']} / "
                         f"{s['requests_lo']} requests = {v} (goal <= 2: {'met' if v <= 2 else 'NOT met'})")
    return lines


def print_tables(rows: list[dict[str, Any]], split: list[dict[str, Any]], prof: list[dict[str, Any]]) -> None:
    print("ms per decode step through LLM.generate (median of repeats); mp: engine core in its own process")
    print("cpu: CPU ms per step, front process + engine process")
    head = ["reqs", "device", "placement", "default", "sync", "sync host", "def/sync", "def/max(h,d)", "def cpu",
            "sync cpu", "steps/tok", "same"]
    print(" | ".join(f"{h:>11}" for h in head))
    for r in rows:
        cells = [r["requests"], r["device_ms"], r["placement"], r["default_ms"], r["sync_ms"], r["sync_host_ms"],
                 r["default_over_sync"], r["default_over_max_host_device"],
                 f"{r['default_front_cpu_ms']:.2f}+{r['default_engine_cpu_ms']:.2f}",
                 f"{r['sync_front_cpu_ms']:.2f}+{r['sync_engine_cpu_ms']:.2f}", r["steps_per_token"],
                 "yes" if r["same_tokens"] else "NO"]
        print(" | ".join(f"{c!s:>11}" for c in cells))
    if split:
        print("\nhost µs per step = fixed + per_request x requests")
        for s in split:
            print("  " + ", ".join(f"{k}={v}" for k, v in s.items()))
    print("\ngoals:")
    for line in goals(rows, split):
        print("  " + line)
    if prof:
        print("\nprofile (zero-time device, default loop): µs per decode step (long call less short call)")
        for p in prof:
            print(f"  {p['requests']:>5} {p['process']:<20} {p['own_us_per_step']!s:>9} own "
                  f"{p['cum_us_per_step']!s:>9} cum {p['calls_per_step']!s:>7} calls  {p['function']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--device-ms", type=float, nargs="+", default=[0.0, 3.0, 10.0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=1,
                   help="prompt tokens per request; requests x prompt-len <= the budget prefills every request in "
                        "one step, so that every decode step carries all of them (steps_per_token 1)")
    p.add_argument("--logprobs", type=int, default=None,
                   help="every request asks for this many log-probabilities per token (vLLM's logprobs)")
    p.add_argument("--profile", action="store_true", help="also profile the front and engine processes")
    p.add_argument("--output", default=str(RESULTS_DIR / "llm_generate.csv"),
                   help="the step times; the host split and the profile go next to it (_host_split, _profile)")
    args = p.parse_args()
    for name in ("repeats", "decode_tokens", "max_num_batched_tokens", "prompt_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(n < 1 for n in args.requests):
        p.error(f"--requests must all be >= 1, got {args.requests}")
    from runner.models.loader import resolve_model_path

    with tempfile.TemporaryDirectory(prefix="ubatch-bench-llm-") as cache_dir:
        model_dir = str(resolve_model_path(MODEL, cache_dir))  # a directory: the engine process finds it too
        rows = run(args.requests, args.device_ms, args.repeats, args.decode_tokens, args.max_num_batched_tokens,
                   args.prompt_len, model_dir, args.logprobs)
        prof = (profile(args.requests, args.decode_tokens, args.max_num_batched_tokens, args.prompt_len,
                        args.repeats, model_dir, cache_dir) if args.profile else [])
    split = host_split(rows)
    print_tables(rows, split, prof)
    out = Path(args.output)
    write_csv(rows, out)
    if split:
        write_csv(split, out.with_name(out.stem + "_host_split.csv"))
    if prof:
        write_csv(prof, out.with_name(out.stem + "_profile.csv"))


if __name__ == "__main__":
    main()
