"""The engine on FP8 weights against the same model unquantised (``python -m gpucheck.engine_fp8``).

The FP8 model is made from the same checkpoint as the bf16 one: ``quantization="fp8"`` quantises every
decoder-layer linear (router gates excepted) and every expert per 128 x 128 block while loading, as vLLM's
``--quantization fp8`` does. Both engines run with default flags but ``--max-num-seqs`` (``engine_run``'s
workload), one after the other on the one GPU:

1. ``base`` (the checkpoint as it is: bf16 on a GPU) and then ``fp8``: the model's parameter bytes, a 2-prompt
   warm-up call, ``--repeats`` measured calls of the workload (the last one is the figure), and one greedy call
   of ``--agree-prompts`` prompts x ``--agree-tokens`` new tokens for the agreement;
2. ``agreement``: the two runs' greedy tokens compared (``fp8_figures.greedy_agreement``: positions up to each
   prompt's first divergence). For scale, ``base.self_agreement`` compares the unquantised engine with itself on
   the same prompts run as two half batches: other batch sizes pick other kernels and graphs, whose rounding
   alone flips near-ties of a model with random weights, whose top two logits are often close;
3. ``experts`` (CUDA only): the FP8 experts of the model's first MoE layer, as loaded, on ``--expert-tokens``
   tokens (the decode batch) through each FP8-capable backend (``deep_gemm`` where it imports, ``triton``) and
   the engine's default backend (which may dequantise, W8A16), eager and in a CUDA graph, against the time to
   read the touched experts' FP8 weights and scales once at the read bandwidth ``bench_gpu.py`` uses (half the
   measured device-to-device copy rate, which counts read + write).

The JSON (``--out``) is rewritten after each phase, so a run stopped part-way keeps what it measured.
"""
from __future__ import annotations

import argparse
import functools
import gc
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from common import empty_prefix_cache, write_json
from gpucheck.engine_run import engine_info, run_figures
from gpucheck.fp8_figures import greedy_agreement
from runner.models.base import MoECausalLM
from ubatch.fp8 import Fp8Tensor

if TYPE_CHECKING:
    from runner import LLM

# this benchmark reads the in-process engine (its model and statistics): the engine core stays here
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

AGREE_SEED = 1  # the agreement prompts differ from the workload's (the engine's seed, 0)
FP8_EXPERT_BACKENDS = ("deep_gemm", "triton")  # the backends with FP8 kernels (MoEExperts.supports_fp8_weights)
Experts = tuple[Fp8Tensor, Fp8Tensor]  # one MoE layer's (w13, w2)


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of a model's parameters (each once: tied weights are one parameter)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def dense_fp8_linears(model: torch.nn.Module) -> dict[str, int]:
    """How many of the model's FP8 linear layers run an FP8 GEMM (DeepGEMM on Hopper) and how many dequantise."""
    from runner.models.quantization.fp8_linear import Fp8Linear

    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    fast = sum(m.uses_fp8_gemm() for m in layers)
    return {"fp8_gemm": fast, "dequantised": len(layers) - fast}


