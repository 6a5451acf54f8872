"""Offline generation with the Python API over 2 DP ranks (expert parallel + DBO), from a plain script.

``LLM(..., data_parallel_size=2)`` starts one engine-core process per rank and stops them when it is closed
(or deleted, or the interpreter exits); prompts go to the least busy rank and the outputs come back in input
order. Text prompts are used when the model ships a tokenizer, token ids otherwise (the built-in tiny models
have none).
Run: ``python examples/offline_generate.py [--model tiny-qwen3-moe] [--device cpu]`` (``--device cpu`` runs
the two ranks on the CPU over gloo on a machine with fewer than two GPUs).
Under ``torchrun --nproc-per-node 2`` the same code runs SPMD instead (vLLM's ``external_launcher``): each
process is one rank, every rank calls ``generate`` with the same prompts and gets every output.
"""
from __future__ import annotations

import argparse

from runner import LLM, SamplingParams
from runner.distributed.device import DEVICE_CHOICES

TEXTS = ["The capital of France is", "Mixture-of-experts models route each token to",
         "Dual-batch overlap hides communication by", "The quick brown fox", "Once upon a time",
         "In a distant galaxy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-qwen3-moe")
    parser.add_argument("--device", choices=DEVICE_CHOICES, default="auto")
    args = parser.parse_args()
    llm = LLM(model=args.model, data_parallel_size=2, enable_expert_parallel=True,  # all2all defaults to auto
              enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=8, device=args.device)
    has_tokenizer = llm.get_tokenizer() is not None
    if has_tokenizer:
        prompts: list = TEXTS
    else:
        prompts = [[(37 * i + 11 * j) % 500 for j in range(3 + 4 * i)] for i in range(len(TEXTS))]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.8, top_p=0.95, seed=1234))
    for i, o in enumerate(outputs):
        c = o.outputs[0]
        shown = repr(c.text) if has_tokenizer else " ".join(map(str, c.token_ids))
        print(f"[{i}] prompt {len(o.prompt_token_ids)} tokens -> {shown} ({c.finish_reason})")
    assert llm.last_stats is not None
    print(llm.last_stats.summary())
    llm.close()


if __name__ == "__main__":  # the rank processes are spawned: they import this file without running main()
    main()
