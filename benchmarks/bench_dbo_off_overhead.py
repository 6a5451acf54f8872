"""What ``--enable-dbo`` costs a step where DBO is decided off: default flags and ``--enable-dbo`` side by side.

The null-cost model of ``bench_host_overhead.py`` on the emulated device (``--emulate-device``, a GPU-like
device time per step), so what is measured is the engine's host work: the step thread's CPU time per step (the
thread that votes, builds the inputs and launches the forward and the sampler; CPU time is what a machine
shared with other jobs blurs least), the process's CPU time per step (every host thread's work; the emulated
device sleeps) and the wall time per step. Two engines in one process, one with default flags
and one with ``enable_dbo=True`` (the measured cost model, which finds DBO losing on this model and turns it
off), run the same workload in alternating calls. Each engine gets a short warm-up call and one full call
(the cost model's first looks at each bucket) before the measured calls; per call the ubatched steps (the
cost model's looks) are counted, and every call's tokens are compared with the default engine's. On CPU the
cost model times the host's forward, so on a crowded machine a burst of other work can make it turn DBO on
for a while: the ``--enable-dbo`` figures are also given over the calls where DBO stayed off (at most
``MAX_LOOKS`` ubatched steps), which is the regime this measures. Usage:
``python benchmarks/bench_dbo_off_overhead.py [--requests 256] [--prompt-len 16] [--max-tokens 128]
[--emulate-device step_us=2400] [--repeats 9] [--output CSV]``; on a GPU ``--gpu-model bench-qwen3-moe-1b`` runs
the 1.2B model as gpu-check's engine parts do, but both engines in one process, call for call (gpu-check runs
each in a process of its own, so their comparison also holds what differs between two processes).
"""
from __future__ import annotations

import argparse
import collections
import functools
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_host_overhead import MODEL
from common import RESULTS_DIR, empty_prefix_cache, write_csv

# this benchmark reads the in-process engine (its runner, core or loop statistics): the engine core stays here
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

ENGINES = ("default", "enable_dbo")  # default flags; enable_dbo=True
MAX_LOOKS = 3  # ubatched steps in a call where DBO stayed off: the cost model's looks at it
FIGURES = ("step_cpu_ms", "cpu_ms", "wall_ms", "decision_us")
DECISION_CALLS = (("runner.worker.model_runner", "ModelRunner", "decide"),
                  ("runner.worker.dbo_step_timing", "MeasuredDBO", "start"),
                  ("runner.worker.dbo_step_timing", "MeasuredDBO", "stop"))
decision_ns: collections.Counter[int] = collections.Counter()  # id(runner or cost model) -> thread CPU ns


