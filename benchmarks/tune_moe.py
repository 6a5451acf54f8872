"""Tune the Triton fused-MoE experts: time candidate launch configurations per token count, write the table.

For each shape (``E,N,K``: experts, intermediate size, hidden size) and each token count, every candidate
configuration runs the experts on random routing (``--top-k`` experts per token) and the fastest is kept;
its output is checked against the default configuration's first, so a table can only hold configurations
that compute the same thing. The table goes to ``--out-dir`` under the name the experts look up
(``E=..,N=..,K=..,device_name=..[,dtype=..][,block_shape=..].json``, vLLM's format), for
``UBATCH_MOE_CONFIG_DIR``. ``--budget-s`` bounds the sweep: each token count gets an equal share, and its
search stops (keeping the best so far) when the share is spent. Each token count also times ``grouped_mm`` on
the same problem (where it is the fused kernel); beside the table goes the backend-choice table
(``...,backends.json``, ``ubatch/modular_moe/experts/backend_choice.py``): per token count the tuned Triton time,
every other backend's, and the fastest of the ones that can be mixed per bucket (``triton``, ``grouped_mm``),
which ``--experts-backend auto`` then runs at that count. ``--json`` also writes, per token count, the kept
configuration's time, the default configuration's, the other backends' and the backend chosen, and both files'
paths, so a table's gain and the backend to prefer are on record.

``--dry-run`` runs the same path on the CPU in Triton's interpreter (tiny shape, two candidates, float32),
to check the script and its tables' formats without a GPU; the other backend timed there is ``torch``, which
cannot be mixed per bucket, so its time is recorded and ``triton`` is chosen. Without a GPU and without
``--dry-run`` it exits 2.
Usage: ``python benchmarks/tune_moe.py --shape 128,768,2048 --top-k 8 [--dtype bfloat16|fp8] [--tokens 1 64 ...]
[--budget-s 1800] [--out-dir DIR]`` or ``python benchmarks/tune_moe.py --dry-run --out-dir DIR``.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ubatch.fp8 import Fp8Tensor, quantize_blocks
from ubatch.modular_moe.experts import make_experts
from ubatch.modular_moe.experts.backend_choice import write_choice_table
from ubatch.modular_moe.experts.triton_configs import (
    TritonMoEConfig,
    choice_file_name,
    config_dtype,
    default_config,
    table_file_names,
)
from ubatch.modular_moe.types import ExpertTokens

TOKENS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)  # vLLM's grid
DRY_RUN_SHAPE = (4, 64, 32)
DRY_RUN_TOKENS = (1, 8)
DRY_RUN_CONFIGS = (TritonMoEConfig(16, 16, 16, 1), TritonMoEConfig(16, 32, 32, 2))
FP8_BLOCK = (128, 128)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "fp8": torch.bfloat16}


def search_space(num_tokens: int, num_experts: int) -> list[TritonMoEConfig]:
    """vLLM's benchmark_moe space, BLOCK_SIZE_M capped where larger row blocks could hold only padding
    (``num_tokens`` routed rows at most per block), in a seeded random order after the default: a budget
    that ends the sweep early has then sampled the whole space evenly, not one corner of it."""
    block_ms = [m for m in (16, 32, 64, 128, 256) if m <= max(16, num_tokens)]
    space = [TritonMoEConfig(m, n, k, g, w, s) for m, n, k, g, w, s in itertools.product(
        block_ms, (32, 64, 128, 256), (64, 128, 256), (1, 16, 32, 64), (4, 8), (2, 3, 4, 5))]
    random.Random(0).shuffle(space)
    default = default_config(num_tokens, num_experts)
    return [default] + [c for c in space if c != default]


def parse_shape(text: str) -> tuple[int, int, int]:
    parts = text.split(",")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"shape {text!r} is not E,N,K (three positive integers)")
    e, n, k = (int(p) for p in parts)
    return e, n, k


def make_problem(shape: tuple[int, int, int], num_tokens: int, top_k: int, dtype_name: str, device: str,
                 seed: int = 0) -> tuple[ExpertTokens, torch.Tensor | Fp8Tensor, torch.Tensor | Fp8Tensor]:
    """Random tokens, routing (``top_k`` distinct experts per token) and expert weights for one timing."""
    num_experts, inter, hidden = shape
    if top_k > num_experts:
        raise ValueError(f"--top-k {top_k} exceeds the {num_experts} experts of shape {shape}")
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = DTYPES[dtype_name]
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g, device=device) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g, device=device) / inter**0.5
    hidden_states = torch.randn(num_tokens, hidden, generator=g, device=device).to(dtype)
    ids = torch.rand(num_tokens, num_experts, generator=g, device=device).topk(top_k, dim=1).indices
    weights = torch.rand(num_tokens, top_k, generator=g, device=device).softmax(dim=1)
    tokens = ExpertTokens("contiguous", hidden_states, topk_ids=ids, topk_weights=weights)
    if dtype_name != "fp8":
        return tokens, w13.to(dtype), w2.to(dtype)
    (qg, sg), (qu, su) = quantize_blocks(w13[:, :inter], FP8_BLOCK), quantize_blocks(w13[:, inter:], FP8_BLOCK)
    fp8_w13 = Fp8Tensor(torch.cat([qg, qu], dim=1), torch.cat([sg, su], dim=1), FP8_BLOCK, row_shards=2)
    return tokens, fp8_w13, Fp8Tensor(*quantize_blocks(w2, FP8_BLOCK), FP8_BLOCK)


def cpu_ms(fn: Callable[[], object], iters: int) -> float:
    """Wall time of one call in the interpreter (the dry run checks the path, not the numbers)."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def tune_one(shape: tuple[int, int, int], num_tokens: int, top_k: int, dtype_name: str, device: str,
             candidates: Sequence[TritonMoEConfig], budget_s: float, iters: int,
             log: Callable[[str], None] = print) -> tuple[TritonMoEConfig, float, int, float, dict[str, float]]:
    """The fastest candidate for one token count, its time (ms), how many candidates ran in the budget, the
    default configuration's time (ms: what the experts run without a table), and the other experts backends'
    times on the same problem (:func:`other_backends`)."""
    from triton.runtime.errors import OutOfResources

    from ubatch.modular_moe.experts.triton_experts import TritonExperts

    tokens, w13, w2 = make_problem(shape, num_tokens, top_k, dtype_name, device)
    default = TritonExperts(config=default_config(num_tokens, shape[0]))
    reference = default.run(tokens, w13, w2).float()
    from bench_gpu import cuda_median_ms  # the GPU benchmarks' CUDA-event timer

    timer = cuda_median_ms if device == "cuda" else cpu_ms
    default_ms = timer(functools.partial(default.run, tokens, w13, w2), iters)
    others = {name: timer(functools.partial(make_experts(name).run, tokens, w13, w2), iters)
              for name in other_backends(device)}
    tol = 1e-5 if DTYPES[dtype_name] == torch.float32 else 2 * 2.0**-7
    deadline = time.monotonic() + budget_s
    best: tuple[TritonMoEConfig, float] | None = None
    tried = 0
    for config in candidates:
        if best is not None and time.monotonic() > deadline:
            break
        experts = TritonExperts(config=config)
        try:
            out = experts.run(tokens, w13, w2)
        except OutOfResources as exc:  # tiles and stages that do not fit in shared memory
            log(f"  {config}: skipped ({exc})")
            continue
        try:
            torch.testing.assert_close(out.float(), reference, rtol=tol, atol=tol * reference.abs().max().item())
        except AssertionError as exc:
            raise AssertionError(f"{config} computes a different result than the default: {exc}") from None
        ms = timer(functools.partial(experts.run, tokens, w13, w2), iters)
        tried += 1
        if best is None or ms < best[1]:
            best = (config, ms)
    if best is None:
        raise RuntimeError(f"no candidate ran for {num_tokens} tokens of shape {shape}")
    return best[0], best[1], tried, default_ms, others


