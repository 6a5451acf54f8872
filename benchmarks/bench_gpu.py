"""The engine's GPU compute against the hardware limit, and DBO on a GPU decode step (one GPU).

``kernels``: every experts and attention backend on a Qwen3-30B-A3B-like layer (``bench-qwen3-moe-1b``), eager
and replayed, against the larger of the memory and FLOP limits measured on the GPU. ``step``: a 512-token decode
step eager / eager-DBO / graph / graph-DBO, without a link and with the link calibrated to comm/compute 0.5, 1, 2.
``qwen3-30b`` (only when named): one layer of Qwen3-30B-A3B's experts (128 of intermediate 768, hidden 2048, top 8)
at 256 and 2048 tokens for every experts backend against the same limit, and that time for its 48 layers.
``sampling``: a decode step's sampling of 256 and 1024 rows at the benchmark model's vocabulary and Qwen3's, LM
head included, greedy (from float32 logits as before, and from the model's bf16 ones as now; replayed, the
decode graphs' head), with a temperature, with Qwen3's temperature, top-k and top-p, with Llama 3's temperature and
top-p (the last three replayed: what the decode graphs' draw heads run), with top-k, top-p, min-p and logprobs,
and the three draw heads as the engine captures them with the fused tails on (the draw by the fused kernel,
``runner/worker/fused_draw.py``): GPU time eager and replayed and the host's launch time, against the LM head's
limit.
``tails`` (only when named): each fused pointwise tail (``--fused-tails``: residual add + RMSNorm, q/k RMSNorm +
RoPE, router top-k) against the torch ops it replaces, at the benchmark model's and Qwen3-30B-A3B's shapes, 256
and 2048 tokens, eager and replayed, each against its bandwidth limit (bytes read + written / measured copy rate).
Writes CSVs under ``benchmarks/results/`` and, with ``--json``, JSON rewritten after each row (what ``make
gpu-check`` reads; ``--quick`` is its short form). Without a GPU it exits 2. Usage: ``python
benchmarks/bench_gpu.py [--sections kernels sampling step qwen3-30b tails] [--iters 20] [--ratios 0.5 1 2] [--quick]
[--json PATH]``.
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

if __name__ == "__main__" and not torch.cuda.is_available():
    print("bench_gpu: needs a CUDA GPU (torch.cuda.is_available() is False): it times CUDA kernels and "
          "CUDA-graph replays against the GPU's own limits, which a CPU run cannot stand in for", file=sys.stderr)
    sys.exit(2)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, calibrated_link, write_csv, write_json
from runner.models.loader import TINY_MODELS
from ubatch.modular_moe.prepare_finalize import device_wait
from ubatch.trace_metrics import intersect, length

MODEL = "bench-qwen3-moe-1b"
MODEL_CONFIG = TINY_MODELS[MODEL]  # a built-in benchmark model (runner.models.loader.BENCH_MODELS)
EXPERT_TOKENS = (64, 512, 2048)
QUICK_EXPERT_TOKENS = (512, 2048)  # the GPU-compute goals' shapes
DECODE_SHAPES = ((512, 512), (256, 4096))  # (requests, context)
STEP_TOKENS, STEP_CONTEXT = 512, 512
QUICK_ITERS, QUICK_RATIOS = 5, (1.0,)
# Qwen3-30B-A3B's published shape; the ``qwen3-30b`` section times one layer's experts (random bf16 weights made
# on the device), the figure a decode step of the full model repeats once per layer
QWEN3_30B_A3B = {"num_hidden_layers": 48, "num_experts": 128, "moe_intermediate_size": 768, "hidden_size": 2048,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "num_experts_per_tok": 8, "head_dim": 128}
QWEN3_30B_KERNEL = "experts (Qwen3-30B-A3B layer)"
QWEN3_30B_TOKENS = (256, 2048)
TAILS = ("add + RMSNorm", "q/k RMSNorm + RoPE", "router top-k")  # the ``tails`` section's kernels
TAILS_TOKENS = (256, 2048)
SAMPLING_KERNEL = "LM head + sampling"
SAMPLING_ROWS = (256, 1024)
SAMPLING_VOCABS = (MODEL_CONFIG["vocab_size"], 151936)  # the benchmark model's, Qwen3's
SAMPLING_MODES = ("greedy, float32 logits", "greedy", "temperature", "qwen3: temperature, top-k 20, top-p",
                  "llama3: temperature, top-p", "top-k, top-p, min-p, logprobs 5",
                  "temperature, fused draw (draw head)", "qwen3, fused draw (top-k head)",
                  "llama3, fused draw (top-p head)")
# the modes that draw with the fused kernel (runner/worker/fused_draw.py), which needs Triton on the device
FUSED_SAMPLING_MODES = SAMPLING_MODES[-3:]
SECTIONS = ("kernels", "sampling", "step", "qwen3-30b", "tails")

Row = dict[str, Any]
Emit = Callable[[Row], None]  # called with each row as soon as it is measured


def experts_shape(tokens: int) -> str:
    """The ``shape`` of an experts row (``make gpu-check`` looks rows up by it)."""
    return f"{tokens} tokens"


def attention_shape(requests: int, context: int) -> str:
    """The ``shape`` of a decode-attention row."""
    return f"{requests} x {context}"


def default_backends(device: str = "cuda") -> dict[str, str]:
    """What ``--experts-backend auto`` and ``--attention-backend auto`` pick on ``device``: the rows the
    engine's defaults run."""
    from runner.attention.selector import resolve_attention_backend
    from ubatch.modular_moe.experts import resolve_experts_backend

    return {"experts": resolve_experts_backend("auto", device), "attention": resolve_attention_backend("auto", device)}


