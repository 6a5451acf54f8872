"""``python -m runner generate|bench``: vLLM-style flags over RunnerConfig, SamplingParams and a workload.

Flags default to ``None`` so "not given" is visible: RunnerConfig's own defaults apply, and
``--all2all-backend`` becomes ``auto`` when DP > 1 with expert parallelism. Every bad value — argparse's
or RunnerConfig's validation — exits with code 2 and ``argument --flag: ...``.

Launch modes: under ``torchrun`` every process runs the job and rank 0 reports; otherwise
``--data-parallel-size N > 1`` spawns N ranks with :func:`runner.launch.launch` and the parent reports.
A dead rank makes the run exit 1 naming it.
"""
from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from runner.config import DBO_COST_MODELS, DBO_DP_RULES, DTYPES, UBATCH_SPLITS, ConfigError, RunnerConfig, \
    all2all_backends, config_fields, \
    experts_backends, make_config
from runner.sampling import SamplingParams
from cudagraph.sizes import parse_cuda_graph_sizes


def _cuda_graph_sizes(text: str) -> list[int]:
    try:
        return parse_cuda_graph_sizes(text)
    except ValueError as e:  # argparse would print only "invalid value" for a plain ValueError
        raise argparse.ArgumentTypeError(str(e)) from None


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (vLLM names)")
    add = g.add_argument
    add("--model", help="built-in tiny model (tiny-qwen3-moe, tiny-deepseek-v3) or a local HF directory")
    add("--dtype", choices=sorted(set(DTYPES) | {"half", "float", "bf16", "fp16", "fp32"}))
    add("--data-parallel-size", "-dp", type=int, metavar="N", help="DP ranks (spawned here unless under torchrun)")
    add("--enable-expert-parallel", action="store_true", default=None, help="spread experts over the DP ranks")
    add("--enable-dbo", action="store_true", default=None, help="dual-batch overlap: run steps as two ubatches")
    add("--dbo-decode-token-threshold", type=int, metavar="N")
    add("--dbo-prefill-token-threshold", type=int, metavar="N")
    add("--ubatch-split", choices=UBATCH_SPLITS)
    add("--dbo-cost-model", choices=DBO_COST_MODELS,
        help="measured: above the thresholds, ubatch only the step sizes where measured steps show DBO is "
             "faster (each side is tried, the loser re-checked now and then); off: the thresholds alone")
    add("--dbo-dp-rule", choices=DBO_DP_RULES,
        help="how DP ranks agree to ubatch: sglang (idle or small ranks never veto; the largest rank decides) "
             "or vllm (all ranks must vote yes)")
    add("--tbo-token-distribution-threshold", type=float, metavar="T")
    add("--all2all-backend", choices=all2all_backends(),
        help="default: auto (torch_ht for prefill steps, torch_ll for decode) with DP > 1 and "
             "--enable-expert-parallel, else none")
    add("--experts-backend", choices=experts_backends())
    add("--emulate-link", metavar="SPEC", help="model the interconnect, e.g. latency_us=50,gbps=10")
    add("--max-num-seqs", type=int, metavar="N")
    add("--max-num-batched-tokens", type=int, metavar="N")
    add("--max-model-len", type=int, metavar="N", help="default: from the model's config")
    add("--block-size", type=int, metavar="N")
    add("--num-kv-blocks", type=int, metavar="N", help="default: sized for --max-num-seqs requests")
    add("--max-dispatch-tokens-per-rank", type=int, metavar="N", help="default: --max-num-batched-tokens")
    add("--enforce-eager", action="store_true", default=None)
    add("--cuda-graph-sizes", type=_cuda_graph_sizes, metavar="SIZES",
        help="decode batch sizes to capture, e.g. '1,2,4,8' (one value N: the ladder up to N); GPU only")
    add("--disable-overlap-schedule", action="store_true", default=None,
        help="run one step at a time (default: the CPU schedules step N+1 while step N runs)")
    add("--disable-consecutive-prefill-overlap", action="store_true", default=None,
        help="a prefill step waits for the previous prefill step's results (time to first token)")
    add("--enable-single-batch-overlap", action="store_true", default=None)
    add("--dist-timeout-s", type=float, metavar="S", help="timeout of every collective (a dead peer's detection)")
    add("--seed", type=int)
    add("--cache-dir", metavar="DIR", help="where built-in models are written; default: $UBATCH_CACHE_DIR or "
        "~/.cache/ubatch")
    add("--trace-file", metavar="PATH", help="write a per-ubatch timeline (Chrome trace JSON, one pid per DP rank) "
        "and print its overlap metrics; with bench, of the DBO-on run")
    defaults = RunnerConfig()
    for action in g._group_actions:  # show RunnerConfig's defaults (argparse's own are None: "not given")
        value = getattr(defaults, action.dest, None)
        if value is not None and action.dest != "all2all_backend" and not isinstance(value, bool):
            action.help = f"{action.help + '; ' if action.help else ''}default: {value}"


