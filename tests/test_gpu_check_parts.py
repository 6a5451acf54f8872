"""``make gpu-check``'s parts on CPU: the subprocess runner (timeouts end the whole process group), the pytest
plugin that picks the GPU tests and records outcomes, the test counts, the Makefile's sanitized list, the
server probe, the model writer, and the model / bench / engine parts run for real on the tiny model (the
bench part exits 2 without a GPU and is recorded as failed, the engine parts give the engine's counters).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "benchmarks")]

import bench_gpu  # noqa: E402
from child_pytest import child_pytest_env  # noqa: E402
from gpucheck import (  # noqa: E402
    engine_qwen3_30b,
    parts,
    select_tests,
    wheels,
)
from gpucheck.goals import BATCH_1024_SPEEDUP, MISS, PASS, evaluate  # noqa: E402
from gpucheck.main import parse_args  # noqa: E402
from gpucheck.outcomes import count_tests  # noqa: E402
from gpucheck.parts import (  # noqa: E402
    GPU_TEST_FILES,
    TEST_WORKERS,
    all_parts,
    bench_part,
    child_env,
    engine_fp8_part,
    engine_link_part,
    engine_part,
    engine_qwen3_30b_part,
    engine_sampled_part,
    env_part,
    gpu_test_files,
    model_part,
    sanitized_tests,
    serve_command,
    serve_part,
    tune_moe_part,
)
from gpucheck.report import render  # noqa: E402
from gpucheck.schedule import Context, Part, run_parts, write_outputs  # noqa: E402
from gpucheck.subproc import run_logged  # noqa: E402

TINY = ["--model", "tiny-qwen3-moe", "--device", "cpu"]
# 40-token prompts: two whole KV blocks of 16 each, cache hits on every call after the first that ran them (the
# warm-up runs two), unless the part empties the prefix cache before each measured call
PROMPT_LEN = 40
TINY_ENGINE = TINY + ["--num-prompts", "4", "--prompt-len", str(PROMPT_LEN), "--max-tokens", "3", "--max-num-seqs",
                      "4"]


def context(tmp_path: Path, **options: object) -> Context:
    return Context(repo=REPO, out_dir=tmp_path, work_dir=tmp_path, log_path=tmp_path / "log.txt",
                   cache_dir=tmp_path / "cache", python=sys.executable, options=dict(options), timeout_s=300)


# ---- subprocesses ---------------------------------------------------------------------------------------------
def test_run_logged_appends_output_under_a_header(tmp_path: Path) -> None:
    log = tmp_path / "log.txt"
    res = run_logged([sys.executable, "-c", "print('hello'); raise SystemExit(3)"], timeout_s=60, log_path=log,
                     title="first")
    assert (res.returncode, res.timed_out) == (3, False) and "hello" in res.tail
    run_logged([sys.executable, "-c", "print('again')"], timeout_s=60, log_path=log, title="second")
    text = log.read_text()
    assert text.index("===== first:") < text.index("hello") < text.index("===== first: exit 3") \
        < text.index("===== second:") < text.index("again")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie has exited


def test_a_timeout_ends_the_whole_process_group(tmp_path: Path) -> None:
    script = ("import subprocess, sys, time\n"
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
              "print('grandchild', p.pid, flush=True)\n"
              "time.sleep(600)\n")
    res = run_logged([sys.executable, "-c", script], timeout_s=3, log_path=tmp_path / "log.txt", title="sleeper")
    assert res.timed_out and res.returncode is None
    pid = int(res.tail.split("grandchild ")[1].split()[0])
    for _ in range(100):  # SIGTERM was sent to the group; the grandchild's exit is asynchronous
        if not _alive(pid):
            break
        time.sleep(0.1)
    assert not _alive(pid)
    assert "killed after" in res.tail


# ---- the GPU test selection and the counts ---------------------------------------------------------------------------
def test_plugin_keeps_the_listed_files_and_every_cuda_test_and_records_outcomes(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    cuda: needs a GPU\n")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "test_a.py").write_text(textwrap.dedent("""
        import pytest

        def test_plain(): pass

        def test_fails(): assert 1 == 2

        @pytest.fixture
        def broken(): raise RuntimeError("fixture")

        def test_errors(broken): pass
        """))
    (tmp_path / "t" / "test_b.py").write_text(textwrap.dedent("""
        import pytest

        def test_not_selected(): pass

        @pytest.mark.cuda
        def test_gpu(): pytest.skip("no gpu here")
        """))
    log = tmp_path / "outcomes.jsonl"
    env = child_pytest_env(PYTHONPATH=str(REPO / "benchmarks"), GPU_CHECK_TEST_FILES="t/test_a.py",
                           GPU_CHECK_TEST_LOG=str(log))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                           "gpucheck.select_tests", "t"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 deselected" in proc.stdout
    counts = count_tests(log.read_text().splitlines())
    assert {k: counts[k] for k in ("passed", "failed", "errors", "skipped")} == {
        "passed": 1, "failed": 1, "errors": 1, "skipped": 1}
    assert [(f["nodeid"], f["outcome"]) for f in counts["failures"]] == [
        ("t/test_a.py::test_fails", "failed"), ("t/test_a.py::test_errors", "error")]
    assert "RuntimeError: fixture" in counts["failures"][1]["message"]


def test_counts_follow_pytests_rules_and_ignore_a_torn_line() -> None:
    lines = [json.dumps(e) for e in (
        {"nodeid": "a", "when": "setup", "outcome": "passed"}, {"nodeid": "a", "when": "call", "outcome": "passed"},
        {"nodeid": "a", "when": "teardown", "outcome": "failed", "message": "leak"},  # error at teardown
        {"nodeid": "b", "when": "setup", "outcome": "passed"}, {"nodeid": "b", "when": "call", "outcome": "passed"},
        {"nodeid": "c", "when": "setup", "outcome": "skipped"},
        {"nodeid": "tests/test_x.py", "when": "collect", "outcome": "failed", "message": "ImportError: fastapi"},
    )] + ['{"nodeid": "d", "wh']
    counts = count_tests(lines)
    assert {k: counts[k] for k in ("passed", "failed", "errors", "skipped")} == {
        "passed": 1, "failed": 0, "errors": 2, "skipped": 1}
    assert counts["failures"] == [{"nodeid": "a", "outcome": "error", "message": "leak"},
                                  {"nodeid": "tests/test_x.py", "outcome": "error", "message": "ImportError: fastapi"}]


def test_gpu_test_files_are_the_makefiles_sanitized_list_plus_the_gpu_sensitive_ones() -> None:
    files = gpu_test_files(REPO)
    sanitized = sanitized_tests((REPO / "Makefile").read_text())
    assert files[:len(sanitized)] == sanitized
    assert "tests/test_graph_memory.py" in sanitized and sanitized[0] == "tests/test_moe_ep.py"
    assert len(files) == len(set(files)) and set(GPU_TEST_FILES) <= set(files)
    assert all((REPO / f).is_file() for f in files)
    assert sanitized_tests("X = 1\nSANITIZED_TESTS ?= a.py b.py \\\n\tc.py\nY = 2\n") == ["a.py", "b.py", "c.py"]
    with pytest.raises(ValueError, match="no 'SANITIZED_TESTS"):
        sanitized_tests("TESTS = a.py\n")


def fake_python(tmp_path: Path, xdist: bool) -> str:
    """A ``python`` that imports pytest-xdist or not, and otherwise only prints its arguments (a pytest run)."""
    fake = tmp_path / ("python-xdist" if xdist else "python-plain")
    fake.write_text("#!/bin/sh\nif [ \"$2\" = \"import xdist\" ]; then exit " + ("0" if xdist else "1") + "; fi\n"
                    "echo \"ARGS $*\"\n")
    fake.chmod(0o755)
    return str(fake)


@pytest.mark.parametrize("xdist", [True, False], ids=["xdist", "no-xdist"])
def test_gpu_tests_run_on_xdist_workers_where_it_imports_else_say_so(tmp_path: Path, xdist: bool) -> None:
    ctx = context(tmp_path, tests="gpu")
    ctx.python = fake_python(tmp_path, xdist)
    said: list[str] = []
    out = parts.tests_part(ctx, say=said.append)  # module-qualified: a bare tests_* name would be collected
    args = next(line for line in (tmp_path / "log.txt").read_text().splitlines() if line.startswith("ARGS "))
    workers = min(TEST_WORKERS, (os.cpu_count() or 2) // 2) if xdist else None
    assert out["status"] == "ok" and out["data"]["workers"] == workers
    assert " -m not triton_interpreter tests" in args and " --durations 15 " in args
    assert (f" -n {workers} --dist loadfile " in args) is xdist and (" -n " in args) is xdist
    if xdist:
        assert said == [] and "note" not in out["data"]
        assert f"On {workers} pytest-xdist workers." in render_tests(out["data"])
    else:
        assert said == [f"gpu-check: {out['data']['note']}"] and "pytest-xdist does not import" in said[0]
        assert "--tests full" in said[0] and f"Note: {out['data']['note']}" in render_tests(out["data"])


@pytest.mark.parametrize("xdist", [True, False], ids=["xdist", "no-xdist"])
def test_full_tests_run_what_make_test_runs_on_the_same_workers(tmp_path: Path, xdist: bool) -> None:
    ctx = context(tmp_path, tests="full")
    ctx.python = fake_python(tmp_path, xdist)
    out = parts.tests_part(ctx, say=pytest.fail)
    runs = [line for line in (tmp_path / "log.txt").read_text().splitlines() if line.startswith("ARGS ")]
    workers = min(TEST_WORKERS, (os.cpu_count() or 2) // 2) if xdist else None
    assert out["status"] == "ok" and out["data"]["workers"] == workers and len(runs) == 2
    assert all((f" -n {workers} --dist loadfile" in args) is xdist and (" -n " in args) is xdist for args in runs)
    assert runs[1].endswith("--stream-sanitizer " + " ".join(sanitized_tests((REPO / "Makefile").read_text())))
    assert "--stream-sanitizer" not in runs[0] and "note" not in out["data"]


def render_tests(data: dict) -> str:
    from gpucheck.report import tests_section

    return "\n".join(tests_section(data))


def test_an_xdist_worker_leaves_the_outcomes_to_the_controller(tmp_path: Path, monkeypatch) -> None:
    """Under ``-n`` every report reaches the controller's hook too: a worker writing as well would log it twice."""
    log = tmp_path / "outcomes.jsonl"
    monkeypatch.setenv("GPU_CHECK_TEST_LOG", str(log))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    select_tests._record({"nodeid": "a", "when": "call", "outcome": "passed"})
    assert not log.exists()
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    select_tests._record({"nodeid": "a", "when": "call", "outcome": "passed"})
    assert count_tests(log.read_text().splitlines())["passed"] == 1


