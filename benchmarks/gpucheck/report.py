"""report.md from the check's results: the goals first (one PASS/MISS row each), then each part's figures.

Pure formatting of ``results`` (what results.json holds): it renders whatever is there, so a check stopped
part-way still gets a report of what it measured, and parts that failed show the end of their output.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from gpucheck.engine_figures import engine_figures


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    def cell(v: Any) -> str:
        if v is None:
            return ""
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v).replace("|", "\\|").replace("\n", " ")

    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(cell(v) for v in row) + " |" for row in rows)]


def _data(results: dict[str, Any], name: str) -> dict[str, Any]:
    return ((results.get("parts") or {}).get(name) or {}).get("data") or {}


def env_section(env: dict[str, Any]) -> list[str]:
    if not env:
        return ["No environment recorded."]

    def imp(name: str) -> str:
        info = env.get(name) or {}
        if info.get("imports"):
            has = info.get("has")
            extra = f" ({', '.join(k for k, v in has.items() if v) or 'none'} of {', '.join(has)})" if has else ""
            return f"{info.get('version')}{extra}"
        return f"does not import: {info.get('error')}"

    server = env.get("server_stack") or {}
    missing = [name for name, info in server.items() if not info.get("imports")]
    gpu = (f"{env.get('gpu')} x{env.get('gpu_count')} (compute capability {env.get('capability')}, "
           f"{env.get('gpu_memory_gib')} GiB, {env.get('multiprocessors')} SMs)" if env.get("gpu") else
           "no CUDA GPU visible")
    return [f"- GPU: {gpu}; driver {env.get('driver')}",
            f"- torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), Triton {imp('triton')}, Python "
            f"{env.get('python')}, transformers {imp('transformers')}, greenlet {imp('greenlet')}",
            f"- deep_ep: {imp('deep_ep')}", f"- deep_gemm: {imp('deep_gemm')}",
            f"- server stack ({', '.join(server)}): " + (f"missing {', '.join(missing)}" if missing else "imports")]


def tests_section(tests: dict[str, Any]) -> list[str]:
    if not tests:
        return ["No test results."]
    lines = [f"Mode `{tests.get('mode')}`; files: {', '.join(tests.get('files') or [])} (plus every `cuda`-marked "
             "test)" if tests.get("mode") == "gpu" else f"Mode `{tests.get('mode')}` (what `make test` runs)", ""]
    if tests.get("workers"):
        lines += [f"On {tests['workers']} pytest-xdist workers.", ""]
    if tests.get("note"):
        lines += [f"Note: {tests['note']}", ""]
    lines += table(["run", "passed", "failed", "errors", "skipped", "exit"],
                   [(r["name"], r["passed"], r["failed"], r["errors"], r["skipped"],
                     "timeout" if r.get("timed_out") else r.get("returncode")) for r in tests.get("runs", [])])
    bad = [f for r in tests.get("runs", []) for f in r.get("failures", [])]
    if bad:
        lines += ["", "Failures:", *(f"- `{f['nodeid']}` ({f['outcome']}): {f['message']}" for f in bad)]
    return lines


def bench_section(bench: dict[str, Any]) -> list[str]:
    if not bench:
        return ["No benchmark results."]
    limits = bench.get("limits") or {}
    lines = [f"{bench.get('device')}, torch {bench.get('torch')}, model {bench.get('model')}, CUDA-event medians of "
             f"{bench.get('iters')}; measured copy {limits.get('copy_tb_s')} TB/s (read + write), bf16 GEMM "
             f"{limits.get('gemm_tflop_s')} TFLOP/s; the engine's defaults here: {bench.get('default_backends')}", ""]
    lines += table(["kernel", "shape", "backend", "limit ms", "eager ms", "x limit", "graph ms", "x limit",
                    "max rel err"],
                   [(r.get("kernel"), r.get("shape"), r.get("backend"), r.get("limit_ms"), r.get("eager_ms"),
                     r.get("eager_x_limit"), r.get("graph_ms"), r.get("graph_x_limit"), r.get("max_rel_err"))
                    for r in bench.get("kernels", [])])
    if bench.get("sampling"):
        lines += ["", "A decode step's sampling, LM head included (graph: replayed, as a decode graph's heads sample "
                      "greedy, temperature, Qwen3 and Llama 3 rows; host µs: the launch):", ""]
        lines += table(["shape", "mode", "limit ms", "eager ms", "graph ms", "eager host µs", "graph host µs"],
                       [(r.get("shape"), r.get("backend"), r.get("limit_ms"), r.get("eager_ms"), r.get("graph_ms"),
                         r.get("eager_host_us"), r.get("graph_host_us")) for r in bench["sampling"]])
    lines += ["", f"Decode step, {bench.get('step_tokens')} tokens at context {bench.get('step_context')} "
                  "(comm/compute 0: no link):", ""]
    lines += table(["comm/compute", "mode", "step ms", "vs no DBO", "ideal ms", "link hidden %", "host syncs",
                    "graph MiB"],
                   [(r.get("comm_over_compute"), r.get("mode"), r.get("step_ms"), r.get("vs_no_dbo"),
                     r.get("ideal_ms"), r.get("link_hidden_pct"), r.get("host_syncs"), r.get("graph_mib"))
                    for r in bench.get("step", [])])
    for section, error in (bench.get("errors") or {}).items():
        lines += ["", f"Section {section} failed: {error}"]
    return lines


ENGINE_ROWS = (("output tok/s", "output_tokens_per_s"), ("output tok/s, first call", "first_call_tokens_per_s"),
               ("steps", "num_steps"),
               ("ubatched steps", "num_ubatched_steps"), ("failed requests", "num_errors"),
               ("wall ms / step", "wall_ms"), ("GPU busy ms / step", "gpu_ms"), ("host ms / step", "host_ms"),
               ("host: CPU thread (schedule, outputs)", "cpu_thread_ms"),
               ("host: launches, not waiting on the GPU", "forward_host_ms"),
               ("host: launches' CPU time (the rest waits for the GIL)", "forward_cpu_ms"),
               ("GPU idle %", "gpu_idle_pct"), ("graph memory MiB", "graph_mib"))


def tune_section(data: dict[str, Any]) -> list[str]:
    """Each table ``tune_moe`` wrote: per token count the configuration kept against the default one, and the
    backend ``--experts-backend auto`` runs there (from the backend-choice table written beside it)."""
    lines = [f"On {data.get('device_name')}; the files are in `moe_configs/` beside this report: copy them to "
             "`ubatch/modular_moe/experts/configs/`.", ""]
    for t in data.get("tables") or []:
        lines += [f"`{Path(t['path']).name}` (E, N, K = {', '.join(map(str, t['shape']))}):", ""]
        others = sorted({name for r in t["rows"] for name in r.get("other_backends_ms") or {}})
        lines += table(["tokens", "tuned ms", "default ms", "speed-up", *(f"{n} ms" for n in others), "candidates",
                        "auto runs", "configuration"],
                       [(r["tokens"], r["ms"], r["default_ms"], r["default_ms"] / r["ms"] if r["ms"] else None,
                         *((r.get("other_backends_ms") or {}).get(n) for n in others), r["tried"], r.get("backend"),
                         " ".join(f"{k}={v}" for k, v in r["config"].items())) for r in t["rows"]])
        if t.get("choice_path"):
            lines += ["", f"`auto runs`: the backend-choice table `{Path(t['choice_path']).name}`."]
        lines += [""]
    return lines


def engine_section(runs: dict[str, dict[str, Any]]) -> list[str]:
    if not any(runs.values()):
        return ["No engine results."]
    names = list(runs)
    figs = {n: engine_figures(d) if d else {} for n, d in runs.items()}
    rows = [(label, *(figs[n].get(key) for n in names)) for label, key in ENGINE_ROWS]

    def graphs(d: dict[str, Any]) -> str:
        g = (d.get("engine") or {}).get("graphs") or {}
        if not g.get("enabled"):
            return "off" if g else ""
        measured = d.get("measured") or {}
        replays = (measured.get("graph_steps") or {}).get("replay")  # cudagraph.Why.REPLAY
        by_head = measured.get("head_replays") or {}
        heads = "" if replays is None else (f"; {sum(by_head.values())} of {replays} replays sampled in a head ("
                                            + ", ".join(f"{n} {k}" for k, n in sorted(by_head.items())) + ")")
        return (f"{len(g.get('sizes') or [])} plain + {len(g.get('dbo_sizes') or [])} DBO, dropped {g.get('dropped')}"
                + heads)

    rows += [("DBO cost model", *("; ".join((runs[n].get("measured") or {}).get("dbo_decisions") or []) or ""
                                  for n in names)),
             ("CUDA graphs", *(graphs(runs[n]) for n in names)),
             ("start-up s (load, KV sizing, capture)", *(runs[n].get("init_s") for n in names)),
             ("experts / attention", *("{} / {}".format(*(((runs[n].get("engine") or {}).get(k)) for k in
                                       ("experts_backend", "attention_backend"))) for n in names))]
    lines = table(["", *names], rows)
    lines += ["", "Figures of the last of the measured calls (the first pays one-time costs: Triton compiles, first "
              "use of a kernel). As a command (plus a 2-prompt warm-up call first):", ""]
    lines += [f"- `{runs[n].get('cli_equivalent')}`" for n in names if runs[n]]
    return lines


def engine_link_section(data: dict[str, Any]) -> list[str]:
    """``engine_link``: the calibration, then default flags and ``--enable-dbo`` over the calibrated link."""
    cal = data.get("calibration")
    if not cal:
        return ["No results."]
    lines = [f"Link `{cal['link']}`: comm/compute {cal['comm_over_compute']:g} of {cal['compute_ms_per_step']:.2f} ms "
             f"of GPU compute per step ({cal['bytes_per_step'] / 2**20:.1f} MiB in {cal['transfers_per_step']:.0f} "
             "transfers per step, from an eager run over a free link).", ""]
    runs = {name: data.get(key) or {} for name, key in (("default flags", "default"), ("--enable-dbo", "dbo"))}
    lines += table(["", *runs], [
        ("output tok/s", *(r.get("output_tokens_per_s") for r in runs.values())),
        ("ubatched steps", *(f"{r.get('num_ubatched_steps')}/{r.get('num_steps')}" if r else None
                             for r in runs.values())),
        ("link hidden %", *(r.get("link_hidden_pct") for r in runs.values())),
        ("DBO cost model", *("; ".join(r.get("dbo_decisions") or []) for r in runs.values()))])
    return lines


def engine_fp8_section(data: dict[str, Any]) -> list[str]:
    """``engine_fp8``: both engines side by side, the greedy agreement, and one layer's experts."""
    from gpucheck.fp8_figures import fp8_figures

    if not data.get("base"):
        return ["No results."]
    runs = {"unquantised": data.get("base") or {}, "--quantization fp8": data.get("fp8") or {}}

    def col(fn: Any) -> list[Any]:
        return [fn(r) if r else None for r in runs.values()]

    def measured(key: str) -> Any:
        return lambda r: (r.get("measured") or {}).get(key)

    def dense(r: dict[str, Any]) -> str:
        d = r.get("dense_fp8_linears") or {}
        return f"{d.get('fp8_gemm')} FP8 GEMM, {d.get('dequantised')} dequantised" if any(d.values()) else "none"

    w = data.get("workload") or {}
    lines = [f"On {data.get('device')}, one engine after the other, default flags but --max-num-seqs: "
             f"{w.get('num_prompts')} prompts of {w.get('prompt_len')} tokens x {w.get('max_tokens')} new tokens "
             "(a warm-up call, then measured calls; the figures are the last call's)", ""]
    lines += table(["", *runs], [
        ("compute dtype", *col(lambda r: r.get("dtype"))),
        ("weight GiB", *col(lambda r: r["weight_bytes"] / 2**30)),
        ("output tok/s", *col(measured("output_tokens_per_s"))),
        ("output tok/s, first call", *col(lambda r: (r.get("measured_runs") or [{}])[0].get("output_tokens_per_s"))),
        ("failed requests", *col(measured("num_errors"))),
        ("experts backend", *col(lambda r: (r.get("engine") or {}).get("experts_backend"))),
        ("FP8 linear layers", *col(dense)),
        ("start-up s (load, quantise, KV sizing, capture)", *col(lambda r: r.get("init_s")))])
    fig = fp8_figures(data)
    ratios = ", ".join(f"{k} {fig[k]:.3f}" for k in ("weight_ratio", "tokens_ratio") if k in fig)
    if ratios:
        lines += ["", f"FP8 / unquantised: {ratios}."]
    agreement = data.get("agreement")
    if agreement:
        lines += ["", f"Greedy agreement, {agreement['prompts']} prompts x {agreement['tokens']} new tokens: "
                      f"{agreement['prefix_pct']:.1f} % of positions before each prompt's first divergence, "
                      f"{agreement['token_pct']:.1f} % of positions equal, {agreement['identical']} prompts "
                      f"identical; first divergence per prompt: {agreement['first_divergence']}"]
    self_agreement = (data.get("base") or {}).get("self_agreement")
    if self_agreement:
        lines += ["", f"For scale, the unquantised engine against itself on the same prompts in two half batches: "
                      f"{self_agreement['prefix_pct']:.1f} % before the first divergence, "
                      f"{self_agreement['identical']} prompts identical"]
    experts = data.get("experts")
    if experts and "error" in experts:
        lines += ["", f"Experts: {experts['error']}"]
    elif experts:
        lines += ["", f"Experts of the first MoE layer as loaded, {experts['tokens']} tokens routed "
                      f"({experts['touched_experts']}/{experts['num_experts']} experts touched): limit = "
                      f"{experts['read_bytes'] / 2**20:.1f} MiB of FP8 weights and scales read once at half the "
                      f"measured copy rate ({experts['copy_tb_s']} TB/s read + write)", ""]
        lines += table(["backend", "FP8 kernel", "engine default", "limit ms", "eager ms", "x limit", "graph ms",
                        "x limit", "max rel err"],
                       [(r.get("backend"), r.get("fp8_kernel"), r.get("engine_default"), r.get("limit_ms"),
                         r.get("eager_ms"), r.get("eager_x_limit"), r.get("graph_ms"), r.get("graph_x_limit"),
                         r.get("max_rel_err")) for r in experts.get("rows", [])])
    return lines