def _workload_args(p: argparse.ArgumentParser, with_output_json: bool) -> None:
    g = p.add_argument_group("workload and sampling")
    add = g.add_argument
    add("--prompts-file", metavar="JSONL", help='one {"prompt": str} or {"prompt_token_ids": [int]} per line')
    add("--num-prompts", type=int, default=8, metavar="N", help="random prompts when no --prompts-file (default 8)")
    add("--random-prompt-len", type=int, default=16, metavar="N", help="tokens per random prompt (default 16)")
    add("--random-range-ratio", type=float, default=0.0, metavar="R",
        help="random prompt lengths vary uniformly in [len*(1-R), len*(1+R)] (default 0: all equal)")
    add("--max-tokens", type=int, default=16, metavar="N")
    add("--temperature", type=float, default=0.0)
    add("--top-p", type=float, default=1.0)
    add("--ignore-eos", action="store_true")
    if with_output_json:
        add("--output-json", metavar="PATH", help="write a JSON list of results in input order")
    add("--disable-tqdm", action="store_true", help="no progress bar (it is also off when stderr is not a TTY)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m runner", description="ubatch reference engine")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,bench}")
    gen = sub.add_parser("generate", help="generate for a prompt file or random prompts, print a summary")
    bench = sub.add_parser("bench", help="run one workload with DBO off, then on; compare speed and outputs")
    for p in (gen, bench):
        _engine_args(p)
        _workload_args(p, with_output_json=p is gen)
        p.set_defaults(subparser=p)  # so errors print the subcommand's usage
    bench.add_argument("--output-csv", metavar="PATH", help="write the comparison table as CSV")
    return parser


@dataclass
class Job:
    """Everything a rank needs (picklable: it travels to spawned ranks)."""

    command: str
    cfg: RunnerConfig
    prompts: list[Any]
    sampling: SamplingParams
    disable_tqdm: bool


def _read_prompts(path: str) -> list[Any]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read {path!r}: {e.strerror or e}") from None
    prompts: list[Any] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not ("prompt" in obj or "prompt_token_ids" in obj):
            raise ValueError(f'{path}:{n}: expected {{"prompt": str}} or {{"prompt_token_ids": [int, ...]}}')
        if "prompt_token_ids" in obj:
            ids = obj["prompt_token_ids"]
            if not isinstance(ids, list):
                raise ValueError(f"{path}:{n}: prompt_token_ids must be a list of ints")
            prompts.append(ids)  # bad ids are per-request errors, reported in the results
        elif isinstance(obj["prompt"], str):
            prompts.append(obj["prompt"])
        else:
            raise ValueError(f"{path}:{n}: prompt must be a string")
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def _model_info(cfg: RunnerConfig) -> tuple[int, bool]:
    """(vocab size, has tokenizer.json) without loading weights: checked before any rank starts."""
    from runner.models.loader import resolve_model_path

    path = resolve_model_path(cfg.model, cfg.cache_dir)
    return int(json.loads((path / "config.json").read_text())["vocab_size"]), (path / "tokenizer.json").is_file()


