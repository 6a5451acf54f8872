"""DeepSeek's decode pipeline (``--dbo-schedule deepseek``) against the ``moe`` schedule and DBO off, on decode steps.

Two DeepSeek-V3-shaped models (``small``; ``balanced``, where SHARED + ATTN-0 is about one MLP stage, as in
DeepSeek's profile) decode over 2 EP ranks (gloo processes) without scheduler or sampling, so only the schedule
differs; the emulated link is calibrated so that a DBO-off step's transfers take R x its compute. Medians of
alternating runs, plus one traced step per schedule for overlap metrics and time per phase.
Usage: ``python benchmarks/bench_deepseek_schedule.py [--models ...] [--ratios 0.5 1 2] [--repeats 15]
[--seqs 64] [--contexts 32 256]``; writes ``benchmarks/results/deepseek_schedule{,_phases}.csv``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import LINK_LATENCY_US, RESULTS_DIR, calibrated_link, write_csv
from runner.models.loader import TINY_MODELS

_SMALL = {**TINY_MODELS["tiny-deepseek-v3"], "vocab_size": 2048, "hidden_size": 512, "intermediate_size": 1024,
          "moe_intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
          "q_lora_rank": 192, "kv_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
          "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
          "first_k_dense_replace": 1}
# "small": ATTN-0 and SHARED are light next to the routed experts. "balanced": a wider q path (q_lora 512,
# 16 heads of 128+32) and two shared experts make SHARED + ATTN-0 about one MLP stage, the proportions of
# DeepSeek's published decode profile (where the dispatch fits under SHARED + ATTN-0).
MODELS = {"bench-dsv3-small": _SMALL,
          "bench-dsv3-balanced": {**_SMALL, "q_lora_rank": 512, "num_attention_heads": 16, "num_key_value_heads": 16,
                                  "qk_nope_head_dim": 128, "n_shared_experts": 2}}
for _name, _config in MODELS.items():  # at import: the spawned ranks resolve them too (temporary cache only)
    TINY_MODELS.setdefault(_name, _config)
BLOCK = 16
VARIANTS = ("off", "moe", "deepseek")
# Phases reported per traced step: span names on the ubatch tracks (what the model, kernel and link record).
PHASES = ("attention", "attn0", "attn1", "mlp_norm", "gate", "route", "pack", "unpack", "shared_experts", "experts",
          "combine_sum", "residual", "transfer_post", "link_wait", "recv_hook", "handoff")


def run_rank(model_name: str, cache_dir: str, ratios: list[float], repeats: int, seqs: int,
             contexts: list[int]) -> dict[str, Any] | None:
    """One rank's body; rank 0 returns the rows."""
    import torch
    import torch.distributed as dist

    from runner.attention.kv_cache import allocate_kv_caches, build_attention_metadata
    from runner.models.loader import load_model
    from ubatch import UBatchConfig, UBatchWrapper, set_forward_context, trace
    from ubatch.distributed import new_ep_groups
    from ubatch.forward_context import DPMetadata
    from ubatch.modular_moe.config import MoEParallelConfig
    from ubatch.slicing import padded_ubatch_slices
    from ubatch.trace_metrics import overlap_metrics

    torch.set_num_threads(1)
    rank = dist.get_rank()
    parallel = MoEParallelConfig(ep_rank=rank, ep_size=2, all2all_backend="torch_ll", ep_groups=new_ep_groups(2),
                                 max_dispatch_tokens_per_rank=seqs, emulate_link="latency_us=0,gbps=1000")
    model, _ = load_model(model_name, parallel, cache_dir=cache_dir)
    per_seq = -(-(max(contexts) + 1) // BLOCK)
    caches = allocate_kv_caches(model.kv_cache_specs(), seqs * per_seq, BLOCK, torch.float32)
    gen = torch.Generator().manual_seed(rank)
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=gen) * 0.5)
    model.bind_kv_caches(caches)
    blocks = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(seqs)]
    ids = torch.randint(0, MODELS[model_name]["vocab_size"], (seqs,), generator=gen)
    half = seqs // 2
    dp = DPMetadata((seqs, seqs), step_token_bound=seqs, ubatch_token_bounds=(half, seqs - half),
                    num_real_tokens=seqs, any_prefill=False)
    slices = padded_ubatch_slices([1] * seqs, seqs, 2)
    wrapper = UBatchWrapper(model, UBatchConfig(num_ubatches=2, handoff_timeout_s=300))
    runtime = model.moe_runtime
    link = runtime.link()
    assert link is not None

    def step(variant: str, meta: Any, rec: trace.TraceRecorder | None = None) -> tuple[float, torch.Tensor]:
        if variant != "off":
            model.set_dbo_schedule(variant)
        dist.barrier()
        with torch.no_grad(), set_forward_context(meta, ubatch_slices=None if variant == "off" else slices,
                                                  trace_rank=rank, dp_metadata=dp):
            if rec is not None:
                with trace.recording(rec):
                    t0 = time.perf_counter()
                    out = wrapper(input_ids=ids, positions=meta.positions)
                    elapsed = time.perf_counter() - t0
            else:
                t0 = time.perf_counter()
                out = wrapper(input_ids=ids, positions=meta.positions)
                elapsed = time.perf_counter() - t0
        return elapsed, out

    rows: list[dict[str, Any]] = []
    phase_rows: list[dict[str, Any]] = []
    try:
        for context in contexts:
            meta = build_attention_metadata([context] * seqs, [1] * seqs, blocks, BLOCK)
            runtime.set_link("latency_us=0,gbps=1000")
            for variant in VARIANTS * 2:  # warm-up: gloo connections, allocator
                step(variant, meta)
            rec = trace.TraceRecorder()
            bytes_before, transfers_before = link.total_bytes, link.num_transfers
            step("off", meta, rec)
            calib = [link.total_bytes - bytes_before, link.num_transfers - transfers_before,
                     overlap_metrics(rec, pid=rank).compute_us * 1e-6]
            box = [calib]
            dist.broadcast_object_list(box, src=0)  # every rank models the same wire: rank 0's calibration
            nbytes, transfers, compute_s = box[0]
            for ratio in ratios:
                comm_s = ratio * compute_s
                runtime.set_link(calibrated_link(int(nbytes), int(transfers), comm_s))
                times: dict[str, list[float]] = {v: [] for v in VARIANTS}
                outs: dict[str, torch.Tensor] = {}
                for _ in range(repeats):
                    for variant in VARIANTS:
                        elapsed, outs[variant] = step(variant, meta)
                        times[variant].append(elapsed)
                identical = torch.equal(outs["moe"], outs["deepseek"])
                metrics = {}
                for variant in VARIANTS:
                    rec = trace.TraceRecorder()
                    step(variant, meta, rec)
                    metrics[variant] = overlap_metrics(rec, pid=rank)
                if rank != 0:
                    continue
                t_off = statistics.median(times["off"])
                for variant in VARIANTS:
                    m = metrics[variant]
                    t = statistics.median(times[variant])
                    key = {"model": model_name.removeprefix("bench-dsv3-"), "context": context,
                           "comm_over_compute": ratio, "schedule": variant}
                    rows.append({**key, "compute_ms": round(compute_s * 1e3, 2), "comm_ms": round(comm_s * 1e3, 2),
                                 "step_ms": round(t * 1e3, 2), "speedup_vs_off": round(t_off / t, 3),
                                 "comm_hidden_pct": round(m.hidden_pct, 1), "bubble_ms": round(m.bubble_us / 1e3, 2),
                                 "recv_wait_ms": round(m.recv_wait_us / 1e3, 2), "handoffs": m.num_handoffs,
                                 "outputs_equal_moe": identical if variant == "deepseek" else ""})
                    phase_rows.append({**key, "traced_step_ms": round(m.wall_us / 1e3, 2),
                                       **{p: round(m.phases.get(p, 0.0) / 1e3, 2) for p in PHASES}})
    finally:
        wrapper.close()
    return {"rows": rows, "phases": phase_rows} if rank == 0 else None


