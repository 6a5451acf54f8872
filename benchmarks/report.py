"""Run the benchmarks that exist and write docs/benchmarks.md: each table with its exact command and machine.

Every number in the report comes from a script under benchmarks/ run here, side by side in one process where
it compares things (medians of repeated runs). GPU-only benchmarks are listed as skipped without a GPU.
Usage: ``python benchmarks/report.py [--only NAME ...] [--quick]``. With ``--only``, the sections of the
benchmarks not named are kept from the existing report, so one section can be regenerated alone.
"""
from __future__ import annotations

import argparse
import csv
import datetime as dt
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"
PY = sys.executable


@dataclass
class Bench:
    name: str
    title: str
    argv: list[str]
    what: str
    needs_gpu: bool = False
    pngs: tuple[str, ...] = ()


def benches(quick: bool) -> list[Bench]:
    r = "3" if quick else "7"
    moe_r = "3" if quick else "5"
    return [
        Bench("handoff", "Handoff cost: ubatch vs a vLLM-style Event pair vs generators",
              ["benchmarks/bench_handoff.py", "--repeats", r],
              "Per-yield cost of control passing from one ubatch to the other."),
        Bench("trace_overhead", "Tracing overhead", ["benchmarks/bench_trace_overhead.py"],
              "Per-handoff cost with the timeline recorder off and on."),
        Bench("moe_overlap", "Communication hidden by DBO: MoE stack over 2 EP ranks",
              ["benchmarks/bench_moe_overlap.py", "--repeats", moe_r],
              "torch_ll over two gloo processes with the emulated link; compute/comm swept 0.25-4.",
              pngs=("moe_overlap.png",)),
        Bench("moe_overlap_ws1", "Communication hidden by DBO: the link model alone (1 rank)",
              ["benchmarks/bench_moe_overlap.py", "--world-size", "1", "--repeats", moe_r],
              "Same stack on one rank ('none' backend): no gloo copies compete for the 2 cores.",
              pngs=("moe_overlap_ws1.png",)),
        Bench("overlap_loop", "Scheduler-level CPU/GPU overlap loop", ["benchmarks/bench_overlap_loop.py"],
              "tokens/s and forward-idle fraction with the overlap loop on/off."),
        Bench("host_overhead", "Engine host time per step", ["benchmarks/bench_host_overhead.py", "--repeats", moe_r],
              "The engine's steps on a Qwen3-MoE shrunk until its forward costs almost nothing (1 layer, hidden 16, "
              "2 experts), at 64, 256 and 1024 running decode requests per rank and a mixed prefill/decode batch, "
              "DP=1 and DP=2, the synchronous and the overlap loop side by side. *host* = wall per step - the "
              "model's forward (forward hooks): what a GPU would wait for the host each step; *(-sampl)*: the same "
              "less `ModelRunner._launch_sampling` (the logits and the sampler). The phase table is thread CPU "
              "time, so the other processes on this machine do not inflate it; its sum can exceed *host* with the "
              "overlap loop, where part of it runs next to the forward."),
        Bench("engine_single", "The engine's DBO, one process: the link model alone",
              ["benchmarks/bench_engine_dbo.py", "--modes", "single", "--repeats", moe_r,
               "--output", "benchmarks/results/engine_dbo_single.csv"],
              "`python -m runner` engine (scheduler, DP vote, model, all-to-all, sampling) on a 120M-parameter "
              "Qwen3-MoE (hidden 1024, 16 experts top-4, 4 layers), DP=1, the emulated link carrying every routed "
              "copy, set relative to the measured compute (comm/compute 0.25-4). DBO is forced on every step "
              "(`--dbo-cost-model off`). *% of ideal*: the saving against `off - min(compute, comm)`; *hidden %*: "
              "the link time spent behind compute in a traced DBO run; *unattr %*: the share of the traced run no "
              "named phase explains. The gap to ideal, from the same trace: *split cost s* (compute of the DBO "
              "run minus the calibrated compute: half-size GEMMs, twice the per-op Python) and *exposed s* (link "
              "time behind no compute), of which *last layer exp s* is the last MoE layer's, whose combine has "
              "no later compute to hide behind. Above 100 % of ideal: the ideal counts only the model's compute "
              "as able to hide the link, but DBO also hides it behind the step's other CPU work (DP vote, "
              "packing, sampling, scheduling).", pngs=("engine_dbo_single.png",)),
        Bench("engine_dp2", "The engine's DBO over 2 DP+EP ranks: real gloo copies plus the link",
              ["benchmarks/bench_engine_dbo.py", "--modes", "dp2", "--repeats", moe_r,
               "--output", "benchmarks/results/engine_dbo_dp2.csv"],
              "Same model and workloads over two rank processes with the phase-aware `auto` all-to-all "
              "(torch_ht for prefill steps, torch_ll for decode). Gloo's copies are CPU work on the ranks' cores "
              "that no overlap can hide on a CPU; *copy CPU %* is the share of the rank's CPU time spent in "
              "gloo's threads (measured from /proc, not on the timeline). *wire on/off*: bytes the real "
              "collectives carried with DBO over without. With DBO off, a rank also waits at every all-to-all "
              "for the slower rank and for gloo's copies; DBO hides part of that too, which is how a saving "
              "can exceed the ideal computed from compute and link time alone.", pngs=("engine_dbo_dp2.png",)),
        Bench("runner_bench_default", "End to end with the defaults: `python -m runner bench` on the tiny model",
              ["-m", "runner", "bench", "--model", "tiny-qwen3-moe", "--data-parallel-size", "2",
               "--enable-expert-parallel", "--emulate-link", "latency_us=20,gbps=0.05", "--num-prompts", "64",
               "--max-tokens", "32", "--max-num-seqs", "64", "--disable-tqdm",
               "--output-csv", "benchmarks/results/runner_bench_default.csv"],
              "The default thresholds and the measured cost model decide where DBO runs. On the tiny built-in "
              "model (hidden 64) every op is dispatch-bound; the run shows which buckets the cost model turned DBO on "
              "in, and that the outputs do not change."),
        Bench("runner_bench", "End to end, DBO forced: `python -m runner bench` on the tiny model",
              ["-m", "runner", "bench", "--model", "tiny-qwen3-moe", "--data-parallel-size", "2",
               "--enable-expert-parallel", "--dbo-decode-token-threshold", "8", "--dbo-prefill-token-threshold", "32",
               "--dbo-cost-model", "off", "--emulate-link", "latency_us=20,gbps=0.05", "--num-prompts", "64",
               "--max-tokens", "32", "--max-num-seqs", "64", "--disable-tqdm",
               "--output-csv", "benchmarks/results/runner_bench.csv"],
              "The same workload with DBO on every step. On the tiny model every op is CPU dispatch-bound, so "
              "splitting a step into two ubatches doubles the Python work per step while the link carries only "
              "~2 ms per step: DBO loses here, and the run shows how much. It proves identical outputs and that "
              "every step ran ubatched."),
        Bench("deepseek_schedule", "DBO schedules on a DeepSeek-V3-shaped model: `moe` vs DeepSeek's decode pipeline",
              ["benchmarks/bench_deepseek_schedule.py", "--repeats", r],
              "Decode steps over 2 EP rank processes with the emulated link set to comm/compute 0.5-2: DBO off, "
              "`--dbo-schedule moe` (vLLM's yields in the MoE kernel) and `--dbo-schedule deepseek` "
              "(SHARED / ATTN-0 / MLP / ATTN-1, deepseek-ai/profile-data). Two shapes: `small` (SHARED + ATTN-0 "
              "light next to the routed experts) and `balanced` (SHARED + ATTN-0 about one MLP stage, as in "
              "DeepSeek's profile). Outputs of both schedules are compared for equality."),
        Bench("sampler", "Sampler cost per decode step", ["benchmarks/bench_sampler.py", "--repeats", "3"],
              "The batched sampler (`runner/worker/sampler.py`) per decode step, greedy only (`greedy`: an argmax), "
              "temperature only (`random`: the draw) and every option on (`all`: temperature, top-k 50, top-p 0.9, "
              "min-p 0.05, repetition/frequency/presence penalties, min_tokens, a logit bias, logprobs 5). "
              "`sampler`: alone on `[rows, 151936]` logits (Qwen3's vocabulary), the step's penalty counts, "
              "metadata, device work and read-back included. `draw`: the draw alone on the same logits, this "
              "sampler's inverse CDF (one uniform per row) against the exponential race of vLLM's `random_sample` "
              "(noise over every token). `engine`: `ModelRunner.step` of a decode step of the engine benchmark's "
              "model (`bench-qwen3-moe-120m`, vocabulary 4096), *sample %* the sampler's share of that step. "
              "CPU, one thread, no GPU: on a GPU these are a few memory-bound passes over `[rows, vocab]`."),
        Bench("serve", "Serving: what DBO does to throughput and latency (`bench-serve`)",
              ["benchmarks/bench_serve.py", "--repeats", "3"] + (["--quick"] if quick else []),
              "`python -m runner bench-serve` (an HTTP client of `python -m runner serve`, timed as `vllm bench "
              "serve`) on the 120M-parameter `bench-qwen3-moe-120m`, DP=1, the emulated link calibrated offline so "
              "that its all-to-all time equals the model's compute on a step of the saturation workload "
              "(`--calibrate-link 1`), default engine flags otherwise (DBO thresholds, the measured cost model). "
              "A server without and one with `--enable-dbo` run side by side, their runs alternating; medians of "
              "3. The load generator, the API server and the rank process share the 2 cores; in the saturation "
              "and low-load runs the rank has one torch thread (`OMP_NUM_THREADS=1`, its calibration too), "
              "leaving the other core to the API server and the load generator; the lone request uses both, its "
              "served and in-process requests alternating, each after the same 0.2 s idle pause. *Where the time "
              "went*: each server's timeline over a few steps of the first run (`/start_profile`, "
              "`/stop_profile`): per step, the union of compute spans, the modelled all-to-all and the part of it "
              "no compute hid, and the host's phases (schedule, DP vote, inputs, sampling, outputs)."),
        Bench("prefix_cache", "Prefix caching: on vs off, offline and served",
              ["benchmarks/bench_prefix_cache.py", "--repeats", "3"],
              "Automatic prefix caching (`--enable-prefix-caching`, the default) against "
              "`--no-enable-prefix-caching`, both engines up together and their runs alternating, each run from an "
              "empty cache (`reset_prefix_cache`), medians of 3, on `tiny-qwen3-moe` (CPU, greedy, EOS ignored, "
              "KV sized for every request of a load). Offline through `LLM.generate`; served through `python -m "
              "runner serve`: the one-shot loads with `bench-serve --compare prefix-caching` (commands below), the "
              "conversations with a streaming client of `/v1/completions`. *shared prefix*: 16 requests at once, a "
              "1,024-token system prompt + 64 tokens of their own, 128 new tokens; *multi-turn*: 8 concurrent "
              "conversations of 4 turns, each prompt the previous one + its 32-token answer + a 64-token user "
              "message; *0 % hit*: 16 unique 1,088-token prompts, 128 new tokens. *computed*: prompt tokens not "
              "served from the cache; *same tokens*: every run with caching generated the tokens of the run "
              "without (not recorded through bench-serve).",
              pngs=("prefix_cache.png",)),
        Bench("cudagraph", "CUDA graphs: eager DBO vs replayed DBO graph vs replayed plain graph",
              ["benchmarks/bench_cudagraph.py"], "Step time and CPU launch time per step.", needs_gpu=True),
        Bench("engine_dbo_gpu", "The engine's DBO on one GPU: default flags vs `--enable-dbo`, without and with a link",
              ["benchmarks/gpu_check.py", "--parts", "env", "model", "engine", "engine_dbo", "engine_link",
               "--out", "benchmarks/results/gpu_check_engine_dbo"],
              "The 1.2B `bench-qwen3-moe-1b`, 256 prompts x 128 new tokens, `--max-num-seqs 256`, CUDA graphs, the "
              "measured cost model: default flags against `--enable-dbo` with no link (DBO cannot win there: goal "
              ">= 0.98x), then both over an emulated link calibrated so that a step's all-to-all takes as long as "
              "its compute (`gpucheck.engine_link`: goal >= 1.3x with >= 85 % of the link hidden). The report "
              "(`report.md` in the output directory) has the figures and the cost model's decision per bucket.",
              needs_gpu=True),
        Bench("gpu", "GPU kernels against the limit, and DBO on a GPU decode step",
              ["benchmarks/bench_gpu.py"],
              "Every experts and attention backend on a Qwen3-30B-A3B-like layer against the measured memory/FLOP "
              "limit (eager and in a CUDA graph), then a 512-token decode step of the 1.2B `bench-qwen3-moe-1b` "
              "eager / eager-DBO / graph / graph-DBO with the link calibrated to comm/compute 0.5, 1, 2.",
              needs_gpu=True),
    ]


