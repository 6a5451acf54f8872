"""``python -m runner bench-serve``: arguments, servers, the runs, and what is printed and written.

Without ``--base-url`` it starts ``python -m runner serve MODEL <--server-args>`` itself (two servers with
``--compare dbo``: one without ``--enable-dbo`` and one with it; ``--compare prefix-caching``: one with
``--no-enable-prefix-caching`` and one with ``--enable-prefix-caching``; both up for the whole run so that their
runs alternate, the idle one using no CPU meanwhile), each one's prefix cache emptied before every run.
``--calibrate-link R`` first measures, offline, the model's compute and all-to-all bytes on a step of the
benchmark's shape and gives both servers an ``--emulate-link`` whose time is ``R`` x that compute (comm = compute
at R = 1), the setting the DBO goals are stated for.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from runner.entrypoints.benchserve.metrics import BenchmarkMetrics
from runner.entrypoints.benchserve.run import ProfileWindow, RunResult, reset_prefix_cache, run_once
from runner.entrypoints.benchserve.server_proc import ServerProcess
from runner.entrypoints.benchserve.vllm_result import (
    DEFAULT_PERCENTILE_METRICS,
    RunSettings,
    parse_metric_percentiles,
    parse_percentile_metrics,
    result_filename,
    vllm_result,
)
from runner.entrypoints.benchserve.workload import (
    BenchRequest,
    arrival_offsets,
    prefix_repetition_requests,
    random_requests,
)

# --compare: each side's label and the serve flags it adds
COMPARED = {"dbo": (("dbo off", ""), ("dbo on", " --enable-dbo")),
            "prefix-caching": (("caching off", " --no-enable-prefix-caching"),
                               ("caching on", " --enable-prefix-caching"))}


def _check_workload_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """vLLM's general ``--input-len``/``--output-len`` set the random dataset's; every count in range, the
    percentile flags parsed, a single run for ``--result-filename``, the ``--result-dir`` made: exit 2 otherwise."""
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.output_len
    for flag, value, least in (("--num-prompts", args.num_prompts, 1), ("--random-input-len", args.random_input_len, 1),
                               ("--random-output-len", args.random_output_len, 1),
                               ("--random-prefix-len", args.random_prefix_len, 0), ("--repeats", args.repeats, 1),
                               ("--prefix-repetition-prefix-len", args.prefix_repetition_prefix_len, 0),
                               ("--prefix-repetition-suffix-len", args.prefix_repetition_suffix_len, 0),
                               ("--prefix-repetition-num-prefixes", args.prefix_repetition_num_prefixes, 1),
                               ("--prefix-repetition-output-len", args.prefix_repetition_output_len, 1)):
        if value < least:
            parser.error(f"argument {flag}: must be >= {least}, got {value}")
    if args.dataset_name == "prefix_repetition":
        if args.num_prompts % args.prefix_repetition_num_prefixes:
            parser.error(f"argument --num-prompts: must be a multiple of --prefix-repetition-num-prefixes "
                         f"({args.prefix_repetition_num_prefixes}) with --dataset-name prefix_repetition, got "
                         f"{args.num_prompts}")
        if args.prefix_repetition_prefix_len + args.prefix_repetition_suffix_len < 1:
            parser.error("argument --prefix-repetition-suffix-len: prompts of no tokens (the prefix and the suffix "
                         "are both 0 long)")
    if not 0.0 <= args.random_range_ratio < 1.0:
        parser.error(f"argument --random-range-ratio: must lie in [0, 1), got {args.random_range_ratio}")
    try:
        args.percentile_metrics = parse_percentile_metrics(args.percentile_metrics or DEFAULT_PERCENTILE_METRICS)
    except ValueError as e:
        parser.error(f"argument --percentile-metrics: {e}")
    try:
        args.metric_percentiles = parse_metric_percentiles(args.metric_percentiles)
    except ValueError as e:
        parser.error(f"argument --metric-percentiles: {e}")
    runs = len(args.request_rates or [args.request_rate]) * args.repeats * (2 if args.compare else 1)
    if args.result_filename and runs > 1:
        parser.error(f"argument --result-filename: this benchmark makes {runs} runs, each saved to its own file; "
                     "drop --result-filename (the names then say which run) or --result-dir alone")
    for flag, folder in (("--result-dir", args.result_dir if args.save_result else None),
                         ("--server-log-dir", args.server_log_dir)):
        if folder:
            try:
                Path(folder).mkdir(parents=True, exist_ok=True)
            except OSError as e:
                parser.error(f"argument {flag}: cannot create {folder!r}: {e.strerror or e}")


def _check_output_paths(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for flag, path in (("--output-json", args.output_json), ("--output-csv", args.output_csv), ("--plot", args.plot)):
        if path and not Path(path).expanduser().resolve().parent.is_dir():
            parser.error(f"argument {flag}: the directory of {path!r} does not exist")


def _vocab_size(model: str) -> int:
    from runner.models.loader import model_config

    return model_config(model).vocab_size


# Above this share of a core, the load generator itself may be the bottleneck (it is one Python event loop).
CLIENT_CPU_WARN = 0.8


def print_metrics(title: str, m: BenchmarkMetrics, result: dict[str, Any], metrics: list[str],
                  percentiles: list[float]) -> None:
    print(f"{'=' * 18} {title} {'=' * max(1, 30 - len(title))}")
    rows = [("Successful requests", m.completed), ("Failed requests", m.failed),
            ("Benchmark duration (s)", f"{m.duration_s:.2f}"), ("Total input tokens", m.total_input_tokens),
            ("Total generated tokens", m.total_output_tokens),
            ("Request throughput (req/s)", f"{m.request_throughput:.2f}"),
            ("Input token throughput (tok/s)", f"{m.input_throughput:.2f}"),
            ("Output token throughput (tok/s)", f"{m.output_throughput:.2f}")]
    if m.engine_steps:
        rows.append(("Steps ubatched (DBO)", f"{m.ubatched_steps:.0f}/{m.engine_steps:.0f}"))
    if m.prompt_tokens_computed is not None:
        rows.append(("Prompt tokens computed", f"{m.prompt_tokens_computed:.0f}"))
    if m.prefix_cache_hit_rate is not None:
        rows.append(("Prefix cache hit rate (%)", f"{100 * m.prefix_cache_hit_rate:.1f}"))
    if m.client_cpu_share is not None:
        rows.append(("Benchmark client CPU (% of a core)", f"{100 * m.client_cpu_share:.0f}"))
    for name in metrics:  # --percentile-metrics at --metric-percentiles, as vLLM prints them
        label = name.upper()
        rows += [(f"Mean {label} (ms)", f"{result[f'mean_{name}_ms']:.2f}"),
                 (f"Median {label} (ms)", f"{result[f'median_{name}_ms']:.2f}")]
        for p in percentiles:
            word = str(int(p)) if int(p) == p else str(p)
            rows.append((f"P{word} {label} (ms)", f"{result[f'p{word}_{name}_ms']:.2f}"))
    for label, value in rows:
        print(f"{label:<40}{value:>14}")
    for err in m.errors:
        print(f"  error: {err}")
    if m.client_cpu_share is not None and m.client_cpu_share > CLIENT_CPU_WARN:
        print(f"warning: the benchmark client used {100 * m.client_cpu_share:.0f}% of a core: it may be what limits "
              "the measured rates (run it on another machine, or lower --max-concurrency)")


COMPARE_ROWS = (("Output token throughput (tok/s)", lambda m: m.output_throughput),
                ("Request throughput (req/s)", lambda m: m.request_throughput),
                ("Median TTFT (ms)", lambda m: m.ttft_ms["median"]), ("P99 TTFT (ms)", lambda m: m.ttft_ms["p99"]),
                ("Median TPOT (ms)", lambda m: m.tpot_ms["median"]), ("P99 ITL (ms)", lambda m: m.itl_ms["p99"]),
                ("Median ITL (ms)", lambda m: m.itl_ms["median"]), ("Median E2E (ms)", lambda m: m.e2el_ms["median"]),
                ("Steps ubatched", lambda m: m.ubatched_steps or 0.0),
                ("Engine steps", lambda m: m.engine_steps or 0.0),
                ("Prompt tokens computed", lambda m: m.prompt_tokens_computed or 0.0),
                ("Prefix cache hit rate (%)", lambda m: 100 * (m.prefix_cache_hit_rate or 0.0)))


def median_metrics(runs: list[BenchmarkMetrics]) -> dict[str, float]:
    return {name: statistics.median(fn(m) for m in runs) for name, fn in COMPARE_ROWS}


def print_comparison(rate: float, labels: list[str], off: dict[str, float], on: dict[str, float],
                     repeats: int) -> None:
    print(f"\n{'=' * 12} {labels[0]} vs {labels[1]}, request rate {rate:g}, medians of {repeats} {'=' * 12}")
    print(f"{'':<36}{labels[0]:>12}{labels[1]:>12}{'on/off':>9}")
    for name, _ in COMPARE_ROWS:
        ratio = on[name] / off[name] if off[name] else float("nan")
        print(f"{name:<36}{off[name]:>12.2f}{on[name]:>12.2f}{ratio:>9.3f}")


def explain(profile: dict[str, Any] | None) -> str:
    """Per step, from a server's profile window: where its time went."""
    if not profile or not profile.get("ranks"):
        return "no profile recorded"
    steps = max(profile.get("steps", 0.0), 1.0)
    r = profile["ranks"][0]
    return (f"per step over {steps:.0f} steps (rank 0): wall {r['wall_ms'] / steps:.2f} ms, compute "
            f"{r['compute_ms'] / steps:.2f} ms, all-to-all {r['comm_ms'] / steps:.2f} ms of which exposed "
            f"{r['exposed_ms'] / steps:.2f} ms ({r['hidden_pct']:.0f}% hidden), host (schedule, vote, inputs, "
            f"sampling, outputs) {r['host_ms'] / steps:.2f} ms")