# ---- timing ---------------------------------------------------------------------------------------------
def cuda_median_ms(fn: Callable[[], Any], iters: int, warmup: int = 3) -> float:
    """Median GPU time of ``fn`` between two CUDA events (the host waits only after each call)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def as_graph(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` captured once into a CUDA graph (after a side-stream warm-up); returns the replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def time_against_limit(row: Row, run: Callable[[], Any], limit_ms: float, iters: int, digits: int = 3) -> None:
    """Put ``run``'s median ms, eager and replayed from a CUDA graph, in ``row`` (``eager_ms``, ``graph_ms``),
    each also as a multiple of ``limit_ms`` (``*_x_limit``); a run that cannot be captured keeps its eager
    figures and gets ``graph_ms`` 'not capturable: <why>' (the torch experts sync with the host)."""
    row["eager_ms"] = round(cuda_median_ms(run, iters), digits)
    row["eager_x_limit"] = round(row["eager_ms"] / limit_ms, 2)
    try:
        replay = as_graph(run)
    except Exception as exc:  # noqa: BLE001 - recorded in the row: the report says why
        row["graph_ms"] = f"not capturable: {type(exc).__name__}: {str(exc)[:100]}"
        return
    row["graph_ms"] = round(cuda_median_ms(replay, iters), digits)
    row["graph_x_limit"] = round(row["graph_ms"] / limit_ms, 2)


def copy_bandwidth(iters: int) -> float:
    """Bytes per second of a 1 GiB device-to-device copy, counting read + write."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = cuda_median_ms(lambda: y.copy_(x), iters)
    return 2 * (1 << 30) / (ms * 1e-3)


def gemm_flops(iters: int) -> float:
    """FLOP/s of a large bf16 matmul: the dense rate a grouped GEMM can at best reach."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = cuda_median_ms(lambda: a @ b, iters)
    return 2 * n ** 3 / (ms * 1e-3)


class Limits:
    """The measured roofline: a kernel's limit is the larger of its memory and FLOP limits."""

    def __init__(self, iters: int) -> None:
        self.read_bytes_per_s = copy_bandwidth(iters) / 2  # one-way: a kernel reads its operands once
        self.flops_per_s = gemm_flops(iters)

    def ms(self, bytes_read: float, flops: float) -> float:
        return max(bytes_read / self.read_bytes_per_s, flops / self.flops_per_s) * 1e3


# ---- kernels --------------------------------------------------------------------------------------------
def experts_traffic(cfg: dict[str, Any], tokens: int, touched: int) -> tuple[int, int]:
    """(bytes read, FLOPs) of one layer's bf16 experts on ``tokens`` tokens routed to ``touched`` experts: each
    touched expert's gate/up/down weights and the tokens once; three GEMMs per (token, expert) route."""
    h, i, k = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
    expert_bytes = (2 * i * h + h * i) * 2
    return touched * expert_bytes + 2 * tokens * h * 2, 2 * tokens * k * 3 * h * i


