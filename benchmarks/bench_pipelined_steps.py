"""Pipelined steps against one step at a time, on the emulated device: what a GPU would see, on a CPU.

The null-cost model of ``bench_host_overhead.py`` with ``--emulate-device step_us=D``: the synchronous loop
should take host + device per step and the pipelined one max(host, device). Both run alternately on one
engine per device time, with the loop's and the emulated stream's counters (launches after a read, launches
that found the stream drained) and token-for-token comparison of outputs. Usage: ``python
benchmarks/bench_pipelined_steps.py [--requests 256] [--device-ms 1.5 3 6] [--repeats 5] [--decode-tokens 32]
[--output CSV]``.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_host_overhead import MODEL, PROMPT_LEN
from common import RESULTS_DIR, write_csv

# this benchmark reads the in-process engine (its runner, core or loop statistics): the engine core stays here
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

LOOPS = ("sync", "pipelined")
EDGE = 2  # EngineCore.step calls left out at each end of a wave


def one_run(llm: Any, core: Any, loop: str, device_us: float, prompts: list[list[int]],
            decode_tokens: int) -> dict[str, Any]:
    """One wave of ``prompts`` on ``core`` with this loop and device time; wall per step over the steady calls."""
    from runner.core.requests import EngineCoreRequest
    from runner.sampling_params import SamplingParams
    from runner.worker.emulated_device import DeviceSpec, EmulatedDevice

    device = EmulatedDevice(DeviceSpec(step_us=device_us))
    llm.runner.emulated_device = device
    core.cfg = core.cfg.replace(disable_overlap_schedule=loop == "sync")
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(i, p, params))
    calls: list[tuple[float, float, int, int]] = []  # (start, end, stream launches, drained launches) after
    collected = []
    while True:
        t0 = time.perf_counter()
        step = core.step()
        calls.append((t0, time.perf_counter(), device.num_launches, device.idle_launches))
        collected.append(step.outputs)
        if not step.running:
            break
    stats = core.last_loop_stats
    assert stats is not None
    tokens: dict[int, list[int]] = defaultdict(list)
    for outputs in collected:
        for o in outputs:
            tokens[o.request_id].extend(o.new_token_ids)
    sel = calls[EDGE:decode_tokens - EDGE]
    if len(sel) < 4:
        raise ValueError(f"only {len(sel)} steady decode steps; raise --decode-tokens")
    steps = len(sel)
    first, last = EDGE, decode_tokens - EDGE  # the steps these calls launched (one launch per call)
    return {"wall_ms": 1e3 * (sel[-1][1] - sel[0][0]) / steps, "steps": steps,
            "launches_after_read": sum(first <= k < last for k in stats.launches_after_read),
            "drained_launches": sel[-1][3] - calls[EDGE - 1][3],
            "tokens": [tokens[i] for i in range(len(prompts))]}


def run(requests: int, device_ms: list[float], repeats: int, decode_tokens: int, cache_dir: str
        ) -> list[dict[str, Any]]:
    import torch

    from runner.core.engine_core import EngineCore
    from runner.entrypoints.llm import LLM

    torch.set_num_threads(1)
    llm = LLM(model=MODEL, cache_dir=cache_dir, device="cpu", max_num_seqs=requests,
              max_num_batched_tokens=max(512, requests * PROMPT_LEN),
              max_model_len=PROMPT_LEN + decode_tokens + 8, emulate_device="step_us=0")
    core = EngineCore(llm.cfg, llm.runner)
    rng = random.Random(11)
    prompts = [[rng.randrange(llm.runner.vocab_size) for _ in range(PROMPT_LEN)] for _ in range(requests)]
    cases = [("sync", 0.0)] + [(loop, ms) for ms in device_ms for loop in LOOPS]
    runs: dict[tuple[str, float], list[dict[str, Any]]] = defaultdict(list)
    try:
        for loop in LOOPS:  # warm-up: first-call costs, the executor thread
            one_run(llm, core, loop, 0.0, prompts[:8], 8)
        for _ in range(repeats):
            for loop, ms in cases:
                runs[(loop, ms)].append(one_run(llm, core, loop, 1e3 * ms, prompts, decode_tokens))
    finally:
        core.close()
        llm.close()
    reference = runs[("sync", 0.0)][0]["tokens"]
    identical = all(r["tokens"] == reference for rs in runs.values() for r in rs)
    med = {case: {k: statistics.median(r[k] for r in rs) for k in ("wall_ms", "launches_after_read",
                                                                    "drained_launches", "steps")}
           for case, rs in runs.items()}
    host = med[("sync", 0.0)]["wall_ms"]
    rows = []
    for ms in device_ms:
        s, p = med[("sync", ms)], med[("pipelined", ms)]
        rows.append({"requests": requests, "device_ms": ms, "host_ms": round(host, 3),
                     "sync_wall_ms": round(s["wall_ms"], 3), "pipelined_wall_ms": round(p["wall_ms"], 3),
                     "sync_over_sum": round(s["wall_ms"] / (host + ms), 3),
                     "pipelined_over_max": round(p["wall_ms"] / max(host, ms), 3),
                     "speedup": round(s["wall_ms"] / p["wall_ms"], 3), "steps": int(p["steps"]),
                     "sync_launches_after_read": s["launches_after_read"],
                     "pipelined_launches_after_read": p["launches_after_read"],
                     "sync_drained_launches": s["drained_launches"],
                     "pipelined_drained_launches": p["drained_launches"],
                     "same_tokens": identical, "repeats": repeats})
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    head = ["reqs", "device", "host", "sync", "sync/(h+d)", "pipelined", "pipe/max", "speed-up", "waits s/p",
            "drained s/p", "same"]
    widths = [5, 7, 7, 7, 10, 9, 8, 8, 10, 11, 5]
    print("ms per step (median of repeats); waits: launches after the previous step's results were read; "
          "drained: launches that found the emulated stream empty (over the measured steps)")
    print(" | ".join(f"{h:>{w}}" for h, w in zip(head, widths, strict=True)))
    for r in rows:
        cells = [r["requests"], r["device_ms"], r["host_ms"], r["sync_wall_ms"], r["sync_over_sum"],
                 r["pipelined_wall_ms"], r["pipelined_over_max"], r["speedup"],
                 f"{r['sync_launches_after_read']:g}/{r['pipelined_launches_after_read']:g}",
                 f"{r['sync_drained_launches']:g}/{r['pipelined_drained_launches']:g}",
                 "yes" if r["same_tokens"] else "NO"]
        print(" | ".join(f"{c:>{w}.3f}" if isinstance(c, float) else f"{c!s:>{w}}"
                         for c, w in zip(cells, widths, strict=True)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=256, help="decode requests running together")
    p.add_argument("--device-ms", type=float, nargs="+", default=[1.5, 3.0, 6.0], help="device time per step")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--decode-tokens", type=int, default=32, help="output tokens per request")
    p.add_argument("--output", default=str(RESULTS_DIR / "pipelined_steps.csv"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ubatch-bench-pipelined-") as cache_dir:
        rows = run(args.requests, args.device_ms, args.repeats, args.decode_tokens, cache_dir)
    print_table(rows)
    write_csv(rows, args.output)


if __name__ == "__main__":
    main()