# ---- the server part ------------------------------------------------------------------------------------------------
def test_serve_command_uses_the_flags_its_help_lists(tmp_path: Path) -> None:
    import argparse

    from runner.entrypoints.benchserve.cli_args import add_bench_serve_args

    parser = argparse.ArgumentParser(prog="python -m runner bench-serve")
    add_bench_serve_args(parser)
    args = serve_command(parser.format_help(), "/m", tmp_path / "s.json", 60)
    assert args == ["-m", "runner", "bench-serve", "--compare", "dbo", "--model", "/m", "--server-args",
                    "--max-num-seqs 256 --gpu-memory-utilization 0.4", "--request-rate", "inf", "--input-len", "16",
                    "--output-len", "128", "--output-json", str(tmp_path / "s.json"), "--startup-timeout", "60",
                    "--num-prompts", "512", "--ignore-eos"]
    parsed = parser.parse_args(args[3:])  # what bench-serve itself makes of it
    assert (parsed.model_flag, parsed.compare, parsed.num_prompts, parsed.output_len) == ("/m", "dbo", 512, 128)
    with_duration = serve_command("--model M --duration S --output-len N", "/m", tmp_path / "s.json", 60)
    assert with_duration == ["-m", "runner", "bench-serve", "--compare", "dbo", "--model", "/m", "--output-len",
                             "128", "--duration", "60"]


