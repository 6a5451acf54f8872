"""The host's time per decode step through the public path, ``LLM.generate``, with the front end included.

The near-null model of ``bench_host_overhead.py`` (vocab 64, hidden 16, one layer, two experts) on the emulated
device (zero time and 3 ms per step by default), 256 requests of 4-token prompts, greedy. Three engines per
device time, alive together and measured in turn so that the machine's drift hits all alike:

- ``mp``: the default, the engine core in a process of its own (``VLLM_ENABLE_V1_MULTIPROCESSING=1``) with its
  default loop (pipelined on the emulated device), the front end in this process;
- ``inproc``: the same loop with the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``);
- ``sync``: in this process, one step at a time (``disable_overlap_schedule=True``).

Wall per decode step: a call of ``--decode-tokens + 1`` tokens minus a call of 1 token (prefill and call set-up
removed), divided by ``--decode-tokens``; the median over ``--repeats``. Every engine's tokens must equal the
synchronous loop's. Usage: ``python benchmarks/bench_llm_generate.py [--requests 256] [--device-ms 0 3]
[--repeats 3] [--decode-tokens 48] [--output CSV]``.
"""
from __future__ import annotations

import argparse
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

from bench_host_overhead import MODEL, PROMPT_LEN
from common import RESULTS_DIR, write_csv

ENGINES = ("mp", "inproc", "sync")
MP_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def open_engine(kind: str, model_dir: str, requests: int, max_len: int, device_ms: float) -> Any:
    from runner.entrypoints.llm import LLM

    before = os.environ.get(MP_ENV)
    os.environ[MP_ENV] = "1" if kind == "mp" else "0"
    try:
        return LLM(model=model_dir, device="cpu", max_num_seqs=requests,
                   max_num_batched_tokens=max(512, requests * PROMPT_LEN), max_model_len=max_len,
                   emulate_device=f"step_us={device_ms * 1e3:g}", disable_overlap_schedule=kind == "sync" or None)
    finally:
        if before is None:
            os.environ.pop(MP_ENV)
        else:
            os.environ[MP_ENV] = before


def timed(llm: Any, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    from runner.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]


def run(requests: int, device_ms: list[float], repeats: int, decode_tokens: int, cache_dir: str
        ) -> list[dict[str, Any]]:
    from runner.models.loader import resolve_model_path

    model_dir = str(resolve_model_path(MODEL, cache_dir))  # a directory: the engine process finds it too
    rng = random.Random(11)
    prompts = [[rng.randrange(64) for _ in range(PROMPT_LEN)] for _ in range(requests)]
    rows = []
    for ms in device_ms:
        engines = {kind: open_engine(kind, model_dir, requests, PROMPT_LEN + decode_tokens + 8, ms)
                   for kind in ENGINES}
        per_step: dict[str, list[float]] = {kind: [] for kind in ENGINES}
        tokens: dict[str, list[list[int]]] = {}
        try:
            for llm in engines.values():  # warm-up: first-call costs, threads, the engine process's first steps
                timed(llm, prompts[:8], 4)
            for _ in range(repeats):
                for kind, llm in engines.items():
                    short, _ = timed(llm, prompts, 1)
                    long, tokens[kind] = timed(llm, prompts, decode_tokens + 1)
                    per_step[kind].append((long - short) / decode_tokens)
        finally:
            for llm in engines.values():
                llm.close()
        med = {kind: 1e3 * statistics.median(v) for kind, v in per_step.items()}
        host = med["sync"] - ms  # the synchronous loop pays host + device per step
        rows.append({"requests": requests, "device_ms": ms, "mp_ms": round(med["mp"], 3),
                     "inproc_ms": round(med["inproc"], 3), "sync_ms": round(med["sync"], 3),
                     "mp_over_sync": round(med["mp"] / med["sync"], 3),
                     "mp_over_max_host_device": round(med["mp"] / max(host, ms), 3) if ms else "",
                     "same_tokens": tokens["mp"] == tokens["inproc"] == tokens["sync"], "repeats": repeats,
                     "decode_tokens": decode_tokens})
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print("ms per decode step through LLM.generate (median of repeats); mp: engine core in its own process")
    head = ["reqs", "device", "mp", "inproc", "sync", "mp/sync", "mp/max(h,d)", "same"]
    print(" | ".join(f"{h:>11}" for h in head))
    for r in rows:
        cells = [r["requests"], r["device_ms"], r["mp_ms"], r["inproc_ms"], r["sync_ms"], r["mp_over_sync"],
                 r["mp_over_max_host_device"], "yes" if r["same_tokens"] else "NO"]
        print(" | ".join(f"{c!s:>11}" for c in cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--device-ms", type=float, nargs="+", default=[0.0, 3.0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=48)
    p.add_argument("--output", default=str(RESULTS_DIR / "llm_generate.csv"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ubatch-bench-llm-") as cache_dir:
        rows = run(args.requests, args.device_ms, args.repeats, args.decode_tokens, cache_dir)
    print_table(rows)
    write_csv(rows, args.output)


if __name__ == "__main__":
    main()
