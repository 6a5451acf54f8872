"""The GPU goals (issue "make gpu-check", from the GPU-compute work) and their PASS/MISS decisions.

Each goal reads the parts' results (``results["parts"]``, as ``schedule`` records them) and returns whether it
holds and what was measured. A goal whose figures are missing -- its part failed, timed out, was skipped or
never ran that far -- is a MISS that says so ("not measured: ..."): the report never passes a goal on figures
it does not have.

Which rows a goal reads: the kernels are those the engine's defaults run on this GPU (``--experts-backend
auto`` / ``--attention-backend auto``, as ``bench_gpu.py`` records them), timed in a CUDA graph where they can
be captured (decode steps replay graphs), else eagerly; the report also names the fastest backend. Step
figures come from ``bench_gpu.py``'s decode step (512 tokens at context 512), engine figures from the engine
run with default flags and with ``--enable-dbo`` (``engine_figures``), and with an emulated link calibrated to
comm = compute (``engine_link``); FP8 figures from ``engine_fp8`` (``fp8_figures``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench_gpu import MODEL_CONFIG, attention_shape, experts_shape, sampling_shape

PASS, MISS = "PASS", "MISS"
GRAPH_MEMORY_LIMIT_BYTES = 4 * 10**9  # "<= 4 GB"
# Pipelined steps (the step loop launches step N+1 before it reads step N's results): the steady default-flags
# call's output tok/s before them, per GPU kind (the H200 check of 2026-11-27 and the H100 one of 2026-11-26),
# and what the goals ask of it.
TOKENS_PER_S_BEFORE_PIPELINING = {"H200": 38_331, "H100": 41_330}
PIPELINED_SPEEDUP = 1.8
# What the host may cost once per-request work is off its critical path (the issue "the host still paces the
# engine"): the GPU's idle share of the steady call, the step thread's host work per decode step, and a greedy
# decode step's sampling (LM head and pick of 256 rows, as the engine runs it: the decode graphs' head) on the GPU
PIPELINED_GPU_IDLE_PCT = 5.0
STEP_THREAD_HOST_MS = 0.5
SAMPLING_GPU_MS = 0.3
SAMPLING_ROWS = 256
# ... and the default-flags call's output tok/s then: on an H200 1.6x the pipelined loop's 61,517 (39db0ea)
TOKENS_PER_S_PIPELINED = {"H200": 61_517}
HOST_OFF_PATH_TOKENS_PER_S = {"H200": 100_000}
# The same call at 1024 concurrent requests (engine_1024) against 256: its output tok/s, and the host's time per
# step, which should grow by at most this much (the CPU goal of the same name)
BATCH_1024_SPEEDUP = 1.3
HOST_GROWTH_1024 = 2.0
# --quantization fp8 against the same checkpoint unquantised (engine_fp8): weight memory, output tok/s on the
# GPUs with FP8 tensor cores the goal is set for, one layer's FP8 experts against their weight-read limit, and
# greedy agreement up to the first divergence (fp8_figures)
FP8_WEIGHT_RATIO = 0.55
FP8_TOKENS_RATIO = 1.2
FP8_TOKENS_GPUS = ("H100", "H200")
FP8_EXPERTS_X = 1.3
FP8_AGREEMENT_PCT = 90.0
# The engine part's workload on the Qwen3-30B-A3B shape (the optional engine_qwen3_30b part): output tok/s on one
# H200: 70 % of its bandwidth limit (at 256 requests nearly every expert is read once per decode step)
QWEN3_30B_TOKENS_PER_S = 12_000


class NotMeasured(Exception):
    """The figures a goal needs are not in the results; the message says why."""


@dataclass(frozen=True)
class Goal:
    key: str
    text: str
    check: Callable[[dict[str, Any]], tuple[bool, str]]  # parts -> (holds, what was measured)


def part_data(parts: dict[str, Any], name: str) -> dict[str, Any]:
    part = parts.get(name)
    if part is None:
        raise NotMeasured(f"the {name} part did not run")
    data = part.get("data")
    if not data:
        reason = part.get("error") or part.get("status", "no result")
        raise NotMeasured(f"the {name} part gave no figures ({part.get('status')}: {reason})")
    return data


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def row_figure(row: dict[str, Any], figure: str) -> tuple[float, str] | None:
    """(``graph_<figure>``, "graph") of a bench row where it was captured, else (``eager_<figure>``, "eager");
    None where neither ran."""
    for mode in ("graph", "eager"):
        x = _num(row.get(f"{mode}_{figure}"))
        if x is not None:
            return x, mode
    return None


def kernel_x(row: dict[str, Any]) -> tuple[float, str] | None:
    """(time over the limit, "graph"|"eager") of a kernel row: the graph figure where it was captured."""
    return row_figure(row, "x_limit")


def kernel_goal(kernel: str, shape: str, limit_x: float,
                backend_key: str) -> Callable[[dict[str, Any]], tuple[bool, str]]:
    def check(parts: dict[str, Any]) -> tuple[bool, str]:
        bench = part_data(parts, "bench")
        rows = [r for r in bench.get("kernels", []) if r.get("kernel") == kernel and r.get("shape") == shape]
        default = (bench.get("default_backends") or {}).get(backend_key)
        mine = next((r for r in rows if r.get("backend") == default), None)
        if mine is None:
            raise NotMeasured(f"no {kernel} row for {shape} with the default backend {default!r} "
                              f"({len(rows)} rows of other backends)")
        got = kernel_x(mine)
        if got is None:
            raise NotMeasured(f"{default} at {shape} did not run: {mine.get('eager_ms')}")
        x, mode = got
        timed = [(kernel_x(r), r["backend"]) for r in rows]
        best_x, best = min(((t[0], b) for t, b in timed if t is not None), default=(x, default))
        text = f"{default} ({mode}) {x:.1f}x the limit ({mine.get(f'{mode}_ms')} ms vs {mine.get('limit_ms')} ms)"
        if best != default:
            text += f"; fastest: {best} {best_x:.1f}x"
        return x <= limit_x, text
    return check


def step_row(bench: dict[str, Any], mode: str, ratio: float) -> dict[str, Any]:
    row = next((r for r in bench.get("step", []) if r.get("mode") == mode and r.get("comm_over_compute") == ratio),
               None)
    if row is None:
        raise NotMeasured(f"no decode-step row for {mode} at comm/compute {ratio:g}")
    return row


def graph_step(parts: dict[str, Any]) -> tuple[bool, str]:
    bench = part_data(parts, "bench")
    ms = step_row(bench, "graph", 0)["step_ms"]
    return ms <= 3.0, f"{ms:.2f} ms ({bench.get('step_tokens')} tokens at context {bench.get('step_context')})"


def graph_dbo(parts: dict[str, Any]) -> tuple[bool, str]:
    row = step_row(part_data(parts, "bench"), "graph-dbo", 1.0)
    speedup, hidden = row["vs_no_dbo"], row.get("link_hidden_pct")
    if hidden is None:
        raise NotMeasured("the graph-DBO row at comm/compute 1 has no link-hidden figure")
    return speedup >= 1.3 and hidden >= 85, f"{speedup:.2f}x graph without DBO, {hidden:.0f} % of the link hidden"


def eager(parts: dict[str, Any]) -> tuple[bool, str]:
    bench = part_data(parts, "bench")
    syncs = {(r["mode"], r["comm_over_compute"]): r["host_syncs"] for r in bench.get("step", [])
             if r.get("mode", "").startswith("eager") and "host_syncs" in r}
    if not syncs:
        raise NotMeasured("no eager decode-step row")
    speedup = step_row(bench, "eager-dbo", 1.0)["vs_no_dbo"]
    most = max(syncs.values())
    return most == 0 and speedup >= 1.0, (f"{most} host syncs in a step (most of {len(syncs)} eager rows); "
                                          f"eager DBO {speedup:.2f}x eager at comm/compute 1")


def engine_data(parts: dict[str, Any]) -> dict[str, Any]:
    return part_data(parts, "engine")


def graph_memory(parts: dict[str, Any]) -> tuple[bool, str]:
    graphs = (engine_data(parts).get("engine") or {}).get("graphs")
    if not graphs:
        raise NotMeasured("the engine run recorded no CUDA-graph report")
    if not graphs.get("enabled"):
        return False, f"CUDA graphs were off ({graphs.get('error') or 'the engine ran eager'})"
    if graphs.get("graph_bytes") is None:
        raise NotMeasured(graphs.get("error") or "no graph memory figure")
    nbytes, dropped, sizes = graphs["graph_bytes"], graphs.get("dropped") or [], graphs.get("sizes") or []
    text = f"{nbytes / 2**20:.0f} MiB for {len(sizes)} graphs (largest {max(sizes, default=0)})"
    if dropped:
        text += f"; dropped (out of memory): {dropped}"
    return nbytes <= GRAPH_MEMORY_LIMIT_BYTES and not dropped, text


def measured_throughput(data: dict[str, Any], run: str) -> tuple[dict[str, Any], float, str]:
    """An engine part's figures, its output tok/s and the goal text's start; ``run`` names it if it did not
    finish its measured generate."""
    from gpucheck.engine_figures import engine_figures

    fig = engine_figures(data)
    if not fig:
        raise NotMeasured(f"the {run} run did not finish its measured generate")
    tok_s = fig["output_tokens_per_s"]
    return fig, tok_s, f"{tok_s:,.0f} output tok/s"


def throughput(parts: dict[str, Any]) -> tuple[bool, str]:
    fig, tok_s, text = measured_throughput(engine_data(parts), "engine")
    if "first_call_tokens_per_s" in fig:
        text += f" (a second call; the first, with one-time costs: {fig['first_call_tokens_per_s']:,.0f})"
    if fig["num_errors"]:
        text += f" ({fig['num_errors']} requests failed)"
    return tok_s >= 30_000 and not fig["num_errors"], text


def host_time(parts: dict[str, Any]) -> tuple[bool, str]:
    from gpucheck.engine_figures import engine_figures

    fig = engine_figures(engine_data(parts))
    if "host_ms" not in fig:
        raise NotMeasured("the engine run has no profiled GPU time or no step-loop counters")
    return fig["host_ms"] < fig["gpu_ms"], (
        f"host {fig['host_ms']:.2f} ms (CPU thread {fig['cpu_thread_ms']:.2f} + launches "
        f"{fig['forward_host_ms']:.2f}) vs GPU {fig['gpu_ms']:.2f} ms per step; GPU idle {fig['gpu_idle_pct']:.0f} %")


def engine_dbo_no_link(parts: dict[str, Any]) -> tuple[bool, str]:
    """``--enable-dbo`` against default flags on one GPU without a link, where DBO cannot win: the measured cost
    model must keep it from costing throughput."""
    from gpucheck.engine_figures import engine_figures

    base, dbo = engine_figures(part_data(parts, "engine")), engine_figures(part_data(parts, "engine_dbo"))
    if not base or not dbo:
        raise NotMeasured(f"the {'engine' if not base else 'engine_dbo'} run did not finish its measured generate")
    ratio = dbo["output_tokens_per_s"] / base["output_tokens_per_s"]
    return ratio >= 0.98 and not dbo["num_errors"], (
        f"{ratio:.2f}x default flags ({dbo['output_tokens_per_s']:,.0f} vs {base['output_tokens_per_s']:,.0f} output "
        f"tok/s; {dbo['num_ubatched_steps']}/{dbo['num_steps']} steps ubatched)")


def engine_dbo_link(parts: dict[str, Any]) -> tuple[bool, str]:
    """``--enable-dbo`` against default flags with the emulated link calibrated to comm = compute."""
    data = part_data(parts, "engine_link")
    cal, base, dbo = data.get("calibration"), data.get("default"), data.get("dbo")
    if not cal or not base or not dbo:
        missing = next(name for name, d in (("calibration", cal), ("default", base), ("dbo", dbo)) if not d)
        raise NotMeasured(f"the engine_link run stopped before its {missing} figures")
    hidden = dbo.get("link_hidden_pct")
    if hidden is None:
        raise NotMeasured("the --enable-dbo run with the link has no link-hidden figure")
    ratio = dbo["output_tokens_per_s"] / base["output_tokens_per_s"]
    return ratio >= 1.3 and hidden >= 85 and not dbo["num_errors"], (
        f"{ratio:.2f}x default flags, {hidden:.0f} % of the link hidden (link {cal['link']}: comm/compute "
        f"{cal['comm_over_compute']:g} of {cal['compute_ms_per_step']:.2f} ms per step; "
        f"{dbo['num_ubatched_steps']}/{dbo['num_steps']} steps ubatched)")
def _engine_figures(parts: dict[str, Any], needs: str) -> dict[str, Any]:
    from gpucheck.engine_figures import engine_figures

    fig = engine_figures(engine_data(parts))
    if needs not in fig:
        raise NotMeasured("the engine run has no profiled GPU time or no step-loop counters")
    return fig


def gpu_idle(parts: dict[str, Any]) -> tuple[bool, str]:
    fig = _engine_figures(parts, "gpu_idle_pct")
    return fig["gpu_idle_pct"] <= PIPELINED_GPU_IDLE_PCT, (
        f"GPU idle {fig['gpu_idle_pct']:.0f} % (wall {fig['wall_ms']:.2f} ms, GPU {fig['gpu_ms']:.2f} ms per step)")


def step_thread(parts: dict[str, Any]) -> tuple[bool, str]:
    fig = _engine_figures(parts, "forward_host_ms")
    return fig["forward_host_ms"] <= STEP_THREAD_HOST_MS, f"{fig['forward_host_ms']:.2f} ms per step"


def sampling(parts: dict[str, Any]) -> tuple[bool, str]:
    """The greedy sampling row of ``bench``'s sampling section at 256 rows of the benchmark model's vocabulary,
    replayed (the head graph a greedy decode step replays), else eager; a temperature's figure beside it."""
    shape = sampling_shape(SAMPLING_ROWS, MODEL_CONFIG["vocab_size"])
    rows = {r.get("backend"): r for r in part_data(parts, "bench").get("sampling", []) if r.get("shape") == shape}
    if "greedy" not in rows:
        raise NotMeasured(f"no greedy sampling row for {shape}")
    got = row_figure(rows["greedy"], "ms")
    if got is None:
        raise NotMeasured(f"greedy sampling at {shape} did not run: {rows['greedy'].get('eager_ms')}")
    ms, mode = got
    text = f"greedy {ms:.3f} ms ({mode}; LM head included, {shape})"
    other = row_figure(rows["temperature"], "ms") if "temperature" in rows else None
    if other is not None:
        text += f"; with a temperature {other[0]:.3f} ms ({other[1]})"
    return ms <= SAMPLING_GPU_MS, text


