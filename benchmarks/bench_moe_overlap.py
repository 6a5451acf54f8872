"""How much of the expert all-to-all DBO hides: an MoE layer stack over 2 ranks with the emulated link.

Each layer is an "attention" stand-in (a chain of matmuls) followed by a FusedMoE over ``torch_ll``. The
link is modelled (``--emulate-link``): its in-flight time uses no CPU, as a NIC's would, so the overlap
is not drowned by loopback gloo burning both cores. Compute per layer is measured with the link off; the
link's bandwidth is then set so that comm = compute / ratio for each compute/comm ratio.

For every ratio the table compares, side by side in one run (medians of repeated runs):
  no-DBO (compute + comm), DBO (2 ubatches), and the ideal ``max(compute, comm)`` per layer;
  hidden % = (no-DBO - DBO) / min(compute, comm): the end-to-end saving against the best possible one;
  comm hidden (trace) % = all-to-all time a traced DBO run spent behind compute, over min(comm, compute) of
  that same run (the most that could hide);
  split overhead % = DBO with no link against no-DBO compute: what running two half-size ubatches costs.
The end-to-end hidden % is the trace % minus what the split costs.

Usage: ``python benchmarks/bench_moe_overlap.py [--tokens 256] [--layers 4] [--repeats 5]``
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_csv
from ubatch import (
    UBatchConfig,
    UBatchSlice,
    UBatchWrapper,
    set_forward_context,
    trace,
)
from ubatch.modular_moe.config import MoEParallelConfig
from ubatch.modular_moe.layer import FusedMoE
from ubatch.modular_moe.prepare_finalize.base import routed_bytes
from ubatch.sbo import SboFlags
from ubatch.trace_metrics import overlap_metrics

RATIOS = (0.25, 0.5, 1.0, 2.0, 4.0)


class SharedExpert(torch.nn.Module):
    """DeepSeek-style shared expert: the work SBO overlaps with the dispatch."""

    def __init__(self, hidden: int, inter: int, g: torch.Generator) -> None:
        super().__init__()
        self.w13 = torch.randn(2 * inter, hidden, generator=g) * hidden ** -0.5
        self.w2 = torch.randn(hidden, inter, generator=g) * inter ** -0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ self.w13.t()).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ self.w2.t()


class Stack(torch.nn.Module):
    def __init__(self, args: argparse.Namespace, parallel: MoEParallelConfig, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        h, e = args.hidden, args.experts
        self.mixers = [torch.randn(h, h, generator=g) / h ** 0.5 for _ in range(args.layers)]
        self.gates = [torch.randn(e, h, generator=g) for _ in range(args.layers)]
        self.moes = torch.nn.ModuleList()
        for _ in range(args.layers):
            shared = SharedExpert(h, args.shared_inter, g) if args.shared_inter else None
            moe = FusedMoE(e, args.top_k, h, args.inter, parallel=parallel, shared_experts=shared)
            with torch.no_grad():
                moe.w13_weight.normal_(0, h ** -0.5, generator=g)
                moe.w2_weight.normal_(0, args.inter ** -0.5, generator=g)
            self.moes.append(moe)
        self.matmuls = args.matmuls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for mixer, gate, moe in zip(self.mixers, self.gates, self.moes, strict=True):
            with trace.compute_span("attention", "A"):
                h = x
                for _ in range(self.matmuls):
                    h = torch.tanh(h @ mixer)
            x = x + moe(h, h @ gate.t())
        return x


def link_for(comm_s_per_layer: float, args: argparse.Namespace) -> str:
    """A link whose dispatch + combine of one layer (both ubatches together) takes ``comm_s_per_layer``."""
    per_direction = routed_bytes(torch.empty(args.tokens, args.hidden), args.top_k)
    latency_us = args.latency_us
    wire_s = comm_s_per_layer / 2 - latency_us * 1e-6
    if wire_s <= 0:
        raise SystemExit(f"--latency-us {latency_us} exceeds the comm time per direction; lower it")
    return f"latency_us={latency_us},gbps={per_direction / wire_s / 1e9:.6f}"


def halves(n: int) -> list[UBatchSlice]:
    m = n // 2
    return [UBatchSlice(slice(0, m), slice(0, m)), UBatchSlice(slice(m, n), slice(m, n))]


def rank_main(rank: int, groups: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    world = args.world_size

    def barrier() -> None:
        if world > 1:
            groups[-1].allreduce([torch.zeros(1)]).wait()

    def build(link: str | None, dbo: bool, sbo: bool = False) -> tuple[Any, Stack]:
        cap = args.tokens // 2 if dbo else args.tokens  # same bytes through gloo in both modes
        parallel = MoEParallelConfig(ep_rank=rank, ep_size=world, all2all_backend="torch_ll" if world > 1 else "none",
                                     ep_groups=groups[:2] if world > 1 else None,
                                     max_dispatch_tokens_per_rank=cap, emulate_link=link,
                                     sbo=SboFlags(dispatch_shared_experts=True) if sbo else SboFlags())
        stack = Stack(args, parallel)
        if not dbo:
            return stack, stack
        return UBatchWrapper(stack, UBatchConfig(num_ubatches=2)), stack

    x = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(rank + 1))

    def once(model: Any, dbo: bool) -> float:
        barrier()
        t0 = time.perf_counter()
        with set_forward_context(ubatch_slices=halves(args.tokens) if dbo else None):
            model(x)
        return (time.perf_counter() - t0) / args.layers

    compute_model, _ = build(None, dbo=False)
    once(compute_model, dbo=False)  # warm-up
    compute_s = statistics.median(once(compute_model, dbo=False) for _ in range(args.repeats))
    split_model, _ = build(None, dbo=True)  # DBO with no link: what splitting the step costs by itself
    once(split_model, dbo=True)
    split_s = statistics.median(once(split_model, dbo=True) for _ in range(args.repeats))
    split_model.close()
    rows = []
    for ratio in args.ratios:
        comm_s = compute_s / ratio
        link = link_for(comm_s, args)
        modes = {"no_dbo": (False, False), "dbo": (True, False)}
        if args.shared_inter:
            modes.update({"sbo": (False, True), "dbo_sbo": (True, True)})
        models = {name: build(link, dbo=d, sbo=b)[0] for name, (d, b) in modes.items()}
        for name, model in models.items():
            once(model, dbo=modes[name][0])  # warm-up
        samples: dict[str, list[float]] = {"compute": [], **{name: [] for name in modes}}
        for _ in range(args.repeats):  # interleaved, so every mode sees the same machine conditions
            samples["compute"].append(once(compute_model, dbo=False))
            for name, model in models.items():
                samples[name].append(once(model, dbo=modes[name][0]))
        with trace.recording() as rec:  # one extra DBO run, traced: how much comm sat behind compute
            once(models["dbo"], dbo=True)
        traced = overlap_metrics(rec)
        for name, model in models.items():
            if modes[name][0]:
                model.close()
        med = {k: statistics.median(v) for k, v in samples.items()}
        c, t_plain, t_dbo = med["compute"], med["no_dbo"], med["dbo"]
        ideal, hideable = max(c, comm_s), min(c, comm_s)
        row = {"target_ratio": ratio, "compute_over_comm": c / comm_s, "compute_ms": c * 1e3,
               "comm_ms": comm_s * 1e3, "ideal_ms": ideal * 1e3}
        row.update({f"{name}_ms": med[name] * 1e3 for name in modes})
        row.update({"speedup": t_plain / t_dbo, "hidden_pct": 100 * (t_plain - t_dbo) / hideable,
                    "dbo_over_ideal": t_dbo / ideal,
                    "trace_hidden_pct": 100 * traced.hidden_us / min(traced.comm_us, traced.compute_us)
                    if traced.comm_us else 0.0,
                    "split_overhead_pct": 100 * (split_s / c - 1), "link": link})
        if args.shared_inter:
            row["dbo_sbo_speedup"] = t_plain / med["dbo_sbo"]
            row["dbo_sbo_hidden_pct"] = 100 * (t_plain - med["dbo_sbo"]) / hideable
        rows.append(row)
    return {"rows": rows}


def _process_rank(rank: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    """One real rank: separate processes do not share a GIL, so one rank's Python never delays the other's."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        groups = [dist.new_group(backend="gloo") for _ in range(3)]
        result = rank_main(rank, groups, args)
        if rank == 0:
            queue.put(result["rows"])
    finally:
        dist.destroy_process_group()


