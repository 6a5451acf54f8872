"""The engine's DBO against no DBO, on a ~120M-parameter Qwen3-MoE, with the link set relative to compute.

Modes: ``single`` (one process, the emulated link alone: transfers that cost no CPU, as RDMA) and ``dp2`` (two
DP+EP ranks, real gloo transfers plus the link; gloo's copy CPU reported apart). Workloads: 1024-token prefill
steps and 512-token decode steps. The link is calibrated to R x the measured compute; ``ideal = off - min(compute,
comm)``, and a traced DBO run per R splits the gap to ideal into split cost, exposed link time and the last MoE
layer's share. Usage: ``python benchmarks/bench_engine_dbo.py [--modes single dp2] [--ratios 0.25 0.5 1 2 4]
[--repeats 3]``.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import LINK_LATENCY_US, RESULTS_DIR, calibrated_link, empty_prefix_cache, write_csv
from runner.models.loader import TINY_MODELS

# this benchmark reads the in-process engine (its runner, core or loop statistics): the engine core stays here
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

MODEL = "bench-qwen3-moe-120m"
MODEL_CONFIG = TINY_MODELS[MODEL]  # a built-in benchmark model (runner.models.loader.BENCH_MODELS)
CALIBRATION_RUNS = 3
WORKLOADS = {  # name -> (prompts per rank, prompt length, max tokens)
    "prefill": (8, 256, 1),
    "decode": (512, 2, 5),
}


def engine_settings(mode: str, cache_dir: str, device: str = "auto") -> dict[str, Any]:
    # DBO on every step
    base = dict(model=MODEL, cache_dir=cache_dir, device=device, enable_dbo=True, dbo_cost_model="off",
                dbo_decode_token_threshold=2, dbo_prefill_token_threshold=2, max_num_seqs=512,
                max_num_batched_tokens=2048, max_model_len=512, emulate_link="latency_us=0,gbps=1000",
                dist_timeout_s=600.0)
    if mode == "dp2":
        base.update(data_parallel_size=2, enable_expert_parallel=True, all2all_backend="auto")
    return base


def set_dbo(llm: Any, on: bool) -> None:
    llm.cfg = llm.cfg.replace(enable_dbo=on)
    llm.runner.cfg = llm.runner.cfg.replace(enable_dbo=on)


def timed(llm: Any, prompts: list[list[int]], params: Any, dbo: bool,
          trace_file: str | None = None) -> tuple[Any, list[list[int]]]:
    """The run's stats and its output tokens per prompt; the prefix cache is emptied first, so that every run
    computes its prompts (the prefill workload's 256-token prompts run again would be cache hits)."""
    empty_prefix_cache(llm)
    set_dbo(llm, dbo)
    llm.cfg = llm.cfg.replace(trace_file=trace_file)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm.last_stats, [list(o.outputs[0].token_ids) for o in outs]


def run_mode(mode: str, cache_dir: str, ratios: list[float], repeats: int,
             device: str = "auto") -> list[dict[str, Any]] | None:
    """One rank's body (both ranks run it under dp2); rank 0 returns the rows."""
    import torch
    import torch.distributed as dist

    from runner.entrypoints.llm import LLM
    from runner.sampling_params import SamplingParams

    torch.set_num_threads(1)
    llm = LLM(**engine_settings(mode, cache_dir, device))
    world = llm.world_size
    runtime = llm.model_runner.model.moe_runtime
    link = runtime.link()
    assert link is not None  # engine_settings sets --emulate-link
    rows = []
    trace_path = str(Path(cache_dir) / f"trace_{mode}.json")
    try:
        for workload, (per_rank, length, max_tokens) in WORKLOADS.items():
            rng = random.Random(7)
            prompts = [[rng.randrange(llm.runner.vocab_size) for _ in range(length)] for _ in range(per_rank * world)]
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)  # greedy
            warm_up = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
            timed(llm, prompts[:world], warm_up, True)
            timed(llm, prompts[:world], warm_up, False)
            computes = []
            for _ in range(CALIBRATION_RUNS):  # one run's compute varies by tens of % on this VM: take a median
                bytes_before, transfers_before = link.total_bytes, link.num_transfers
                timed(llm, prompts, params, False, trace_path)
                if llm.rank == 0:
                    computes.append(llm.last_trace.metrics[0].compute_us * 1e-6)
            calib = [link.total_bytes - bytes_before, link.num_transfers - transfers_before,
                     statistics.median(computes) if computes else 0.0]
            if world > 1:  # every rank models the same wire: take rank 0's calibration
                box = [calib]
                dist.broadcast_object_list(box, src=0)
                calib = box[0]
            nbytes, transfers, compute_s = calib
            for ratio in ratios:
                comm_s = ratio * compute_s
                runtime.set_link(calibrated_link(int(nbytes), int(transfers), comm_s))
                off: list[float] = []
                on: list[float] = []
                wire, tokens = {False: 0, True: 0}, {}
                for _ in range(repeats):
                    for dbo, times in ((False, off), (True, on)):
                        before = runtime.wire_bytes()
                        stats, tokens[dbo] = timed(llm, prompts, params, dbo)
                        times.append(stats.elapsed_s)
                        wire[dbo] = runtime.wire_bytes() - before
                traced, _ = timed(llm, prompts, params, True, trace_path)
                if llm.rank == 0:
                    m = llm.last_trace.metrics[0]
                    cpu = llm.last_trace.cpu[0]
                    t_off, t_on = statistics.median(off), statistics.median(on)
                    ideal = t_off - min(compute_s, comm_s)
                    rows.append({
                        "mode": mode, "workload": workload, "comm_over_compute": ratio,
                        "compute_s": round(compute_s, 4), "comm_s": round(comm_s, 4),
                        "dbo_off_s": round(t_off, 4), "dbo_on_s": round(t_on, 4), "ideal_s": round(ideal, 4),
                        "speedup": round(t_off / t_on, 3),
                        "saving_pct_of_ideal": (round(100 * (t_off - t_on) / (t_off - ideal), 1)
                                                if t_off > ideal else 0.0),
                        "comm_hidden_pct": round(m.hidden_pct, 1),
                        "unattributed_pct": round(m.unattributed_pct, 1),
                        "copy_cpu_s": round(cpu.other_s, 4) if cpu is not None else 0.0,
                        "copy_cpu_pct_of_rank_cpu": (round(100 * cpu.other_s / cpu.total_s, 1)
                                                     if cpu and cpu.total_s else 0.0),
                        "ubatched_steps": f"{traced.num_ubatched_steps}/{traced.num_steps}",
                        "wire_on_over_off": round(wire[True] / wire[False], 3) if wire[False] else 0.0,
                        "outputs_identical": tokens[False] == tokens[True],  # greedy: DBO must not change a token
                        # Where the gap to ideal goes, from the traced DBO run: compute grown by the split,
                        # link time behind no compute, and the share of that in the last MoE layer.
                        "compute_on_s": round(m.compute_us * 1e-6, 4),
                        "split_cost_s": round(m.compute_us * 1e-6 - compute_s, 4),
                        "exposed_s": round(m.exposed_us * 1e-6, 4),
                        "last_layer_exposed_s": round(m.layers[max(m.layers)].exposed_us * 1e-6, 4)
                        if m.layers else 0.0,
                    })
    finally:
        llm.close()
    return rows if llm.rank == 0 else None


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = [("mode", "mode", 6), ("workload", "workload", 8), ("comm_over_compute", "comm/compute", 12),
            ("compute_s", "compute s", 9), ("comm_s", "comm s", 7), ("dbo_off_s", "off s", 7), ("dbo_on_s", "on s", 7),
            ("ideal_s", "ideal s", 7), ("speedup", "on/off", 6), ("saving_pct_of_ideal", "% of ideal", 10),
            ("comm_hidden_pct", "hidden %", 8), ("unattributed_pct", "unattr %", 8),
            ("copy_cpu_pct_of_rank_cpu", "copy CPU %", 10), ("wire_on_over_off", "wire on/off", 11),
            ("split_cost_s", "split cost s", 12), ("exposed_s", "exposed s", 9),
            ("last_layer_exposed_s", "last layer exp s", 16)]
    print(" | ".join(f"{title:>{w}}" for _, title, w in cols))
    for r in rows:
        cells = []
        for key, _, w in cols:
            v = r[key] if key != "speedup" else f"{r[key]:.2f}x"
            cells.append(f"{v:>{w}}" if not isinstance(v, float) else f"{v:>{w}.3f}".rstrip("0").rstrip(".").rjust(w))
        print(" | ".join(cells))


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    groups = sorted({(r["mode"], r["workload"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.6), squeeze=False)
    for ax, (mode, workload) in zip(axes[0], groups, strict=True):
        sel = [r for r in rows if (r["mode"], r["workload"]) == (mode, workload)]
        x = [r["comm_over_compute"] for r in sel]
        ax.plot(x, [r["dbo_off_s"] for r in sel], "o-", label="DBO off")
        ax.plot(x, [r["dbo_on_s"] for r in sel], "s-", label="DBO on")
        ax.plot(x, [r["ideal_s"] for r in sel], "k--", label="ideal")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{mode}: {workload}")
        ax.set_xlabel("comm / compute")
        ax.set_ylabel("seconds per run")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", nargs="+", default=["single", "dp2"], choices=["single", "dp2"])
    ap.add_argument("--ratios", nargs="+", type=float, default=[0.25, 0.5, 1.0, 2.0, 4.0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", default=str(RESULTS_DIR / "engine_dbo.csv"))
    from runner.distributed.device import DEVICE_CHOICES

    ap.add_argument("--device", default="auto", choices=DEVICE_CHOICES,
                    help="as the engine's --device; dp2 on a host with one GPU needs cpu")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ubatch-bench-") as cache_dir:
        for mode in args.modes:
            if mode == "single":
                got = run_mode(mode, cache_dir, args.ratios, args.repeats, args.device)
            else:
                from runner.distributed.launch import launch

                got = launch(run_mode, 2, args=(mode, cache_dir, args.ratios, args.repeats, args.device),
                             timeout_s=3600, device=args.device)[0]
            assert got is not None
            rows.extend(got)
    print(f"engine DBO: {MODEL} (hidden 1024, 16 experts top-4, 4 layers); medians of {args.repeats}; "
          f"link latency {LINK_LATENCY_US:g} us per transfer")
    print_table(rows)
    differ = [f"{r['mode']}/{r['workload']}/{r['comm_over_compute']:g}" for r in rows if not r["outputs_identical"]]
    print("greedy outputs DBO off vs on: " + (f"identical in all {len(rows)} cases" if not differ
                                                else f"DIFFERENT in {', '.join(differ)}"))
    write_csv(rows, args.output)
    plot(rows, Path(args.output).with_suffix(".png"))


if __name__ == "__main__":
    main()