def _figures_256_1024(parts: dict[str, Any], needs: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The engine's figures at 256 (the engine part) and 1024 concurrent requests (engine_1024)."""
    from gpucheck.engine_figures import engine_figures

    at_256, at_1024 = engine_figures(engine_data(parts)), engine_figures(part_data(parts, "engine_1024"))
    for name, fig in (("engine", at_256), ("engine_1024", at_1024)):
        if needs not in fig:
            raise NotMeasured(f"the {name} run has no {needs}")
    return at_256, at_1024


def batch_1024(parts: dict[str, Any]) -> tuple[bool, str]:
    at_256, at_1024 = _figures_256_1024(parts, "output_tokens_per_s")
    ratio = at_1024["output_tokens_per_s"] / at_256["output_tokens_per_s"]
    text = (f"{ratio:.2f}x ({at_1024['output_tokens_per_s']:,.0f} vs {at_256['output_tokens_per_s']:,.0f} output "
            "tok/s)")
    if at_1024["num_errors"]:
        text += f" ({at_1024['num_errors']} requests failed)"
    return ratio >= BATCH_1024_SPEEDUP and not at_1024["num_errors"], text


def host_growth_1024(parts: dict[str, Any]) -> tuple[bool, str]:
    """The host's time per step at 1024 requests against 256, as fixed + per request (a line through both)."""
    at_256, at_1024 = _figures_256_1024(parts, "host_ms")
    lo, hi = at_256["host_ms"], at_1024["host_ms"]
    per_request_us = 1e3 * (hi - lo) / (1024 - 256)
    return hi <= HOST_GROWTH_1024 * lo, (
        f"{hi / lo:.2f}x (host {lo:.2f} ms per step at 256, {hi:.2f} at 1024: {lo - 256e-3 * per_request_us:.2f} ms "
        f"+ {per_request_us:.2f} µs per request)")


def pipelined_throughput(parts: dict[str, Any]) -> tuple[bool, str]:
    fig = _engine_figures(parts, "output_tokens_per_s")
    gpu = (part_data(parts, "env").get("gpu") or "")
    kind = next((k for k in TOKENS_PER_S_BEFORE_PIPELINING if k in gpu), None)
    if kind is None:
        raise NotMeasured(f"no figure before pipelining for the GPU {gpu!r} (known: "
                          f"{', '.join(TOKENS_PER_S_BEFORE_PIPELINING)})")
    before, tok_s = TOKENS_PER_S_BEFORE_PIPELINING[kind], fig["output_tokens_per_s"]
    return tok_s >= PIPELINED_SPEEDUP * before and not fig["num_errors"], (
        f"{tok_s:,.0f} output tok/s, {tok_s / before:.2f}x the {kind}'s {before:,} before pipelining")


def host_off_path_throughput(parts: dict[str, Any]) -> tuple[bool, str]:
    fig = _engine_figures(parts, "output_tokens_per_s")
    gpu, tok_s = (part_data(parts, "env").get("gpu") or ""), fig["output_tokens_per_s"]
    kind = next((k for k in HOST_OFF_PATH_TOKENS_PER_S if k in gpu), None)
    if kind is None:
        raise NotMeasured(f"the goal is set for the {', '.join(HOST_OFF_PATH_TOKENS_PER_S)}; this run was on {gpu!r} "
                          f"({tok_s:,.0f} output tok/s)")
    before = TOKENS_PER_S_PIPELINED[kind]
    return tok_s >= HOST_OFF_PATH_TOKENS_PER_S[kind] and not fig["num_errors"], (
        f"{tok_s:,.0f} output tok/s, {tok_s / before:.2f}x the {kind}'s {before:,} of the pipelined loop")


def _fp8(parts: dict[str, Any], needs: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``engine_fp8``'s data and its figures (``fp8_figures``), which must hold ``needs``."""
    from gpucheck.fp8_figures import fp8_figures

    data = part_data(parts, "engine_fp8")
    fig = fp8_figures(data)
    if needs not in fig:
        phase = next((p for p in ("base", "fp8", "agreement") if not data.get(p)), "measured")
        raise NotMeasured(f"the engine_fp8 run stopped before its {phase} figures")
    return data, fig


def fp8_weights(parts: dict[str, Any]) -> tuple[bool, str]:
    data, fig = _fp8(parts, "weight_ratio")
    base, fp8 = data["base"], data["fp8"]
    return fig["weight_ratio"] <= FP8_WEIGHT_RATIO, (
        f"{fig['weight_ratio']:.3f}x ({fp8['weight_bytes'] / 2**30:.2f} GiB FP8 vs {base['weight_bytes'] / 2**30:.2f} "
        f"GiB {base.get('dtype')})")


def fp8_throughput(parts: dict[str, Any]) -> tuple[bool, str]:
    data, fig = _fp8(parts, "tokens_ratio")
    device = data.get("device") or ""
    if not any(kind in device for kind in FP8_TOKENS_GPUS):
        raise NotMeasured(f"the goal is set for {' and '.join(FP8_TOKENS_GPUS)}; this run was on {device!r} "
                          f"({fig['tokens_ratio']:.2f}x)")
    base, fp8 = data["base"], data["fp8"]
    experts = (fp8.get("engine") or {}).get("experts_backend")
    text = (f"{fig['tokens_ratio']:.2f}x ({fp8['measured']['output_tokens_per_s']:,.0f} vs "
            f"{base['measured']['output_tokens_per_s']:,.0f} output tok/s; experts backend {experts})")
    if fig["num_errors"]:
        text += f" ({fig['num_errors']} requests failed)"
    return fig["tokens_ratio"] >= FP8_TOKENS_RATIO and not fig["num_errors"], text


def fp8_experts(parts: dict[str, Any]) -> tuple[bool, str]:
    """The fastest FP8 kernel (graph time where it captured) over the FP8 weight-read limit; the engine's
    default backend is named beside it when it is another one."""
    experts = part_data(parts, "engine_fp8").get("experts")
    if not experts:
        raise NotMeasured("the engine_fp8 run stopped before timing the experts")
    if "error" in experts:
        raise NotMeasured(experts["error"])
    rows = experts.get("rows") or []
    timed = [(got, r) for r in rows if (got := kernel_x(r)) is not None]
    fp8 = [(got, r) for got, r in timed if r.get("fp8_kernel")]
    if not fp8:
        tried = [r for r in rows if r.get("fp8_kernel") is not False]
        raise NotMeasured("no FP8 experts kernel ran: " + "; ".join(f"{r['backend']}: {r.get('eager_ms')}"
                                                                      for r in tried))
    (x, mode), best = min(fp8, key=lambda t: t[0][0])
    text = (f"{best['backend']} ({mode}) {x:.2f}x the limit ({best[f'{mode}_ms']} ms vs {best['limit_ms']} ms: "
            f"{experts['touched_experts']}/{experts['num_experts']} experts' FP8 weights and scales at "
            f"{experts['tokens']} tokens)")
    default = next(((got, r) for got, r in timed if r.get("engine_default") and r is not best), None)
    if default is not None:
        (dx, dmode), row = default
        text += f"; the engine's default, {row['backend']} ({'FP8' if row.get('fp8_kernel') else 'dequantising'}), "
        text += f"{dx:.2f}x ({dmode})"
    return x <= FP8_EXPERTS_X, text


def fp8_agreement(parts: dict[str, Any]) -> tuple[bool, str]:
    data, fig = _fp8(parts, "agreement_pct")
    a = data["agreement"]
    text = (f"{fig['agreement_pct']:.1f} % of {a['prompts']} x {a['tokens']} positions up to the first divergence "
            f"({a['identical']}/{a['prompts']} prompts identical; {a['token_pct']:.1f} % of positions equal)")
    floor = data["base"].get("self_agreement")
    if floor:
        text += f"; bf16 against itself in half batches: {floor['prefix_pct']:.1f} %"
    return fig["agreement_pct"] >= FP8_AGREEMENT_PCT, text


def qwen3_30b_throughput(parts: dict[str, Any]) -> tuple[bool, str]:
    fig, tok_s, text = measured_throughput(part_data(parts, "engine_qwen3_30b"), "engine_qwen3_30b")
    if "wall_ms" in fig:
        text += f" ({fig['wall_ms']:.2f} ms per step)"
    return tok_s >= QWEN3_30B_TOKENS_PER_S and not fig["num_errors"], text


def _tests(parts: dict[str, Any], full: bool) -> tuple[bool, str]:
    data = part_data(parts, "tests")
    if full and data.get("mode") != "full":
        raise NotMeasured("this check ran the GPU tests only (--tests gpu); the whole suite needs "
                          "`--parts tests --tests full` in a call of its own")
    status = parts["tests"].get("status")
    counts = data.get("total") or {}
    text = (f"{counts.get('passed', 0)} passed, {counts.get('failed', 0)} failed, {counts.get('errors', 0)} errors, "
            f"{counts.get('skipped', 0)} skipped ({data.get('mode')}" + (f"; {status}" if status != "ok" else "") + ")")
    ok = status == "ok" and counts.get("passed", 0) > 0 and not counts.get("failed") and not counts.get("errors")
    return ok, text


GOALS: tuple[Goal, ...] = (
    Goal("experts_512", "Experts per layer at 512 tokens <= 2x the limit",
         kernel_goal("experts", experts_shape(512), 2.0, "experts")),
    Goal("experts_2048", "Experts per layer at 2048 tokens <= 3x the limit",
         kernel_goal("experts", experts_shape(2048), 3.0, "experts")),
    Goal("attention_512x512", "Decode attention at 512 x 512 <= 2x the limit",
         kernel_goal("decode attention", attention_shape(512, 512), 2.0, "attention")),
    Goal("attention_256x4096", "Decode attention at 256 x 4096 <= 2x the limit",
         kernel_goal("decode attention", attention_shape(256, 4096), 2.0, "attention")),
    Goal("graph_step", "Graph decode step of the 1.2B model at 512 tokens, compute only, <= 3 ms", graph_step),
    Goal("graph_dbo", "Graph DBO at comm = compute >= 1.3x graph without DBO, >= 85 % of the link hidden", graph_dbo),
    Goal("eager", "Eager: 0 host syncs in a decode step; eager DBO >= 1.0x eager", eager),
    Goal("graph_memory", "Default graph ladder at --max-num-seqs 256 in <= 4 GB of graph memory", graph_memory),
    Goal("throughput", "Default flags, 256 x 128 tokens: >= 30k output tok/s", throughput),
    Goal("host_time", "Default flags, 256 x 128 tokens: host time per step below the GPU step time", host_time),
    Goal("engine_dbo", "One GPU, no link: --enable-dbo >= 0.98x default flags (engine, 256 x 128 tokens)",
         engine_dbo_no_link),
    Goal("engine_dbo_link", "Link at comm = compute: --enable-dbo >= 1.3x default flags, >= 85 % of the link "
         "hidden (engine)", engine_dbo_link),
    Goal("gpu_idle", f"Default flags, 256 x 128 tokens: GPU idle <= {PIPELINED_GPU_IDLE_PCT:g} % of the steady call",
         gpu_idle),
    Goal("step_thread", f"Default flags, 256 x 128 tokens: the step thread's host work <= {STEP_THREAD_HOST_MS:g} "
                        "ms per step", step_thread),
    Goal("sampling", f"Greedy sampling of {SAMPLING_ROWS} rows of the 1.2B model, LM head included: <= "
                     f"{SAMPLING_GPU_MS:g} ms of GPU (bench)", sampling),
    Goal("pipelined_throughput", f"Default flags, 256 x 128 tokens: >= {PIPELINED_SPEEDUP:g}x the output tok/s "
                                 "before pipelining (H200 >= 69k, H100 >= 74k)", pipelined_throughput),
    Goal("host_off_path_throughput", "Default flags, 256 x 128 tokens: >= "
         f"{HOST_OFF_PATH_TOKENS_PER_S['H200'] // 1000}k output tok/s on an H200", host_off_path_throughput),
    Goal("batch_1024", f"Default flags, 1024 x 128 tokens: >= {BATCH_1024_SPEEDUP:g}x the output tok/s of 256 x 128",
         batch_1024),
    Goal("host_1024", f"Default flags: host time per step at 1024 requests <= {HOST_GROWTH_1024:g}x at 256",
         host_growth_1024),
    Goal("fp8_weights", f"--quantization fp8: weight memory <= {FP8_WEIGHT_RATIO:g}x bf16 (1.2B model)", fp8_weights),
    Goal("fp8_throughput", f"--quantization fp8, default flags, 256 x 128 tokens: >= {FP8_TOKENS_RATIO:g}x bf16's "
                           f"output tok/s ({' / '.join(FP8_TOKENS_GPUS)})", fp8_throughput),
    Goal("fp8_experts", f"FP8 experts of one layer at 256 tokens <= {FP8_EXPERTS_X:g}x the time to read their FP8 "
                        "weights and scales once (fastest FP8 kernel)", fp8_experts),
    Goal("fp8_agreement", f"--quantization fp8 greedy tokens equal bf16's on >= {FP8_AGREEMENT_PCT:g} % of the first "
                          "16 positions of 64 prompts (up to the first divergence)", fp8_agreement),
    Goal("qwen3_30b_throughput", f"Qwen3-30B-A3B shape, random weights, default flags, 256 x 128 tokens: >= "
                                 f"{QWEN3_30B_TOKENS_PER_S:,} output tok/s (`--parts engine_qwen3_30b`)",
         qwen3_30b_throughput),
    Goal("gpu_tests", "GPU tests pass (pytest -m cuda and the GPU-sensitive files) on the GPU",
         lambda parts: _tests(parts, full=False)),
    Goal("make_test", "make test on the one-GPU machine passes", lambda parts: _tests(parts, full=True)),
)


def evaluate(parts: dict[str, Any], goals: tuple[Goal, ...] = GOALS) -> list[dict[str, str]]:
    """One verdict per goal, in the table's order."""
    out = []
    for goal in goals:
        try:
            holds, measured = goal.check(parts)
            verdict = PASS if holds else MISS
        except NotMeasured as exc:
            verdict, measured = MISS, f"not measured: {exc}"
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:  # a result of an unexpected shape
            verdict, measured = MISS, f"not measured: unreadable result ({type(exc).__name__}: {exc})"
        out.append({"key": goal.key, "goal": goal.text, "verdict": verdict, "measured": measured})
    return out
