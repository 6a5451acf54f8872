"""The engine as a user runs it, on the 1.2B benchmark model (``python -m gpucheck.engine_run``).

Default flags but ``--max-num-seqs``: ``LLM(model="bench-qwen3-moe-1b", cache_dir=..., max_num_seqs=256[,
enable_dbo=True])`` (the check's cache directory holds the checkpoint ``model_prep`` wrote),
random prompts as ``python -m runner generate`` makes them, greedy (``--sampling``: or a checkpoint's sampling
defaults, ``common.SAMPLING_SETTINGS``), a fixed number of new tokens each. One short warm-up call (as ``python
-m runner bench`` does), then, each call from an empty prefix cache (as there):

- ``measured``: one ``generate`` of the whole workload; the engine's own counters (``LLM.last_stats``,
  ``LLM.last_loop_stats``);
- ``profiled`` (CUDA only): the same call again under the torch profiler, recording GPU activity only, for the
  GPU's busy time per step (``engine_figures`` compares it with the host's time per step).

``engine`` holds what the engine chose (backends, KV blocks) and its CUDA-graph capture report (graph memory,
sizes kept and dropped). The JSON (``--out``) is rewritten after each phase, so a run stopped part-way keeps
what it measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from common import SAMPLING_SETTINGS, empty_prefix_cache, write_json
from ubatch.trace_metrics import length

# this benchmark reads the in-process engine (its runner, core or loop statistics): the engine core stays here
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # the torch profiler's GPU activity in a Chrome trace


def cli_equivalent(flags: dict[str, Any], args: argparse.Namespace) -> str:
    cache = f" --cache-dir {flags['cache_dir']}" if "cache_dir" in flags else ""
    return (f"python -m runner generate --model {flags['model']}{cache} --max-num-seqs {args.max_num_seqs} "
            f"--num-prompts {args.num_prompts} --random-prompt-len {args.prompt_len} --max-tokens {args.max_tokens} "
            f"--ignore-eos" + sampling_flags(args.sampling) + (" --enable-dbo" if args.enable_dbo else "") +
            (f" --device {args.device}" if args.device else "") +
            (f" --load-format {args.load_format}" if args.load_format else ""))


def sampling_flags(name: str) -> str:
    """The CLI's sampling flags for ``--sampling name`` (none for greedy, the CLI's default)."""
    temperature, top_k, top_p = SAMPLING_SETTINGS[name]
    return "" if name == "greedy" else (f" --temperature {temperature}" + (f" --top-k {top_k}" if top_k else "")
                                        + f" --top-p {top_p}")


def engine_info(llm: Any) -> dict[str, Any]:
    """What the engine chose and captured, read off the model runner (``None`` where an attribute is gone)."""
    runner = llm.runner
    attention = getattr(runner, "attention_backend", None)
    info: dict[str, Any] = {"device": str(getattr(runner, "device", None)),
                            "experts_backend": getattr(runner, "experts_backend", None),
                            "attention_backend": type(attention).__name__ if attention is not None else None,
                            "num_kv_blocks": getattr(runner, "num_kv_blocks", None)}
    if not hasattr(runner, "graph_runner"):
        info["graphs"] = {"enabled": None, "error": "the model runner has no graph_runner attribute"}
        return info
    graph_runner = runner.graph_runner
    graphs: dict[str, Any] = {"enabled": graph_runner is not None}
    report = getattr(graph_runner, "report", None) if graph_runner is not None else None
    if graph_runner is not None and report is None:
        graphs["error"] = "the graph runner holds no capture report"
    if report is not None:
        graphs.update(graph_bytes=report.graph_bytes, capture_s=round(report.seconds, 2),
                      sizes=[k.num_tokens for k in report.keys if not k.ubatched],
                      dbo_sizes=[k.num_tokens for k in report.keys if k.ubatched],
                      dropped=[k.num_tokens for k in report.dropped], summary=report.summary(),
                      dropped_message=report.dropped_message())
    info["graphs"] = graphs
    return info


def run_figures(llm: Any, outputs: list[Any]) -> dict[str, Any]:
    stats = llm.last_stats
    out: dict[str, Any] = {**dataclasses.asdict(stats), "output_tokens_per_s": round(stats.output_tokens_per_s, 1)}
    loop = getattr(llm, "last_loop_stats", None)
    if loop is not None:
        out["loop"] = {**{k: v for k, v in dataclasses.asdict(loop).items() if k != "sync_reasons"},
                       "sync_reasons": dict(loop.sync_reasons)}
    graph_runner = llm.model_runner.graph_runner
    if graph_runner is not None:  # counts since the engine started (the warm-up and earlier calls included)
        out["graph_steps"] = {why.value: n for why, n in graph_runner.stats.items()}
        out["head_replays"] = dict(graph_runner.num_head_replays)  # by head: greedy, draw
    errors = [o.error for o in outputs if o.error is not None]
    if errors:
        out["first_errors"] = errors[:3]
    return out


def gpu_busy(trace_events: list[dict[str, Any]]) -> dict[str, Any]:
    """GPU activity in a profiler trace: the union of kernel/copy/memset intervals (s), and the kernel count."""
    gpu = [e for e in trace_events if e.get("cat") in GPU_CATEGORIES and "dur" in e]
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in gpu if e["cat"] == "kernel"]
    return {"gpu_busy_s": length([(e["ts"], e["ts"] + e["dur"]) for e in gpu]) / 1e6,
            "gpu_kernel_s": length(kernels) / 1e6, "num_kernels": len(kernels)}


def profiled_events(llm: Any, prompts: list[Any], sampling: Any) -> list[dict[str, Any]]:
    """The Chrome-trace events of one ``generate`` under the torch profiler (GPU activity only), from an empty
    prefix cache (the prompts ran before: their whole blocks would be cache hits)."""
    from torch.profiler import ProfilerActivity, profile

    empty_prefix_cache(llm)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, sampling, use_tqdm=False)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())["traceEvents"]


def profiled_run(llm: Any, prompts: list[Any], sampling: Any) -> dict[str, Any]:
    events = profiled_events(llm, prompts, sampling)
    stats = llm.last_stats
    return {"num_steps": stats.num_steps, "elapsed_s": stats.elapsed_s,
            "output_tokens_per_s": round(stats.output_tokens_per_s, 1), **gpu_busy(events)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a checkpoint directory or built-in name (default: the 1.2B model)")
    p.add_argument("--cache-dir", default=None, help="where a built-in model's checkpoint is written")
    p.add_argument("--enable-dbo", action="store_true")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--sampling", choices=list(SAMPLING_SETTINGS), default="greedy",
                   help="every request's sampling settings")
    p.add_argument("--device", default=None, help="default: the engine's (auto)")
    p.add_argument("--load-format", default=None, help="the engine's --load-format (dummy: random weights from the "
                   "model directory's config.json)")
    p.add_argument("--no-profile", action="store_true", help="skip the profiled run")
    p.add_argument("--repeats", type=int, default=1,
                   help="measured calls in a row (default 1); each one's figures go to 'measured_runs', the last "
                        "to 'measured': the first call pays one-time costs (Triton compiles for new shapes)")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    from bench_gpu import MODEL
    from runner import LLM, SamplingParams
    from runner.entrypoints.cli import random_prompts
    from runner.models.loader import model_config, resolve_model_path

    model = args.model or MODEL
    model_dir = str(resolve_model_path(model, args.cache_dir))  # written now if missing, not inside LLM's timing
    flags: dict[str, Any] = {"model": model, "max_num_seqs": args.max_num_seqs}
    if args.cache_dir:
        flags["cache_dir"] = args.cache_dir
    if args.enable_dbo:
        flags["enable_dbo"] = True
    if args.device:
        flags["device"] = args.device
    if args.load_format:
        flags["load_format"] = args.load_format
    doc: dict[str, Any] = {"cli_equivalent": cli_equivalent(flags, args), "flags": flags, "model_dir": model_dir,
                           "workload": {"num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
                                        "max_tokens": args.max_tokens, "sampling": args.sampling}}
    write_json(doc, args.out)
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    llm = LLM(**flags)
    try:
        doc["init_s"] = round(time.perf_counter() - t0, 2)
        doc["engine"] = engine_info(llm)
        if cuda:
            free, total = torch.cuda.mem_get_info()
            doc["memory"] = {"total_bytes": total, "free_after_init_bytes": free,
                             "max_allocated_bytes": torch.cuda.max_memory_allocated()}
        write_json(doc, args.out)
        prompts = random_prompts(args.num_prompts, args.prompt_len, 0.0, model_config(model_dir).vocab_size,
                                 llm.cfg.seed)
        temperature, top_k, top_p = SAMPLING_SETTINGS[args.sampling]
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                  ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)
        doc["measured_runs"] = []
        for _ in range(max(1, args.repeats)):
            empty_prefix_cache(llm)  # as `python -m runner bench`: every call computes its prompts
            outputs = llm.generate(prompts, sampling, use_tqdm=False)
            doc["measured"] = run_figures(llm, outputs)
            doc["measured_runs"].append(doc["measured"])
            write_json(doc, args.out)
            print(llm.last_stats.summary(), flush=True)
        if cuda and not args.no_profile:
            doc["profiled"] = profiled_run(llm, prompts, sampling)
            write_json(doc, args.out)
            print(f"profiled: {doc['profiled']}", flush=True)
    finally:
        llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
