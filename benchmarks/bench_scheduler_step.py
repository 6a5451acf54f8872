"""The scheduler's own CPU time per running request per steady decode step: ``schedule()`` + ``update()``.

No model and no engine: N requests (16-token prompts, greedy stand-in tokens that never stop them) are admitted,
then the scheduler is driven as the pipelined loop drives it (schedule step N+1, then update step N) and the
process CPU time of ``--steps`` steps is divided by steps x requests. The scheduler of this tree (``new``) is
compared with the one at ``--baseline`` (``old``: its ``runner/core/scheduler.py`` from git, loaded as a separate
module over this tree's other modules), alternating old and new ``--repeats`` times in one process so that the
machine's load hits both alike; medians. Both must schedule the same tokens (checked on every run).

Usage: ``python benchmarks/bench_scheduler_step.py [--requests 256 1024] [--steps 200] [--repeats 7]
[--baseline main] [--output CSV]``.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, write_csv
from runner.core import scheduler as new_scheduler
from runner.sampling_params import SamplingParams

PROMPT_LEN = 16
BLOCK_SIZE = 16
VOCAB = 1000
TOKEN = 7  # what the stand-in model samples: not EOS, so nothing stops


def load_baseline(ref: str) -> ModuleType:
    """``runner/core/scheduler.py`` as of git ``ref``, imported as its own module."""
    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(["git", "-C", str(root), "show", f"{ref}:runner/core/scheduler.py"], check=True,
                            capture_output=True, text=True, timeout=60).stdout
    path = Path(tempfile.mkdtemp()) / "scheduler_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("scheduler_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["scheduler_baseline"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def run(module: ModuleType, requests: int, steps: int) -> tuple[float, list[int]]:
    """CPU seconds of ``steps`` pipelined decode steps over ``requests`` requests, and the last step's tokens."""
    max_len = PROMPT_LEN + steps + 16
    blocks = requests * (-(-max_len // BLOCK_SIZE) + 1)
    sched = module.Scheduler(max_num_seqs=requests, max_num_batched_tokens=requests * PROMPT_LEN,
                             block_size=BLOCK_SIZE, num_kv_blocks=blocks, max_model_len=max_len,
                             vocab_size=VOCAB, eos_token_ids=[0])
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0)
    for i in range(requests):
        sched.add_request([1 + (i + j) % (VOCAB - 1) for j in range(PROMPT_LEN)], params)
    first = sched.schedule()
    sched.update(first, [TOKEN] * first.num_reqs)  # every request admitted, one token sampled
    prev = sched.schedule()
    t0 = time.process_time()
    for _ in range(steps):
        nxt = sched.schedule()
        sched.update(prev, [TOKEN] * prev.num_reqs)
        prev = nxt
    elapsed = time.process_time() - t0
    if prev.num_reqs != requests or not prev.is_uniform_decode:
        raise RuntimeError(f"expected a decode step of {requests} requests, got {prev.num_reqs} "
                           f"(uniform decode: {prev.is_uniform_decode})")
    return elapsed, np.asarray(prev.token_ids).tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--baseline", default="main", help="git ref of the scheduler to compare with")
    ap.add_argument("--output", default=str(RESULTS_DIR / "scheduler_step.csv"))
    args = ap.parse_args()
    old = load_baseline(args.baseline)
    rows = []
    for n in args.requests:
        per: dict[str, list[float]] = {"old": [], "new": []}
        for _ in range(args.repeats):
            tokens = {}
            for name, module in (("old", old), ("new", new_scheduler)):
                seconds, tokens[name] = run(module, n, args.steps)
                per[name].append(seconds / (args.steps * n) * 1e6)
            if tokens["old"] != tokens["new"]:
                raise RuntimeError(f"{n} requests: old and new schedulers scheduled different tokens")
        old_us, new_us = statistics.median(per["old"]), statistics.median(per["new"])
        rows.append({"requests": n, "steps": args.steps, "repeats": args.repeats, "baseline": args.baseline,
                     "old_us_per_req_step": round(old_us, 3), "new_us_per_req_step": round(new_us, 3),
                     "speedup": round(old_us / new_us, 3)})
        print(rows[-1], flush=True)
    write_csv(rows, args.output)


if __name__ == "__main__":
    main()