def calibrate(model: str, server_args: str, input_len: int, num_seqs: int, ratio: float) -> str:
    """An ``--emulate-link`` spec: the model's all-to-all over ``num_seqs`` requests of ``input_len`` tokens
    decoding 8 tokens, offline without DBO, timed ``ratio`` x its compute (see the module docstring)."""
    import random
    import tempfile

    from runner.config import config_fields, make_config
    from runner.entrypoints.engine_args import add_engine_args
    from runner.entrypoints.llm import LLM
    from runner.sampling_params import SamplingParams
    from runner.worker.model_runner import ModelRunner
    from ubatch.modular_moe.prepare_finalize.emulated_link import LinkSpec

    engine_parser = argparse.ArgumentParser(prog="bench-serve --server-args", add_help=False)
    add_engine_args(engine_parser)
    ns, _ = engine_parser.parse_known_args(["--model", model, *shlex.split(server_args)])  # server flags: ignored
    engine = {k: v for k, v in vars(ns).items() if k in config_fields() and v is not None}
    engine.update(model=model, data_parallel_size=1, enable_expert_parallel=False, all2all_backend=None,
                  enable_dbo=False, emulate_link="latency_us=0,gbps=1000")
    cfg = make_config(**engine)
    llm = LLM(cfg, runner=ModelRunner(cfg))  # in this process: the link's counters are read here
    try:
        link = llm.model_runner.model.moe_runtime.link()
        assert link is not None  # emulate_link is set above
        rng = random.Random(7)
        prompts = [[rng.randrange(llm.runner.vocab_size) for _ in range(input_len)] for _ in range(num_seqs)]
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
        computes = []
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(3):
                if not llm.reset_prefix_cache():  # every run computes its prompts (they ran before)
                    raise RuntimeError("the prefix cache could not be reset between calibration runs")
                nbytes, transfers = link.total_bytes, link.num_transfers
                llm.cfg = llm.cfg.replace(trace_file=str(Path(tmp) / "calib.json"))
                llm.generate(prompts, params, use_tqdm=False)
                computes.append(llm.last_trace.metrics[0].compute_us * 1e-6)
                nbytes, transfers = link.total_bytes - nbytes, link.num_transfers - transfers
        compute = statistics.median(computes)
        spec = LinkSpec.calibrated(nbytes, transfers, ratio * compute).to_text()
        print(f"calibrated link: compute {compute * 1e3:.1f} ms for {transfers} transfers of {nbytes / 1e6:.1f} MB in "
              f"all -> --emulate-link {spec} (comm = {ratio:g} x compute)")
        return spec
    finally:
        llm.close()