def experts_rows(limits: Limits, iters: int, expert_tokens: tuple[int, ...] = EXPERT_TOKENS,
                 emit: Emit = print, cfg: dict[str, Any] = MODEL_CONFIG, kernel: str = "experts") -> list[Row]:
    """Every experts backend (but DeepGEMM's, which takes FP8 masked batches) on one layer of ``cfg``'s
    experts, random bf16 weights made on the device, against the torch backend's output and the limit."""
    from ubatch.modular_moe.experts import EXPERTS_BACKENDS, make_experts
    from ubatch.modular_moe.types import ExpertTokens

    e, h, i, k = cfg["num_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
    torch.manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) / h ** 0.5
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) / i ** 0.5
    rows = []
    for tokens in expert_tokens:
        x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
        weights, ids = torch.topk(torch.softmax(torch.randn(tokens, e, device="cuda"), -1), k)
        batch = ExpertTokens("contiguous", x, ids.to(torch.int32), (weights / weights.sum(-1, keepdim=True)).float())
        touched = int(torch.unique(ids).numel())
        limit = limits.ms(*experts_traffic(cfg, tokens, touched))
        reference = make_experts("torch").apply(batch, w13, w2).float()
        for name in EXPERTS_BACKENDS:
            if name == "deep_gemm":  # it takes fp8 masked batches, not this bf16 contiguous one
                continue
            row: Row = {"kernel": kernel, "backend": name, "shape": experts_shape(tokens),
                        "limit_ms": round(limit, 3)}
            try:
                backend = make_experts(name)
                run = functools.partial(backend.apply, batch, w13, w2)
                out = run().float()
                row["max_rel_err"] = f"{((out - reference).abs().max() / reference.abs().max()).item():.1e}"
                time_against_limit(row, run, limit, iters)
            except Exception as exc:  # noqa: BLE001
                row["eager_ms"] = f"{type(exc).__name__}: {str(exc)[:100]}"
            rows.append(row)
            emit(row)
    return rows