def test_serve_part_records_not_available_when_the_subcommand_is_missing(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho \"python -m runner: error: invalid choice: 'bench-serve'\" >&2\nexit 2\n")
    fake.chmod(0o755)
    ctx = context(tmp_path)
    ctx.python = str(fake)
    assert serve_part(ctx) == {"status": "not available",
                               "error": "python -m runner bench-serve --help: "
                                        "python -m runner: error: invalid choice: 'bench-serve'"}


# ---- model, bench and engine parts on the tiny model -----------------------------------------------------------------
def test_model_prep_on_cpu_writes_what_the_engine_writes(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from runner.models.loader import resolve_model_path

    out = model_part(context(tmp_path, model_args=TINY))
    assert out["status"] == "ok", out
    assert out["data"]["existed"] is False and out["data"]["path"] == str(tmp_path / "cache/models/tiny-qwen3-moe")
    mine = Path(out["data"]["path"])
    engines = resolve_model_path("tiny-qwen3-moe", tmp_path / "engine-cache")
    assert json.loads((mine / "config.json").read_text()) == json.loads((engines / "config.json").read_text())
    a, b = load_file(str(mine / "model.safetensors")), load_file(str(engines / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert model_part(context(tmp_path, model_args=TINY))["data"]["existed"] is True


@pytest.mark.slow  # each part in a process of its own
def test_parts_on_cpu_give_results_the_goals_and_report_read(tmp_path: Path) -> None:
    ctx = context(tmp_path, model_args=TINY, engine_args=TINY_ENGINE)
    gpu = torch.cuda.is_available()  # there the bench part would really run: minutes, and the 1.2B model
    plan = [Part("env", "env", 120, env_part), Part("model", "model", 120, model_part),
            *([] if gpu else [Part("bench", "bench", 120, bench_part)]),
            Part("engine", "engine", 300, lambda c: engine_part(c, False)),
            Part("engine_dbo", "dbo", 300, lambda c: engine_part(c, True)),
            Part("engine_1024", "1024", 300, lambda c: engine_part(c, False, 1024))]
    results = run_parts(plan, ctx, {}, deadline=time.monotonic() + 3600, save=lambda r: write_outputs(r, tmp_path),
                        say=lambda s: None)
    p = results["parts"]
    assert p["env"]["status"] == "ok" and p["env"]["data"]["torch"] == torch.__version__
    assert p["env"]["data"]["cuda_available"] is gpu
    assert p["model"]["status"] == "ok"
    if not gpu:
        assert p["bench"]["status"] == "failed" and p["bench"]["error"] == "exit status 2"
        assert "bench_gpu: needs a CUDA GPU" in p["bench"]["tail"]
    for name, dbo in (("engine", False), ("engine_dbo", True), ("engine_1024", False)):
        data = p[name]["data"]
        assert p[name]["status"] == "ok", p[name]
        assert (data["measured"]["num_requests"], data["measured"]["num_output_tokens"]) == (4, 12)
        assert data["measured"]["enable_dbo"] is dbo and data["measured"]["loop"]["num_steps"] >= 3
        assert [(r["prefix_cache_queries"], r["prefix_cache_hits"]) for r in data["measured_runs"]] == [
            (4 * PROMPT_LEN, 0)] * 2  # every measured call computed its prompts
        assert data["engine"]["graphs"] == {"enabled": False} and "profiled" not in data
    verdicts = {g["key"]: (g["verdict"], g["measured"]) for g in results["goals"]}
    assert verdicts["graph_memory"] == (MISS, "CUDA graphs were off (the engine ran eager)")
    assert verdicts["host_time"] == (MISS, "not measured: the engine run has no profiled GPU time or no "
                                           "step-loop counters")
    assert verdicts["throughput"][0] == MISS
    assert " output tok/s (a second call; the first, with one-time costs: " in verdicts["throughput"][1]
    report = (tmp_path / "report.md").read_text()
    assert report == render(results) and "| output tok/s |" in report and "| output tok/s, first call |" in report
    if not gpu:
        assert verdicts["graph_step"][1].startswith("not measured: the bench part gave no figures (failed")
        assert "bench_gpu: needs a CUDA GPU" in report
    assert json.loads((tmp_path / "results.json").read_text())["goals"] == evaluate(p)
    log = (tmp_path / "log.txt").read_text()
    assert "===== engine --enable-dbo:" in log
    # 1024 prompts and seats; the test's engine_args come after and shrink the run to 4
    assert "===== engine_1024: " in log and " --num-prompts 1024 --max-num-seqs 1024 " in log
    # the tiny runs' speeds are whatever this machine gave: the verdict must follow the ratio it states
    ratio = float(verdicts["batch_1024"][1].split("x (", 1)[0])
    assert verdicts["batch_1024"][0] == (PASS if ratio >= BATCH_1024_SPEEDUP else MISS)
    assert verdicts["host_1024"] == (MISS, "not measured: the engine run has no host_ms")


def test_the_fp8_part_on_cpu_compares_the_engine_quantised_while_loading_with_it_unquantised(tmp_path: Path) -> None:
    """``engine_fp8`` run for real on the tiny model (fp32 on the CPU): both engines' weights, their measured
    calls and the greedy agreement; the experts are not timed off a GPU, which the goal says."""
    from runner.models.loader import load_model

    ctx = context(tmp_path, engine_args=TINY_ENGINE, fp8_args=["--agree-prompts", "5", "--agree-tokens", "4"])
    out = engine_fp8_part(ctx)
    assert out["status"] == "ok", out
    data = out["data"]
    sizes = {}
    for name, quantization in (("base", None), ("fp8", "fp8")):
        model, _ = load_model("tiny-qwen3-moe", cache_dir=tmp_path / "cache", quantization=quantization)
        sizes[name] = sum(p.numel() * p.element_size() for p in model.parameters())
        run = data[name]
        assert (run["dtype"], run["weight_bytes"]) == ("float32", sizes[name])
        assert (run["measured"]["num_requests"], run["measured"]["num_output_tokens"]) == (4, 12)
        assert len(run["measured_runs"]) == 2 and run["flags"].get("quantization") == quantization
        assert [(r["prefix_cache_queries"], r["prefix_cache_hits"]) for r in run["measured_runs"]] == [
            (4 * PROMPT_LEN, 0)] * 2  # every measured call computed its prompts
    assert data["fp8"]["dense_fp8_linears"]["dequantised"] > 0 and data["base"]["dense_fp8_linears"] == {
        "fp8_gemm": 0, "dequantised": 0}
    agreement = data["agreement"]
    assert (agreement["prompts"], agreement["tokens"], len(agreement["first_divergence"])) == (5, 4, 5)
    assert agreement["prefix_pct"] == 100 * sum(agreement["first_divergence"]) / 20
    own = data["base"]["self_agreement"]  # the unquantised engine against itself in batches of 2 and 3 prompts
    assert (own["prompts"], own["tokens"], len(own["first_divergence"])) == (5, 4, 5) and "self_agreement" not in \
        data["fp8"]
    assert data["device"] == "cpu" and data["experts"]["error"].startswith("not timed: the experts are timed with "
                                                                           "CUDA events")
    verdicts = {g["key"]: (g["verdict"], g["measured"]) for g in evaluate({"engine_fp8": out})}
    ratio = sizes["fp8"] / sizes["base"]
    assert verdicts["fp8_weights"][1].startswith(f"{ratio:.3f}x (") and verdicts["fp8_weights"][0] == (
        "PASS" if ratio <= 0.55 else MISS)
    assert verdicts["fp8_throughput"][1].startswith("not measured: the goal is set for H100 and H200; this run was "
                                                    "on 'cpu'")
    assert verdicts["fp8_experts"] == (MISS, f"not measured: {data['experts']['error']}")
    assert verdicts["fp8_agreement"][1].startswith(f"{agreement['prefix_pct']:.1f} % of 5 x 4 positions")
    report = render({"parts": {"engine_fp8": out}, "goals": evaluate({"engine_fp8": out})})
    assert "| compute dtype | float32 | float32 |" in report and f"Experts: {data['experts']['error']}" in report


def test_children_import_the_repo_and_benchmarks_first(tmp_path: Path) -> None:
    env = child_env(context(tmp_path))
    assert env["PYTHONPATH"].split(":")[:2] == [str(REPO), str(REPO / "benchmarks")]
    assert [p.name for p in all_parts()] == ["env", "tests", "model", "bench", "engine", "engine_dbo", "engine_1024",
                                             "engine_fp8", "engine_link", "serve", "engine_sampled", "engine_qwen3_30b",
                                             "tune_moe"]
    assert [p.name for p in all_parts() if p.optional] == ["engine_sampled", "engine_qwen3_30b", "tune_moe"]
    assert "engine_qwen3_30b" not in parse_args([]).parts  # run only when named
    assert parse_args(["--parts", "engine_qwen3_30b"]).parts == ["engine_qwen3_30b"]


def test_the_qwen3_30b_part_runs_the_engine_on_random_weights_from_a_config_alone(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    """``engine_qwen3_30b`` run for real on the CPU with the tiny model's shape in place of Qwen3-30B-A3B's: the
    part writes ``config.json`` alone and the engine draws the weights (``--load-format dummy``)."""
    from runner.models.loader import TINY_MODELS

    monkeypatch.setattr(engine_qwen3_30b, "CONFIG", TINY_MODELS["tiny-qwen3-moe"])
    workload = ["--device", "cpu", "--num-prompts", "4", "--prompt-len", "8", "--max-tokens", "3",
                "--max-num-seqs", "4"]
    out = engine_qwen3_30b_part(context(tmp_path, engine_args=workload))
    assert out["status"] == "ok", out
    data = out["data"]
    model_dir = tmp_path / engine_qwen3_30b.NAME
    assert data["model_dir"] == str(model_dir) and sorted(f.name for f in model_dir.iterdir()) == ["config.json"]
    assert data["flags"]["load_format"] == "dummy" and " --load-format dummy" in data["cli_equivalent"]
    assert (data["measured"]["num_requests"], data["measured"]["num_output_tokens"]) == (4, 12)
    verdicts = {g["key"]: (g["verdict"], g["measured"]) for g in evaluate({"engine_qwen3_30b": out})}
    assert verdicts["qwen3_30b_throughput"][0] == MISS and " output tok/s (" in verdicts["qwen3_30b_throughput"][1]
    report = render({"parts": {"engine_qwen3_30b": out}, "goals": evaluate({"engine_qwen3_30b": out})})
    assert "| Qwen3-30B-A3B shape |" in report


def test_the_sampled_engine_part_samples_with_qwen3s_defaults(tmp_path: Path) -> None:
    """``engine_sampled`` run for real on the CPU with the tiny model: every request samples with Qwen3's defaults,
    the command line a user would run says so, and the report gives the part its engine column."""
    workload = ["--model", "tiny-qwen3-moe", "--device", "cpu", "--num-prompts", "4", "--prompt-len", "8",
                "--max-tokens", "3", "--max-num-seqs", "4"]
    out = engine_sampled_part(context(tmp_path, engine_args=workload))
    assert out["status"] == "ok", out
    data = out["data"]
    assert data["workload"]["sampling"] == "qwen3"
    assert data["cli_equivalent"].endswith("--ignore-eos --temperature 0.6 --top-k 20 --top-p 0.95 --device cpu")
    assert (data["measured"]["num_requests"], data["measured"]["num_output_tokens"]) == (4, 12)
    report = render({"parts": {"engine_sampled": out}, "goals": evaluate({"engine_sampled": out})})
    assert "| Qwen3 sampling |" in report


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the part really tunes (minutes)")
def test_the_tune_part_needs_a_gpu_and_its_report_section_reads_the_tuners_summary(tmp_path: Path) -> None:
    out = tune_moe_part(context(tmp_path))
    assert (out["status"], out["error"], out["data"]) == ("failed", "exit status 2", None)
    assert "tune_moe: needs a CUDA GPU" in out["tail"]
    pytest.importorskip("triton")
    summary = tmp_path / "tuned.json"  # the summary the part reads, from the tuner's dry run
    proc = subprocess.run([sys.executable, "benchmarks/tune_moe.py", "--dry-run", "--out-dir", str(tmp_path / "t"),
                           "--json", str(summary)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(summary.read_text())
    report = render({"parts": {"tune_moe": {"status": "ok", "data": doc}}, "goals": []})
    name = Path(doc["tables"][0]["path"]).name
    assert "## Tuned Triton experts tables" in report and f"`{name}` (E, N, K = 4, 64, 32):" in report
    rows = [line for line in report.splitlines() if " GROUP_SIZE_M=" in line]
    assert [r.split(" | ")[0] for r in rows] == ["| 1", "| 8"]  # a row per token count, the candidates timed
    assert all(r.split(" | ")[5] == "2" for r in rows)  # after the torch experts' ms: the alternative timed
    assert all(r.split(" | ")[6] == "triton" for r in rows)  # what auto runs there (torch is never chosen)
    assert f"`{Path(doc['tables'][0]['choice_path']).name}`" in report
    assert "| tokens | tuned ms | default ms | speed-up | torch ms | candidates | auto runs | configuration |" in report


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the part really runs (minutes, the 1.2B model)")
def test_the_engine_link_part_needs_a_gpu_and_says_so(tmp_path: Path) -> None:
    out = engine_link_part(context(tmp_path))
    assert (out["status"], out["error"], out["data"]) == ("failed", "exit status 2", None)
    assert "engine_link: needs a CUDA GPU" in out["tail"] and "Traceback" not in out["tail"]


# ---- bench_gpu.py's quick mode and JSON ------------------------------------------------------------------------------
def test_bench_gpu_quick_mode_arguments() -> None:
    quick = bench_gpu.parse_args(["--quick"])
    assert (quick.iters, quick.ratios, quick.quick) == (bench_gpu.QUICK_ITERS, [1.0], True)
    full = bench_gpu.parse_args([])
    assert (full.iters, full.ratios) == (20, [0.5, 1.0, 2.0])
    assert bench_gpu.parse_args(["--quick", "--iters", "3"]).iters == 3
    with pytest.raises(SystemExit):
        bench_gpu.parse_args(["--iters", "0"])


def test_bench_gpu_json_is_rewritten_after_every_row(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    results = bench_gpu.Results(path, device="x")
    assert json.loads(path.read_text()) == {"device": "x", "kernels": [], "step": [], "errors": {}}
    emit = results.emitter("step")
    emit({"mode": "graph"})
    assert json.loads(path.read_text())["step"] == [{"mode": "graph"}]
    results.error("kernels", RuntimeError("out of memory"))
    assert json.loads(path.read_text())["errors"] == {"kernels": "RuntimeError: out of memory"}


# ---- the wheels ----------------------------------------------------------------------------------------------------
def test_wheel_set_checks(tmp_path: Path) -> None:
    assert wheels.wheel_name("pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.whl") == "pydantic-core"
    names = [t.split("==")[0] for t in wheels.TOP]
    assert len(names) == len(set(names)) and all("==" in t for t in wheels.TOP)
    files = []
    for name in ("greenlet-3.5.6-cp312-cp312-x.whl", "greenlet-3.5.5-cp312-cp312-x.whl", "torch-2.13.0-cp312-x.whl"):
        (tmp_path / name).write_bytes(b"x")
        files.append(tmp_path / name)
    assert wheels.check(files) == ["greenlet twice: greenlet-3.5.6-cp312-cp312-x.whl and "
                                   "greenlet-3.5.5-cp312-cp312-x.whl",
                                   "torch-2.13.0-cp312-x.whl would shadow the GPU image's own torch"]
    assert wheels.check(files[:1]) == []
