"""ubatch's reference engine. ``from runner import LLM, SamplingParams`` is vLLM's ``from vllm import ...``.

The package is layered along the path of a request (``tests/test_imports.py`` checks it): front ends
(``entrypoints``: the offline ``LLM``, the CLI, the OpenAI-compatible server) -> engine client (``engine``:
tokenization, output processing, routing to DP ranks) -> per-rank engine core (``core``: scheduler, KV-block
bookkeeping, the step loop) -> model runner (``worker``) -> ``models`` and ``attention`` -> process plumbing
(``distributed``). ``config``, ``sampling_params`` and ``tracing`` are shared by every layer.
"""
from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Lazy: ``import runner.config`` (the CLI's argument parsing) must not import torch and the model code.
    if name == "LLM":
        from runner.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from runner.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'runner' has no attribute {name!r}")