def attention_rows(limits: Limits, iters: int, emit: Emit = print) -> list[Row]:
    from decode_backends import decode_attention_backends

    cfg = MODEL_CONFIG
    hq, hkv, d, block = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], 16
    rows = []
    for reqs, ctx in DECODE_SHAPES:
        torch.manual_seed(0)
        num_blocks = reqs * ctx // block
        cache = torch.randn(num_blocks, block, 2, hkv, d, device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(reqs, ctx // block)
        seq_lens = torch.full((reqs,), ctx, device="cuda", dtype=torch.int32)
        q = torch.randn(reqs, hq, d, device="cuda", dtype=torch.bfloat16)
        kv_bytes = cache.numel() * cache.element_size()
        limit = limits.ms(kv_bytes + 2 * q.numel() * 2, 4 * reqs * hq * ctx * d)
        reference = None
        for name, run in decode_attention_backends(q, cache, table, seq_lens, d ** -0.5).items():
            row: Row = {"kernel": "decode attention", "backend": name, "shape": attention_shape(reqs, ctx),
                        "limit_ms": round(limit, 3)}
            try:
                out = run().float()
                reference = out if reference is None else reference
                row["max_rel_err"] = f"{((out - reference).abs().max() / reference.abs().max()).item():.1e}"
                time_against_limit(row, run, limit, iters)
            except Exception as exc:  # noqa: BLE001
                row["eager_ms"] = f"{type(exc).__name__}: {str(exc)[:100]}"
            rows.append(row)
            emit(row)
        del cache
    return rows


# ---- the fused tails -----------------------------------------------------------------------------------
def tails_traffic(kernel: str, cfg: dict[str, Any], tokens: int) -> int:
    """Bytes one call of a fused tail reads plus writes on ``tokens`` tokens of ``cfg``, bf16 activations:
    add + RMSNorm reads x, the residual and the weight and writes the output and the new residual; q/k norm +
    RoPE reads q, k, cos, sin and both norm weights and writes q and k; the router reads fp32 logits and writes
    fp32 weights and int64 ids."""
    h, d, k = cfg["hidden_size"], cfg["head_dim"], cfg["num_experts_per_tok"]
    heads = cfg["num_attention_heads"] + cfg["num_key_value_heads"]
    if kernel == "add + RMSNorm":
        return (4 * tokens * h + h) * 2
    if kernel == "q/k RMSNorm + RoPE":
        return (2 * tokens * heads * d + tokens * d + 2 * d) * 2
    if kernel == "router top-k":
        return tokens * cfg["num_experts"] * 4 + tokens * k * (4 + 8)
    raise ValueError(f"unknown tail {kernel!r}; expected one of {TAILS}")


def tail_runs(kernel: str, cfg: dict[str, Any], tokens: int) -> dict[str, Callable[[], Any]]:
    """``{"fused": ..., "torch": ...}``: the two implementations of one tail on random bf16 inputs made on the
    device, each a call returning its outputs as one tuple."""
    from runner.models.configs import RopeConfig
    from runner.models.layers import RMSNorm, RotaryEmbedding
    from ubatch.modular_moe.fused_router import fused_select_experts
    from ubatch.modular_moe.router import select_experts

    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    h, d = cfg["hidden_size"], cfg["head_dim"]
    if kernel == "add + RMSNorm":
        x, residual = torch.randn(tokens, h, device=dev, dtype=bf16), torch.randn(tokens, h, device=dev, dtype=bf16)
        fused, plain = (RMSNorm(h, 1e-6, bf16).to(dev).requires_grad_(False) for _ in range(2))
        fused.fused = True
        return {"fused": lambda: fused.add_and_norm(x, residual), "torch": lambda: plain.add_and_norm(x, residual)}
    if kernel == "q/k RMSNorm + RoPE":
        q = torch.randn(tokens, cfg["num_attention_heads"], d, device=dev, dtype=bf16)
        k = torch.randn(tokens, cfg["num_key_value_heads"], d, device=dev, dtype=bf16)
        q_norm, k_norm = (RMSNorm(d, 1e-6, bf16).to(dev).requires_grad_(False) for _ in range(2))
        ropes = {name: RotaryEmbedding(d, RopeConfig(rope_theta=1e6)) for name in ("fused", "torch")}
        ropes["fused"].fused = True
        cos, sin = ropes["torch"].cos_sin(torch.arange(tokens, device=dev) * 7, bf16)
        return {name: functools.partial(rope.norm_and_rotate, q, k, cos, sin, q_norm, k_norm)
                for name, rope in ropes.items()}
    if kernel == "router top-k":
        logits = torch.randn(tokens, cfg["num_experts"], device=dev)  # fp32: no ties, so one id order
        top_k = cfg["num_experts_per_tok"]
        return {"fused": lambda: fused_select_experts(logits, top_k, True),
                "torch": lambda: select_experts(logits, top_k, True)}
    raise ValueError(f"unknown tail {kernel!r}; expected one of {TAILS}")


def tails_rows(limits: Limits, iters: int, emit: Emit = print) -> list[Row]:
    """Each tail, fused and torch, at the benchmark model's and Qwen3-30B-A3B's shapes: eager and replayed
    times against the tail's bandwidth limit, and the fused outputs' largest difference from torch's."""
    rows = []
    copy_bytes_per_s = 2 * limits.read_bytes_per_s  # read + write, as the traffic counts them
    for model, cfg in ((MODEL, MODEL_CONFIG), ("Qwen3-30B-A3B", QWEN3_30B_A3B)):
        for tokens in TAILS_TOKENS:
            for kernel in TAILS:
                limit = tails_traffic(kernel, cfg, tokens) / copy_bytes_per_s * 1e3
                runs = tail_runs(kernel, cfg, tokens)
                reference = runs["torch"]()
                for name, run in runs.items():
                    row: Row = {"kernel": kernel, "model": model, "backend": name, "shape": experts_shape(tokens),
                                "limit_ms": round(limit, 4)}
                    try:
                        out = run()
                        row["max_abs_err"] = max(float((a.double() - b.double()).abs().max())
                                                 for a, b in zip(out, reference, strict=True))
                        time_against_limit(row, run, limit, iters, digits=4)
                    except Exception as exc:  # noqa: BLE001
                        row["eager_ms"] = f"{type(exc).__name__}: {str(exc)[:100]}"
                    rows.append(row)
                    emit(row)
    return rows


def sampling_shape(rows: int, vocab: int) -> str:
    """The ``shape`` of a sampling row."""
    return f"{rows} rows x {vocab} vocab"


def sampling_inputs(rows: int, vocab: int, hidden: int, device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """The sampling section's seeded bf16 hidden rows ``[rows, hidden]`` and LM head weight ``[vocab, hidden]``."""
    torch.manual_seed(0)
    x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
    return x, torch.randn(vocab, hidden, device=device, dtype=torch.bfloat16) * hidden ** -0.5


def sampling_runs(rows: int, vocab: int, hidden: int, device: str = "cuda") -> dict[str, Callable[[], Any]]:
    """Each sampling mode of :data:`SAMPLING_MODES` on ``rows`` random bf16 hidden rows made on the device: the LM
    head (bf16, ``[vocab, hidden]``), then the pick as the engine runs it (``sampler.sample_on_device`` with the
    step's metadata built once, as a decode step's is). The fused-draw modes run a graph head as the engine
    captures it with the fused tails on (``cuda_graphs.draw_sampling_head``, its inputs staged once): every row
    drawing, the draw and top-k heads' kernel dividing and cutting as it reads."""
    import numpy as np

    from runner.sampling_params import SamplingParams
    from runner.worker.cuda_graphs import draw_sampling_head
    from runner.worker.sampler import DRAW_COLUMNS, SamplingHead, greedy_rows, sample_on_device
    from runner.worker.sampling_metadata import build_sampling_metadata
    from runner.worker.sampling_settings import SamplingSettings

    x, weight = sampling_inputs(rows, vocab, hidden, device)

    def lm_head(hidden_rows: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden_rows, weight)

    def logits() -> torch.Tensor:
        return lm_head(x)

    def sampled_with(params: SamplingParams) -> Callable[[], Any]:
        settings = SamplingSettings.of_rows([params] * rows, list(range(rows)), [16] * rows, vocab)
        index = np.arange(rows)
        meta = build_sampling_metadata(settings, index, index, np.full(rows, 3), device)
        return lambda: sample_on_device(logits(), meta)

    def head(kind: SamplingHead, temperature: float, top_k: int, top_p: float) -> Callable[[], Any]:
        staged = {"temperature": temperature, "uniform": 0.5, "top_k": float(top_k), "top_p_floor": 1 - top_p}
        inputs = torch.tensor([[staged[name] for name in DRAW_COLUMNS]] * rows, device=device)
        run = draw_sampling_head(lambda h: lm_head(h).float(), vocab, inputs, kind, fused=True)
        return lambda: run(x)

    return {"greedy, float32 logits": lambda: greedy_rows(logits().float()),
            "greedy": lambda: greedy_rows(logits()),
            "temperature": sampled_with(SamplingParams(temperature=0.8, seed=1)),
            "qwen3: temperature, top-k 20, top-p": sampled_with(SamplingParams(temperature=0.6, seed=1, top_k=20,
                                                                              top_p=0.95)),
            "llama3: temperature, top-p": sampled_with(SamplingParams(temperature=0.6, seed=1, top_p=0.9)),
            "top-k, top-p, min-p, logprobs 5": sampled_with(SamplingParams(temperature=0.8, seed=1, top_k=50,
                                                                            top_p=0.9, min_p=0.05, logprobs=5)),
            "temperature, fused draw (draw head)": head(SamplingHead.DRAW, 0.8, 0, 1.0),
            "qwen3, fused draw (top-k head)": head(SamplingHead.TOP_K, 0.6, 20, 0.95),
            "llama3, fused draw (top-p head)": head(SamplingHead.TOP_P, 0.6, 0, 0.9)}


def host_launch_us(fn: Callable[[], Any], iters: int) -> float:
    """Median host microseconds to launch one call of ``fn`` (the GPU drained before each, not waited on)."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def sampling_rows(limits: Limits, iters: int, emit: Emit = print) -> list[Row]:
    """Each sampling mode at each (rows, vocabulary): GPU ms eager and replayed against the LM head's limit
    (reading its weight, or its FLOPs), and the host's µs to launch it eagerly and as a replay."""
    hidden = MODEL_CONFIG["hidden_size"]
    out = []
    for vocab in SAMPLING_VOCABS:
        for rows in SAMPLING_ROWS:
            limit = limits.ms(vocab * hidden * 2, 2 * rows * hidden * vocab)
            for mode, run in sampling_runs(rows, vocab, hidden).items():
                row: Row = {"kernel": SAMPLING_KERNEL, "shape": sampling_shape(rows, vocab), "backend": mode,
                            "limit_ms": round(limit, 4)}
                try:
                    time_against_limit(row, run, limit, iters, digits=4)
                    row["eager_host_us"] = round(host_launch_us(run, iters), 1)
                    if isinstance(row.get("graph_ms"), float):
                        row["graph_host_us"] = round(host_launch_us(as_graph(run), iters), 1)
                except Exception as exc:  # noqa: BLE001 - recorded in the row
                    row["eager_ms"] = f"{type(exc).__name__}: {str(exc)[:100]}"
                out.append(row)
                emit(row)
            gc.collect()
            torch.cuda.empty_cache()
    return out


# ---- the decode step ------------------------------------------------------------------------------------
def count_host_syncs(fn: Callable[[], Any]) -> int:
    """Host syncs CUDA reports for one call of ``fn`` (sync debug mode "warn" warns once per sync)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def sleep_overlap_pct(fn: Callable[[], Any], repeats: int = 3) -> tuple[float, dict[str, float]]:
    """Share of the emulated link's wait-kernel time that overlaps compute kernels, from a profiler trace;
    also the top kernels by GPU time (per call) so the table can say where the time went."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as fh:
        prof.export_chrome_trace(fh.name)
        with open(fh.name) as trace_file:
            events = [e for e in json.load(trace_file)["traceEvents"] if e.get("cat") == "kernel"]
    sleeps = [(e["ts"], e["ts"] + e["dur"]) for e in events if device_wait.KERNEL_NAME in e["name"]]
    compute = [(e["ts"], e["ts"] + e["dur"]) for e in events if device_wait.KERNEL_NAME not in e["name"]]

    slept = length(sleeps)
    hidden = length(intersect(sleeps, compute))
    top: dict[str, float] = {}
    for e in events:
        top[e["name"][:48]] = top.get(e["name"][:48], 0.0) + e["dur"] / repeats / 1e3
    return (100 * hidden / slept if slept else 0.0), dict(sorted(top.items(), key=lambda kv: -kv[1])[:4])


def step_row(mode: str, times: dict[str, float], ratio: float | None, comm: float = 0.0,
             compute: dict[str, float] | None = None, overlap: tuple[float, dict[str, float]] | None = None,
             graph_mib: float | None = None, host_syncs: int | None = None) -> Row:
    """One row of the step table from what was measured: ``times`` (ms per mode under this link), ``ratio``
    (comm/compute the link was set to; None: no link), ``comm`` (the link's ms per step), ``compute`` (each
    mode's link-free ms), ``overlap`` (link hidden %, top kernels), ``graph_mib`` (graph modes),
    ``host_syncs`` (eager modes)."""
    plain = mode.removesuffix("-dbo")
    dbo = mode.endswith("-dbo")
    row: Row = {"comm_over_compute": ratio if ratio is not None else 0, "mode": mode,
                "step_ms": round(times[mode], 3), "vs_no_dbo": round(times[plain] / times[mode], 3) if dbo else 1.0}
    if ratio is not None and compute is not None:
        ideal = max(compute[plain], comm)
        hidden, top = overlap if overlap is not None else (None, {})
        row.update(compute_ms=round(compute[plain], 3), comm_ms=round(comm, 3), ideal_ms=round(ideal, 3),
                   step_over_ideal=round(times[mode] / ideal, 3),
                   link_hidden_pct=round(hidden, 1) if hidden is not None else None,
                   top_kernels_ms=json.dumps({k: round(v, 3) for k, v in top.items()}))
    else:
        row["split_cost_ms"] = round(times[mode] - times[plain], 3) if dbo else 0.0
    if graph_mib is not None:
        row["graph_mib"] = round(graph_mib, 1)
    if host_syncs is not None:
        row["host_syncs"] = host_syncs
    return row


class StepBench:
    """One ModelRunner on the bench model; eager and graph decode steps with and without DBO."""

    def __init__(self, iters: int, cache_dir: str | None = None) -> None:
        from bench_cudagraph import Decode
        from runner.config import RunnerConfig
        from runner.worker.model_runner import ModelRunner

        self.iters = iters
        self.cache_dir = cache_dir or tempfile.mkdtemp(prefix="bench_gpu_")  # where the model's checkpoint goes
        cfg = RunnerConfig(model=MODEL, dtype="bfloat16", cache_dir=self.cache_dir, enable_dbo=True,
                           dbo_decode_token_threshold=2, emulate_link="latency_us=0,gbps=1000000",
                           max_num_seqs=STEP_TOKENS, max_num_batched_tokens=STEP_TOKENS,
                           max_model_len=STEP_CONTEXT + 64, enforce_eager=True)
        self.runner = ModelRunner(cfg)
        self.decode = Decode(self.runner, STEP_CONTEXT)
        self.runtime = self.runner.model.moe_runtime

    def eager(self, dbo: bool) -> Callable[[], Any]:
        return self.decode.eager_step(self.runner.wrapper if dbo else self.runner.model, STEP_TOKENS, dbo)

    def graphs(self) -> dict[bool, tuple[Any, float]]:
        """A fresh capture of the plain and the DBO graph for the current link: {dbo: (graph runner, MiB)}."""
        from cudagraph.dispatch import GraphKey, token_split
        from runner.worker.cuda_graphs import make_graph_runner

        out = {}
        for dbo in (False, True):
            key = GraphKey(STEP_TOKENS, token_split(STEP_TOKENS, 2) if dbo else ())
            gr = make_graph_runner(self.runner, sizes=[STEP_TOKENS], progress=False,
                                   wrapper=self.runner.wrapper if dbo else None, keys=[key])
            report = gr.capture()
            out[dbo] = (gr, report.graph_bytes / 2 ** 20)
        return out

    def replay(self, gr: Any, dbo: bool) -> Callable[[], Any]:
        return self.decode.replay_step(gr, STEP_TOKENS, dbo)

    def measure(self, ratio: float | None, comm: float = 0.0, compute: dict[str, float] | None = None,
                emit: Emit = print) -> list[Row]:
        """Every mode under the current link. ``comm``: the link's time per step (ms) it was set to;
        ``compute``: each mode's time without a link (ms), from the first, link-free call."""
        graphs = self.graphs()
        modes = {"eager": self.eager(False), "eager-dbo": self.eager(True),
                 "graph": self.replay(graphs[False][0], False), "graph-dbo": self.replay(graphs[True][0], True)}
        times = {m: cuda_median_ms(fn, self.iters) for m, fn in modes.items()}
        rows = []
        for mode, fn in modes.items():
            overlap = sleep_overlap_pct(fn) if ratio is not None and compute is not None else None
            graph_mib = graphs[mode == "graph-dbo"][1] if mode.startswith("graph") else None
            syncs = None if mode.startswith("graph") else count_host_syncs(fn)
            row = step_row(mode, times, ratio, comm, compute, overlap, graph_mib, syncs)
            rows.append(row)
            emit(row)
        for gr, _ in graphs.values():
            gr.clear()
        gc.collect()
        torch.cuda.empty_cache()
        return rows

    def run(self, ratios: Sequence[float], emit: Emit = print) -> list[Row]:
        link = self.runtime.link()
        assert link is not None  # the engine is set up with --emulate-link
        before_bytes, before_transfers = link.total_bytes, link.num_transfers
        self.eager(False)()
        torch.cuda.synchronize()
        nbytes, transfers = link.total_bytes - before_bytes, link.num_transfers - before_transfers
        rows = self.measure(None, emit=emit)
        compute = {r["mode"]: r["step_ms"] for r in rows}
        for ratio in ratios:
            comm_s = ratio * compute["graph"] * 1e-3  # the production mode's compute sets the link
            self.runtime.set_link(calibrated_link(nbytes, transfers, comm_s))
            rows += self.measure(ratio, comm_s * 1e3, compute, emit=emit)
        return rows

    def close(self) -> None:
        self.runner.close()


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{title}")
    keys = [k for k in rows[0] if k != "top_kernels_ms"]
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r.get(k, "")) for k in keys))