# Sections recorded by hand -- measured on another machine (a GPU lent for one session), or comparing an earlier
# commit with this one -- which a run of this script cannot regenerate: every section whose title ends with this
# mark is kept from the existing report as it is, in its order.
RECORDED_MARK = "(recorded)"
GPU_RECORD_TITLE = "GPU check on one H200 (recorded)"


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{os.cpu_count()} cores ({cpu}), {gpu}, Python {platform.python_version()}, torch {torch.__version__}, "
            f"{platform.system()} {platform.release()}")


def run(b: Bench) -> tuple[str, float, int]:
    t0 = time.perf_counter()
    proc = subprocess.run([PY, *b.argv], cwd=ROOT, capture_output=True, text=True, timeout=3600)
    out = (proc.stdout + ("\n" + proc.stderr if proc.returncode else "")).strip()
    out = out.replace(f"{ROOT}/", "")  # paths as a reader's checkout has them
    return out, time.perf_counter() - t0, proc.returncode


def batch_sweep_plot(tokens: list[int], repeats: str) -> tuple[str, str]:
    """DBO speed-up vs tokens per rank at compute ~ comm: the 'speed-up vs batch size' picture."""
    rows = []
    for n in tokens:
        csv_path = RESULTS / f"moe_overlap_tokens{n}.csv"
        argv = ["benchmarks/bench_moe_overlap.py", "--tokens", str(n), "--ratios", "1", "--repeats", repeats,
                "--csv", str(csv_path), "--png", str(RESULTS / f"moe_overlap_tokens{n}.png")]
        subprocess.run([PY, *argv], cwd=ROOT, capture_output=True, text=True, timeout=1800, check=True)
        with open(csv_path) as fh:
            row = next(csv.DictReader(fh))
        rows.append((n, float(row["speedup"]), float(row["hidden_pct"]), float(row["ideal_ms"]),
                     float(row["no_dbo_ms"])))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([r[0] for r in rows], [r[1] for r in rows], marker="o", label="DBO / no DBO")
    ax.plot([r[0] for r in rows], [r[4] / r[3] for r in rows], ls="--", color="grey", label="ideal")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per rank per step")
    ax.set_ylabel("speed-up")
    ax.set_title("DBO speed-up vs batch size (compute = comm)")
    ax.legend()
    fig.tight_layout()
    png = DOCS / "speedup_vs_batch.png"
    fig.savefig(png, dpi=120)
    table = "| tokens/rank | DBO speed-up | ideal speed-up | hidden % |\n|---:|---:|---:|---:|\n" + "\n".join(
        f"| {n} | {s:.2f}x | {nd / i:.2f}x | {h:.1f}% |" for n, s, h, i, nd in rows)
    cmd = f"python benchmarks/bench_moe_overlap.py --tokens N --ratios 1 --repeats {repeats}  (N in {tokens})"
    return table, cmd


