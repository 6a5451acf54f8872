"""What prefix caching costs when nothing hits, in CPU time: ``LLM.generate`` with caching off and on, both
engines in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so this process's CPU time covers the front end
and the engine), calls alternating (off, on, then on, off: drift falls on both), each call on prompts no call
made before, so the cache can find nothing (every output's ``num_cached_tokens`` is checked to be 0).

Process CPU time (``time.process_time``) is the figure to judge on a shared machine: other processes' load
lengthens wall time, CPU time much less (it still moves with their use of the shared caches and memory), so the
rows also give the median over repeats of each back-to-back pair's ratio off / on. A cProfile of one further
call per side says how much of the on-side's CPU is the cache's own work: hashing the full blocks and looking
them up at admission (``Scheduler._cached_prefix``) and registering them (``Scheduler._cache_full_blocks``).
"""
from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: cProfile's (file suffix, function name) of the cache's own work; neither calls the other, so their
#: cumulative times add up
CACHE_WORK = (("runner/core/scheduler.py", "_cached_prefix"), ("runner/core/scheduler.py", "_cache_full_blocks"))
SIDES = ("off", "on")


@dataclass
class SideTimes:
    """Per-call wall and process CPU seconds of one side, in call order, and the tokens each call generated."""

    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    outputs: list[list[list[int]]] = field(default_factory=list)


def timed_call(llm: Any, prompts: list[list[int]], params: Any, side: str, times: SideTimes) -> None:
    """One ``generate`` on ``prompts``, timed; raises if any prompt token was served from the cache."""
    w0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    times.cpu_s.append(time.process_time() - c0)
    times.wall_s.append(time.perf_counter() - w0)
    cached = [o.num_cached_tokens for o in outs]
    if any(c != 0 for c in cached):
        raise RuntimeError(f"caching {side}: a 0 %-hit call found cached tokens {cached}: its prompts were not new")
    times.outputs.append([list(o.outputs[0].token_ids) for o in outs])


def profile_call(llm: Any, prompts: list[list[int]], params: Any) -> tuple[float, float, float]:
    """One profiled ``generate``: its total profiled seconds, the cumulative seconds of :data:`CACHE_WORK`, and
    the seconds spent in ``BlockPool``'s own code (all block bookkeeping, with or without caching)."""
    prof = cProfile.Profile()
    prof.runcall(llm.generate, prompts, params, use_tqdm=False)
    stats: Any = pstats.Stats(prof)  # ``stats``/``total_tt`` are pstats internals without stubs
    cache_s = sum(row[3] for (path, _, name), row in stats.stats.items()
                  if any(path.endswith(suffix) and name == fn for suffix, fn in CACHE_WORK))
    pool_s = sum(row[2] for (path, _, _), row in stats.stats.items() if path.endswith("runner/core/kv_blocks.py"))
    return float(stats.total_tt), cache_s, pool_s


def measure(make_llm: Callable[[bool], Any], prompts_of: Callable[[int], list[list[int]]], max_tokens: int,
            repeats: int, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """``repeats`` alternating timed calls per side and one profiled call per side: the CSV rows (one per side)."""
    from runner.sampling_params import SamplingParams

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # both engines in this process: its CPU time is theirs
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llms = {side: make_llm(side == "on") for side in SIDES}
    times = {side: SideTimes() for side in SIDES}
    profiled: dict[str, tuple[float, float, float]] = {}
    try:
        for side, llm in llms.items():  # warm-up: first-call costs
            timed_call(llm, prompts_of(10_000), params, side, SideTimes())
        for rep in range(repeats):
            prompts = prompts_of(rep)  # new to both engines; both sides run the same ones
            for side in (SIDES if rep % 2 == 0 else SIDES[::-1]):
                timed_call(llms[side], prompts, params, side, times[side])
                progress(f"0 % hit CPU, caching {side} call {rep + 1}: wall {times[side].wall_s[-1]:.2f} s, "
                         f"CPU {times[side].cpu_s[-1]:.2f} s")
        for side, llm in llms.items():
            profiled[side] = profile_call(llm, prompts_of(20_000), params)
            progress(f"0 % hit CPU, caching {side} profiled: {profiled[side][0]:.2f} s, cache work "
                     f"{profiled[side][1]:.3f} s, BlockPool {profiled[side][2]:.3f} s")
    finally:
        for llm in llms.values():
            llm.close()
    same = times["on"].outputs == times["off"].outputs
    med = {side: (statistics.median(times[side].wall_s), statistics.median(times[side].cpu_s)) for side in SIDES}
    # each repeat's two calls ran back to back, under much the same load: the median of their ratios
    paired = {side: (statistics.median(off / this for off, this in zip(times["off"].wall_s, times[side].wall_s,
                                                                       strict=True)),
                     statistics.median(off / this for off, this in zip(times["off"].cpu_s, times[side].cpu_s,
                                                                       strict=True))) for side in SIDES}
    return [{"load": "0 % hit", "caching": side, "calls": repeats, "cached_tokens": 0,
             "median_wall_s": round(med[side][0], 3), "median_cpu_s": round(med[side][1], 3),
             "wall_tput_vs_off": round(med["off"][0] / med[side][0], 4),
             "cpu_tput_vs_off": round(med["off"][1] / med[side][1], 4),
             "paired_wall_ratio": round(paired[side][0], 4), "paired_cpu_ratio": round(paired[side][1], 4),
             "min_cpu_s": round(min(times[side].cpu_s), 3), "max_cpu_s": round(max(times[side].cpu_s), 3),
             "profiled_s": round(profiled[side][0], 3), "profiled_cache_work_s": round(profiled[side][1], 4),
             "cache_work_share": round(profiled[side][1] / profiled[side][0], 5),
             "profiled_block_pool_s": round(profiled[side][2], 4),
             "same_tokens_as_off": ("yes" if same else "no") if side == "on" else "-"} for side in SIDES]


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"\n0 % hit, in-process CPU time, medians of {rows[0]['calls']} alternating calls per side "
          "(every output: num_cached_tokens == 0)")
    for r in rows:
        print(f"caching {r['caching']:3}  wall {r['median_wall_s']:.2f} s ({r['wall_tput_vs_off']:.3f}x)  "
              f"CPU {r['median_cpu_s']:.2f} s ({r['cpu_tput_vs_off']:.3f}x, range {r['min_cpu_s']:.2f}-"
              f"{r['max_cpu_s']:.2f}; paired {r['paired_cpu_ratio']:.3f}x)  "
              f"profiled {r['profiled_s']:.2f} s, cache work "
              f"{r['profiled_cache_work_s']:.3f} s ({r['cache_work_share']:.2%}), BlockPool "
              f"{r['profiled_block_pool_s']:.3f} s  "
              f"same tokens {r['same_tokens_as_off']}")
