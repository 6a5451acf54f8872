"""What DBO does to serving throughput and latency, measured as users measure it: ``python -m runner bench-serve``.

Three measurements on the 120M-parameter ``bench-qwen3-moe-120m`` (DP=1, the emulated link calibrated so that its
all-to-all time equals the model's compute on a step of the saturation workload, ``--calibrate-link 1``; default
engine flags otherwise: thresholds, the measured cost model):

- ``saturation``: ``--request-rate inf`` with 512 requests in flight (512-token decode steps), DBO off vs on,
  alternating runs, medians of ``--repeats``; each server's timeline recorded for a few seconds says where a step's
  time went;
- ``low load``: ``--max-concurrency 4``: whether DBO costs latency where it cannot help (4-token steps are
  below the decode threshold, so DBO must stay off);
- ``lone request``: the time to first token of one request on an idle server against the same request's
  ``LLM.generate`` time in this process, ``max_tokens=1``.

Prints markdown tables and writes ``benchmarks/results/serve_*.json`` (bench-serve's own JSON) and
``serve_summary.csv``. Usage: ``python benchmarks/bench_serve.py [--repeats 3] [--quick]``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, empty_prefix_cache, write_csv

MODEL = "bench-qwen3-moe-120m"
ENGINE = "--max-num-seqs 512 --max-num-batched-tokens 2048 --max-model-len 512 --device cpu"


# The saturation and low-load runs give the rank one torch thread (its calibration too, so that comm = compute
# holds in the run): on the 2-core machine the other core goes to the API server and the load generator, which
# otherwise take CPU from the rank's compute mid-step. The lone request keeps the default (every core).
RANK_THREADS = "1"
IDLE_S = 0.2  # the lone-request runs' pause before each request


def bench_serve(label: str, args: list[str]) -> dict[str, Any]:
    out = RESULTS_DIR / f"serve_{label}.json"
    cmd = [sys.executable, "-m", "runner", "bench-serve", MODEL, "--ignore-eos", "--output-json", str(out), *args]
    print(f"$ OMP_NUM_THREADS={RANK_THREADS} python {shlex.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": RANK_THREADS})
    if proc.returncode != 0:
        raise RuntimeError(f"bench-serve {label} failed ({proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    link = next((ln for ln in proc.stdout.splitlines() if ln.startswith("calibrated link:")), "")
    data = json.loads(out.read_text())
    data["calibration"] = link
    return data


def medians(data: dict[str, Any], server: str) -> dict[str, float]:
    return next(s[server] for s in data["summary"])


def explain(data: dict[str, Any], server: str) -> str:
    prof = next((r["profile"] for r in data["runs"] if r["server"] == server and r["profile"]), None)
    if not prof or not prof.get("ranks"):
        return "no profile"
    steps, r = max(prof["steps"], 1.0), prof["ranks"][0]
    return (f"{r['wall_ms'] / steps:.1f} ms/step: compute {r['compute_ms'] / steps:.1f}, all-to-all "
            f"{r['comm_ms'] / steps:.1f} of which exposed {r['exposed_ms'] / steps:.1f} ({r['hidden_pct']:.0f}% "
            f"hidden), host {r['host_ms'] / steps:.1f}")


def compare_table(title: str, data: dict[str, Any], rows: list[str]) -> list[dict[str, Any]]:
    off, on = medians(data, "dbo off"), medians(data, "dbo on")
    print(f"\n{title}\n  {data['calibration'] or 'no link calibration'}")
    print(f"  {'':<34}{'DBO off':>11}{'DBO on':>11}{'on/off':>9}")
    out = []
    for name in rows:
        ratio = on[name] / off[name] if off[name] else float("nan")
        print(f"  {name:<34}{off[name]:>11.2f}{on[name]:>11.2f}{ratio:>9.3f}")
        out.append({"section": title, "metric": name, "dbo_off": round(off[name], 3), "dbo_on": round(on[name], 3),
                    "ratio": round(ratio, 4)})
    for server in ("dbo off", "dbo on"):
        print(f"  where the time went, {server}: {explain(data, server)}")
    return out


def lone_request(repeats: int, input_len: int) -> list[dict[str, Any]]:
    """TTFT of one request at a time on an idle server vs ``LLM.generate`` of the same prompt, max_tokens=1."""
    import asyncio

    from runner.entrypoints.benchserve.run import run_once
    from runner.entrypoints.benchserve.server_proc import ServerProcess
    from runner.entrypoints.benchserve.workload import random_requests
    from runner.models.loader import model_config

    vocab = model_config(MODEL).vocab_size
    reqs = random_requests(repeats, input_len, 1, vocab, seed=5)
    from runner import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    ttfts, offline = [], []
    # Served and in-process requests alternate, each after the same idle pause, so that drift in the machine's
    # speed and the wake-up of idle thread pools fall on both sides alike.
    with ServerProcess(MODEL, ENGINE, name="lone") as srv:
        llm = LLM(model=MODEL, max_num_seqs=512, max_num_batched_tokens=2048, max_model_len=512, device="cpu")
        try:
            asyncio.run(run_once(srv.base_url, MODEL, random_requests(2, input_len, 1, vocab, seed=9), [0.0, 0.0]))
            llm.generate([reqs[0].prompt_token_ids], params, use_tqdm=False)  # warm-up
            for r in reqs:
                time.sleep(IDLE_S)  # each request arrives at an idle server
                res = asyncio.run(run_once(srv.base_url, MODEL, [r], [0.0]))
                ttfts.append(res.results[0].ttft_s)
                empty_prefix_cache(llm)  # the warm-up ran the first prompt: its whole blocks would be hits
                time.sleep(IDLE_S)
                t0 = time.perf_counter()
                llm.generate([r.prompt_token_ids], params, use_tqdm=False)
                offline.append(time.perf_counter() - t0)
        finally:
            llm.close()
    served, local = statistics.median(ttfts) * 1e3, statistics.median(offline) * 1e3
    print(f"\nLone request, {input_len}-token prompt, first token (medians of {repeats})")
    print(f"  {'TTFT p50 on an idle server (HTTP, rank process)':<52}{served:>9.2f} ms")
    print(f"  {'LLM.generate of the same request, in-process':<52}{local:>9.2f} ms")
    print(f"  {'ratio':<52}{served / local:>9.3f}")
    return [{"section": "lone request", "metric": "ttft_p50_ms", "dbo_off": round(served, 3), "dbo_on": "",
             "ratio": round(served / local, 4)},
            {"section": "lone request", "metric": "llm_generate_ms", "dbo_off": round(local, 3), "dbo_on": "",
             "ratio": ""}]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="fewer requests (a smoke run, not the report's figures)")
    p.add_argument("--only", nargs="+", choices=["saturation", "low", "lone"], default=["saturation", "low", "lone"])
    args = p.parse_args()
    random.seed(0)
    n_sat, n_low = (256, 16) if args.quick else (1024, 64)
    rows: list[dict[str, Any]] = []
    link = ["--calibrate-link", "1"]  # the saturation run calibrates; the low-load run reuses its link
    if "saturation" in args.only:
        sat = bench_serve("saturation", [
            "--compare", "dbo", *link, "--request-rate", "inf", "--max-concurrency", "512",
            "--num-prompts", str(n_sat), "--input-len", "32", "--output-len", "16", "--repeats", str(args.repeats),
            "--server-args", ENGINE, "--profile", "4", "3"])
        rows += compare_table("Saturation: request rate inf, 512 in flight (512-token decode steps)", sat,
                              ["Output token throughput (tok/s)", "Request throughput (req/s)", "Median TTFT (ms)",
                               "Median TPOT (ms)", "P99 ITL (ms)", "Steps ubatched", "Engine steps"])
        spec = re.search(r"--emulate-link (\S+)", sat["calibration"])
        link = []  # the low-load servers get the same link (or none, if the calibration line is missing)
        engine_low = f"{ENGINE} --emulate-link {spec.group(1)}" if spec else ENGINE
    else:
        engine_low = ENGINE
    if "low" in args.only:
        low = bench_serve("low_load", [
            "--compare", "dbo", *link, "--request-rate", "inf", "--max-concurrency", "4",
            "--num-prompts", str(n_low), "--input-len", "32", "--output-len", "32", "--repeats", str(args.repeats),
            "--server-args", engine_low])
        saturation_link = engine_low.split("--emulate-link ")[-1]
        low["calibration"] = low["calibration"] or f"the saturation run's link: {saturation_link}"
        rows += compare_table("Low load: 4 in flight, default cost model", low,
                              ["P99 ITL (ms)", "Median ITL (ms)", "Median TPOT (ms)", "Median TTFT (ms)",
                               "Output token throughput (tok/s)", "Steps ubatched", "Engine steps"])
    if "lone" in args.only:
        rows += lone_request(5 if args.quick else 15, 32)
    write_csv(rows, RESULTS_DIR / "serve_summary.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