def existing_sections(path: Path) -> dict[str, str]:
    """The report's current sections by title (the text after ``## ``, up to the end of that line)."""
    if not path.exists():
        return {}
    parts = ("\n" + path.read_text()).split("\n## ")[1:]
    return {part.split("\n", 1)[0]: "## " + part.rstrip("\n") + "\n" for part in parts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", help="run only these benchmarks (names as in the report)")
    ap.add_argument("--quick", action="store_true", help="fewer repeats (for a smoke run)")
    ap.add_argument("--out", default=str(DOCS / "benchmarks.md"))
    ap.add_argument("--skip-sweep", action="store_true", help="skip the batch-size sweep")
    args = ap.parse_args()
    import torch

    has_gpu = torch.cuda.is_available()
    existing = existing_sections(Path(args.out))
    kept = existing if args.only else {}
    sections = []
    for b in benches(args.quick):
        if args.only and b.name not in args.only:
            if b.title in kept:
                sections.append(kept[b.title])
            continue
        cmd = "python " + " ".join(b.argv)
        if b.needs_gpu and not has_gpu:
            sections.append(f"## {b.title}\n\n{b.what}\n\nNot run here: needs a CUDA GPU (`{cmd}`). The current GPU "
                            f"figures are in the recorded section \"{GPU_RECORD_TITLE}\".\n")
            continue
        if not (ROOT / b.argv[0]).exists() and b.argv[0] != "-m":
            sections.append(f"## {b.title}\n\nNot run: `{b.argv[0]}` does not exist yet.\n")
            continue
        print(f"running {b.name}: {cmd}", flush=True)
        out, secs, rc = run(b)
        status = "" if rc == 0 else f"\n**exit code {rc}**\n"
        text = f"## {b.title}\n\n{b.what}\n\n```\n{cmd}\n```\n{status}\n```\n{out}\n```\n\n(took {secs:.0f} s)\n"
        for png in b.pngs:
            if (RESULTS / png).exists():
                shutil.copy(RESULTS / png, DOCS / png)
                text += f"\n![{b.title}]({png})\n"
        sections.append(text)
    sweep_title = "DBO speed-up vs batch size"
    if not args.skip_sweep and (not args.only or "sweep" in args.only):
        print("running the batch-size sweep", flush=True)
        table, cmd = batch_sweep_plot([64, 128, 256, 512], "3" if args.quick else "5")
        sections.append(f"## {sweep_title}\n\n```\n{cmd}\n```\n\n{table}\n\n"
                        "![speed-up vs batch size](speedup_vs_batch.png)\n")
    elif sweep_title in kept:
        sections.append(kept[sweep_title])
    sections += [text for title, text in existing.items() if title.endswith(RECORDED_MARK)]
    header = (f"# Benchmarks\n\nGenerated by `python benchmarks/report.py` on {dt.date.today()}.\n\n"
              f"Machine: {machine()}.\n\nCPU timings on this 2-core VM are noisy (±10-30% between runs); every "
              "comparison below is measured side by side in one run, as medians of repeated runs.\n\n"
              "How to read the MoE overlap tables: *comm hidden (trace)* is the share of the all-to-all time that "
              "a traced DBO run spent behind compute, out of what could hide; *DBO hidden %* is the end-to-end "
              "saving against the best possible one. The gap between them is *split overhead*: running a step as "
              "two half-size ubatches costs more compute on this CPU (expert GEMMs with half the rows, twice the "
              "Python dispatch, and with two gloo processes twice the real transfers)."
              + (" GPU sections that say 'Not run' need a GPU; none was available for these runs." if not has_gpu
                 else "")
              + " Sections marked (recorded) were measured by hand (on another machine, or against an earlier commit)"
                " and are kept as they were.\n\n")
    Path(args.out).write_text(header + "\n".join(sections))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