def _run_label(args: argparse.Namespace, server: str, repeat: int, num_servers: int) -> str | None:
    """The result's ``label``: ``--label`` (None: vLLM's file name uses --backend), plus the server with
    --compare and the run with --repeats, so each run's file has its own name."""
    parts = [args.label] if args.label else ([args.backend] if num_servers > 1 or args.repeats > 1 else [])
    if num_servers > 1:
        parts.append(server.replace(" ", "-"))
    if args.repeats > 1:
        parts.append(f"run{repeat + 1}")
    return "-".join(parts) or None


def _save_result(args: argparse.Namespace, settings: RunSettings, result: dict[str, Any]) -> None:
    """vLLM's ``--save-result``: the run's JSON in ``--result-dir`` (its directory was made at the start)."""
    path = Path(args.result_dir or ".") / (args.result_filename or result_filename(settings, result["date"]))
    path.write_text(json.dumps(result))
    print(f"saved the result to {path}")


def workload(args: argparse.Namespace, vocab: int) -> list[BenchRequest]:
    """The requests of ``--dataset-name``."""
    if args.dataset_name == "prefix_repetition":
        return prefix_repetition_requests(args.num_prompts, args.prefix_repetition_prefix_len,
                                          args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
                                          args.prefix_repetition_output_len, vocab, seed=args.seed)
    return random_requests(args.num_prompts, args.random_input_len, args.random_output_len, vocab,
                           range_ratio=args.random_range_ratio, seed=args.seed, prefix_len=args.random_prefix_len)