def other_backends(device: str) -> tuple[str, ...]:
    """The experts backends the tuned kernel is timed against: ``grouped_mm`` where it is the fused kernel (what
    ``--experts-backend auto`` runs there without a backend-choice table, and the other backend a bucket may
    choose), on the CPU ``torch`` (the dry run: recorded, never chosen)."""
    from ubatch.modular_moe.experts.grouped_mm_experts import has_fused_grouped_mm

    if device == "cpu":
        return ("torch",)
    return ("grouped_mm",) if has_fused_grouped_mm(device) else ()


def tune(shape: tuple[int, int, int], token_counts: Sequence[int], top_k: int, dtype_name: str, device: str,
         device_name: str, out_dir: Path, budget_s: float, iters: int,
         candidates: Callable[[int, int], Sequence[TritonMoEConfig]] = search_space
         ) -> tuple[Path, Path, list[dict[str, Any]]]:
    """Tune every token count of one shape and write its Triton table and its backend-choice table; returns both
    files and one row per token count (the configuration kept, its time, the default configuration's, the
    candidates timed, the other backends' times, the backend ``auto`` runs there)."""
    table: dict[str, dict[str, int]] = {}
    measured: dict[int, dict[str, float]] = {}
    rows: list[dict[str, Any]] = []
    for num_tokens in token_counts:
        config, ms, tried, default_ms, others = tune_one(shape, num_tokens, top_k, dtype_name, device,
                                                         candidates(num_tokens, shape[0]),
                                                         budget_s / len(token_counts), iters)
        print(f"E,N,K={shape} tokens={num_tokens}: {config} {ms:.4f} ms (best of {tried}; default "
              f"{default_ms:.4f} ms" + "".join(f"; {n} {t:.4f} ms" for n, t in others.items()) + ")", flush=True)
        table[str(num_tokens)] = config.to_json()
        measured[num_tokens] = {"triton": ms, **others}
        rows.append({"tokens": num_tokens, "config": config.to_json(), "ms": ms, "default_ms": default_ms,
                     "tried": tried, "other_backends_ms": others})
    block = FP8_BLOCK if dtype_name == "fp8" else None
    key = (*shape, device_name, config_dtype(str(DTYPES[dtype_name]).removeprefix("torch."), block), block)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / table_file_names(*key)[0]
    path.write_text(json.dumps(table, indent=4) + "\n")
    print(f"wrote {path}", flush=True)
    choice_path = out_dir / choice_file_name(*key)
    choices = write_choice_table(choice_path, measured)
    for row in rows:
        row["backend"] = choices.entries[row["tokens"]].backend
    print(f"wrote {choice_path}", flush=True)
    return path, choice_path, rows


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=parse_shape, action="append", help="E,N,K (repeatable)")
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="token counts to tune")
    p.add_argument("--top-k", type=int, default=8, help="experts per token")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                   help="activation/weight dtype; fp8 = block-FP8 weights (128x128) with bf16 activations")
    p.add_argument("--budget-s", type=float, default=1800.0, help="total sweep time, split over shapes and counts")
    p.add_argument("--iters", type=int, default=20, help="timed calls per candidate")
    p.add_argument("--out-dir", type=Path, default=Path("moe_configs"), help="where the table files go")
    p.add_argument("--json", type=Path, default=None,
                   help="also write what was tuned (both tables' paths; per token count the time, the default's, "
                        "the other backends' and the backend auto runs there) here")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU interpreter, tiny shape, two candidates: checks the path and the table format")
    args = p.parse_args(argv)
    if any(t < 1 for t in args.tokens):
        p.error(f"--tokens must be positive, got {args.tokens}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the experts are first built, below
        done = [tune(DRY_RUN_SHAPE, DRY_RUN_TOKENS, 2, "float32", "cpu", "cpu", args.out_dir, args.budget_s, 1,
                     candidates=lambda _tokens, _experts: DRY_RUN_CONFIGS)]
        write_summary(args.json, "cpu", [DRY_RUN_SHAPE], done)
        return 0
    if not torch.cuda.is_available():
        print("tune_moe: needs a CUDA GPU (torch.cuda.is_available() is False): it times the Triton kernels "
              "on the GPU the table is for; --dry-run checks the script on the CPU", file=sys.stderr)
        return 2
    if not args.shape:
        print("tune_moe: give at least one --shape E,N,K", file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name()
    done = []
    for shape in args.shape:
        done.append(tune(shape, args.tokens, args.top_k, args.dtype, "cuda", device_name, args.out_dir,
                         args.budget_s / len(args.shape), args.iters))
        write_summary(args.json, device_name, args.shape[:len(done)], done)  # a stopped run keeps what it tuned
    return 0


def write_summary(path: Path | None, device_name: str, shapes: Sequence[tuple[int, int, int]],
                  done: Sequence[tuple[Path, Path, list[dict[str, Any]]]]) -> None:
    """``--json``: the GPU, and per shape its Triton table's path, its backend-choice table's and the rows
    (nothing without ``--json``)."""
    if path is None:
        return
    tables = [{"shape": list(shape), "path": str(table), "choice_path": str(choices), "rows": rows}
              for shape, (table, choices, rows) in zip(shapes, done, strict=True)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"device_name": device_name, "tables": tables}, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
