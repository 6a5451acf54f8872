"""Decode step time: eager DBO (threads) vs a replayed DBO graph vs a replayed non-DBO graph, on one GPU.

The model is the built-in tiny MoE (or ``--model``) on the ``none`` all-to-all wrapped in the emulated
link (a wait kernel on a side stream, so the communication costs GPU time but no CPU), the engine's default
experts and attention backends (``--experts-backend``, ``--attention-backend``: auto).
For each decode size, side by side in one run (medians over ``--iters`` steps):

  step ms    wall time from the forward call to the end of its GPU work (synchronised every step)
  launch ms  CPU time until the forward call returns (what the host spends issuing one step)

Modes: ``eager-threads-dbo`` (vLLM style: one OS thread per ubatch), ``eager-greenlet-dbo``, ``eager``
(no DBO), ``graph-dbo`` (captured with the threads executor; replay runs no threads), ``graph``.
Writes ``benchmarks/results/cudagraph.csv``. Without a GPU it exits with status 2 and says so.

Usage: ``python benchmarks/bench_cudagraph.py [--sizes 32,64,128] [--emulate-link latency_us=30,gbps=50]``
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if __name__ == "__main__" and not torch.cuda.is_available():
    print("bench_cudagraph: needs a CUDA GPU (torch.cuda.is_available() is False); CUDA graphs cannot be "
          "captured or timed on CPU", file=sys.stderr)
    sys.exit(2)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from cudagraph.dispatch import GraphKey, token_split
from cudagraph.manager import GraphRunner
from cudagraph.sizes import parse_cuda_graph_sizes
from runner.attention.kv_cache import build_attention_metadata
from runner.config import RunnerConfig
from runner.worker.cuda_graphs import make_graph_runner
from runner.worker.model_runner import ModelRunner
from ubatch.forward_context import set_forward_context
from ubatch.slicing import maybe_create_ubatch_slices
from ubatch.wrapper import UBatchConfig, UBatchWrapper

OUT = Path(__file__).resolve().parent / "results" / "cudagraph.csv"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-qwen3-moe")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--sizes", default="32,64,128", type=parse_cuda_graph_sizes)
    p.add_argument("--emulate-link", default="latency_us=30,gbps=50")
    p.add_argument("--context-len", type=int, default=256, help="cached tokens per request")
    p.add_argument("--experts-backend", default="auto")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--csv", type=Path, default=OUT)
    return p.parse_args()


class Decode:
    """Requests with ``context_len`` cached tokens; ``inputs(n, ubatch)`` builds one decode step's inputs."""

    def __init__(self, runner: ModelRunner, context_len: int) -> None:
        self.runner, self.ctx = runner, context_len
        per = runner.max_model_len // runner.block_size
        self.blocks = [list(range(i * per, (i + 1) * per)) for i in range(runner.cfg.max_num_seqs)]

    def inputs(self, n: int, ubatch: bool) -> tuple[Any, Any, torch.Tensor, torch.Tensor]:
        r = self.runner
        meta = build_attention_metadata([self.ctx] * n, [1] * n, self.blocks[:n], r.block_size, r.device)
        r.input_ids[:n].copy_(torch.arange(n) % 100)
        assert meta.positions is not None  # build_attention_metadata always sets them
        r.positions[:n].copy_(meta.positions)
        slices = maybe_create_ubatch_slices(True, np.ones(n, dtype=np.int64), n, n, 2)[1] if ubatch else None
        return meta, slices, r.input_ids[:n], r.positions[:n]

    def eager_step(self, model: Any, n: int, ubatch: bool) -> Callable[[], Any]:
        """One eager decode step of ``n`` requests through ``model`` (the runner's model or a UBatchWrapper),
        handed what an engine step hands it: the attention backend's metadata, built before the forward."""
        meta, slices, ids, pos = self.inputs(n, ubatch)
        attn = self.runner._attention_metadata(meta, slices)

        def run() -> Any:
            with set_forward_context(attn_metadata=attn, ubatch_slices=slices):
                return model(input_ids=ids, positions=pos)
        return run

    def replay_step(self, gr: GraphRunner, n: int, ubatch: bool) -> Callable[[], Any]:
        """One replay of ``gr``'s graph for ``n`` requests; an error if no graph replays."""
        meta, slices, ids, pos = self.inputs(n, ubatch)

        def run() -> Any:
            out = gr.try_replay(meta, slices, ids, pos)
            if out is NotImplemented:
                raise RuntimeError(f"no graph replayed for {n} tokens: {dict(gr.stats)}")
            return out
        return run


def timed(fn: Callable[[], Any], iters: int, warmup: int) -> tuple[float, float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    steps, launches = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        steps.append(time.perf_counter() - t0)
        launches.append(t1 - t0)
    return statistics.median(steps) * 1e3, statistics.median(launches) * 1e3


def main() -> int:
    args = parse_args()
    sizes = args.sizes
    cfg = RunnerConfig(model=args.model, dtype=args.dtype, enable_dbo=True, dbo_decode_token_threshold=2,
                       experts_backend=args.experts_backend, attention_backend=args.attention_backend,
                       emulate_link=args.emulate_link or None, enforce_eager=True,
                       max_num_seqs=max(sizes), max_num_batched_tokens=max(max(sizes), 512),
                       max_model_len=args.context_len + 64)
    runner = ModelRunner(cfg)
    greenlet = runner.wrapper
    threads = UBatchWrapper(runner.model, UBatchConfig(2, executor="threads"), runner.device)
    graph_dbo = make_graph_runner(runner, sizes=sizes, progress=True, wrapper=threads,
                                  keys=[GraphKey(n, token_split(n, 2)) for n in sizes])
    graph_plain = make_graph_runner(runner, sizes=sizes, progress=True, wrapper=None,
                                    keys=[GraphKey(n) for n in sizes])
    for gr in (graph_dbo, graph_plain):
        report = gr.capture()
        print(report.summary())
        print("  " + ", ".join(f"{key}: {nbytes / 2**20:.1f} MiB" for key, nbytes in report.memory_table()))
    decode = Decode(runner, args.context_len)

    rows = []
    for n in sizes:
        modes = {"eager-threads-dbo": decode.eager_step(threads, n, True),
                 "eager-greenlet-dbo": decode.eager_step(greenlet, n, True),
                 "eager": decode.eager_step(runner.model, n, False),
                 "graph-dbo": decode.replay_step(graph_dbo, n, True),
                 "graph": decode.replay_step(graph_plain, n, False)}
        for mode, fn in modes.items():
            step_ms, launch_ms = timed(fn, args.iters, args.warmup)
            rows.append({"tokens": n, "mode": mode, "step_ms": round(step_ms, 3), "launch_ms": round(launch_ms, 3)})
    print(f"\n{torch.cuda.get_device_name()}  model={args.model} dtype={args.dtype} link={args.emulate_link} "
          f"context={args.context_len}  (medians of {args.iters} steps)")
    print(f"{'tokens':>6} {'mode':<20} {'step ms':>9} {'launch ms':>10} {'vs eager-threads-dbo':>21}")
    base = {r["tokens"]: r["step_ms"] for r in rows if r["mode"] == "eager-threads-dbo"}
    for r in rows:
        print(f"{r['tokens']:>6} {r['mode']:<20} {r['step_ms']:>9.3f} {r['launch_ms']:>10.3f} "
              f"{base[r['tokens']] / r['step_ms']:>20.2f}x")
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with args.csv.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.csv}")
    threads.close()
    runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
