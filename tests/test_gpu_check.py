"""``make gpu-check``'s own logic on CPU: the no-GPU exit, the goal table's PASS/MISS decisions on recorded
figures, the part schedule (budgets, the deadline, failures that do not stop the check, results saved after
every part) and the report. The figures fed in are built with ``bench_gpu.step_row`` and the shapes of
``engine_run``'s JSON, so the goals read what the benchmarks write. No timing is asserted: the schedule runs on
a fake clock. The parts' subprocesses are tested in test_gpu_check_parts.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "benchmarks")]

import bench_gpu  # noqa: E402
from gpucheck import goals as goals_mod  # noqa: E402
from gpucheck.engine_figures import engine_figures  # noqa: E402
from gpucheck.goals import GOALS, MISS, PASS, evaluate  # noqa: E402
from gpucheck.report import render  # noqa: E402
from gpucheck.schedule import MIN_START_S, Context, Part, run_parts, write_outputs  # noqa: E402


# ---- the no-GPU exit ---------------------------------------------------------------------------------------
def test_exits_2_and_says_why_without_a_gpu(tmp_path: Path) -> None:
    out = tmp_path / "report"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # hides a GPU where there is one
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--out", str(out)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "gpu-check: needs one NVIDIA GPU with CUDA" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()  # nothing written


def test_make_target_runs_the_script_with_the_report_directory() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}  # under make test
    proc = subprocess.run(["make", "-n", "--no-print-directory", "gpu-check", "PY=python3", "GPU_CHECK_OUT=/x/y"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "GPU_CHECK_OUT=/x/y python3 benchmarks/gpu_check.py"


def test_bad_time_limit_is_refused() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--time-limit-s", "0"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "argument --time-limit-s: must be > 0, got 0.0" in proc.stderr


# ---- recorded figures ---------------------------------------------------------------------------------------
def kernel(kernel_name: str, shape: str, backend: str, limit: float, eager: Any, graph: Any = None) -> dict[str, Any]:
    row = {"kernel": kernel_name, "backend": backend, "shape": shape, "limit_ms": limit, "eager_ms": eager}
    if isinstance(eager, float):
        row["eager_x_limit"] = round(eager / limit, 1)
    if graph is not None:
        row["graph_ms"] = graph
        if isinstance(graph, float):
            row["graph_x_limit"] = round(graph / limit, 1)
    return row


def bench_doc(*, eager_syncs: int = 0, hidden: float = 90.0, graph_dbo_ms: float = 3.6,
              greedy_ms: float = 0.04) -> dict[str, Any]:
    """A bench_gpu.py --quick JSON: grouped_mm experts 1.5x / 3.5x, triton attention 1.8x (graph) and 2.5x
    (eager only), graph step 2.5 ms, graph DBO 5.0 / graph_dbo_ms at comm = compute, eager DBO 1.05x, greedy
    sampling of 256 rows ``greedy_ms`` replayed."""
    e, a = bench_gpu.experts_shape, bench_gpu.attention_shape
    kernels = [kernel("experts", e(512), "torch", 0.2, 8.0, "not capturable: RuntimeError"),
               kernel("experts", e(512), "grouped_mm", 0.2, 0.4, 0.3),
               kernel("experts", e(2048), "grouped_mm", 0.25, 1.0, 0.875),
               kernel("experts", e(2048), "triton", 0.25, 2.0, 0.5),
               kernel("decode attention", a(512, 512), "triton", 0.1, 0.3, 0.18),
               kernel("decode attention", a(256, 4096), "triton", 0.8, 2.0, "RuntimeError: capture failed")]
    free = {"eager": 10.0, "eager-dbo": 11.0, "graph": 2.5, "graph-dbo": 3.0}
    linked = {"eager": 20.0, "eager-dbo": 19.0, "graph": 5.0, "graph-dbo": graph_dbo_ms}
    step = [bench_gpu.step_row(m, free, None, graph_mib=40.0 if m.startswith("graph") else None,
                               host_syncs=None if m.startswith("graph") else 0) for m in free]
    step += [bench_gpu.step_row(m, linked, 1.0, 2.5, free, (hidden, {"k": 1.0}),
                                graph_mib=40.0 if m.startswith("graph") else None,
                                host_syncs=None if m.startswith("graph") else (eager_syncs if m == "eager" else 0))
             for m in linked]
    shape = bench_gpu.sampling_shape(256, bench_gpu.MODEL_CONFIG["vocab_size"])
    sampling = [{"kernel": bench_gpu.SAMPLING_KERNEL, "shape": shape, "backend": mode, "limit_ms": 0.01,
                 "eager_ms": eager, "graph_ms": graph, "eager_host_us": 80.0, "graph_host_us": 9.0}
                for mode, eager, graph in (("greedy, float32 logits", 0.09, 0.05), ("greedy", 0.06, greedy_ms),
                                           ("temperature", 0.3, 0.21))]
    return {"device": "H100", "iters": 5, "step_tokens": 512, "step_context": 512, "limits": {"copy_tb_s": 3.0},
            "default_backends": {"experts": "grouped_mm", "attention": "triton"}, "kernels": kernels, "step": step,
            "sampling": sampling, "errors": {}}


def engine_doc(*, graph_bytes: int = 3 * 10**9, dropped: tuple[int, ...] = (), tok_s: float = 31000.0,
               enabled: bool = True) -> dict[str, Any]:
    """An engine_run.py JSON: 130 steps, 10 ms wall / step, CPU thread 2 ms, forward thread 9 ms, GPU 7 ms."""
    graphs: dict[str, Any] = {"enabled": enabled}
    if enabled:
        graphs.update(graph_bytes=graph_bytes, sizes=[1, 2, 4, 256], dbo_sizes=[], dropped=list(dropped))
    return {"cli_equivalent": "python -m runner generate ...", "init_s": 20.0,
            "engine": {"experts_backend": "grouped_mm", "attention_backend": "TritonAttentionBackend",
                       "graphs": graphs},
            "measured": {"num_requests": 256, "num_errors": 0, "num_output_tokens": 32768, "elapsed_s": 1.3,
                         "num_steps": 130, "num_ubatched_steps": 0, "output_tokens_per_s": tok_s,
                         "loop": {"wall_s": 1.3, "forward_busy_s": 1.17, "cpu_work_s": 0.26, "num_steps": 130}},
            "profiled": {"num_steps": 130, "gpu_busy_s": 0.91, "elapsed_s": 1.4}}


def engine_link_doc(default_tok_s: float = 15000.0, dbo_tok_s: float = 21000.0,
                    hidden: float | None = 90.0) -> dict[str, Any]:
    """An engine_link.py JSON: the link calibrated to comm = compute, default flags and --enable-dbo over it."""
    run = {"num_steps": 138, "num_errors": 0, "num_ubatched_steps": 0, "output_tokens_per_s": default_tok_s}
    return {"calibration": {"num_steps": 138, "compute_ms_per_step": 2.5, "bytes_per_step": 1.2e8,
                            "transfers_per_step": 8.0, "comm_over_compute": 1.0, "link": "latency_us=20,gbps=51.2"},
            "default": run, "dbo": {**run, "num_ubatched_steps": 128, "output_tokens_per_s": dbo_tok_s,
                                    "link_hidden_pct": hidden}}


def engine_fp8_doc(*, fp8_tok_s: float = 40000.0, device: str = "NVIDIA H200", prefix: float = 95.0,
                   triton_graph_x: float | str = 1.2) -> dict[str, Any]:
    """An engine_fp8.py JSON: 2 GiB of bf16 weights against 1.0625 GiB FP8, 31,000 against ``fp8_tok_s`` output
    tok/s; experts: deep_gemm does not import, triton's FP8 kernel at ``triton_graph_x`` (graph), the engine's
    default grouped_mm dequantising at 3x."""
    def engine(weight_bytes: int, tok_s: float, fp8_gemm: int) -> dict[str, Any]:
        run = {"num_requests": 256, "num_errors": 0, "num_steps": 130, "num_ubatched_steps": 0,
               "output_tokens_per_s": tok_s}
        return {"init_s": 20.0, "dtype": "bfloat16", "weight_bytes": weight_bytes, "engine": {
            "experts_backend": "grouped_mm"}, "dense_fp8_linears": {"fp8_gemm": fp8_gemm, "dequantised": 0},
            "measured": run, "measured_runs": [{**run, "output_tokens_per_s": 9000.0}, run]}

    triton: dict[str, Any] = {"backend": "triton", "fp8_kernel": True, "engine_default": False, "limit_ms": 0.15,
                              "eager_ms": 0.2, "eager_x_limit": 1.33}
    if isinstance(triton_graph_x, float):
        triton.update(graph_ms=round(0.15 * triton_graph_x, 4), graph_x_limit=triton_graph_x)
    else:
        triton.update(eager_ms=triton_graph_x, eager_x_limit=None)
    rows = [{"backend": "deep_gemm", "limit_ms": 0.15, "engine_default": False,
             "eager_ms": "ImportError: No module named 'deep_gemm'"}, triton,
            {"backend": "grouped_mm", "fp8_kernel": False, "engine_default": True, "limit_ms": 0.15, "eager_ms": 0.5,
             "eager_x_limit": 3.33, "graph_ms": 0.45, "graph_x_limit": 3.0}]
    return {"device": device, "workload": {"num_prompts": 256, "prompt_len": 16, "max_tokens": 128,
                                           "agree_prompts": 64, "agree_tokens": 16},
            "base": {**engine(2**31, 31000.0, 0), "self_agreement": {
                "prompts": 64, "tokens": 16, "prefix_pct": 97.5, "token_pct": 98.0, "identical": 60,
                "first_divergence": [16] * 60 + [6] * 4}},
            "fp8": engine(2**30 + 2**26, fp8_tok_s, 16),
            "agreement": {"prompts": 64, "tokens": 16, "prefix_pct": prefix, "token_pct": 96.0, "identical": 50,
                          "first_divergence": [16] * 50 + [3] * 14},
            "experts": {"tokens": 256, "touched_experts": 64, "num_experts": 64, "read_bytes": 150 * 2**20,
                        "copy_tb_s": 4.1, "rows": rows}}


def suite_doc(mode: str = "gpu", failed: int = 0) -> dict[str, Any]:
    run: dict[str, Any] = {"name": "gpu tests", "returncode": 1 if failed else 0, "timed_out": False, "passed": 400,
           "failed": failed, "errors": 0, "skipped": 3, "failures": []}
    return {"mode": mode, "files": ["tests/test_a.py"], "runs": [run],
            "total": {k: run[k] for k in ("passed", "failed", "errors", "skipped")}}


def parts(**data: dict[str, Any]) -> dict[str, Any]:
    return {name: {"status": "ok" if not (name == "tests" and d["total"]["failed"]) else "failed", "data": d}
            for name, d in data.items()}


def verdicts(p: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {g["key"]: (g["verdict"], g["measured"]) for g in evaluate(p)}


def test_every_goal_is_decided_on_recorded_figures() -> None:
    v = verdicts(parts(bench=bench_doc(), engine=engine_doc(), engine_dbo=engine_doc(tok_s=30690.0),
                       engine_link=engine_link_doc(), engine_fp8=engine_fp8_doc(), tests=suite_doc()))
    assert [k for k in v] == [g.key for g in GOALS]
    assert {k: verdict for k, (verdict, _) in v.items()} == {
        "experts_512": PASS, "experts_2048": MISS, "attention_512x512": PASS, "attention_256x4096": MISS,
        "graph_step": PASS, "graph_dbo": PASS, "eager": PASS, "graph_memory": PASS, "throughput": PASS,
        "host_time": PASS, "engine_dbo": PASS, "engine_dbo_link": PASS, "gpu_idle": MISS, "step_thread": MISS,
        "sampling": PASS, "pipelined_throughput": MISS, "host_off_path_throughput": MISS, "batch_1024": MISS,
        "host_1024": MISS, "fp8_weights": PASS, "fp8_throughput": PASS, "fp8_experts": PASS, "fp8_agreement": PASS,
        "qwen3_30b_throughput": MISS, "gpu_tests": PASS, "make_test": MISS}
    assert v["qwen3_30b_throughput"][1] == "not measured: the engine_qwen3_30b part did not run"
    for tok_s, verdict in ((13_000.0, PASS), (11_000.0, MISS)):  # the optional part, run
        got = verdicts(parts(engine_qwen3_30b=engine_doc(tok_s=tok_s)))["qwen3_30b_throughput"]
        assert got == (verdict, f"{tok_s:,.0f} output tok/s (10.00 ms per step)")
    assert v["engine_dbo"][1] == "0.99x default flags (30,690 vs 31,000 output tok/s; 0/130 steps ubatched)"
    assert v["engine_dbo_link"][1] == ("1.40x default flags, 90 % of the link hidden (link latency_us=20,gbps=51.2: "
                                       "comm/compute 1 of 2.50 ms per step; 128/138 steps ubatched)")
    assert v["experts_512"][1] == "grouped_mm (graph) 1.5x the limit (0.3 ms vs 0.2 ms)"
    assert v["experts_2048"][1] == "grouped_mm (graph) 3.5x the limit (0.875 ms vs 0.25 ms); fastest: triton 2.0x"
    assert v["attention_256x4096"][1] == "triton (eager) 2.5x the limit (2.0 ms vs 0.8 ms)"  # graph failed
    assert v["graph_step"][1] == "2.50 ms (512 tokens at context 512)"
    assert v["graph_dbo"][1] == "1.39x graph without DBO, 90 % of the link hidden"
    assert v["eager"][1] == "0 host syncs in a step (most of 4 eager rows); eager DBO 1.05x eager at comm/compute 1"
    assert v["host_time"][1] == ("host 4.00 ms (CPU thread 2.00 + launches 2.00) vs GPU 7.00 ms per step; "
                                 "GPU idle 30 %")
    assert v["make_test"][1].startswith("not measured: this check ran the GPU tests only")
    assert v["gpu_idle"][1] == "GPU idle 30 % (wall 10.00 ms, GPU 7.00 ms per step)"
    assert v["step_thread"][1] == "2.00 ms per step"
    assert v["sampling"][1] == ("greedy 0.040 ms (graph; LM head included, 256 rows x 8192 vocab); with a "
                                "temperature 0.210 ms (graph)")
    assert v["pipelined_throughput"][1] == "not measured: the env part did not run"
    assert v["fp8_weights"][1] == "0.531x (1.06 GiB FP8 vs 2.00 GiB bfloat16)"
    assert v["fp8_throughput"][1] == "1.29x (40,000 vs 31,000 output tok/s; experts backend grouped_mm)"
    assert v["fp8_experts"][1] == ("triton (graph) 1.20x the limit (0.18 ms vs 0.15 ms: 64/64 experts' FP8 weights "
                                   "and scales at 256 tokens); the engine's default, grouped_mm (dequantising), "
                                   "3.00x (graph)")
    assert v["fp8_agreement"][1] == ("95.0 % of 64 x 16 positions up to the first divergence (50/64 prompts "
                                     "identical; 96.0 % of positions equal); bf16 against itself in half batches: "
                                     "97.5 %")


def test_the_1024_request_goals_compare_with_the_256_run() -> None:
    """engine_doc's 256 run: 31,000 tok/s, host 4.00 ms per step (CPU thread 2 + forward 2). At 1024: 45,000
    tok/s and host 7.00 ms (CPU thread 5): 1.45x; the host grew 1.75x, 0.50 + 0.00391 ms per request."""
    big = engine_doc(tok_s=45000.0)
    big["measured"]["loop"]["cpu_work_s"] = 0.65
    v = verdicts(parts(engine=engine_doc(), engine_1024=big))
    assert v["batch_1024"] == (PASS, "1.45x (45,000 vs 31,000 output tok/s)")
    assert v["host_1024"] == (PASS, "1.75x (host 4.00 ms per step at 256, 7.00 at 1024: 3.00 ms + 3.91 µs per "
                                    "request)")
    big["measured"]["loop"]["cpu_work_s"] = 1.3  # CPU thread 10 ms: host 12 ms, 3x
    slow = engine_doc(tok_s=38000.0)
    slow["measured"]["num_errors"] = 2
    v = verdicts(parts(engine=engine_doc(), engine_1024=slow))
    assert v["batch_1024"] == (MISS, "1.23x (38,000 vs 31,000 output tok/s) (2 requests failed)")
    assert verdicts(parts(engine=engine_doc(), engine_1024=big))["host_1024"][0] == MISS
    assert verdicts(parts(engine=engine_doc()))["batch_1024"] == (MISS, "not measured: the engine_1024 part did "
                                                                        "not run")


def test_pipelining_goals_pass_on_a_busy_gpu_and_compare_with_the_same_kind_of_gpu() -> None:
    """GPU 9.6 of 10 ms a step, the step thread 0.4 ms (the read of the results is on the other thread), and
    70k tok/s: enough on an H200 (1.8 x 38,331), not on an H100 (1.8 x 41,330)."""
    doc = engine_doc(tok_s=70000.0)
    doc["profiled"]["gpu_busy_s"] = 1.248
    doc["measured"]["loop"].update(forward_busy_s=0.052, read_wait_s=0.0)
    for gpu, verdict in (("NVIDIA H200", PASS), ("NVIDIA H100 80GB HBM3", MISS)):
        v = verdicts(parts(engine=doc, env={"gpu": gpu}))
        assert v["gpu_idle"] == (PASS, "GPU idle 4 % (wall 10.00 ms, GPU 9.60 ms per step)")
        assert v["step_thread"] == (PASS, "0.40 ms per step")
        assert v["pipelined_throughput"][0] == verdict
    assert v["pipelined_throughput"][1] == "70,000 output tok/s, 1.69x the H100's 41,330 before pipelining"
    assert v["host_off_path_throughput"][1] == ("not measured: the goal is set for the H200; this run was on "
                                                "'NVIDIA H100 80GB HBM3' (70,000 output tok/s)")
    for tok_s, verdict in ((70_000.0, MISS), (101_000.0, PASS)):
        got = verdicts(parts(engine=engine_doc(tok_s=tok_s), env={"gpu": "NVIDIA H200"}))["host_off_path_throughput"]
        assert got == (verdict, f"{tok_s:,.0f} output tok/s, {tok_s / 61_517:.2f}x the H200's 61,517 of the "
                                "pipelined loop")
    v = verdicts(parts(engine=doc, env={"gpu": "NVIDIA A100"}))
    assert v["pipelined_throughput"] == (MISS, "not measured: no figure before pipelining for the GPU "
                                               "'NVIDIA A100' (known: H200, H100)")


@pytest.mark.parametrize("change, key, measured", [
    (dict(bench=bench_doc(eager_syncs=3)), "eager", "3 host syncs in a step"),
    (dict(bench=bench_doc(hidden=80.0)), "graph_dbo", "80 % of the link hidden"),
    (dict(bench=bench_doc(graph_dbo_ms=4.5)), "graph_dbo", "1.11x graph without DBO"),
    (dict(bench=bench_doc(greedy_ms=0.45)), "sampling", "greedy 0.450 ms (graph"),
    (dict(bench={**bench_doc(), "sampling": []}), "sampling", "not measured: no greedy sampling row for 256 rows"),
    (dict(engine=engine_doc(graph_bytes=5 * 10**9)), "graph_memory", "4768 MiB for 4 graphs (largest 256)"),
    (dict(engine=engine_doc(dropped=(256,))), "graph_memory", "dropped (out of memory): [256]"),
    (dict(engine=engine_doc(enabled=False)), "graph_memory", "CUDA graphs were off"),
    (dict(engine=engine_doc(tok_s=29000.0)), "throughput", "29,000 output tok/s"),
    (dict(tests=suite_doc(failed=2)), "gpu_tests", "400 passed, 2 failed, 0 errors, 3 skipped (gpu; failed)"),
    (dict(engine_dbo=engine_doc(tok_s=0.79 * 31000)), "engine_dbo", "0.79x default flags"),  # the H200
    (dict(engine_link=engine_link_doc(dbo_tok_s=18000.0)), "engine_dbo_link", "1.20x default flags, 90 %"),
    (dict(engine_link=engine_link_doc(hidden=70.0)), "engine_dbo_link", "1.40x default flags, 70 % of the link"),
    (dict(engine_link=engine_link_doc(hidden=None)), "engine_dbo_link", "not measured: the --enable-dbo run with "
                                                                         "the link has no link-hidden figure"),
    (dict(engine_fp8=engine_fp8_doc(fp8_tok_s=25000.0)), "fp8_throughput", "0.81x (25,000 vs 31,000 output tok/s"),
    (dict(engine_fp8=engine_fp8_doc(device="NVIDIA A100")), "fp8_throughput",
     "not measured: the goal is set for H100 and H200; this run was on 'NVIDIA A100' (1.29x)"),
    (dict(engine_fp8=engine_fp8_doc(prefix=80.0)), "fp8_agreement", "80.0 % of 64 x 16 positions"),
    (dict(engine_fp8=engine_fp8_doc(triton_graph_x=1.5)), "fp8_experts", "triton (graph) 1.50x the limit"),
    (dict(engine_fp8=engine_fp8_doc(triton_graph_x="RuntimeError: out of resources")), "fp8_experts",
     "not measured: no FP8 experts kernel ran: deep_gemm: ImportError: No module named 'deep_gemm'; "
     "triton: RuntimeError: out of resources"),
])
def test_a_goal_missed_is_a_miss_naming_the_figure(change: dict[str, Any], key: str, measured: str) -> None:
    docs = {"bench": bench_doc(), "engine": engine_doc(), "engine_dbo": engine_doc(), "engine_link": engine_link_doc(),
            "engine_fp8": engine_fp8_doc(), "tests": suite_doc(), **change}
    verdict, text = verdicts(parts(**docs))[key]
    assert verdict == MISS and measured in text


def test_the_whole_suite_goal_passes_only_on_a_full_run() -> None:
    assert verdicts(parts(tests=suite_doc("full")))["make_test"] == (
        PASS, "400 passed, 0 failed, 0 errors, 3 skipped (full)")
    assert verdicts(parts(tests=suite_doc("full", failed=1)))["make_test"][0] == MISS


def test_goals_without_figures_are_misses_saying_why() -> None:
    v = verdicts({})
    assert all(verdict == MISS for verdict, _ in v.values())
    assert v["experts_512"][1] == "not measured: the bench part did not run"
    timed_out = {"bench": {"status": "timeout", "error": "killed at its 120 s timeout", "data": None}}
    assert verdicts(timed_out)["graph_step"][1] == ("not measured: the bench part gave no figures (timeout: killed "
                                                    "at its 120 s timeout)")
    partial = bench_doc()
    partial["step"] = partial["step"][:4]  # stopped before the linked rows
    v = verdicts(parts(bench=partial))
    assert v["graph_step"][0] == PASS
    assert v["graph_dbo"] == (MISS, "not measured: no decode-step row for graph-dbo at comm/compute 1")
    stopped = engine_link_doc()
    del stopped["dbo"]
    assert verdicts(parts(engine_link=stopped))["engine_dbo_link"] == (
        MISS, "not measured: the engine_link run stopped before its dbo figures")
    fp8_stopped = engine_fp8_doc()
    del fp8_stopped["fp8"], fp8_stopped["agreement"], fp8_stopped["experts"]
    v = verdicts(parts(engine_fp8=fp8_stopped))
    assert v["fp8_weights"] == (MISS, "not measured: the engine_fp8 run stopped before its fp8 figures")
    assert v["fp8_experts"] == (MISS, "not measured: the engine_fp8 run stopped before timing the experts")
    on_cpu = {**engine_fp8_doc(), "experts": {"error": "not timed: not on a CUDA GPU"}}
    assert verdicts(parts(engine_fp8=on_cpu))["fp8_experts"] == (MISS, "not measured: not timed: not on a CUDA GPU")
    no_default = bench_doc()
    no_default["default_backends"]["experts"] = "deep_gemm"
    assert verdicts(parts(bench=no_default))["experts_512"][1] == (
        "not measured: no experts row for 512 tokens with the default backend 'deep_gemm' (2 rows of other backends)")


def test_engine_figures_are_the_engine_counters_per_step() -> None:
    fig = engine_figures(engine_doc())
    assert {k: round(v, 6) for k, v in fig.items() if isinstance(v, float)} == {
        "output_tokens_per_s": 31000.0, "wall_ms": 10.0, "cpu_thread_ms": 2.0, "forward_ms": 9.0, "gpu_ms": 7.0,
        "forward_host_ms": 2.0, "host_ms": 4.0, "gpu_idle_pct": 30.0, "graph_mib": round(3e9 / 2**20, 6)}
    doc = engine_doc()
    doc["profiled"]["gpu_busy_s"] = 1.3  # the forward thread waited on the GPU all the time
    fig = engine_figures(doc)
    assert fig["forward_host_ms"] == 0.0 and fig["host_ms"] == pytest.approx(2.0)
    assert engine_figures({"cli_equivalent": "x"}) == {}


def test_forward_host_time_leaves_out_the_wait_for_sampled_ids_and_the_first_call_is_reported() -> None:
    doc = engine_doc()
    doc["measured"]["loop"]["read_wait_s"] = 0.91  # 7 ms a step in the read-back: 2 ms of the forward's own work
    first = {**doc["measured"], "output_tokens_per_s": 9000.0}
    doc["measured_runs"] = [first, doc["measured"]]
    fig = engine_figures(doc)
    assert fig["forward_host_ms"] == pytest.approx(2.0) and fig["host_ms"] == pytest.approx(4.0)
    assert fig["first_call_tokens_per_s"] == 9000.0 and fig["output_tokens_per_s"] == 31000.0
    assert "forward_cpu_ms" not in fig  # a run without the CPU-time counter
    doc["measured"]["loop"]["forward_cpu_s"] = 0.13  # its own CPU time: 1 ms a step, the rest waited for the GIL
    assert engine_figures(doc)["forward_cpu_ms"] == pytest.approx(1.0)


# ---- the schedule ----------------------------------------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def context(tmp_path: Path) -> Context:
    return Context(repo=REPO, out_dir=tmp_path, work_dir=tmp_path, log_path=tmp_path / "log.txt",
                   cache_dir=tmp_path, python=sys.executable)


def test_parts_run_in_order_under_their_budgets_and_the_deadline(tmp_path: Path) -> None:
    clock, calls, saved = FakeClock(), [], []

    def part(name: str, spend: float, status: str = "ok") -> Part:
        def run(ctx: Context) -> dict[str, Any]:
            calls.append((name, ctx.timeout_s))
            clock.now += spend
            return {"status": status, "data": {"n": name}}
        return Part(name, name.upper(), 100, run)

    def boom(ctx: Context) -> dict[str, Any]:
        calls.append(("boom", ctx.timeout_s))
        raise RuntimeError("the check's own bug")

    plan = [part("a", 50), Part("boom", "B", 30, boom), part("c", 90, "timeout"), part("d", 1), part("e", 1)]
    results = run_parts(plan, context(tmp_path), {}, deadline=150.0, clock=clock,
                        save=lambda r: saved.append(json.loads(json.dumps(r))), say=lambda s: None)
    # a: its own budget; boom: its budget; c: what is left of the deadline; d: runs with 10 s left; e: skipped
    assert calls == [("a", 100), ("boom", 30), ("c", 100), ("d", 10)]
    assert [(n, p["status"]) for n, p in results["parts"].items()] == [
        ("a", "ok"), ("boom", "error"), ("c", "timeout"), ("d", "ok"), ("e", "skipped")]
    assert results["parts"]["boom"]["error"] == "RuntimeError: the check's own bug"
    assert "Traceback" in results["parts"]["boom"]["tail"]
    assert results["parts"]["e"]["error"] == ("no time left: 9 s of the check's time limit remained when it was "
                                              "due") and results["parts"]["e"]["timeout_s"] == 0
    assert [list(s["parts"]) for s in saved] == [["a"], ["a", "boom"], ["a", "boom", "c"], ["a", "boom", "c", "d"],
                                                 ["a", "boom", "c", "d", "e"]]
    assert all(len(s["goals"]) == len(GOALS) for s in saved)
    assert MIN_START_S == 10.0


def test_a_part_with_an_unknown_status_is_an_error(tmp_path: Path) -> None:
    results = run_parts([Part("x", "X", 10, lambda ctx: {"status": "fine"})], context(tmp_path), {},
                        deadline=100.0, clock=FakeClock(), save=lambda r: None, say=lambda s: None)
    assert results["parts"]["x"]["status"] == "error"
    assert results["parts"]["x"]["error"] == "part returned status 'fine'"


def test_results_on_disk_hold_every_finished_part_before_the_next_starts(tmp_path: Path) -> None:
    seen = []

    def second(ctx: Context) -> dict[str, Any]:
        seen.append(json.loads((tmp_path / "results.json").read_text()))
        seen.append((tmp_path / "report.md").read_text())
        return {"status": "failed", "error": "exit status 1", "tail": "boom at the end", "data": None}

    plan = [Part("bench", "kernels", 60, lambda ctx: {"status": "ok", "data": bench_doc()}),
            Part("engine", "engine", 60, second)]
    results = run_parts(plan, context(tmp_path), {"started": "today", "time_limit_s": 420}, deadline=1000.0,
                        clock=FakeClock(), save=lambda r: write_outputs(r, tmp_path), say=lambda s: None)
    on_disk, report = seen
    assert list(on_disk["parts"]) == ["bench"] and on_disk["parts"]["bench"]["data"]["kernels"]
    assert "| PASS | Graph decode step of the 1.2B model at 512 tokens, compute only, <= 3 ms | 2.50 ms" in report
    final = (tmp_path / "report.md").read_text()
    assert json.loads((tmp_path / "results.json").read_text()) == json.loads(json.dumps(results))
    assert "### engine: failed (exit status 1)" in final and "boom at the end" in final


def test_report_has_one_pass_or_miss_line_per_goal_and_every_part() -> None:
    results: dict[str, Any] = {
        "started": "2026-01-01 00:00 UTC", "commit": "abc1234", "time_limit_s": 420, "elapsed_s": 300.0,
        "command": "gpu_check.py", "parts": parts(bench=bench_doc(), engine=engine_doc(), tests=suite_doc()),
        "goals": []}
    results["parts"]["engine_dbo"] = {"status": "ok", "data": engine_doc(tok_s=20000.0)}
    results["parts"]["engine_dbo"]["data"]["measured"]["dbo_decisions"] = ["decode 256-511 tok replayed: DBO off "
                                                                           "(0.57x)"]
    results["parts"]["engine"]["data"]["measured"].update(graph_steps={"replay": 254, "mixed batch": 6},
                                                          head_replays={"greedy": 250, "draw": 4})
    results["parts"]["engine_link"] = {"status": "ok", "data": engine_link_doc()}
    results["parts"]["engine_fp8"] = {"status": "ok", "data": engine_fp8_doc()}
    results["parts"]["serve"] = {"status": "not available", "error": "python -m runner bench-serve --help: no"}
    results["goals"] = evaluate(results["parts"])
    text = render(results)
    goal_lines = [line for line in text.splitlines() if line.startswith(("| PASS |", "| MISS |"))]
    assert [line.split(" | ")[1] for line in goal_lines] == [g.text for g in GOALS]
    assert "Commit abc1234; time limit 420 s, took 300.0 s" in text
    assert "| output tok/s | 31,000 | 20,000 |" in text
    assert "| host ms / step | 4 | 4 |" in text
    assert "| DBO cost model |  | decode 256-511 tok replayed: DBO off (0.57x) |" in text
    assert "| 256 rows x 8192 vocab | greedy | 0.01 | 0.06 | 0.04 | 80 | 9 |" in text
    assert ("| CUDA graphs | 4 plain + 0 DBO, dropped []; 254 of 254 replays sampled in a head (4 draw, 250 greedy) "
            "| 4 plain + 0 DBO, dropped [] |") in text
    assert "Link `latency_us=20,gbps=51.2`: comm/compute 1 of 2.50 ms of GPU compute per step" in text
    assert "| output tok/s | 15,000 | 21,000 |" in text and "| link hidden % |  | 90 |" in text
    assert "Not available: python -m runner bench-serve --help: no" in text
    assert "| experts | 2048 tokens | triton | 0.25 | 2 | 8 | 0.5 | 2 |  |" in text
    assert "| weight GiB | 2 | 1.06 |" in text and "| output tok/s | 31,000 | 40,000 |" in text
    assert "| FP8 linear layers | none | 16 FP8 GEMM, 0 dequantised |" in text
    assert "FP8 / unquantised: weight_ratio 0.531, tokens_ratio 1.290." in text
    assert "| triton | True | False | 0.15 | 0.2 | 1.33 | 0.18 | 1.2 |  |" in text
    assert "| deep_gemm |  | False | 0.15 | ImportError: No module named 'deep_gemm' |" in text
    assert ("For scale, the unquantised engine against itself on the same prompts in two half batches: 97.5 % "
            "before the first divergence, 60 prompts identical") in text
    assert render({}).startswith("# GPU check: GPU unknown")  # nothing measured still renders


def test_goal_table_reads_the_default_backends_bench_gpu_records() -> None:
    assert bench_gpu.default_backends("cpu") == {"experts": "torch", "attention": "torch"}
    assert goals_mod.GRAPH_MEMORY_LIMIT_BYTES == 4 * 10**9


# ---- FP8 figures ------------------------------------------------------------------------------------------------
def test_greedy_agreement_counts_positions_up_to_each_first_divergence() -> None:
    from gpucheck.fp8_figures import first_divergence, greedy_agreement

    base = [[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8, 99]]
    other = [[1, 2, 3, 4], [1, 9, 3, 4], [0, 6, 7, 8, 42]]  # the 5th tokens are past the compared 4
    assert greedy_agreement(base, other, 4) == {
        "prompts": 3, "tokens": 4, "prefix_pct": 100 * 5 / 12, "token_pct": 100 * 10 / 12, "identical": 1,
        "first_divergence": [4, 1, 0]}
    assert first_divergence([1, 2], [1, 2, 3]) == 2 and first_divergence([], [1]) == 0
    with pytest.raises(ValueError, match="the two runs have 3 and 2 outputs"):
        greedy_agreement(base, other[:2], 4)
    with pytest.raises(ValueError, match=r"prompts \[1\] have fewer than 4 generated tokens"):
        greedy_agreement(base, [[1, 2, 3, 4], [1, 2], [5, 6, 7, 8]], 4)
    with pytest.raises(ValueError, match="tokens must be >= 1, got 0"):
        greedy_agreement(base, other, 0)
