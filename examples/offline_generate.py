"""Offline generation with the Python API over 2 DP ranks (expert parallel + DBO), via the built-in launcher.

Each rank builds an ``LLM`` and calls ``generate`` with the same prompt list; prompts are spread round-robin
over the ranks and every rank gets all results back in input order. Text prompts are used when the model
ships a tokenizer, token ids otherwise (the built-in tiny models have none).
Run: ``python examples/offline_generate.py [--model tiny-qwen3-moe] [--device cpu]`` (``--device cpu`` runs
the two ranks on the CPU over gloo on a machine with fewer than two GPUs).
(Under torchrun, call ``rank_main`` directly: ``LLM`` joins the torchrun world by itself.)
"""
from __future__ import annotations

import argparse

from runner import LLM, SamplingParams
from runner.distributed.device import DEVICE_CHOICES
from runner.distributed.launch import launch
from runner.entrypoints.llm import GenerationStats
from runner.outputs import RequestOutput

TEXTS = ["The capital of France is", "Mixture-of-experts models route each token to",
         "Dual-batch overlap hides communication by", "The quick brown fox", "Once upon a time",
         "In a distant galaxy"]


def rank_main(model: str, device: str = "auto") -> tuple[list[RequestOutput], GenerationStats | None, bool]:
    llm = LLM(model=model, data_parallel_size=2, enable_expert_parallel=True,  # all2all defaults to auto
              enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=8, device=device)
    has_tokenizer = llm.get_tokenizer() is not None
    if has_tokenizer:
        prompts: list = TEXTS
    else:
        prompts = [[(37 * i + 11 * j) % 500 for j in range(3 + 4 * i)] for i in range(len(TEXTS))]
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.95, seed=1234)
    outputs = llm.generate(prompts, params)
    stats = llm.last_stats if llm.rank == 0 else None
    llm.close()
    return outputs, stats, has_tokenizer


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-qwen3-moe")
    parser.add_argument("--device", choices=DEVICE_CHOICES, default="auto")
    args = parser.parse_args()
    # rank 0's view; it holds every result
    outputs, stats, has_tokenizer = launch(rank_main, 2, args=(args.model, args.device), device=args.device)[0]
    for i, o in enumerate(outputs):
        c = o.outputs[0]
        shown = repr(c.text) if has_tokenizer else " ".join(map(str, c.token_ids))
        print(f"[{i}] prompt {len(o.prompt_token_ids)} tokens -> {shown} ({c.finish_reason})")
    print(stats.summary())
