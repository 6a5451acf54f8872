"""``python -m runner generate|bench``: vLLM-style flags over RunnerConfig, SamplingParams and a workload.

Flags default to ``None`` so "not given" is visible: RunnerConfig's own defaults apply, and
``--all2all-backend`` becomes ``auto`` when DP > 1 with expert parallelism. Every bad value — argparse's
or RunnerConfig's validation — exits with code 2 and ``argument --flag: ...``.

Launch modes (vLLM's ``LLM``): in a plain process the job runs over the engine-core processes this process
starts, one per DP rank (``runner/engine/sync_client.py``; ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps one rank
in this process), and this process reports; under
``torchrun`` (``--distributed-executor-backend external_launcher`` asks for it) every process runs the job as
one rank, SPMD, and rank 0 reports.

Failures are one line each, never a traceback unless ``--debug`` (or ``UBATCH_DEBUG=1``): what can be checked
before any rank starts is (the model's config and checkpoint headers, ``--max-model-len`` against the model,
the output paths; exit 2 naming the flag); a failed rank is named, ranks failing alike are reported once
(exit 1); SIGINT/SIGTERM/SIGHUP stop every rank (exit 128 + the signal). A run in which no request succeeded
exits 1, and a results file that cannot be written at the end is reported after the summary (exit 1).
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import random
import sys
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.batch_defaults import UsageContext
from runner.config import RunnerConfig
from runner.core.prompt_checks import prompt_problem
from runner.engine.generation_config import GenerationConfig
from runner.entrypoints.cli_parser import CliParser
from runner.entrypoints.engine_args import (
    add_engine_args,
    add_model_positional,
    config_from_args,
    model_info_or_exit,
    resolve_model_arg,
    with_batch_defaults_from_args,
)
from runner.entrypoints.output_paths import output_path_error
from runner.entrypoints.report import (
    compare_outputs,
    report_bench,
    report_generate,
    request_output_json,
)
from runner.entrypoints.tokenizer_args import tokenizer_dir_or_exit
from runner.sampling_params import SamplingParams, SamplingParamsError

if TYPE_CHECKING:  # the functions that build one import it where they run
    from runner.entrypoints.llm import LLM


DEBUG_ENV = "UBATCH_DEBUG"
DEBUG_HINT = f"(run with --debug or {DEBUG_ENV}=1 for the full traceback)"


# The sampling flags: SamplingParams field -> the CLI's default when neither the flag nor the checkpoint's
# generation_config.json sets it (vLLM's SamplingParams defaults, except temperature: this CLI is greedy unless
# asked, so runs compare token for token).
SAMPLING_FLAG_DEFAULTS: dict[str, Any] = {
    "n": 1, "max_tokens": 16, "min_tokens": 0, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "stop": None, "logprobs": None,
    "ignore_eos": False, "include_stop_str_in_output": False,
}


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (vLLM's SamplingParams; a flag not given takes the model's "
                             "generation_config.json value, else the default shown)")
    add = g.add_argument
    add("--n", type=int, metavar="N", help="samples per prompt (needs --temperature > 0); default: 1")
    add("--max-tokens", type=int, metavar="N", help="most tokens generated per sample; default: 16")
    add("--min-tokens", type=int, metavar="N", help="EOS and stop tokens are held back until this many; default: 0")
    add("--temperature", type=float, metavar="T", help="0 is greedy; default: 0 (greedy: runs compare token for "
        "token; vLLM's SamplingParams default is 1.0)")
    add("--top-p", type=float, metavar="P", help="nucleus sampling: keep the most likely tokens up to this "
        "probability mass; default: 1.0 (off)")
    add("--top-k", type=int, metavar="K", help="keep the K most likely tokens; default: 0 (off)")
    add("--min-p", type=float, metavar="P", help="drop tokens less likely than P times the most likely; "
        "default: 0 (off)")
    add("--presence-penalty", type=float, metavar="X", help="OpenAI's: subtract X from tokens already in the "
        "output; default: 0")
    add("--frequency-penalty", type=float, metavar="X", help="OpenAI's: subtract X times a token's count in the "
        "output; default: 0")
    add("--repetition-penalty", type=float, metavar="X", help="transformers': divide positive (multiply negative) "
        "logits of tokens in the prompt or output by X; default: 1 (off)")
    add("--stop", action="append", metavar="TEXT", help="stop when the text contains TEXT, which is cut from the "
        "output (repeat the flag for several); needs a model with a tokenizer; default: none")
    add("--include-stop-str-in-output", action="store_true", default=None,
        help="keep the stop string in the text (default: off)")
    add("--logprobs", type=int, metavar="N", help="return each sampled token's log-probability and the N most "
        "likely tokens' in --output-json; default: none")
    add("--ignore-eos", action="store_true", default=None, help="keep generating past EOS and the "
        "generation_config.json EOS ids, up to --max-tokens (default: off)")


def _workload_args(p: argparse.ArgumentParser, with_output_json: bool) -> None:
    g = p.add_argument_group("workload")
    add = g.add_argument
    add("--prompt", action="append", metavar="TEXT", help="a text prompt (repeat the flag for several; needs a "
        "model with a tokenizer); default: --num-prompts random token-id prompts")
    add("--prompts-file", metavar="JSONL", help='one {"prompt": str} or {"prompt_token_ids": [int]} per line '
        "(default: --num-prompts random token-id prompts)")
    add("--num-prompts", type=int, default=8, metavar="N", help="random prompts when no --prompts-file (default 8)")
    add("--random-prompt-len", type=int, default=16, metavar="N", help="tokens per random prompt (default 16)")
    add("--random-range-ratio", type=float, default=0.0, metavar="R",
        help="random prompt lengths vary uniformly in [len*(1-R), len*(1+R)] (default 0: all equal)")
    if with_output_json:
        add("--output-json", metavar="PATH", help="write every request in input order: prompt, prompt token ids, "
            "and per sample the text, token ids, finish and stop reason, logprobs (default: none; its "
            "directory must exist)")
    add("--disable-tqdm", action="store_true", help="no progress bar (default: shown when stderr is a TTY)")
    add("--debug", action="store_true", help=f"print the full traceback of an error (also: {DEBUG_ENV}=1; "
        "default: off)")


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="python -m runner", description="ubatch reference engine")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,bench,serve,bench-serve}")
    gen = sub.add_parser("generate", help="generate for a prompt file or random prompts, print a summary")
    bench = sub.add_parser("bench", help="run one workload with DBO off, then on; compare speed (median of "
                           "--bench-repeats runs, with their spread) and outputs (in a half-precision dtype, a "
                           "difference is checked again in float32)")
    for p in (gen, bench):
        add_model_positional(p)
        add_engine_args(p)
        _sampling_args(p)
        _workload_args(p, with_output_json=p is gen)
        p.set_defaults(subparser=p)  # so errors print the subcommand's usage
    bench.add_argument("--output-csv", metavar="PATH", help="write the comparison table as CSV (default: none; its "
                       "directory must exist)")
    bench.add_argument("--bench-repeats", type=int, default=3, metavar="N",
                       help="timed runs of the workload per variant after the warm-up; tok/s is their median and "
                       "the run-to-run spread (max - min) / median is reported (default 3)")
    from runner.entrypoints.benchserve.cli_args import add_bench_serve_args
    from runner.entrypoints.serve import add_serve_args

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the DP ranks (vLLM's `vllm serve`)")
    add_serve_args(serve, functools.partial(add_engine_args, model_required=True))
    serve.set_defaults(subparser=serve)
    bench_serve = sub.add_parser("bench-serve", help="serving throughput and latency as `vllm bench serve` "
                                                     "measures them; --compare dbo: DBO off against on")
    add_bench_serve_args(bench_serve)
    bench_serve.set_defaults(subparser=bench_serve)
    return parser


@dataclass
class Job:
    """Everything a run needs (picklable)."""

    command: str
    cfg: RunnerConfig
    prompts: list[Any]
    sampling: SamplingParams
    disable_tqdm: bool
    repeats: int = 1  # bench: timed runs per variant
    tokenizer: str | None = None  # --tokenizer: a directory to load the tokenizer from instead of the model's
    rank_processes: bool = False  # engine-core processes are started here (engine_processes)
    debug: bool = False  # --debug: the rank processes print their tracebacks


def _read_prompts(path: str) -> list[Any]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read {path!r}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not a text file (byte {e.start} is not UTF-8); expected one JSON object per "
                         "line") from None
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


def random_prompts(num: int, length: int, range_ratio: float, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lo, hi = max(1, round(length * (1 - range_ratio))), max(1, round(length * (1 + range_ratio)))
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(num)]


def _sampling(args: argparse.Namespace, generation: GenerationConfig, parser: argparse.ArgumentParser,
              check_only: bool = False) -> SamplingParams:
    """The flags given, over the checkpoint's defaults, over the CLI's (``SAMPLING_FLAG_DEFAULTS``); a bad value
    exits 2 naming its flag."""
    given = {k: getattr(args, k) for k in SAMPLING_FLAG_DEFAULTS if getattr(args, k, None) is not None}
    values = given if check_only else {**SAMPLING_FLAG_DEFAULTS, **generation.sampling_defaults, **given}
    try:
        return SamplingParams(**values)
    except SamplingParamsError as e:
        parser.error(f"argument --{e.field.replace('_', '-')}: {e}")


def job_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Job:
    """Validate everything before any process starts; errors go through ``parser.error`` (exit 2)."""
    from runner.distributed.launch import torchrun_env_present

    resolve_model_arg(args, parser, required=False)
    if args.prompt and args.prompts_file:
        parser.error("argument --prompt: give prompts with --prompt or --prompts-file, not both")
    cfg = config_from_args(args, parser)
    for flag, value in (("--num-prompts", args.num_prompts), ("--random-prompt-len", args.random_prompt_len)):
        if value < 1:
            parser.error(f"argument {flag}: must be >= 1, got {value}")
    if args.distributed_executor_backend == "external_launcher" and not torchrun_env_present():
        parser.error("argument --distributed-executor-backend: external_launcher runs this command as one rank of "
                     "a world launched outside it: `torchrun --nproc-per-node N -m runner ...`; leave it unset (mp) to "
                     "have this command start the DP ranks")
    if getattr(args, "bench_repeats", 1) < 1:
        parser.error(f"argument --bench-repeats: must be >= 1, got {args.bench_repeats}")
    if not 0.0 <= args.random_range_ratio < 1.0:
        parser.error(f"argument --random-range-ratio: must lie in [0, 1), got {args.random_range_ratio}")
    _sampling(args, GenerationConfig(), parser, check_only=True)  # the flags' own values, before the model
    for flag, path in (("--output-json", getattr(args, "output_json", None)),
                       ("--output-csv", getattr(args, "output_csv", None)), ("--trace-file", cfg.trace_file)):
        problem = output_path_error(path) if path else None
        if problem:
            parser.error(f"argument {flag}: {problem}")
    info = model_info_or_exit(cfg, parser)
    cfg = with_batch_defaults_from_args(cfg, args, info.max_model_len, UsageContext.LLM_CLASS)
    tokenizer = tokenizer_dir_or_exit(args, parser)
    has_tokenizer = tokenizer is not None or info.has_tokenizer
    sampling = _sampling(args, info.generation_config, parser)
    if sampling.stop and not has_tokenizer:
        parser.error(f"argument --stop: model {cfg.model!r} has no tokenizer to find stop strings in the text")
    if args.prompt:
        if not has_tokenizer:
            parser.error(f"argument --prompt: model {cfg.model!r} has no tokenizer to encode text prompts; use "
                         "--prompts-file with {\"prompt_token_ids\": [...]} lines")
        prompts = list(args.prompt)
    elif args.prompts_file:
        try:
            prompts = _read_prompts(args.prompts_file)
        except ValueError as e:
            parser.error(f"argument --prompts-file: {e}")
        text = next((i for i, p in enumerate(prompts) if isinstance(p, str)), None)
        if text is not None and not has_tokenizer:
            parser.error(f"argument --prompts-file: prompt {text} is text but model {cfg.model!r} has no "
                         "tokenizer; use {\"prompt_token_ids\": [...]} lines")
        for i, p in enumerate(prompts):  # token ids are checked here; text prompts by the rank that encodes them
            problem = None if isinstance(p, str) else prompt_problem(p, sampling, info.vocab_size, info.max_model_len)
            if problem:
                parser.error(f"argument --prompts-file: prompt {i}: {problem}")
    else:
        prompts = random_prompts(args.num_prompts, args.random_prompt_len, args.random_range_ratio,
                                 info.vocab_size, cfg.seed)
    return Job(args.command, cfg, prompts, sampling, args.disable_tqdm, getattr(args, "bench_repeats", 1),
               tokenizer, rank_processes=engine_processes(cfg),
               debug=_debug(args))


def engine_processes(cfg: RunnerConfig) -> bool:
    """Whether this process starts engine-core processes for the job: in a plain process (not one of torchrun's
    ranks) with DP > 1, or by default (``VLLM_ENABLE_V1_MULTIPROCESSING``) with one rank."""
    from runner.distributed.launch import torchrun_env_present
    from runner.engine.core_client import multiprocessing_enabled

    return not torchrun_env_present() and (cfg.data_parallel_size > 1 or multiprocessing_enabled())


# ---------------------------------------------------------------------------------------------- the run
def open_llm(job: Job, cfg: RunnerConfig) -> LLM:
    """The engine of one run: over engine-core processes started here when ``job.rank_processes`` (their
    tracebacks on stderr only with ``--debug``), else in this process (the only rank, or one of torchrun's)."""
    from runner.engine.core_client import make_client
    from runner.entrypoints.llm import LLM

    if not job.rank_processes:
        return LLM(cfg, tokenizer=job.tokenizer)
    client = make_client(cfg, rank_tracebacks=job.debug)
    try:
        return LLM(cfg, engine_client=client, tokenizer=job.tokenizer)
    except BaseException:
        client.close()
        raise


def run_job(job: Job) -> dict[str, Any] | None:
    """The job in this process (over its rank processes, or as one rank of a torchrun world). Rank 0 returns the
    results; other torchrun ranks None.

    ``bench``: DBO off, then on, each warmed up and then run ``job.repeats`` times (every run's stats are kept),
    the prefix cache emptied before each run, so that every run computes the same prompts alike.
    When the model computes in a half-precision dtype and the two variants' tokens differ, both run once more
    in float32 with DBO on every step the thresholds allow (:func:`float32_check`): what a comparison in
    bfloat16 cannot tell apart, rounding or a wrong result, float32 does.
    """
    from runner.tracing import result_to_json

    runs = []
    variants = [job.cfg] if job.command == "generate" else [job.cfg.replace(enable_dbo=False, trace_file=None),
                                                             job.cfg.replace(enable_dbo=True)]
    rank = 0
    for cfg in variants:
        llm = open_llm(job, cfg)
        rank = llm.rank
        try:
            if job.command == "bench":  # warm-up: first-call costs must not count against either variant
                llm.generate(job.prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
            repeats = []
            for _ in range(job.repeats if job.command == "bench" else 1):
                if job.command == "bench" and not llm.reset_prefix_cache():  # every timed run computes its prompts
                    raise RuntimeError("the prefix cache could not be reset between bench runs (a request still "
                                       "held KV blocks)")
                outputs = llm.generate(job.prompts, job.sampling, use_tqdm=not job.disable_tqdm)
                stats = llm.last_stats
                assert stats is not None  # every generate() sets it
                repeats.append(asdict(stats))
            has_tokenizer = llm.get_tokenizer() is not None
            assert stats is not None
            dtype, experts_backend = model_facts(llm)
            runs.append({"dbo": cfg.enable_dbo, "has_tokenizer": has_tokenizer,
                         "outputs": [request_output_json(i, o, has_tokenizer) for i, o in enumerate(outputs)],
                         "stats": asdict(stats), "repeats": repeats, "summary": stats.summary(),
                         "trace": result_to_json(llm.last_trace), "dtype": dtype,
                         "experts_backend": experts_backend})
        finally:
            llm.close()
            del llm
            gc.collect()
    result: dict[str, Any] = {"runs": runs}
    if job.command == "bench":
        result["float32_check"] = float32_check(job, runs)
    return result if rank == 0 else None


def model_facts(llm: LLM) -> tuple[str, str]:
    """(the dtype the ranks' model computes in: ``bfloat16``, ``float32``, ...; their experts backend), as the
    rank processes reported them once loaded, or read from this process's model runner."""
    info = llm.engine_client.core_info
    return info.dtype, info.experts_backend


def float32_check(job: Job, runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """DBO off vs on once more in float32 when the timed runs computed in a half-precision dtype and their tokens
    differ (``None`` otherwise; every DP rank decides alike, from the same gathered outputs).

    DBO splits a step's GEMMs into two halves of the rows, and bfloat16 rounds a half-size GEMM differently on
    logits that are nearly flat; float32 does not. DBO runs on every step the thresholds allow (cost model off)
    so the check covers DBO, and ``grouped_mm`` experts (bf16-only GEMMs) are replaced by ``triton``.
    """
    off, on = runs
    if off["dtype"] == "float32" or compare_outputs(off["outputs"], on["outputs"]) is None:
        return None
    experts = "triton" if on["experts_backend"] == "grouped_mm" else job.cfg.experts_backend
    outputs = []
    for dbo in (False, True):
        llm = open_llm(job, job.cfg.replace(dtype="float32", enable_dbo=dbo, dbo_cost_model="off",
                                            experts_backend=experts, trace_file=None))
        try:
            has_tokenizer = llm.get_tokenizer() is not None
            got = llm.generate(job.prompts, job.sampling, use_tqdm=False)
            outputs.append([request_output_json(i, o, has_tokenizer) for i, o in enumerate(got)])
        finally:
            llm.close()
            del llm
            gc.collect()
    return {"dtype": off["dtype"], "experts_backend": experts, "off": outputs[0], "on": outputs[1]}


# ---------------------------------------------------------------------------------------------- parent side
def _debug(args: argparse.Namespace) -> bool:
    return bool(args.debug) or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the subcommand, whose --help lists its flags
        args.subparser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "serve":
        from runner.entrypoints.serve import serve_main

        return serve_main(args, args.subparser)
    if args.command == "bench-serve":
        from runner.entrypoints.benchserve.main import main as bench_serve_main

        return bench_serve_main(args, args.subparser)
    job = job_from_args(args, args.subparser)
    debug = job.debug
    from runner.distributed.launch import (
        LaunchError,
        LaunchInterrupted,
        ParentSignals,
        describe_exception,
        torchrun_env_present,
    )
    from runner.engine.mp_client import RanksDeadError

    under_torchrun = torchrun_env_present() and int(os.environ["WORLD_SIZE"]) > 1
    who = f"[rank {os.environ['RANK']}] " if under_torchrun else ""  # every torchrun process reports its own
    try:
        if job.rank_processes:  # SIGINT/SIGTERM/SIGHUP stop every rank process, then this one (LaunchInterrupted)
            with ParentSignals():
                result = run_job(job)
        else:  # the only rank, or one of torchrun's: LLM joins its world and only rank 0 gets a result
            result = run_job(job)
    except LaunchInterrupted as e:  # SIGINT/SIGTERM/SIGHUP to this process: every rank was stopped first
        print(f"error: {e}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print(f"{who}interrupted", file=sys.stderr)
        return 130
    except RanksDeadError as e:  # a rank failed, fell silent or did not load: named, one line for ranks alike
        print(f"error: {e.cause}", file=sys.stderr)
        if e.tracebacks and not debug:
            print(DEBUG_HINT, file=sys.stderr)
        return 1
    except LaunchError as e:  # the ranks could not be started (a GPU per NCCL rank)
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - in this process: one line, the traceback only when asked for
        if debug:
            traceback.print_exc()
        print(f"{who}error: {describe_exception(e)}", file=sys.stderr)
        if not debug:
            print(DEBUG_HINT, file=sys.stderr)
        return 1
    if result is None:
        return 0
    if job.command == "generate":
        return report_generate(result, args.output_json)
    return report_bench(result, args.output_csv)
