"""Trace one DBO step of a tiny 2-layer MoE model on 2 thread ranks and draw its timeline.

    python examples/trace_dbo_step.py --emulate-link latency_us=1000,gbps=1

Each rank runs ``attention -> router -> FusedMoE (+ shared experts)`` per layer, split into two ubatches
by ``UBatchWrapper``; the all-to-alls go through the emulated link, whose in-flight time uses no CPU, so
the overlap seen here is the overlap DBO would get from a real interconnect of that latency/bandwidth.
CPU compute is ~100x slower than a GPU's, so the default link is scaled to match: per ubatch and layer
the compute (A+E+S) and the link time (D+C) are both about 2 ms. The model marks its attention with
``trace.compute_span("attention", "A", layer=i)``; the MoE kernel and the link record experts (E),
shared experts (S), dispatch (D) and combine (C) themselves. Writes the rank-0 Chrome trace (open it in
https://ui.perfetto.dev) and its timeline PNG into a new temporary directory (or ``--out-dir``, or the exact
``--trace-out`` / ``--png-out`` paths), and prints the overlap metrics and both paths. The picture in
README.md is ``docs/dbo_timeline.png``; to redraw it, ask for it explicitly:

    python examples/trace_dbo_step.py --trace-out docs/dbo_trace.json --png-out docs/dbo_timeline.png
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import threading
from typing import Any

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without `pip install -e .`

from ubatch import UBatchConfig, UBatchSlice, UBatchWrapper, set_forward_context, trace  # noqa: E402
from ubatch.modular_moe.config import MoEParallelConfig  # noqa: E402
from ubatch.modular_moe.layer import FusedMoE  # noqa: E402
from ubatch.modular_moe.runtime import MoERuntime  # noqa: E402
from ubatch.testing.thread_ranks import run_thread_ranks  # noqa: E402
from ubatch.trace_metrics import format_metrics, overlap_metrics  # noqa: E402


class SharedMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, g: torch.Generator) -> None:
        super().__init__()
        self.up = torch.randn(hidden, inter, generator=g) * hidden ** -0.5
        self.down = torch.randn(inter, hidden, generator=g) * inter ** -0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.up) @ self.down


class TinyMoEModel(nn.Module):
    """Per layer: a matmul stand-in for attention (marked "A"), a router, and a FusedMoE with shared experts."""

    def __init__(self, parallel: MoEParallelConfig, layers: int, hidden: int, inter: int, experts: int,
                 top_k: int, attn_width: int, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)  # same weights on every rank
        self.attn_in = [torch.randn(hidden, attn_width, generator=g) * hidden ** -0.5 for _ in range(layers)]
        self.attn_out = [torch.randn(attn_width, hidden, generator=g) * attn_width ** -0.5 for _ in range(layers)]
        self.gates = [torch.randn(experts, hidden, generator=g) for _ in range(layers)]
        self.moe = nn.ModuleList()
        runtime = MoERuntime(parallel)  # the layers share one backend and one modelled link
        for _ in range(layers):
            layer = FusedMoE(experts, top_k, hidden, inter, runtime=runtime,
                             shared_experts=SharedMLP(hidden, inter, g))
            for e in range(experts):
                for shard, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
                    layer.load_expert_weight(e, shard, torch.randn(*shape, generator=g) * shape[1] ** -0.5)
            self.moe.append(layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, moe in enumerate(self.moe):
            with trace.compute_span("attention", "A", layer=i):
                x = x + torch.tanh(x @ self.attn_in[i]) @ self.attn_out[i]
            x = x + moe(x, x @ self.gates[i].t())
        return x


def run(args: argparse.Namespace) -> trace.TraceRecorder:
    """Warm up (gloo connections, allocator), then trace ``args.steps`` DBO steps on every rank."""
    rec = trace.TraceRecorder()
    barrier = threading.Barrier(args.ranks)

    def rank_main(rank: int, groups: list[Any]) -> None:
        parallel = MoEParallelConfig(ep_rank=rank, ep_size=args.ranks, all2all_backend="torch_ll",
                                     ep_groups=groups, max_dispatch_tokens_per_rank=(args.tokens + 1) // 2,
                                     emulate_link=args.emulate_link)
        model = TinyMoEModel(parallel, args.layers, args.hidden, args.inter, args.experts, args.top_k, args.attn_width)
        x = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(rank))
        mid, end = args.tokens // 2, args.tokens
        slices = [UBatchSlice(slice(0, mid), slice(0, mid)), UBatchSlice(slice(mid, end), slice(mid, end))]
        wrapper = UBatchWrapper(model, UBatchConfig(num_ubatches=2, handoff_timeout_s=60))
        try:
            with torch.no_grad(), set_forward_context(ubatch_slices=slices, trace_rank=rank):
                for _ in range(args.warmup):
                    wrapper(x)
                with contextlib.ExitStack() as stack:
                    if rank == 0:  # the recorder is process-global: one rank installs it for all
                        stack.enter_context(trace.recording(rec))
                    barrier.wait()  # every rank warm before anyone records
                    for _ in range(args.steps):
                        wrapper(x)
                    barrier.wait()
        finally:
            wrapper.close()

    run_thread_ranks(args.ranks, rank_main, num_groups=2, timeout_s=120)
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--emulate-link", default="latency_us=1000,gbps=1", help="latency_us=<float>,gbps=<float>")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32, help="tokens per rank (two ubatches of half)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--inter", type=int, default=256)
    p.add_argument("--attn-width", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--out-dir", help="where dbo_trace.json and dbo_timeline.png go (default: a new temporary "
                                     "directory; never the repository)")
    p.add_argument("--trace-out", help="Chrome trace path (default: OUT_DIR/dbo_trace.json)")
    p.add_argument("--png-out", help="timeline PNG path (default: OUT_DIR/dbo_timeline.png)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.trace_out is None or args.png_out is None:
        out_dir = args.out_dir or tempfile.mkdtemp(prefix="ubatch-trace-dbo-step-")
        os.makedirs(out_dir, exist_ok=True)
        args.trace_out = args.trace_out or os.path.join(out_dir, "dbo_trace.json")
        args.png_out = args.png_out or os.path.join(out_dir, "dbo_timeline.png")

    rec = run(args)
    path = trace.save(rec, args.trace_out, pid=0)
    print(f"rank-0 Chrome trace: {path}")
    chrome = trace.load(path)
    print(format_metrics(overlap_metrics(chrome)))
    from ubatch.plot import render

    render(chrome, args.png_out, title_prefix=f"{args.layers}-layer MoE, {args.ranks} ranks, link {args.emulate_link}")
    print(f"timeline: {args.png_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