class Results:
    """The ``--json`` document: rows are added as they are measured and the file is rewritten each time."""

    def __init__(self, path: Path | None, **header: Any) -> None:
        self.path = path
        self.doc: dict[str, Any] = {**header, "kernels": [], "step": [], "errors": {}}
        self.save()

    def save(self) -> None:
        if self.path is not None:
            write_json(self.doc, self.path)

    def set(self, key: str, value: Any) -> None:
        self.doc[key] = value
        self.save()

    def emitter(self, section: str) -> Emit:
        def emit(row: Row) -> None:
            print(row, flush=True)
            self.doc.setdefault(section, []).append(row)  # qwen3-30b's list only where that section runs
            self.save()
        return emit

    def error(self, section: str, exc: BaseException) -> None:
        self.doc["errors"][section] = f"{type(exc).__name__}: {exc}"
        self.save()


def qwen3_30b_section(args: argparse.Namespace, results: Results) -> None:
    """Experts per layer of Qwen3-30B-A3B for each backend, and what its 48 layers cost a step at that rate."""
    limits = Limits(args.iters)
    layers = QWEN3_30B_A3B["num_hidden_layers"]
    emit = results.emitter("qwen3-30b")

    def emit_with_layers(row: Row) -> None:
        best = row.get("graph_ms") if isinstance(row.get("graph_ms"), float) else row.get("eager_ms")
        if isinstance(best, float):
            row[f"x{layers}_layers_ms"] = round(best * layers, 2)
        emit(row)

    rows = experts_rows(limits, args.iters, QWEN3_30B_TOKENS, emit_with_layers, QWEN3_30B_A3B, QWEN3_30B_KERNEL)
    print_table(f"{QWEN3_30B_KERNEL} (ms; x limit = time / max(memory limit, FLOP limit))", rows)
    if not args.quick:
        write_csv(rows, RESULTS_DIR / "gpu_qwen3_30b_experts.csv")