async def _bench(args: argparse.Namespace, servers: list[tuple[str, str]], model: str, model_name: str,
                 vocab: int) -> list[dict[str, Any]]:
    """Every (rate, repeat, server) run; servers alternate inside each repeat. On the servers it started (no
    ``--base-url``) each run starts from an empty prefix cache: every rate and repeat sends the same prompts, whose
    whole blocks would otherwise be hits from the second run on."""
    rates = args.request_rates or [args.request_rate]
    requests = workload(args, vocab)
    warmup = random_requests(min(8, args.num_prompts), args.random_input_len, 4, vocab, seed=args.seed + 99)
    for _, url in servers:
        await run_once(url, model_name, warmup, [0.0] * len(warmup), api_key=args.api_key, ignore_eos=True)
    records: list[dict[str, Any]] = []
    for rate in rates:
        offsets = arrival_offsets(len(requests), rate, burstiness=args.burstiness, seed=args.seed)
        for rep in range(args.repeats):
            for label, url in servers:
                profile = ProfileWindow(*args.profile) if args.profile and rep == 0 else None
                if not args.base_url:
                    await asyncio.to_thread(reset_prefix_cache, url, args.api_key)
                res: RunResult = await run_once(url, model_name, requests, offsets,
                                                max_concurrency=args.max_concurrency, api_key=args.api_key,
                                                profile=profile, ignore_eos=args.ignore_eos)
                settings = RunSettings(args.backend, _run_label(args, label, rep, len(servers)), model, model,
                                       args.num_prompts, rate, args.burstiness, args.max_concurrency)
                result = vllm_result(settings, res.results, res.duration_s, args.percentile_metrics,
                                     args.metric_percentiles, detailed=args.save_detailed)
                print_metrics(f"{label}, rate {rate:g}, run {rep + 1}", res.metrics, result, args.percentile_metrics,
                              args.metric_percentiles)
                if res.profile is not None:
                    print(f"  where the time went: {explain(res.profile)}")
                if args.save_result:
                    _save_result(args, settings, result)
                records.append({"server": label, "request_rate": rate, "repeat": rep, **res.metrics.flat(),
                                "metrics": res.metrics.to_dict(), "profile": res.profile})
    return records


def _summarise(args: argparse.Namespace, records: list[dict[str, Any]], labels: list[str]) -> list[dict[str, Any]]:
    summary = []
    for rate in args.request_rates or [args.request_rate]:
        per = {label: median_metrics([BenchmarkMetrics(**_metrics_kwargs(r["metrics"])) for r in records
                                      if r["server"] == label and r["request_rate"] == rate]) for label in labels}
        summary.append({"request_rate": rate, **{label: per[label] for label in labels}})
        if len(labels) == 2:
            print_comparison(rate, labels, per[labels[0]], per[labels[1]], args.repeats)
            for label in labels:
                prof = next((r["profile"] for r in records if r["server"] == label and r["request_rate"] == rate
                             and r["profile"]), None)
                if prof is not None:
                    print(f"  {label}: {explain(prof)}")
    return summary


def _metrics_kwargs(d: dict[str, Any]) -> dict[str, Any]:
    return {**d, "errors": tuple(d.get("errors", ()))}


