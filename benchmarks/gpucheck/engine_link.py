"""The engine with an emulated all-to-all as slow as its compute: default flags against ``--enable-dbo``
(``python -m gpucheck.engine_link``; a GPU only).

On one GPU there is no all-to-all for DBO to hide, so the link is emulated on the GPU (a wait kernel on the
GPU's global timer per transfer, on a side stream, as ``bench_gpu.py``'s decode step) and calibrated so that a
step's link time equals its compute time (``--comm-over-compute``, default 1):

1. ``calibration``: the engine with default flags, eager, and a link of no cost (latency 0, 1 PB/s), one
   ``generate`` of the workload under the torch profiler: the GPU's compute per step (the union of every
   kernel but the link's, per step) and the link's bytes and transfers per step (its own counters: every step
   runs eager, so every transfer is counted);
2. the link: ``LinkSpec.calibrated`` (20 us per transfer, the bandwidth carrying the bytes in what is left);
3. ``default`` and ``dbo``: the engine as a user runs it (CUDA graphs) with that link, default flags and then
   ``--enable-dbo``; each a warm-up call, a measured call, and for DBO a profiled call giving the share of
   the link's time that overlapped compute (``link_hidden_pct``) and the cost model's decisions.

The JSON (``--out``) is rewritten after each phase, so a run stopped part-way keeps what it measured.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path
from typing import Any

import torch

from common import calibrated_link, empty_prefix_cache, write_json
from gpucheck.engine_run import profiled_events, run_figures
from ubatch.modular_moe.prepare_finalize import device_wait
from ubatch.trace_metrics import intersect, length

# this benchmark reads the in-process engine (its runner, core or loop statistics): the engine core stays here
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

FREE_LINK = "latency_us=0,gbps=1000000"  # no cost worth measuring: the calibration counts bytes through it
SEED = 0  # the engine's default seed: the prompts ``python -m runner generate`` makes


def link_and_compute(trace_events: list[dict[str, Any]]) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """The link's wait kernels and every other kernel of a profiler trace, as (start, end) intervals in µs."""
    kernels = [e for e in trace_events if e.get("cat") == "kernel" and "dur" in e]
    link = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if device_wait.KERNEL_NAME in e["name"]]
    compute = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if device_wait.KERNEL_NAME not in e["name"]]
    return link, compute


def hidden_pct(trace_events: list[dict[str, Any]]) -> float | None:
    """Share of the link's time that overlapped compute kernels (None: no link kernel ran)."""
    link, compute = link_and_compute(trace_events)
    total = length(link)
    return 100 * length(intersect(link, compute)) / total if total else None


def moe_link(llm: Any) -> Any:
    """The rank's emulated link (every MoE layer shares it)."""
    link = llm.runner.model.moe_runtime.link()
    if link is None:
        raise RuntimeError("the engine was built without its emulated link")
    return link


def warm_up_params() -> Any:
    from runner import SamplingParams

    return SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def calibrate(flags: dict[str, Any], prompts: list[Any], sampling: Any, ratio: float) -> dict[str, Any]:
    from runner import LLM

    llm = LLM(**flags, enforce_eager=True, emulate_link=FREE_LINK)
    try:
        llm.generate(prompts[:2], warm_up_params(), use_tqdm=False)
        link = moe_link(llm)
        bytes0, transfers0 = link.total_bytes, link.num_transfers
        events = profiled_events(llm, prompts, sampling)
        steps = llm.last_stats.num_steps
        nbytes, transfers = link.total_bytes - bytes0, link.num_transfers - transfers0
    finally:
        llm.close()
        del llm
        gc.collect()
    _, compute = link_and_compute(events)
    compute_s = length(compute) / 1e6 / steps
    return {"num_steps": steps, "compute_ms_per_step": 1e3 * compute_s, "bytes_per_step": nbytes / steps,
            "transfers_per_step": transfers / steps, "comm_over_compute": ratio,
            "link": calibrated_link(round(nbytes / steps), round(transfers / steps), ratio * compute_s)}


def measure(flags: dict[str, Any], prompts: list[Any], sampling: Any, profile_link: bool) -> dict[str, Any]:
    from runner import LLM

    llm = LLM(**flags)
    try:
        llm.generate(prompts[:2], warm_up_params(), use_tqdm=False)
        empty_prefix_cache(llm)  # the warm-up's prompts would be cache hits
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        out = run_figures(llm, outputs)
        if profile_link:
            out["link_hidden_pct"] = hidden_pct(profiled_events(llm, prompts, sampling))
    finally:
        llm.close()
        del llm
        gc.collect()
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a checkpoint directory or built-in name (default: the 1.2B model)")
    p.add_argument("--cache-dir", default=None, help="where a built-in model's checkpoint is written")
    p.add_argument("--comm-over-compute", type=float, default=1.0, help="link time / compute time per step")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args()


def main() -> int:
    if not torch.cuda.is_available():
        print("engine_link: needs a CUDA GPU: the link is a wait kernel on the GPU and its calibration reads the "
              "GPU's kernel times", file=sys.stderr)
        return 2
    args = parse_args()
    from bench_gpu import MODEL
    from runner import SamplingParams
    from runner.entrypoints.cli import random_prompts
    from runner.models.loader import model_config, resolve_model_path

    model = args.model or MODEL
    model_dir = str(resolve_model_path(model, args.cache_dir))
    flags: dict[str, Any] = {"model": model, "max_num_seqs": args.max_num_seqs}
    if args.cache_dir:
        flags["cache_dir"] = args.cache_dir
    prompts = random_prompts(args.num_prompts, args.prompt_len, 0.0, model_config(model_dir).vocab_size, SEED)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    doc: dict[str, Any] = {"flags": flags, "workload": {"num_prompts": args.num_prompts,
                                                        "prompt_len": args.prompt_len, "max_tokens": args.max_tokens}}
    doc["calibration"] = calibrate(flags, prompts, sampling, args.comm_over_compute)
    write_json(doc, args.out)
    link = doc["calibration"]["link"]
    print(f"link {link}: {doc['calibration']}", flush=True)
    for name, dbo in (("default", False), ("dbo", True)):
        doc[name] = measure({**flags, "emulate_link": link, **({"enable_dbo": True} if dbo else {})}, prompts,
                            sampling, profile_link=dbo)
        write_json(doc, args.out)
        print(f"{name}: {doc[name]['output_tokens_per_s']:,.0f} output tok/s, "
              f"{doc[name]['num_ubatched_steps']}/{doc[name]['num_steps']} steps ubatched", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