def sampling_section(args: argparse.Namespace, results: Results) -> None:
    """The sampling rows (``sampling_rows``), a table and, outside ``--quick``, a CSV."""
    rows = sampling_rows(Limits(args.iters), args.iters, results.emitter("sampling"))
    print_table("LM head + sampling (ms; x limit = time / the LM head's memory or FLOP limit; host µs to launch)",
                rows)
    if not args.quick:
        write_csv(rows, RESULTS_DIR / "gpu_sampling.csv")


def tails_section(args: argparse.Namespace, results: Results) -> None:
    """The fused tails against torch (``tails_rows``), a table and, outside ``--quick``, a CSV."""
    rows = tails_rows(Limits(args.iters), args.iters, results.emitter("tails"))
    print_table("fused tails (ms; x limit = time / (bytes read + written / measured copy rate))", rows)
    if not args.quick:
        write_csv(rows, RESULTS_DIR / "gpu_tails.csv")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sections", nargs="+", default=["kernels", "sampling", "step"], choices=SECTIONS,
                   help="qwen3-30b (not run by default): one Qwen3-30B-A3B layer's experts at "
                        f"{' and '.join(map(str, QWEN3_30B_TOKENS))} tokens, each backend against the limit; "
                        "tails (not run by default): the fused pointwise tails against torch's ops")
    p.add_argument("--iters", type=int, default=None, help=f"default 20 ({QUICK_ITERS} with --quick)")
    p.add_argument("--ratios", nargs="+", type=float, default=None,
                   help="comm/compute ratios of the step section (default 0.5 1 2; 1 with --quick)")
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK_ITERS} iterations, experts at {' and '.join(map(str, QUICK_EXPERT_TOKENS))} tokens, "
                        "comm/compute 1 only, no CSV (make gpu-check)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the rows as JSON too")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="where the model's checkpoint is written (default: a fresh temporary directory)")
    args = p.parse_args(argv)
    if args.iters is None:
        args.iters = QUICK_ITERS if args.quick else 20
    if args.iters < 1:
        p.error(f"argument --iters: must be >= 1, got {args.iters}")
    if args.ratios is None:
        args.ratios = list(QUICK_RATIOS) if args.quick else [0.5, 1.0, 2.0]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  model {MODEL} (bf16)")
    results = Results(args.json, device=torch.cuda.get_device_name(), torch=torch.__version__, model=MODEL,
                      iters=args.iters, quick=args.quick, ratios=args.ratios, step_tokens=STEP_TOKENS,
                      step_context=STEP_CONTEXT, default_backends=default_backends())
    if "kernels" in args.sections:
        try:
            limits = Limits(args.iters)
            results.set("limits", {"copy_tb_s": round(2 * limits.read_bytes_per_s / 1e12, 3),
                                   "gemm_tflop_s": round(limits.flops_per_s / 1e12, 1)})
            print(f"measured: copy {2 * limits.read_bytes_per_s / 1e12:.2f} TB/s (read + write), "
                  f"bf16 GEMM {limits.flops_per_s / 1e12:.0f} TFLOP/s")
            emit = results.emitter("kernels")
            rows = experts_rows(limits, args.iters, QUICK_EXPERT_TOKENS if args.quick else EXPERT_TOKENS, emit)
            rows += attention_rows(limits, args.iters, emit)
            print_table("kernels (ms; x limit = time / max(memory limit, FLOP limit))", rows)
            if not args.quick:
                write_csv(rows, RESULTS_DIR / "gpu_kernels.csv")
        except Exception as exc:  # noqa: BLE001 - recorded; the step section still runs
            traceback.print_exc()
            results.error("kernels", exc)
        gc.collect()
        torch.cuda.empty_cache()
    for name, section in (("sampling", sampling_section), ("qwen3-30b", qwen3_30b_section),
                          ("tails", tails_section)):
        if name not in args.sections:
            continue
        try:
            section(args, results)
        except Exception as exc:  # noqa: BLE001 - recorded; the next section still runs
            traceback.print_exc()
            results.error(name, exc)
        gc.collect()
        torch.cuda.empty_cache()
    if "step" in args.sections:
        try:
            bench = StepBench(args.iters, args.cache_dir)
            try:
                rows = bench.run(args.ratios, results.emitter("step"))
            finally:
                bench.close()
            print_table(f"decode step, {STEP_TOKENS} tokens at context {STEP_CONTEXT} (CUDA-event medians of "
                        f"{args.iters})", rows)
            if not args.quick:
                write_csv(rows, RESULTS_DIR / "gpu_step.csv")
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            results.error("step", exc)
    return 1 if results.doc["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