def _plot(path: str, summary: list[dict[str, Any]], labels: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label in labels:
        xs = [s[label]["P99 ITL (ms)"] for s in summary]
        ys = [s[label]["Output token throughput (tok/s)"] for s in summary]
        ax.plot(xs, ys, marker="o", label=label)
        for s, x, y in zip(summary, xs, ys, strict=True):
            ax.annotate(f"{s['request_rate']:g} rps", (x, y), fontsize=7)
    ax.set_xlabel("p99 inter-token latency (ms)")
    ax.set_ylabel("output tokens/s")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    model = args.model or args.model_flag
    if model is None:
        parser.error("the following arguments are required: MODEL (or --model)")
    if args.model and args.model_flag and args.model != args.model_flag:
        parser.error(f"argument --model: {args.model_flag!r} differs from the positional MODEL {args.model!r}")
    _check_workload_args(args, parser)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error(f"argument --max-concurrency: must be >= 1, got {args.max_concurrency}")
    if args.base_url and (args.compare or args.calibrate_link is not None):
        parser.error("argument --base-url: --compare and --calibrate-link start their own servers; drop --base-url")
    _check_output_paths(args, parser)
    model_name = args.served_model_name or model
    vocab = _vocab_size(model)
    server_args = args.server_args
    if args.calibrate_link is not None:
        seqs = args.max_concurrency or args.num_prompts
        link = calibrate(model, server_args, args.random_input_len, seqs, args.calibrate_link)
        server_args += f" --emulate-link {link}"
    if args.served_model_name:
        server_args += f" --served-model-name {shlex.quote(args.served_model_name)}"
    if args.api_key:
        server_args += f" --api-key {shlex.quote(args.api_key)}"
    if args.profile:  # the servers it starts record into private directories of their own
        server_args += f" --profile-dir {shlex.quote(tempfile.gettempdir())}"
    procs: list[ServerProcess] = []
    try:
        if args.base_url:
            servers = [("server", args.base_url.rstrip("/"))]
        else:
            variants = [(label, server_args + extra) for label, extra in COMPARED[args.compare]] if args.compare \
                else [("server", server_args)]
            for label, extra in variants:
                proc = ServerProcess(model, extra, startup_timeout_s=args.startup_timeout, name=label,
                                     log_dir=args.server_log_dir)
                procs.append(proc)
                print(f"{label}: log at {proc.log_path}", file=sys.stderr, flush=True)
                proc.start()
            servers = [(p.name, p.base_url) for p in procs]
        records = asyncio.run(_bench(args, servers, model, model_name, vocab))
    finally:
        codes = [(p.name, p.stop()) for p in procs]
        _finish_logs(procs, codes, keep=args.server_log_dir is not None)
    bad = [(name, code) for name, code in codes if code not in (0, None)]
    labels = [label for label, _ in servers]
    summary = _summarise(args, records, labels)
    outputs_ok = True
    for flag, path, write in (("--output-json", args.output_json,
                               lambda p: Path(p).write_text(json.dumps({"args": vars(args), "runs": records,
                                                                        "summary": summary}, indent=1, default=str))),
                              ("--output-csv", args.output_csv, lambda p: _write_csv(p, records)),
                              ("--plot", args.plot, lambda p: _plot(p, summary, labels))):
        if not path:
            continue
        try:
            write(path)
        except OSError as e:
            outputs_ok = False
            print(f"error: argument {flag}: cannot write {path!r}: {e.strerror or e}", file=sys.stderr)
    for name, code in bad:
        print(f"error: the {name} server exited with code {code} on SIGTERM (expected 0)", file=sys.stderr)
    failed = sum(r["failed"] for r in records)
    return 1 if bad or not outputs_ok or failed == sum(r["completed"] + r["failed"] for r in records) else 0


def _finish_logs(procs: list[ServerProcess], codes: list[tuple[str, int | None]], keep: bool) -> None:
    """Keep the servers' logs in --server-log-dir, or when a server did not exit cleanly (to read why); remove
    them otherwise. Either way say what happened to each."""
    failed = any(code not in (0, None) for _, code in codes)
    for proc in procs:
        kept = proc.finish_log(keep or failed)
        print(f"{proc.name}: log {'kept at ' + kept if kept else 'removed (' + proc.log_path + ')'}", file=sys.stderr)


def _write_csv(path: str, records: list[dict[str, Any]]) -> None:
    import csv

    rows = [{k: v for k, v in r.items() if k not in ("metrics", "profile")} for r in records]
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")



