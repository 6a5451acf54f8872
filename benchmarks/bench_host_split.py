"""Where the host's time per decode step goes, by part, through the public path (``LLM.generate``): the
scheduler, the engine core's output emission, the step's inputs, the model's own forward, sampling (LM head
included) and the front's output processing, each as a fixed part plus a part per running request.

The engine core runs in this process on the zero-time emulated device, with the synchronous loop (one thread
does everything) or, ``--loop default``, the pipelined one (the step thread launches, this thread schedules and
processes); each part's thread CPU time is exact either way, timed by wrapping the methods that do it
(``PARTS``). The model is ``bench_host_overhead``'s near-null Qwen3-MoE (hidden 16, one layer, vocabulary
512), 1-token prompts, greedy. Per step: (a ``--decode-tokens + 1``-token call less a 1-token call) / the extra
steps, the median of ``--repeats``. On a GPU the forward and the sampling's kernels are device time; here the
CPU computes them, and their cost per request sets a floor under the host's growth with the batch.

Usage: ``python benchmarks/bench_host_split.py [--requests 256 1024] [--loop sync|default] [--repeats 3]
[--decode-tokens 32] [--output CSV]``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_llm_generate import open_engine, prompts_for, timed
from common import RESULTS_DIR, write_csv

# part -> the methods whose thread CPU it is, as (module, class or None, attribute); nested calls are not
# double-counted: a part's methods do not call each other's
PARTS: dict[str, tuple[tuple[str, str | None, str], ...]] = {
    "scheduler": (("runner.core.scheduler", "Scheduler", "schedule"), ("runner.core.scheduler", "Scheduler", "update")),
    "core outputs": (("runner.core.engine_core", "EngineCore", "_on_results"),
                     ("runner.core.engine_core", "EngineCore", "take_outputs")),
    "step inputs": (("runner.worker.model_runner", "ModelRunner", "_stage_inputs"),
                    ("runner.worker.model_runner", "ModelRunner", "_attention_metadata")),
    "forward": (("runner.worker.model_runner", "ModelRunner", "_forward"),),
    "sampling": (("runner.worker.model_runner", "ModelRunner", "_launch_sampling"),),
    "front": (("runner.engine.output_processor", "OutputProcessor", "process_outputs"),),
}
TOTAL = "total (process)"


def instrument(spent: dict[str, float]) -> None:
    """Wrap every method of :data:`PARTS` so that its thread CPU time adds to ``spent[part]``."""
    import importlib

    for part, methods in PARTS.items():
        for module_name, class_name, attr in methods:
            owner: Any = importlib.import_module(module_name)
            if class_name is not None:
                owner = getattr(owner, class_name)
            setattr(owner, attr, _timed(getattr(owner, attr), part, spent))


def _timed(fn: Callable[..., Any], part: str, spent: dict[str, float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[part] += time.thread_time() - t0
    return wrapper


def measure(model_dir: str, loop: str, requests: int, decode_tokens: int, repeats: int, spent: dict[str, float]
            ) -> dict[str, float]:
    """µs per decode step of each part (and the process total), medians over ``repeats``."""
    prompts = prompts_for(requests, 1)
    llm = open_engine("inproc", loop, model_dir, requests, max(1024, requests), decode_tokens + 9, 0.0)
    try:
        timed(llm, prompts, decode_tokens + 1)  # warm-up
        per_step: dict[str, list[float]] = defaultdict(list)
        for _ in range(repeats):
            runs = []
            for tokens in (decode_tokens + 1, 1):
                spent.clear()
                c0 = time.process_time()
                call = timed(llm, prompts, tokens)
                runs.append((call.steps, time.process_time() - c0, dict(spent)))
            (steps_long, cpu_long, long), (steps_short, cpu_short, short) = runs
            steps = steps_long - steps_short
            for part in PARTS:
                per_step[part].append(1e6 * (long.get(part, 0.0) - short.get(part, 0.0)) / steps)
            per_step[TOTAL].append(1e6 * (cpu_long - cpu_short) / steps)
    finally:
        llm.close()
    return {part: statistics.median(v) for part, v in per_step.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, nargs=2, default=[256, 1024], metavar=("LO", "HI"))
    p.add_argument("--loop", choices=("sync", "default"), default="sync")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--output", default=None, help="default: benchmarks/results/host_split_<loop>.csv")
    args = p.parse_args()
    lo, hi = args.requests
    if not 1 <= lo < hi:
        p.error(f"--requests needs 1 <= LO < HI, got {lo} {hi}")
    if args.repeats < 1 or args.decode_tokens < 1:
        p.error("--repeats and --decode-tokens must be >= 1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch

    torch.set_num_threads(1)
    from bench_host_overhead import MODEL
    from runner.models.loader import resolve_model_path

    spent: dict[str, float] = defaultdict(float)
    instrument(spent)
    with tempfile.TemporaryDirectory(prefix="ubatch-bench-split-") as cache_dir:
        model_dir = str(resolve_model_path(MODEL, cache_dir))
        at = {n: measure(model_dir, args.loop, n, args.decode_tokens, args.repeats, spent) for n in (lo, hi)}
    rows = []
    for part in [*PARTS, TOTAL]:
        a, b = at[lo][part], at[hi][part]
        per_request = (b - a) / (hi - lo)
        rows.append({"loop": args.loop, "part": part, f"us_per_step_{lo}": round(a, 1),
                     f"us_per_step_{hi}": round(b, 1), "fixed_us": round(a - per_request * lo, 1),
                     "per_request_us": round(per_request, 3)})
    print(f"{'part':16} {lo:>10} {hi:>10} {'fixed':>8} {'per req':>8}  (µs per decode step)")
    for r in rows:
        print(f"{r['part']:16} {r[f'us_per_step_{lo}']:10.1f} {r[f'us_per_step_{hi}']:10.1f} {r['fixed_us']:8.1f} "
              f"{r['per_request_us']:8.3f}")
    write_csv(rows, args.output or RESULTS_DIR / f"host_split_{args.loop}.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
