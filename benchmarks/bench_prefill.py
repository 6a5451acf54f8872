"""Prefill attention of a step: the padded groups (``runner/attention/prefill_batch.py``) against the former
per-request loop (``reference.per_request_prefill``), on the CPU or a GPU.

For each shape (requests x new tokens, with earlier context or not) it times ``--layers`` calls of the
backend's ``attend`` over the step's prefill (the metadata built once, as a step does), the per-request loop
alike, and reports milliseconds per step (medians of ``--repeats``, the device synchronised at the end of each
step), the largest difference between the two, the number of groups, and on CUDA the peak memory one layer
adds. On CUDA it also says which SDPA kernels accept the two forms the Triton backend passes (``is_causal``
with ``enable_gqa``; the GQA-folded additive bias) and the per-request masked form (boolean mask with
``enable_gqa``), by running each under ``torch.nn.attention.sdpa_kernel`` restricted to one kernel.

Usage: ``python benchmarks/bench_prefill.py [--device cuda] [--dtype bfloat16] [--backend triton]
[--layers 16] [--repeats 5]``; CSV to ``benchmarks/results/prefill.csv``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from common import RESULTS_DIR, write_csv
from runner.attention.kv_cache import build_attention_metadata
from runner.attention.reference import per_request_prefill

HQ, HKV, D, BS = 16, 4, 128, 16
SHAPES = [  # (name, context per request, new tokens per request)
    ("32 prompts x 16", [0] * 32, [16] * 32),
    ("8 chunks of 256 after 768", [768] * 8, [256] * 8),
    ("1 prompt of 2048", [0], [2048]),
    ("1 chunk of 512 after 1536 + 31 prompts x 16", [1536] + [0] * 31, [512] + [16] * 31),
]


def make_backend(name: str):
    if name == "torch":
        from runner.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    from runner.attention.triton_backend import TritonAttentionBackend

    def no_decode(*a, **k):
        raise RuntimeError("prefill only")

    return TritonAttentionBackend(decode_fn=no_decode)


def repeated(times: int, fn: Callable[..., Any], *args: Any) -> Callable[[], list[Any]]:
    """``fn(*args)`` run ``times`` times (once per layer), as one call to time."""
    return lambda: [fn(*args) for _ in range(times)]


def timed(fn, device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def sdpa_kernels(device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Which kernel takes each form, on a small GQA group (4 requests, 64 queries after 64 keys of context)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    r, lq, s, g = 4, 64, 128, HQ // HKV
    q = torch.randn(r, HQ, lq, D, device=device, dtype=dtype)
    k, v = (torch.randn(r, HKV, s, D, device=device, dtype=dtype) for _ in range(2))
    mask = (torch.arange(s, device=device) <= torch.arange(s - lq, s, device=device)[:, None]).expand(r, 1, lq, s)
    qf = q.view(r, HKV, g * lq, D)
    bias = torch.zeros(r, 1, g * lq, s, device=device, dtype=dtype).masked_fill_(~mask.repeat(1, 1, g, 1),
                                                                               float("-inf"))
    forms = {
        "is_causal + enable_gqa (same-length prompts)": lambda: F.scaled_dot_product_attention(
            q, k[:, :, :lq], v[:, :, :lq], is_causal=True, enable_gqa=True),
        "GQA-folded additive bias (other groups)": lambda: F.scaled_dot_product_attention(qf, k, v, attn_mask=bias),
        "bool mask + enable_gqa (former per-request)": lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=True),
    }
    rows = []
    for form, fn in forms.items():
        ok = []
        for kernel in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                       SDPBackend.MATH):
            try:
                with sdpa_kernel([kernel]):
                    fn()
                ok.append(kernel.name)
            except RuntimeError:
                pass
        rows.append({"form": form, "kernels": " ".join(ok) or "none"})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--backend", default=None, choices=["torch", "triton"],
                    help="default: triton on CUDA, torch on the CPU (what --attention-backend auto picks)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shapes", type=int, nargs="*", default=None, help="indices into SHAPES (default: all)")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    name = args.backend or ("triton" if device.type == "cuda" else "torch")
    backend = make_backend(name)
    kind = "torch" if name == "torch" else "sdpa"
    rows = []
    for i, (label, ctx, qlen) in enumerate(SHAPES):
        if args.shapes is not None and i not in args.shapes:
            continue
        need = [-(-(c + q) // BS) for c, q in zip(ctx, qlen, strict=True)]
        ids = torch.randperm(sum(need)).tolist()
        blocks, at = [], 0
        for n in need:
            blocks.append(ids[at:at + n])
            at += n
        k_cache = torch.randn(sum(need), BS, HKV, D, device=device, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(sum(qlen), HQ, D, device=device, dtype=dtype)
        meta = backend.build_metadata(build_attention_metadata(ctx, qlen, blocks, BS, device=device))
        batched = timed(repeated(args.layers, backend.attend, q, k_cache, v_cache, meta, D ** -0.5),
                        device, args.repeats)
        loop = timed(repeated(args.layers, per_request_prefill, kind, q, k_cache, v_cache, meta, D ** -0.5),
                     device, args.repeats)
        got = backend.attend(q, k_cache, v_cache, meta, D ** -0.5)
        want = per_request_prefill(kind, q, k_cache, v_cache, meta, D ** -0.5)
        diff = max(float((got[r].float() - w.float()).abs().max()) for r, w in want.items())
        row = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "dtype": str(dtype).replace("torch.", ""), "backend": name, "shape": label,
               "groups": len(meta.prefill_groups), "layers": args.layers,
               "batched_ms": round(batched * 1e3, 3), "per_request_ms": round(loop * 1e3, 3),
               "max_abs_diff": f"{diff:.3g}"}
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            backend.attend(q, k_cache, v_cache, meta, D ** -0.5)
            torch.cuda.synchronize()
            row["layer_peak_mib"] = round((torch.cuda.max_memory_allocated(device) - base) / 2 ** 20, 1)
        print(row, flush=True)
        rows.append(row)
    write_csv(rows, RESULTS_DIR / "prefill.csv")
    if device.type == "cuda":
        for row in sdpa_kernels(device, dtype):
            print(row, flush=True)


if __name__ == "__main__":
    main()
