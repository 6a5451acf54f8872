"""``python -m runner bench-serve``'s flags, apart from the benchmark itself so that building the CLI's parser
imports no HTTP client (the base install runs every other subcommand without the ``serve`` extra)."""
from __future__ import annotations

import argparse
import math

from runner.entrypoints.benchserve.vllm_result import (
    DEFAULT_METRIC_PERCENTILES,
    DEFAULT_PERCENTILE_METRICS,
    PERCENTILE_METRICS,
)


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    add("model", nargs="?", help="model to serve and to draw prompt token ids for (also --model)")
    add("--model", dest="model_flag", metavar="MODEL", help="same as the positional MODEL")
    add("--base-url", help="benchmark a running server (e.g. http://127.0.0.1:8000) instead of starting one")
    add("--served-model-name", help="model name in requests (default: MODEL)")
    add("--api-key", help="bearer token for a server started with --api-key")
    add("--server-args", default="", metavar="ARGS",
        help="flags for the `python -m runner serve` this starts, as one string (e.g. '-dp 2 "
             "--enable-expert-parallel --max-num-seqs 512'); default: none")
    add("--compare", choices=["dbo", "prefix-caching"],
        help="dbo: run the workload against a server without and one with --enable-dbo, alternating, and print "
             "both with their ratio; prefix-caching: the same with --no-enable-prefix-caching and "
             "--enable-prefix-caching. Every server this starts has its prefix cache reset (POST "
             "/reset_prefix_cache) before every run, so that each run starts cold")
    add("--repeats", type=int, default=1, metavar="N", help="runs per server and rate; medians are reported "
                                                            "(default 1)")
    add("--num-prompts", type=int, default=1000, metavar="N", help="requests per run (default 1000)")
    add("--dataset-name", choices=["random", "prefix_repetition"], default="random",
        help="random: random token ids (vLLM's random dataset); prefix_repetition: a few random prefixes, each "
             "followed by random suffixes (vLLM's; --prefix-repetition-*) (default random)")
    add("--random-input-len", type=int, default=1024, metavar="N", help="prompt tokens per request after the "
        "prefix (default 1024)")
    add("--random-output-len", type=int, default=128, metavar="N", help="tokens asked for per request; fewer when "
        "the model ends on EOS, unless --ignore-eos (default 128)")
    add("--random-range-ratio", type=float, default=0.0, metavar="R",
        help="input and output lengths vary uniformly in [len*(1-R), len*(1+R)] (default 0)")
    add("--random-prefix-len", type=int, default=0, metavar="N",
        help="the same N random tokens first in every prompt (default 0)")
    add("--prefix-repetition-prefix-len", type=int, default=256, metavar="N",
        help="prefix_repetition: tokens of each shared prefix (default 256)")
    add("--prefix-repetition-suffix-len", type=int, default=256, metavar="N",
        help="prefix_repetition: random tokens after the prefix in each prompt (default 256)")
    add("--prefix-repetition-num-prefixes", type=int, default=10, metavar="N",
        help="prefix_repetition: distinct prefixes; --num-prompts must be a multiple of it (default 10)")
    add("--prefix-repetition-output-len", type=int, default=128, metavar="N",
        help="prefix_repetition: tokens asked for per request (default 128)")
    add("--input-len", type=int, metavar="N", help="sets --random-input-len (vLLM's general flag)")
    add("--output-len", type=int, metavar="N", help="sets --random-output-len (vLLM's general flag)")
    add("--ignore-eos", action="store_true", help="ask the server to ignore EOS, so every request generates its "
        "whole output length (default: EOS ends a request)")
    add("--backend", choices=["openai", "vllm"], default="openai",
        help="the API: both send streamed /v1/completions requests (default openai)")
    add("--label", help="prefix of the --save-result file name (default: --backend)")
    add("--percentile-metrics", metavar="LIST",
        help=f"comma-separated metrics to report percentiles of: {', '.join(PERCENTILE_METRICS)} "
             f"(default {DEFAULT_PERCENTILE_METRICS})")
    add("--metric-percentiles", default=DEFAULT_METRIC_PERCENTILES, metavar="LIST",
        help=f"comma-separated percentiles of those metrics, e.g. 50,90,99 (default {DEFAULT_METRIC_PERCENTILES})")
    add("--save-result", action="store_true", help="save each run's result as vLLM's JSON in --result-dir")
    add("--save-detailed", action="store_true", help="with --save-result: also the per-request lists (input_lens, "
        "output_lens, ttfts, itls, generated_texts, errors, ...)")
    add("--result-dir", metavar="DIR", help="where --save-result writes (created if missing; default: the "
        "current directory)")
    add("--result-filename", metavar="NAME", help="the --save-result file name, for a single run (default: "
        "{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json)")
    add("--server-log-dir", metavar="DIR", help="keep each started server's log in DIR (default: a temporary "
        "file, removed when the servers exited cleanly, kept and named when one failed)")
    add("--request-rate", type=float, default=math.inf, metavar="RPS",
        help="requests per second, Poisson arrivals; inf sends all at once (default inf)")
    add("--request-rates", type=float, nargs="+", metavar="RPS",
        help="a sweep of request rates (plots throughput against p99 ITL with --plot)")
    add("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps; 1 = Poisson (default 1)")
    add("--max-concurrency", type=int, metavar="N", help="at most N requests in flight (default: no cap)")
    add("--seed", type=int, default=0, help="seed of the prompts and arrival times (default 0)")
    add("--calibrate-link", type=float, metavar="R",
        help="give the servers an --emulate-link whose all-to-all time is R x the model's measured compute on "
             "a step of this workload's shape (offline, DP=1, before the servers start)")
    add("--profile", type=float, nargs=2, metavar=("DELAY_S", "DURATION_S"),
        help="record each server's timeline for DURATION_S seconds, DELAY_S seconds into each first run, and say "
             "where the step time went (compute, exposed all-to-all, host time)")
    add("--output-json", metavar="PATH", help="write every run's metrics (and profiles) as JSON")
    add("--output-csv", metavar="PATH", help="write one CSV row per run")
    add("--plot", metavar="PATH", help="PNG of output throughput against p99 ITL over the request rates")
    add("--startup-timeout", type=float, default=600.0, metavar="S",
        help="how long a started server may take to answer /health (default 600)")