def random_prompts(num: int, length: int, range_ratio: float, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lo, hi = max(1, round(length * (1 - range_ratio))), max(1, round(length * (1 + range_ratio)))
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(num)]


def job_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Job:
    """Validate everything before any process starts; errors go through ``parser.error`` (exit 2)."""
    from runner.launch import torchrun_env_present

    engine = {k: v for k, v in vars(args).items() if k in config_fields() and v is not None}
    if torchrun_env_present():  # under torchrun: one DP rank per process
        world = int(os.environ["WORLD_SIZE"])
        if engine.setdefault("data_parallel_size", world) != world:
            parser.error(f"argument --data-parallel-size: {engine['data_parallel_size']} does not match torchrun's "
                         f"WORLD_SIZE={world} (omit it under torchrun)")
    try:
        cfg = make_config(**engine)
    except ConfigError as e:
        parser.error(f"argument {e.flag}: {e}")
    for flag, value in (("--num-prompts", args.num_prompts), ("--random-prompt-len", args.random_prompt_len)):
        if value < 1:
            parser.error(f"argument {flag}: must be >= 1, got {value}")
    if not 0.0 <= args.random_range_ratio < 1.0:
        parser.error(f"argument --random-range-ratio: must lie in [0, 1), got {args.random_range_ratio}")
    try:
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                  seed=None, ignore_eos=args.ignore_eos)
    except ValueError as e:
        field = str(e).split()[0]
        parser.error(f"argument --{field.replace('_', '-')}: {e}")
    try:
        vocab, has_tokenizer = _model_info(cfg)
    except (OSError, KeyError, ValueError) as e:
        parser.error(f"argument --model: {e}")
    if args.prompts_file:
        try:
            prompts = _read_prompts(args.prompts_file)
        except ValueError as e:
            parser.error(f"argument --prompts-file: {e}")
        text = next((i for i, p in enumerate(prompts) if isinstance(p, str)), None)
        if text is not None and not has_tokenizer:
            parser.error(f"argument --prompts-file: prompt {text} is text but model {cfg.model!r} has no "
                         "tokenizer.json; use {\"prompt_token_ids\": [...]} lines")
    else:
        prompts = random_prompts(args.num_prompts, args.random_prompt_len, args.random_range_ratio, vocab, cfg.seed)
    return Job(args.command, cfg, prompts, sampling, args.disable_tqdm)


# ---------------------------------------------------------------------------------------------- rank side
def run_job(job: Job) -> dict[str, Any] | None:
    """One rank's work (spawned, torchrun or in-process). Rank 0 returns the results; other ranks None."""
    from runner.engine import LLM
    from runner.tracing import result_to_json

    runs = []
    variants = [job.cfg] if job.command == "generate" else [job.cfg.replace(enable_dbo=False, trace_file=None),
                                                             job.cfg.replace(enable_dbo=True)]
    rank = 0
    for cfg in variants:
        llm = LLM(cfg)
        rank = llm.rank
        try:
            if job.command == "bench":  # warm-up: first-call costs must not count against either variant
                llm.generate(job.prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True), disable_progress=True)
            outputs = llm.generate(job.prompts, job.sampling, disable_progress=job.disable_tqdm)
            runs.append({"dbo": cfg.enable_dbo, "outputs": [o.to_json() for o in outputs],
                         "stats": asdict(llm.last_stats), "summary": llm.last_stats.summary(),
                         "trace": result_to_json(llm.last_trace)})
        finally:
            llm.close()
            del llm
            gc.collect()
    return {"runs": runs} if rank == 0 else None


# ---------------------------------------------------------------------------------------------- reporting
NO_UBATCH_HINT = ("note: DBO was on but no step ran ubatched: each DP rank's batch stayed below "
                  "--dbo-decode-token-threshold / --dbo-prefill-token-threshold (or a rank's second ubatch would "
                  "have been empty); lower the thresholds or send more prompts")