def print_table(rows: list[dict[str, Any]], cols: list[str]) -> None:
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
    print(" | ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    for r in rows:
        print(" | ".join(str(r[c]).rjust(w) for c, w in zip(cols, widths, strict=True)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--ratios", nargs="+", type=float, default=[0.5, 1.0, 2.0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--seqs", type=int, default=64, help="decode sequences per rank (two ubatches of half)")
    ap.add_argument("--contexts", nargs="+", type=int, default=[32, 256],
                    help="cached tokens per sequence (one run each): short = balanced stages, long = heavy ATTN-1")
    ap.add_argument("--output", default=str(RESULTS_DIR / "deepseek_schedule.csv"))
    args = ap.parse_args()
    if args.seqs < 2 or args.seqs % 2:
        ap.error(f"--seqs must be an even number >= 2, got {args.seqs}")
    from runner.distributed.launch import launch

    rows: list[dict[str, Any]] = []
    phases: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ubatch-bench-") as cache_dir:
        for name in args.models:
            got = launch(run_rank, 2, args=(name, cache_dir, args.ratios, args.repeats, args.seqs, args.contexts),
                         timeout_s=3600, backend="gloo")[0]
            assert got is not None
            rows += got["rows"]
            phases += got["phases"]
    print(f"decode steps, DeepSeek-V3-shaped models ({', '.join(args.models)}: 4 layers, the first dense, 16 experts "
          f"top-4), 2 EP ranks (processes, torch_ll), {args.seqs} sequences per rank, cached tokens per sequence: "
          f"{args.contexts}; medians of {args.repeats}; link latency {LINK_LATENCY_US:g} us")
    print_table(rows, list(rows[0]))
    print("\nwhere the traced step went (ms per phase, rank 0; phases overlap the link, not each other)")
    cols = ["model", "context", "comm_over_compute", "schedule", "traced_step_ms"] + [
        p for p in PHASES if any(r[p] for r in phases)]
    print_table(phases, cols)
    write_csv(rows, args.output)
    write_csv(phases, Path(args.output).with_name(Path(args.output).stem + "_phases.csv"))


if __name__ == "__main__":
    main()
