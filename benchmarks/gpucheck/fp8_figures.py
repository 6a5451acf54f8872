"""The FP8 figures of an ``engine_fp8`` run, from its JSON: what the goals and the report read.

- ``weight_ratio``: the FP8 model's parameter bytes over the unquantised one's (FP8 values, their fp32 scales,
  and what stays in the model's dtype: embeddings, norms, router gates, the LM head);
- ``tokens_ratio``: the FP8 engine's output tok/s over the unquantised one's, each the last measured call;
- ``agreement_pct``: :func:`greedy_agreement`'s ``prefix_pct``.

Greedy agreement is counted up to the first divergence: once two greedy runs pick different tokens their
contexts differ, so later positions compare continuations of different texts and say nothing about the
weights. A prompt whose tokens first differ at position ``d`` agrees on ``d`` positions (all of them when none
differs); the figure is the agreeing positions over all positions, in percent.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """The first position where ``a`` and ``b`` differ; their common length when one is a prefix of the other."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):  # strict=False: a request may stop early (EOS)
        if x != y:
            return i
    return min(len(a), len(b))


def greedy_agreement(base: Sequence[Sequence[int]], other: Sequence[Sequence[int]], tokens: int) -> dict[str, Any]:
    """Agreement of two greedy runs over the same prompts, ``tokens`` positions each (module docstring).

    ``prefix_pct``: positions before each prompt's first divergence over all positions; ``token_pct``: positions
    equal wherever they are (shown beside it, not a goal); ``identical``: prompts whose tokens all agree;
    ``first_divergence``: per prompt, the first position that differs (``tokens`` when none does)."""
    if len(base) != len(other):
        raise ValueError(f"the two runs have {len(base)} and {len(other)} outputs; they must cover the same prompts")
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    short = [i for i, (a, b) in enumerate(zip(base, other, strict=True)) if len(a) < tokens or len(b) < tokens]
    if short:
        raise ValueError(f"prompts {short[:5]} have fewer than {tokens} generated tokens in a run; generate "
                         "with ignore_eos so every position is compared")
    firsts = [first_divergence(a[:tokens], b[:tokens]) for a, b in zip(base, other, strict=True)]
    equal = sum(x == y for a, b in zip(base, other, strict=True) for x, y in zip(a[:tokens], b[:tokens], strict=True))
    total = len(base) * tokens
    return {"prompts": len(base), "tokens": tokens, "prefix_pct": 100 * sum(firsts) / total if total else None,
            "token_pct": 100 * equal / total if total else None, "identical": sum(f == tokens for f in firsts),
            "first_divergence": firsts}


def fp8_figures(data: dict[str, Any]) -> dict[str, Any]:
    """The ratios available in ``data`` (a phase that did not finish leaves its figures out)."""
    base, fp8 = data.get("base") or {}, data.get("fp8") or {}
    fig: dict[str, Any] = {}
    if base.get("weight_bytes") and fp8.get("weight_bytes") is not None:
        fig["weight_ratio"] = fp8["weight_bytes"] / base["weight_bytes"]
    base_run, fp8_run = base.get("measured"), fp8.get("measured")
    if base_run and fp8_run and base_run["output_tokens_per_s"]:
        fig["tokens_ratio"] = fp8_run["output_tokens_per_s"] / base_run["output_tokens_per_s"]
        fig["num_errors"] = base_run["num_errors"] + fp8_run["num_errors"]
    agreement = data.get("agreement")
    if agreement and agreement.get("prefix_pct") is not None:
        fig["agreement_pct"] = agreement["prefix_pct"]
    return fig
