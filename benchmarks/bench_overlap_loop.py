"""Scheduler-level overlap loop on vs off (``--disable-overlap-schedule``): tokens/s and forward idle time.

Off and on runs alternate on one engine; ``LoopStats`` gives forward busy and idle time, ``hidden`` (the share
of per-step CPU work that no longer stalls the forward side) and ``wall saved`` (the share that became wall
time: near zero or negative on CPU, where both threads share the GIL and the cores, which is why it is
reported). Configurations: ``tiny-qwen3-moe`` at 16 and 128 sequences and a wider model with more kernel time.
Usage: ``python benchmarks/bench_overlap_loop.py [--repeats 5] [--max-tokens 64] [--threads 1]``.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, empty_prefix_cache, write_csv
from runner.entrypoints.llm import LLM
from runner.models.loader import TINY_MODELS
from runner.sampling_params import SamplingParams

# this benchmark reads the in-process engine (its runner, core or loop statistics): the engine core stays here
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

WIDE = "bench-wide-qwen3-moe"
WIDE_CONFIG = {**TINY_MODELS["tiny-qwen3-moe"], "hidden_size": 256, "intermediate_size": 512,
               "moe_intermediate_size": 128, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
               "vocab_size": 4096}


@dataclass
class Config:
    model: str
    max_num_seqs: int


CONFIGS = [Config("tiny-qwen3-moe", 16), Config("tiny-qwen3-moe", 128), Config(WIDE, 64)]


def one_run(llm: LLM, prompts: list[list[int]], params: SamplingParams, overlap: bool) -> dict[str, Any]:
    """One timed call from an empty prefix cache (the same prompts run again would be cache hits from
    ``--prompt-len`` 17 on): its per-step figures and tokens."""
    empty_prefix_cache(llm)
    llm.cfg = llm.cfg.replace(disable_overlap_schedule=not overlap)
    outs = llm.generate(prompts, params, use_tqdm=False)
    st, ls = llm.last_stats, llm.last_loop_stats
    assert st is not None and ls is not None and ls.overlap is overlap
    return {"tok_s": st.output_tokens_per_s, "idle_frac": ls.forward_idle_fraction,
            "idle_ms": 1e3 * ls.forward_idle_s / ls.num_steps, "busy_ms": 1e3 * ls.forward_busy_s / ls.num_steps,
            "wall_ms": 1e3 * ls.wall_s / ls.num_steps, "cpu_ms": 1e3 * ls.cpu_work_s / ls.num_steps,
            "steps": ls.num_steps, "overlapped": ls.num_overlapped_steps,
            "tokens": [o.outputs[0].token_ids for o in outs]}


def bench(cfg: Config, args: argparse.Namespace, cache_dir: str) -> dict[str, Any]:
    llm = LLM(model=cfg.model, cache_dir=cache_dir, max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=2048)
    rng = random.Random(0)
    vocab = llm.runner.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(2 * cfg.max_num_seqs)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for overlap in (False, True):  # warm-up: first-call costs, the executor thread
        llm.cfg = llm.cfg.replace(disable_overlap_schedule=not overlap)
        llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for _ in range(args.repeats):
        for overlap in (False, True):
            runs[overlap].append(one_run(llm, prompts, params, overlap))
    llm.close()
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "tokens"}
           for mode, rs in runs.items()}
    off, on = med[False], med[True]
    identical = all(r["tokens"] == runs[False][0]["tokens"] for rs in runs.values() for r in rs)
    return {"model": cfg.model, "max_num_seqs": cfg.max_num_seqs, "steps": int(off["steps"]),
            "tok_s_off": round(off["tok_s"], 1), "tok_s_on": round(on["tok_s"], 1),
            "idle_frac_off": round(off["idle_frac"], 4), "idle_frac_on": round(on["idle_frac"], 4),
            "idle_ms_step_off": round(off["idle_ms"], 4), "idle_ms_step_on": round(on["idle_ms"], 4),
            "busy_ms_step_off": round(off["busy_ms"], 3), "busy_ms_step_on": round(on["busy_ms"], 3),
            "cpu_ms_step_off": round(off["cpu_ms"], 4), "cpu_ms_step_on": round(on["cpu_ms"], 4),
            "overlapped_steps_on": int(on["overlapped"]),
            "hidden": round((off["idle_ms"] - on["idle_ms"]) / off["idle_ms"], 3) if off["idle_ms"] > 0 else 0.0,
            "wall_saved": round((off["wall_ms"] - on["wall_ms"]) / off["idle_ms"], 3) if off["idle_ms"] > 0 else 0.0,
            "outputs_identical": identical, "repeats": args.repeats, "threads": args.threads}


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = [("model", "model", 22), ("seqs", "max_num_seqs", 5), ("tok/s off", "tok_s_off", 10),
            ("tok/s on", "tok_s_on", 10), ("idle% off", "idle_frac_off", 10), ("idle% on", "idle_frac_on", 9),
            ("idle ms/step off", "idle_ms_step_off", 17), ("on", "idle_ms_step_on", 7),
            ("busy ms/step off", "busy_ms_step_off", 17), ("on", "busy_ms_step_on", 8),
            ("hidden", "hidden", 7), ("wall saved", "wall_saved", 11), ("same tokens", "outputs_identical", 12)]
    print("".join(f"{h:>{w}}" for h, _, w in cols))
    for r in rows:
        cells = []
        for _, k, w in cols:
            v = r[k]
            if k.startswith("idle_frac"):
                v = f"{100 * v:.2f}"
            cells.append(f"{v!s:>{w}}")
        print("".join(cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the forward side (default 1: on a 2-core machine the CPU loop keeps "
                        "the other core)")
    p.add_argument("--output", default=str(RESULTS_DIR / "overlap_loop.csv"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    TINY_MODELS.setdefault(WIDE, WIDE_CONFIG)  # built on first use into the temporary cache, never the user's
    rows = []
    with tempfile.TemporaryDirectory(prefix="ubatch-bench-") as cache_dir:
        for cfg in CONFIGS:
            rows.append(bench(cfg, args, cache_dir))
            print(f"done: {cfg.model} max_num_seqs={cfg.max_num_seqs}", file=sys.stderr)
    print_table(rows)
    write_csv(rows, args.output)


if __name__ == "__main__":
    main()