def serve_section(part: dict[str, Any]) -> list[str]:
    if not part:
        return ["Not run."]
    if part.get("status") == "not available":
        return [f"Not available: {part.get('error')}"]
    lines = [f"Command: `{part.get('command')}`; {part.get('status')}"]
    data = part.get("data")
    if data:
        import json

        text = json.dumps(data.get("summary", data), indent=1, default=str)  # bench-serve's summary when it has one
        lines += ["", "```json", text[:6000] + ("\n..." if len(text) > 6000 else ""), "```"]
    return lines


def render(results: dict[str, Any]) -> str:
    parts = results.get("parts") or {}
    env = _data(results, "env")
    lines = [f"# GPU check: {env.get('gpu') or 'GPU unknown'}, {results.get('started', '')}", "",
             f"Commit {results.get('commit') or 'unknown'}; time limit {results.get('time_limit_s')} s"
             + (f", took {results['elapsed_s']} s" if "elapsed_s" in results else " (still running or stopped)")
             + f"; `{results.get('command', '')}`. Every child's output is in log.txt beside this file.", "",
             "## Goals", ""]
    lines += table(["verdict", "goal", "measured"],
                   [(g["verdict"], g["goal"], g["measured"]) for g in results.get("goals", [])])
    lines += ["", "## Parts", ""]
    lines += table(["part", "status", "seconds", "budget s", "note"],
                   [(name, p.get("status"), p.get("seconds"), p.get("budget_s"), p.get("error") or "")
                    for name, p in parts.items()])
    lines += ["", "## Environment", "", *env_section(env)]
    lines += ["", "## Tests", "", *tests_section(_data(results, "tests"))]
    lines += ["", "## Kernels and the decode step (`bench_gpu.py --quick`)", "",
              *bench_section(_data(results, "bench"))]
    lines += ["", "## The engine as a user runs it (1.2B model, 256 prompts x 128 new tokens, --max-num-seqs 256; "
              "1024 of each; and, with --parts engine_sampled or engine_qwen3_30b, sampling with Qwen3's defaults, "
              "a Qwen3-30B-A3B-shaped model with random weights)",
              "",
              *engine_section({"default flags": _data(results, "engine"),
                               "--enable-dbo": _data(results, "engine_dbo"),
                               "default flags, 1024": _data(results, "engine_1024"),
                               "Qwen3 sampling": _data(results, "engine_sampled"),
                               "Qwen3-30B-A3B shape": _data(results, "engine_qwen3_30b")})]
    lines += ["", "## FP8 against bf16 (`gpucheck.engine_fp8`: the same checkpoint, `--quantization fp8`)", "",
              *engine_fp8_section(_data(results, "engine_fp8"))]
    lines += ["", "## The engine with an emulated link at comm = compute (`gpucheck.engine_link`)", "",
              *engine_link_section(_data(results, "engine_link"))]
    lines += ["", "## Server (`bench-serve --compare dbo`)", "", *serve_section(parts.get("serve") or {})]
    tuned = _data(results, "tune_moe")
    if tuned:
        lines += ["", "## Tuned Triton experts tables (`--parts tune_moe`)", "", *tune_section(tuned)]
    failed = [(n, p) for n, p in parts.items() if p.get("tail")]
    if failed:
        lines += ["", "## End of the output of parts that did not finish cleanly"]
        for name, p in failed:
            lines += ["", f"### {name}: {p.get('status')} ({p.get('error')})", "", "```", p["tail"].strip(), "```"]
    return "\n".join(lines) + "\n"