def run_process_ranks(args: argparse.Namespace) -> list[dict[str, Any]]:
    import multiprocessing as mp
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_process_rank, args=(r, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=1200)
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise SystemExit(f"rank process exited with code {p.exitcode}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256, help="tokens per rank per step")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=128)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--shared-inter", type=int, default=128,
                    help="shared expert width (0: none, and no SBO rows)")
    ap.add_argument("--matmuls", type=int, default=6, help="matmuls in each layer's attention stand-in")
    ap.add_argument("--latency-us", type=float, default=20.0)
    ap.add_argument("--ratios", type=float, nargs="+", default=list(RATIOS))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--world-size", type=int, choices=(1, 2), default=2,
                    help="2: real EP over two gloo processes; 1: the link model alone (no gloo CPU cost)")
    ap.add_argument("--csv", default=str(Path(__file__).parent / "results" / "moe_overlap.csv"))
    ap.add_argument("--png", default=str(Path(__file__).parent / "results" / "moe_overlap.png"))
    args = ap.parse_args()
    if args.world_size == 1:
        suffix = "_ws1"
        args.csv = args.csv.replace(".csv", suffix + ".csv")
        args.png = args.png.replace(".png", suffix + ".png")
    torch.set_num_threads(1)
    rows = run_process_ranks(args) if args.world_size > 1 else rank_main(0, [], args)["rows"]
    where = "2 ranks (processes, gloo), torch_ll" if args.world_size > 1 else "1 rank, 'none' backend"
    print(f"MoE stack over {where} + emulated link; {args.tokens} tokens/rank, hidden "
          f"{args.hidden}, {args.experts} experts top-{args.top_k}, {args.layers} layers; median of {args.repeats}")
    cols = [("compute/comm", "compute_over_comm", "{:.2f}"), ("compute ms", "compute_ms", "{:.2f}"),
            ("comm ms", "comm_ms", "{:.2f}"), ("no-DBO ms", "no_dbo_ms", "{:.2f}"), ("DBO ms", "dbo_ms", "{:.2f}"),
            ("ideal ms", "ideal_ms", "{:.2f}"), ("DBO speed-up", "speedup", "{:.2f}x"),
            ("DBO hidden %", "hidden_pct", "{:.1f}%"), ("comm hidden (trace) %", "trace_hidden_pct", "{:.1f}%"),
            ("split overhead %", "split_overhead_pct", "{:.1f}%")]
    if "sbo_ms" in rows[0]:
        cols += [("SBO ms", "sbo_ms", "{:.2f}"), ("DBO+SBO ms", "dbo_sbo_ms", "{:.2f}"),
                 ("DBO+SBO hidden %", "dbo_sbo_hidden_pct", "{:.1f}%")]
    print(" | ".join(f"{h:>{max(len(h), 8)}s}" for h, _, _ in cols))
    for r in rows:
        print(" | ".join(f"{fmt.format(r[k]):>{max(len(h), 8)}s}" for h, k, fmt in cols))
    write_csv(rows, args.csv)
    plot(rows, args.png)
    print(f"wrote {args.csv} and {args.png}")


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["compute_over_comm"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in [("no_dbo_ms", "no DBO"), ("dbo_ms", "DBO"), ("dbo_sbo_ms", "DBO + SBO"),
                       ("ideal_ms", "ideal max(compute, comm)")]:
        if key not in rows[0]:
            continue
        ax1.plot(x, [r[key] for r in rows], marker="o", label=label)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("compute / comm")
    ax1.set_ylabel("ms per layer")
    ax1.legend()
    ax1.set_title("Step time per layer")
    ax2.plot(x, [r["hidden_pct"] for r in rows], marker="o", color="tab:green", label="end to end (no-DBO - DBO)")
    ax2.plot(x, [r["trace_hidden_pct"] for r in rows], marker="s", color="tab:purple",
             label="comm behind compute (traced)")
    ax2.axhline(80, ls="--", color="grey", label="goal 80%")
    ax2.set_xscale("log", base=2)
    ax2.set_ylim(0, 110)
    ax2.set_xlabel("compute / comm")
    ax2.set_ylabel("% of hideable comm hidden")
    ax2.legend()
    ax2.set_title("Communication hidden by DBO")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
