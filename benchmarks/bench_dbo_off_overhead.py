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
[--emulate-device step_us=2400] [--repeats 9] [--output CSV]``.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_host_overhead import MODEL  # noqa: E402 - registers the null-cost model
from common import RESULTS_DIR, write_csv  # noqa: E402

ENGINES = ("default", "enable_dbo")  # default flags; enable_dbo=True
MAX_LOOKS = 3  # ubatched steps in a call where DBO stayed off: the cost model's looks at it
FIGURES = ("step_cpu_ms", "cpu_ms", "wall_ms")


def thread_cpu_s(thread_id: int | None) -> float:
    """CPU seconds the thread ``thread_id`` (a ``threading.get_ident()``) has used so far."""
    if thread_id is None:
        raise RuntimeError("the engine has no forward thread yet")
    return time.clock_gettime(time.pthread_getcpuclockid(thread_id))


def one_call(llm: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """One ``generate`` of the workload: per-step figures, the ubatched steps it ran and its tokens."""
    from runner.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ubatched_before = llm.runner.num_ubatched_steps
    core = llm._core  # the engine core of the previous call: its forward thread lives as long as the LLM
    step_cpu = None if core is None else thread_cpu_s(core.forward_thread_id)
    cpu = time.process_time()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    cpu = time.process_time() - cpu
    if step_cpu is not None:
        step_cpu = thread_cpu_s(llm._core.forward_thread_id) - step_cpu
    loop = llm.last_loop_stats
    steps = loop.num_steps
    return {"step_cpu_ms": float("nan") if step_cpu is None else 1e3 * step_cpu / steps,
            "cpu_ms": 1e3 * cpu / steps, "wall_ms": 1e3 * loop.wall_s / steps, "steps": steps,
            "ubatched": llm.runner.num_ubatched_steps - ubatched_before,
            "tokens": [o.outputs[0].token_ids for o in outputs]}


def run(requests: int, prompt_len: int, max_tokens: int, device: str, repeats: int, cache_dir: str
        ) -> tuple[list[dict[str, Any]], list[str]]:
    import torch

    from runner.entrypoints.llm import LLM

    torch.set_num_threads(1)
    llms = {name: LLM(model=MODEL, cache_dir=cache_dir, device="cpu", max_num_seqs=requests,
                      max_num_batched_tokens=1024, max_model_len=prompt_len + max_tokens + 8, emulate_device=device,
                      enable_dbo=name == "enable_dbo") for name in ENGINES}
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
                     "emulate_device": device, "steps": int(statistics.median(c["steps"] for c in kept)),
                     **{k: round(med[k], 3) for k in FIGURES},
                     **{f"{k}_vs_default": round(med[k] / base[k], 4) for k in FIGURES},
                     "ubatched_first_call": first[name.split(",")[0]]["ubatched"],
                     "ubatched_per_call": "/".join(str(c["ubatched"]) for c in kept),
                     "same_tokens": same, "repeats": repeats})
    return rows, decisions


def print_table(rows: list[dict[str, Any]], decisions: list[str]) -> None:
    print("ms per step, median of the measured calls: step thread CPU | process CPU | wall, each also as x default")
    print("engine | calls | steps | step thread CPU | x | process CPU | x | wall | x | ubatched: first call | measured "
          "| same tokens")
    for r in rows:
        cells = [r["engine"], r["calls"], r["steps"]]
        for k in FIGURES:
            cells += [r[k], r[f"{k}_vs_default"]]
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
    p.add_argument("--output", default=str(RESULTS_DIR / "dbo_off_overhead.csv"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ubatch-bench-dbo-off-") as cache_dir:
        rows, decisions = run(args.requests, args.prompt_len, args.max_tokens, args.emulate_device, args.repeats,
                              cache_dir)
    print_table(rows, decisions)
    write_csv(rows, args.output)


if __name__ == "__main__":
    main()