def greedy_ids(llm: LLM, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Each prompt's ``tokens`` greedy new tokens (EOS ignored), in one ``generate`` call from an empty prefix
    cache (the self-agreement runs the same prompts again: it compares batch shapes, not cached KV)."""
    from runner import SamplingParams

    empty_prefix_cache(llm)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def run_engine(flags: dict[str, Any], prompts: list[list[int]], agree_prompts: list[list[int]],
               args: argparse.Namespace, *, fp8: bool) -> tuple[dict[str, Any], list[list[int]], Experts | None]:
    """One engine's figures and its greedy tokens for the agreement prompts; the FP8 engine's also a copy of its
    first MoE layer's FP8 experts (taken before it closes), the unquantised one's its agreement with itself."""
    from runner import LLM, SamplingParams

    t0 = time.perf_counter()
    flags = {**flags, "quantization": "fp8"} if fp8 else flags
    llm = LLM(**flags)
    try:
        model = llm.model_runner.model
        out: dict[str, Any] = {"init_s": round(time.perf_counter() - t0, 2), "flags": flags,
                               "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                               "weight_bytes": weight_bytes(model), "dense_fp8_linears": dense_fp8_linears(model),
                               "engine": engine_info(llm)}
        greedy = functools.partial(SamplingParams, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:2], greedy(max_tokens=2), use_tqdm=False)
        out["measured_runs"] = []
        for _ in range(max(1, args.repeats)):
            empty_prefix_cache(llm)  # as `python -m runner bench`: every call computes its prompts
            out["measured"] = run_figures(llm, llm.generate(prompts, greedy(max_tokens=args.max_tokens),
                                                            use_tqdm=False))
            out["measured_runs"].append(out["measured"])
            print(llm.last_stats.summary(), flush=True)
        agree_tokens = greedy_ids(llm, agree_prompts, args.agree_tokens)
        if not fp8:  # the unquantised engine: the same prompts in two half batches (module docstring)
            half = len(agree_prompts) // 2
            halves = [*greedy_ids(llm, agree_prompts[:half], args.agree_tokens),
                      *greedy_ids(llm, agree_prompts[half:], args.agree_tokens)]
            out["self_agreement"] = greedy_agreement(agree_tokens, halves, args.agree_tokens)
        experts = first_layer_experts(model) if fp8 else None
    finally:
        llm.close()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out, agree_tokens, experts


def first_layer_experts(model: MoECausalLM) -> Experts:
    """A copy of the first MoE layer's experts as the FP8 model holds them (values and block scales)."""
    spec = model.weight_spec()
    if not spec.moe_layers:
        raise ValueError(f"{type(model).__name__} has no MoE layers: no experts to time")
    w13, w2 = spec.moe_layers[min(spec.moe_layers)].expert_weights()
    if not isinstance(w13, Fp8Tensor) or not isinstance(w2, Fp8Tensor):
        raise TypeError(f"the quantization='fp8' model's experts are {type(w13).__name__} and {type(w2).__name__}, "
                        "not FP8 tensors with their scales")
    return (Fp8Tensor(w13.data.clone(), w13.scale.clone(), w13.block, w13.row_shards),
            Fp8Tensor(w2.data.clone(), w2.scale.clone(), w2.block, w2.row_shards))


def fp8_read_bytes(w13: Fp8Tensor, w2: Fp8Tensor, touched: int) -> int:
    """Bytes of ``touched`` experts' FP8 values and fp32 scales, each read once."""
    per_expert = sum((t.data[0].numel() * t.data.element_size() + t.scale[0].numel() * t.scale.element_size())
                     for t in (w13, w2))
    return touched * per_expert


def experts_rows(w13: Fp8Tensor, w2: Fp8Tensor, tokens: int, top_k: int, iters: int) -> dict[str, Any]:
    """Each FP8-capable backend and the engine's default one on ``tokens`` routed tokens, against the FP8
    weight-read limit (module docstring), with its error against the torch experts on the dequantised weights."""
    from bench_gpu import copy_bandwidth, experts_shape, time_against_limit
    from ubatch.modular_moe.experts import make_experts, resolve_experts_backend
    from ubatch.modular_moe.types import ExpertTokens

    read_bytes_per_s = copy_bandwidth(iters) / 2  # bench_gpu.Limits: a kernel reads its operands once
    e, h = w13.shape[0], w13.shape[2]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(tokens, e, device="cuda", generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k)
    batch = ExpertTokens("contiguous", x, ids.to(torch.int32), (weights / weights.sum(-1, keepdim=True)).float())
    touched = int(torch.unique(ids).numel())
    nbytes = fp8_read_bytes(w13, w2, touched)
    limit = nbytes / read_bytes_per_s * 1e3
    reference = make_experts("torch").run(batch, w13, w2).float()
    default = resolve_experts_backend("auto", "cuda")
    rows = []
    for name in dict.fromkeys((*FP8_EXPERT_BACKENDS, default)):
        row: dict[str, Any] = {"kernel": "fp8 experts", "backend": name, "shape": experts_shape(tokens),
                               "limit_ms": round(limit, 4), "engine_default": name == default}
        try:
            backend = make_experts(name)
            row["fp8_kernel"] = backend.supports_fp8_weights
            run = functools.partial(backend.run, batch, w13, w2)
            out = run().float()
            row["max_rel_err"] = f"{((out - reference).abs().max() / reference.abs().max()).item():.1e}"
            time_against_limit(row, run, limit, iters, digits=4)
        except Exception as exc:  # noqa: BLE001 - e.g. deep_gemm does not import: the row says so
            row["eager_ms"] = f"{type(exc).__name__}: {str(exc)[:150]}"
        rows.append(row)
        print(f"experts: {row}", flush=True)
    return {"tokens": tokens, "touched_experts": touched, "num_experts": e, "read_bytes": nbytes,
            "copy_tb_s": round(2 * read_bytes_per_s / 1e12, 3), "rows": rows}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a checkpoint directory or built-in name (default: the 1.2B model)")
    p.add_argument("--cache-dir", default=None, help="where a built-in model's checkpoint is written")
    p.add_argument("--device", default=None, help="default: the engine's (auto)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2, help="measured calls in a row; the last one is the figure")
    p.add_argument("--agree-prompts", type=int, default=64)
    p.add_argument("--agree-tokens", type=int, default=16)
    p.add_argument("--expert-tokens", type=int, default=256, help="tokens routed to the timed experts")
    p.add_argument("--iters", type=int, default=5, help="CUDA-event timings per experts measurement (median)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    for flag in ("num_prompts", "prompt_len", "max_tokens", "max_num_seqs", "agree_prompts", "agree_tokens",
                 "expert_tokens", "iters"):
        if getattr(args, flag) < 1:
            p.error(f"argument --{flag.replace('_', '-')}: must be >= 1, got {getattr(args, flag)}")
    return args


def main() -> int:
    args = parse_args()
    from bench_gpu import MODEL
    from runner.entrypoints.cli import random_prompts
    from runner.models.loader import model_config, resolve_model_path

    model = args.model or MODEL
    model_dir = str(resolve_model_path(model, args.cache_dir))  # written now if missing, not inside LLM's timing
    config = model_config(model_dir)
    flags: dict[str, Any] = {"model": model, "max_num_seqs": args.max_num_seqs}
    if args.cache_dir:
        flags["cache_dir"] = args.cache_dir
    if args.device:
        flags["device"] = args.device
    prompts = random_prompts(args.num_prompts, args.prompt_len, 0.0, config.vocab_size, 0)
    agree_prompts = random_prompts(args.agree_prompts, args.prompt_len, 0.0, config.vocab_size, AGREE_SEED)
    cuda = torch.cuda.is_available() and args.device != "cpu"
    doc: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu", "model_dir": model_dir,
                           "workload": {
        "num_prompts": args.num_prompts, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
        "agree_prompts": args.agree_prompts, "agree_tokens": args.agree_tokens}}
    write_json(doc, args.out)
    doc["base"], base_tokens, _ = run_engine(flags, prompts, agree_prompts, args, fp8=False)
    write_json(doc, args.out)
    doc["fp8"], fp8_tokens, experts = run_engine(flags, prompts, agree_prompts, args, fp8=True)
    doc["agreement"] = greedy_agreement(base_tokens, fp8_tokens, args.agree_tokens)
    write_json(doc, args.out)
    print(f"agreement: {({k: v for k, v in doc['agreement'].items() if k != 'first_divergence'})}", flush=True)
    if not cuda:
        doc["experts"] = {"error": "not timed: the experts are timed with CUDA events against the GPU's measured "
                                   "copy bandwidth, and this run is not on a CUDA GPU"}
    else:
        assert experts is not None
        doc["experts"] = experts_rows(*experts, args.expert_tokens, config.num_experts_per_tok, args.iters)
    write_json(doc, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
