"""The check's parts, in the order they run (most important figures first), and what each reads back.

Every part runs its work in a subprocess (``subproc.run_logged``) that writes JSON, so a crash, a hang or a
CUDA error in one part cannot take the check down, and a part killed at its timeout still leaves what it had
written. Budgets are caps for an H100; the check's own deadline (7 minutes by default) bounds their sum.
``Context.options``: ``tests`` (gpu|full), ``serve_seconds``, and extra arguments: ``model_args`` for
``model_prep``, ``engine_args`` for ``engine_run``, ``engine_link`` and ``engine_fp8``, ``fp8_args`` for
``engine_fp8`` alone (the CPU tests run these parts on the tiny model this way).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_gpu import MODEL as BENCH_MODEL
from gpucheck.outcomes import count_tests
from gpucheck.schedule import Context, Part
from gpucheck.subproc import ProcResult, run_logged

# The GPU-sensitive test files beyond the Makefile's SANITIZED_TESTS, by what they exercise on a GPU.
GPU_TEST_FILES = (
    "tests/test_attention.py", "tests/test_attention_backends.py", "tests/test_triton_paged_decode.py",  # attention
    "tests/test_experts.py", "tests/test_grouped_mm_experts.py",  # experts
    "tests/test_graph_memory.py", "tests/test_memory_budget.py", "tests/test_cudagraph_cuda.py",  # graphs, memory
    "tests/test_trace.py", "tests/test_trace_cuda_events.py",  # traces (CUDA-event spans)
    "tests/test_no_host_sync.py", "tests/test_device.py",  # sync-free eager step, device choice
    "tests/test_overlap_loop.py", "tests/test_wrapper.py",  # the forward thread, ubatch threads (one CPU stream)
)
SERVE_SECONDS = 60
SERVE_PROMPTS = 512  # per server: two waves of 256 sequences, 128 steps each
# pytest-xdist workers for the gpu tests (at most half the CPU cores). In one process they reached 86 % in 150 s
# on an H200 (about 175 s in all), past the part's budget; the GPU machines' image has pytest-xdist. Files stay
# whole on one worker (``--dist loadfile``): a module's fixtures (a runner, a model) are built once. Each worker
# is a process of its own on the one GPU, so a test reads only its own process's memory counters
# (``torch.cuda.memory_allocated``).
TEST_WORKERS = 6


def sanitized_tests(makefile: str) -> list[str]:
    """The files of the Makefile's ``SANITIZED_TESTS ?= ...`` (continuation lines joined)."""
    m = re.search(r"^SANITIZED_TESTS\s*\?=((?:.*\\\n)*.*)$", makefile, re.M)
    if m is None:
        raise ValueError("the Makefile has no 'SANITIZED_TESTS ?=' line")
    return m.group(1).replace("\\\n", " ").split()


def gpu_test_files(repo: Path) -> list[str]:
    files = sanitized_tests((repo / "Makefile").read_text())
    return files + [f for f in GPU_TEST_FILES if f not in files]


def child_env(ctx: Context, **extra: str) -> dict[str, str]:
    """The environment of a part's subprocess: the repo and benchmarks/ importable, output unbuffered."""
    env = dict(os.environ)
    paths = [str(ctx.repo), str(ctx.repo / "benchmarks")] + [p for p in env.get("PYTHONPATH", "").split(":") if p]
    env.update(PYTHONPATH=":".join(paths), PYTHONUNBUFFERED="1", **extra)
    return env


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def outcome(proc: ProcResult, data: dict[str, Any] | None, timeout_s: float) -> dict[str, Any]:
    """A part's outcome from its subprocess: ``ok`` (exit 0), ``timeout`` or ``failed``, with the data read."""
    if proc.timed_out:
        out: dict[str, Any] = {"status": "timeout", "error": f"killed at its {timeout_s:.0f} s timeout"}
    elif proc.returncode == 0:
        out = {"status": "ok"}
    else:
        out = {"status": "failed", "error": f"exit status {proc.returncode}"}
    if out["status"] != "ok":
        out["tail"] = proc.tail
    out["data"] = data
    return out


def _run(ctx: Context, name: str, args: list[str], json_path: Path | None, timeout_s: float | None = None,
         **env: str) -> dict[str, Any]:
    timeout = timeout_s if timeout_s is not None else ctx.timeout_s
    proc = run_logged([ctx.python, *args], timeout_s=timeout, log_path=ctx.log_path, title=name,
                      env=child_env(ctx, **env), cwd=ctx.repo)
    return outcome(proc, read_json(json_path) if json_path is not None else None, timeout)