def time_decision_calls() -> None:
    """Wrap the DBO decision's calls so that each adds its thread CPU time to ``decision_ns[id(self)]``."""
    import importlib

    for module, cls_name, name in DECISION_CALLS:
        cls = getattr(importlib.import_module(module), cls_name)
        original = getattr(cls, name)

        @functools.wraps(original)
        def timed(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            t0 = time.thread_time_ns()
            try:
                return _original(self, *args, **kwargs)
            finally:
                decision_ns[id(self)] += time.thread_time_ns() - t0

        setattr(cls, name, timed)


def thread_cpu_s(thread_id: int | None) -> float:
    """CPU seconds the thread ``thread_id`` (a ``threading.get_ident()``) has used so far."""
    if thread_id is None:
        raise RuntimeError("the engine has no forward thread yet")
    return time.clock_gettime(time.pthread_getcpuclockid(thread_id))


def one_call(llm: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """One ``generate`` of the workload from an empty prefix cache (the same prompts run again would be cache
    hits from ``--prompt-len`` 17 on): per-step figures, the ubatched steps it ran and its tokens."""
    from runner.sampling_params import SamplingParams

    empty_prefix_cache(llm)

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ubatched_before = llm.runner.num_ubatched_steps
    owners = (id(llm.runner), id(llm.runner.cost_model))
    decision_before = sum(decision_ns[o] for o in owners)
    client = llm.engine_client  # in process: its engine core's forward thread lives as long as the LLM
    thread = client.forward_thread_id
    step_cpu = None if thread is None else thread_cpu_s(thread)
    cpu = time.process_time()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    cpu = time.process_time() - cpu
    if step_cpu is not None:
        step_cpu = thread_cpu_s(client.forward_thread_id) - step_cpu
    loop = llm.last_loop_stats
    steps = loop.num_steps
    return {"step_cpu_ms": float("nan") if step_cpu is None else 1e3 * step_cpu / steps,
            "cpu_ms": 1e3 * cpu / steps, "wall_ms": 1e3 * loop.wall_s / steps, "steps": steps,
            "decision_us": 1e-3 * (sum(decision_ns[o] for o in owners) - decision_before) / steps,
            "ubatched": llm.runner.num_ubatched_steps - ubatched_before,
            "tokens": [o.outputs[0].token_ids for o in outputs]}


def engine_args(gpu_model: str | None, emulate_device: str, requests: int, prompt_len: int, max_tokens: int,
                cache_dir: str | None) -> dict[str, Any]:
    """The ``LLM`` arguments both engines share: the null-cost model on the CPU's emulated device, or
    ``gpu_model`` with the engine's defaults on a GPU (CUDA graphs, the KV cache from a share of the memory each)."""
    if gpu_model is not None:
        return {"model": gpu_model, "cache_dir": cache_dir, "max_num_seqs": requests, "gpu_memory_utilization": 0.4}
    return {"model": MODEL, "cache_dir": cache_dir, "device": "cpu", "max_num_seqs": requests,
            "max_num_batched_tokens": 1024, "max_model_len": prompt_len + max_tokens + 8,
            "emulate_device": emulate_device}


def run(requests: int, prompt_len: int, max_tokens: int, common: dict[str, Any], repeats: int
        ) -> tuple[list[dict[str, Any]], list[str]]:
    import torch

    from runner.entrypoints.llm import LLM

    if common.get("device") == "cpu":
        torch.set_num_threads(1)  # the null-cost model: one intra-op thread, as bench_host_overhead.py
    time_decision_calls()
    llms = {name: LLM(**common, enable_dbo=name == "enable_dbo") for name in ENGINES}
    try:
        rng = random.Random(7)
        vocab = llms["default"].runner.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(requests)]
        first: dict[str, dict[str, Any]] = {}
        for name, llm in llms.items():
            one_call(llm, prompts[:2], 2)  # as gpu-check: a short warm-up call ...
            first[name] = one_call(llm, prompts, max_tokens)  # ... and the first full one: the first looks
        calls: dict[str, list[dict[str, Any]]] = {name: [] for name in llms}
        for _ in range(repeats):
            for name, llm in llms.items():
                calls[name].append(one_call(llm, prompts, max_tokens))
        decisions = llms["enable_dbo"].last_stats.dbo_decisions if llms["enable_dbo"].last_stats else []
    finally:
        for llm in llms.values():
            llm.close()
    reference = calls["default"][0]["tokens"]
    same = all(c["tokens"] == reference for cs in calls.values() for c in cs) and \
        all(c["tokens"] == reference for c in first.values())
    base = {k: statistics.median(c[k] for c in calls["default"]) for k in FIGURES}
    rows = []
    for name, kept in (("default", calls["default"]), ("enable_dbo", calls["enable_dbo"]),
                       ("enable_dbo, DBO off", [c for c in calls["enable_dbo"] if c["ubatched"] <= MAX_LOOKS])):
        if not kept:
            continue
        med = {k: statistics.median(c[k] for c in kept) for k in FIGURES}
        rows.append({"engine": name, "calls": len(kept), "requests": requests, "max_tokens": max_tokens,
                     "model": common["model"], "emulate_device": common.get("emulate_device", ""),
                     "steps": int(statistics.median(c["steps"] for c in kept)),
                     **{k: round(med[k], 3) for k in FIGURES},
                     **{f"{k}_vs_default": round(med[k] / base[k], 4) for k in FIGURES},
                     "ubatched_first_call": first[name.split(",")[0]]["ubatched"],
                     "ubatched_per_call": "/".join(str(c["ubatched"]) for c in kept),
                     "same_tokens": same, "repeats": repeats})
    return rows, decisions


def print_table(rows: list[dict[str, Any]], decisions: list[str]) -> None:
    print("per step, median of the measured calls: step thread CPU ms | process CPU ms | wall ms, each also as x "
          "default | the DBO decision's step-thread CPU us, and its extra over default as a share of default's step "
          "thread CPU")
    print("engine | calls | steps | step thread CPU | x | process CPU | x | wall | x | decision us | extra % | "
          "ubatched: first call | measured | same tokens")
    base = rows[0]
    for r in rows:
        cells = [r["engine"], r["calls"], r["steps"]]
        for k in FIGURES[:3]:
            cells += [r[k], r[f"{k}_vs_default"]]
        extra = (r["decision_us"] - base["decision_us"]) * 1e-3 / base["step_cpu_ms"]
        cells += [r["decision_us"], f"{100 * extra:.2f}"]
        cells += [f"{r['ubatched_first_call']} | {r['ubatched_per_call']}", "yes" if r["same_tokens"] else "NO"]
        print(" | ".join(str(c) for c in cells))
    print("DBO cost model: " + ("; ".join(decisions) if decisions else "no bucket ran both ways"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--emulate-device", default="step_us=2400", help="the device time per step (--emulate-device)")
    p.add_argument("--repeats", type=int, default=9, help="measured calls per engine, alternating")
    p.add_argument("--gpu-model", default=None,
                   help="on a GPU: this model (e.g. bench-qwen3-moe-1b) with the engine's defaults instead of the "
                        "null-cost model on the emulated device")
    p.add_argument("--cache-dir", default=None, help="with --gpu-model: where a built-in model's checkpoint is kept")
    p.add_argument("--output", default=str(RESULTS_DIR / "dbo_off_overhead.csv"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ubatch-bench-dbo-off-") as tmp:
        common = engine_args(args.gpu_model, args.emulate_device, args.requests, args.prompt_len, args.max_tokens,
                             args.cache_dir or tmp)
        rows, decisions = run(args.requests, args.prompt_len, args.max_tokens, common, args.repeats)
    print_table(rows, decisions)
    write_csv(rows, args.output)


if __name__ == "__main__":
    main()