def _report_generate(result: dict[str, Any], output_json: str | None) -> None:
    run = result["runs"][0]
    outputs = run["outputs"]
    for o in outputs[:4]:
        shown = " ".join(map(str, o["token_ids"][:12])) + (" ..." if len(o["token_ids"]) > 12 else "")
        text = f" {o['text']!r}" if o.get("text") else ""
        print(f"[{o['index']}] {o['finish_reason']}: {shown}{text}")
    if len(outputs) > 4:
        print(f"... {len(outputs) - 4} more")
    for o in [o for o in outputs if o["error"]][:10]:
        print(f"request {o['index']}: error: {o['error']}", file=sys.stderr)
    if output_json:
        Path(output_json).write_text(json.dumps(outputs, indent=1) + "\n")
    print(run["summary"])
    if run["dbo"] and run["stats"]["num_steps"] and not run["stats"]["num_ubatched_steps"]:
        print(NO_UBATCH_HINT, file=sys.stderr)
    _report_trace(run)


def _report_trace(run: dict[str, Any]) -> None:
    if run.get("trace"):
        print(run["trace"]["report"])


def compare_outputs(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> str | None:
    """None when token outputs are identical, else where they first differ."""
    diffs = [(x["index"], x["token_ids"], y["token_ids"]) for x, y in zip(a, b) if x["token_ids"] != y["token_ids"]]
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} results"
    if not diffs:
        return None
    idx, x, y = diffs[0]
    pos = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    return f"{len(diffs)} of {len(a)} requests differ (first: request {idx} at output token {pos})"


def _report_bench(result: dict[str, Any], output_csv: str | None) -> None:
    off, on = result["runs"]
    rows = [("output tok/s", lambda s: f"{s['num_output_tokens'] / s['elapsed_s']:.1f}" if s["elapsed_s"] else "0"),
            ("total time (s)", lambda s: f"{s['elapsed_s']:.3f}"),
            ("output tokens", lambda s: str(s["num_output_tokens"])),
            ("steps", lambda s: str(s["num_steps"])),
            ("ubatched steps", lambda s: str(s["num_ubatched_steps"]))]
    print(f"{'':<16}{'DBO off':>12}{'DBO on':>12}")
    for name, fmt in rows:
        print(f"{name:<16}{fmt(off['stats']):>12}{fmt(on['stats']):>12}")
    diff = compare_outputs(off["outputs"], on["outputs"])
    verdict = f"identical ({len(on['outputs'])} requests)" if diff is None else f"DIFFERENT: {diff}"
    print(f"token outputs DBO off vs on: {verdict}")
    if on["stats"]["num_steps"] and not on["stats"]["num_ubatched_steps"]:
        print(NO_UBATCH_HINT, file=sys.stderr)
    _report_trace(on)
    if output_csv:
        with open(output_csv, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["dbo", "output_tok_per_s", "total_time_s", "output_tokens", "steps", "ubatched_steps",
                        "outputs_identical"])
            for run in (off, on):
                s = run["stats"]
                w.writerow([run["dbo"], round(s["num_output_tokens"] / s["elapsed_s"], 3) if s["elapsed_s"] else 0,
                            round(s["elapsed_s"], 4), s["num_output_tokens"], s["num_steps"],
                            s["num_ubatched_steps"], diff is None])


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    job = job_from_args(args, args.subparser)
    from runner.launch import LaunchError, launch, torchrun_env_present

    try:
        if torchrun_env_present() and int(os.environ["WORLD_SIZE"]) > 1:
            result = run_job(job)  # LLM joins the torchrun world; only rank 0 gets a result
        elif job.cfg.data_parallel_size > 1:
            result = launch(run_job, job.cfg.data_parallel_size, args=(job,), timeout_s=job.cfg.dist_timeout_s)[0]
        else:
            result = run_job(job)
    except LaunchError as e:  # a rank died or could not start: name it, no parent traceback
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    if result is None:
        return 0
    if job.command == "generate":
        _report_generate(result, args.output_json)
    else:
        _report_bench(result, args.output_csv)
    return 0