# ---- the parts ------------------------------------------------------------------------------------------
def env_part(ctx: Context) -> dict[str, Any]:
    path = ctx.work_dir / "env.json"
    return _run(ctx, "env", ["-m", "gpucheck.env_info", "--out", str(path)], path)


def xdist_workers(ctx: Context) -> int | None:
    """How many pytest-xdist workers the gpu tests get, or ``None`` where pytest-xdist does not import in the
    tests' Python (``ctx.python`` with the parts' environment)."""
    try:
        probe = subprocess.run([ctx.python, "-c", "import xdist"], capture_output=True, text=True, timeout=60,
                               env=child_env(ctx), cwd=ctx.repo)
    except subprocess.TimeoutExpired:
        return None
    if probe.returncode != 0:
        return None
    return max(1, min(TEST_WORKERS, (os.cpu_count() or 2) // 2))


def no_xdist_note(python: str) -> str:
    return (f"pytest-xdist does not import in {python}: the gpu tests run in one process, about 175 s on an "
            "H200, more than this part's budget; install pytest-xdist, or run every test with "
            "--parts tests --tests full")


def xdist_args(workers: int | None) -> list[str]:
    """pytest's arguments for ``workers`` pytest-xdist workers, whole files to each (none: one process)."""
    return ["-n", str(workers), "--dist", "loadfile"] if workers else []


def gpu_test_args(base: list[str], workers: int | None) -> list[str]:
    """The gpu tests' pytest arguments: ``base``, the workers (none: one process), the slowest tests listed."""
    # Without the triton_interpreter-marked tests: on a GPU machine each one runs in a TRITON_INTERPRET=1 child
    # process (tests/conftest.py), seconds apiece, on CPU tensors; CI runs them. On an H100 they kept this run
    # from getting past 15 % of its files in 150 s.
    return base + xdist_args(workers) + ["--durations", "15", "-m", "not triton_interpreter", "tests"]


def tests_part(ctx: Context, say: Callable[[str], None] = print) -> dict[str, Any]:
    """``--tests gpu`` (default): the GPU-sensitive files and every cuda-marked test, one pytest run, on
    pytest-xdist workers where it imports (else in one process, with a note said and reported).
    ``--tests full``: what ``make test`` runs, the suite and then the sanitized files, on the same workers."""
    mode = ctx.options.get("tests", "gpu")
    base = ["-m", "pytest", "-rs", "-q", "-p", "no:cacheprovider", "-p", "gpucheck.select_tests",
            "--continue-on-collection-errors"]
    data: dict[str, Any] = {"mode": mode, "runs": []}
    if mode not in ("gpu", "full"):
        raise ValueError(f"tests mode must be gpu or full, got {mode!r}")
    workers = xdist_workers(ctx)
    data["workers"] = workers
    if mode == "gpu":
        files = gpu_test_files(ctx.repo)
        if workers is None:
            data["note"] = no_xdist_note(ctx.python)
            say(f"gpu-check: {data['note']}")
        runs = [("gpu tests", gpu_test_args(base, workers), {"GPU_CHECK_TEST_FILES": " ".join(files)})]
    else:
        files = sanitized_tests((ctx.repo / "Makefile").read_text())
        runs = [("suite", base + xdist_args(workers), {}),
                ("sanitized", base + xdist_args(workers) + ["--stream-sanitizer", *files], {})]
    deadline_left = ctx.timeout_s
    data["files"] = files
    result: dict[str, Any] = {"status": "ok"}
    for i, (name, args, env) in enumerate(runs):
        if deadline_left <= 1:
            if result["status"] == "ok":
                result = {"status": "timeout", "error": f"no time left for the {name} run"}
            break
        log = ctx.work_dir / f"tests-{i}.jsonl"
        log.unlink(missing_ok=True)
        proc = run_logged([ctx.python, *args], timeout_s=deadline_left, log_path=ctx.log_path, title=name,
                          env=child_env(ctx, OMP_NUM_THREADS="1", GPU_CHECK_TEST_LOG=str(log), **env), cwd=ctx.repo)
        deadline_left -= proc.seconds
        counts = count_tests(log.read_text().splitlines() if log.exists() else [])
        data["runs"].append({"name": name, "returncode": proc.returncode, "timed_out": proc.timed_out, **counts})
        run_outcome = outcome(proc, None, proc.seconds)
        if run_outcome["status"] != "ok" and result["status"] == "ok":
            result = {k: v for k, v in run_outcome.items() if k != "data"}
            result["error"] = f"{name}: {result['error']}"
    data["total"] = {k: sum(r[k] for r in data["runs"]) for k in ("passed", "failed", "errors", "skipped")}
    result["data"] = data
    return result


def model_part(ctx: Context) -> dict[str, Any]:
    path = ctx.work_dir / "model.json"
    args = ["-m", "gpucheck.model_prep", "--cache-dir", str(ctx.cache_dir), "--out", str(path)]
    return _run(ctx, "model", args + list(ctx.options.get("model_args", ())), path)


def bench_part(ctx: Context) -> dict[str, Any]:
    path = ctx.work_dir / "bench.json"
    return _run(ctx, "bench", ["benchmarks/bench_gpu.py", "--quick", "--json", str(path), "--cache-dir",
                               str(ctx.cache_dir)], path)


def engine_part(ctx: Context, dbo: bool, requests: int = 256) -> dict[str, Any]:
    """The engine on the 1.2B model, ``requests`` prompts at once (``--max-num-seqs`` as many)."""
    name = "engine_dbo" if dbo else "engine" if requests == 256 else f"engine_{requests}"
    path = ctx.work_dir / f"{name}.json"
    # Two measured calls: the first pays one-time costs (Triton compiles for shapes not met at start-up, first
    # use of a kernel), the second is the engine's steady state; the report shows both.
    args = ["-m", "gpucheck.engine_run", "--cache-dir", str(ctx.cache_dir), "--out", str(path), "--repeats", "2"]
    if requests != 256:
        args += ["--num-prompts", str(requests), "--max-num-seqs", str(requests)]
    args += list(ctx.options.get("engine_args", ())) + (["--enable-dbo"] if dbo else [])
    return _run(ctx, "engine --enable-dbo" if dbo else "engine" if requests == 256 else name, args, path)


def engine_sampled_part(ctx: Context) -> dict[str, Any]:
    """The engine part's workload, every request sampling with Qwen3's defaults (temperature 0.6, top-k 20, top-p
    0.95): the decode graphs' top-k head samples its steps."""
    path = ctx.work_dir / "engine_sampled.json"
    args = ["-m", "gpucheck.engine_run", "--cache-dir", str(ctx.cache_dir), "--out", str(path), "--repeats", "2",
            "--sampling", "qwen3"]
    return _run(ctx, "engine, Qwen3 sampling", args + list(ctx.options.get("engine_args", ())), path)


def engine_qwen3_30b_part(ctx: Context) -> dict[str, Any]:
    """The engine part's workload on a Qwen3-30B-A3B-shaped model with random weights drawn on the GPU
    (``gpucheck.engine_qwen3_30b``)."""
    from gpucheck.engine_qwen3_30b import write_config

    path = ctx.work_dir / "engine_qwen3_30b.json"
    args = ["-m", "gpucheck.engine_run", "--model", str(write_config(ctx.work_dir)), "--load-format", "dummy",
            "--out", str(path), "--repeats", "2"]
    return _run(ctx, "engine, Qwen3-30B-A3B shape", args + list(ctx.options.get("engine_args", ())), path)


TUNE_TOKENS = (1, 16, 64, 128, 256, 512, 1024, 2048)  # the decode sizes of the engine parts and bench_gpu's
TUNE_BUDGET_S = 240


def tune_moe_part(ctx: Context) -> dict[str, Any]:
    """``benchmarks/tune_moe.py`` for the experts of the 1.2B model and of Qwen3-30B-A3B (both top 8): the tables
    go to the report directory (``moe_configs/``), to be committed to ``ubatch/modular_moe/experts/configs``."""
    from bench_gpu import MODEL_CONFIG, QWEN3_30B_A3B

    path = ctx.work_dir / "tune_moe.json"
    args = ["benchmarks/tune_moe.py", "--top-k", "8", "--tokens", *map(str, TUNE_TOKENS), "--budget-s",
            str(TUNE_BUDGET_S), "--out-dir", str(ctx.out_dir / "moe_configs"), "--json", str(path)]
    for cfg in (MODEL_CONFIG, QWEN3_30B_A3B):
        args += ["--shape", f"{cfg['num_experts']},{cfg['moe_intermediate_size']},{cfg['hidden_size']}"]
    return _run(ctx, "tune_moe", args, path)


def engine_link_part(ctx: Context) -> dict[str, Any]:
    """Default flags against ``--enable-dbo`` with the emulated link calibrated to comm = compute
    (``gpucheck.engine_link``)."""
    path = ctx.work_dir / "engine_link.json"
    args = ["-m", "gpucheck.engine_link", "--cache-dir", str(ctx.cache_dir), "--out", str(path)]
    return _run(ctx, "engine with a link", args + list(ctx.options.get("engine_args", ())), path)


def engine_fp8_part(ctx: Context) -> dict[str, Any]:
    """The engine on the model quantised to FP8 while loading against it unquantised, and one layer's FP8
    experts against their weight-read limit (``gpucheck.engine_fp8``)."""
    path = ctx.work_dir / "engine_fp8.json"
    args = ["-m", "gpucheck.engine_fp8", "--cache-dir", str(ctx.cache_dir), "--out", str(path)]
    args += list(ctx.options.get("engine_args", ())) + list(ctx.options.get("fp8_args", ()))
    return _run(ctx, "engine fp8 vs bf16", args, path)


def has_flag(help_text: str, flag: str) -> bool:
    return re.search(rf"(^|[\s,\[]){re.escape(flag)}\b", help_text) is not None


def serve_command(help_text: str, model_dir: str, json_path: Path, seconds: int) -> list[str]:
    """``bench-serve --compare dbo`` with the options its ``--help`` lists (``runner/entrypoints/benchserve``):
    the model, both servers at ``--max-num-seqs 256`` and 0.4 of the GPU's memory each (they run side by side
    on the one GPU), a saturating burst of 16-token prompts x 128 new tokens (EOS ignored), JSON out. It has no
    duration option: ``SERVE_PROMPTS`` requests per server keep a run well inside ``seconds``, and a
    ``--duration`` option is used if one appears. No emulated link: on one GPU there is no all-to-all for DBO to
    hide."""
    args = ["-m", "runner", "bench-serve", "--compare", "dbo"]
    wanted = [("--model", model_dir), ("--server-args", "--max-num-seqs 256 --gpu-memory-utilization 0.4"),
              ("--request-rate", "inf"), ("--input-len", "16"), ("--output-len", "128"),
              ("--output-json", str(json_path)), ("--startup-timeout", str(seconds))]
    if has_flag(help_text, "--duration"):
        wanted.append(("--duration", str(seconds)))
    else:
        wanted.append(("--num-prompts", str(SERVE_PROMPTS)))
    for flag, value in wanted:
        if has_flag(help_text, flag):
            args += [flag, value]
    if has_flag(help_text, "--ignore-eos"):  # every request generates its whole output length
        args.append("--ignore-eos")
    return args


def serve_part(ctx: Context) -> dict[str, Any]:
    """``bench-serve --compare dbo`` for about a minute, if ``python -m runner bench-serve`` exists."""
    wait = min(60.0, ctx.timeout_s)
    try:
        probe = subprocess.run([ctx.python, "-m", "runner", "bench-serve", "--help"], capture_output=True, text=True,
                               timeout=wait, env=child_env(ctx), cwd=ctx.repo)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "error": f"python -m runner bench-serve --help did not answer in {wait:.0f} s"}
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
        return {"status": "not available", "error": f"python -m runner bench-serve --help: {why[:300]}"}
    path = ctx.work_dir / "serve.json"
    model_dir = str(ctx.cache_dir / "models" / BENCH_MODEL)
    args = serve_command(probe.stdout, model_dir, path, int(ctx.options.get("serve_seconds", SERVE_SECONDS)))
    result = _run(ctx, "bench-serve", args, path)
    result["command"] = " ".join(["python", *args])
    return result


def all_parts() -> list[Part]:
    return [
        Part("env", "GPU, driver, torch, Triton, CUDA, deep_ep/deep_gemm", 30, env_part),
        Part("tests", "the GPU tests", 120, tests_part),
        Part("model", "the 1.2B benchmark model's checkpoint", 90, model_part),
        Part("bench", "kernels and the decode step against their limits (bench_gpu.py --quick)", 120, bench_part),
        Part("engine", "the engine with default flags, 256 x 128 tokens", 90, lambda c: engine_part(c, False)),
        Part("engine_dbo", "the same with --enable-dbo", 90, lambda c: engine_part(c, True)),
        Part("engine_1024", "the engine with default flags, 1024 x 128 tokens", 90,
             lambda c: engine_part(c, False, 1024)),
        Part("engine_fp8", "--quantization fp8 vs bf16: weights, tok/s, greedy agreement, FP8 experts", 150,
             engine_fp8_part),
        Part("engine_link", "default flags vs --enable-dbo, emulated link at comm = compute", 240, engine_link_part),
        Part("serve", "bench-serve --compare dbo", 150, serve_part),
        Part("engine_sampled", "the engine part's workload sampling with Qwen3's defaults (temperature, top-k, "
             "top-p)", 90, engine_sampled_part, optional=True),
        Part("engine_qwen3_30b", "the engine part's workload on a Qwen3-30B-A3B-shaped model, random weights "
             "(--load-format dummy)", 300, engine_qwen3_30b_part, optional=True),
        Part("tune_moe", "tune the Triton experts' launch tables for the 1.2B model's and Qwen3-30B-A3B's shapes",
             TUNE_BUDGET_S + 60, tune_moe_part, optional=True),
    ]
