"""The engine's attention: one backend interface for eager steps and CUDA-graph decode.

- ``reference.py``: plain-torch paged attention over ``CommonAttentionMetadata``, the tests' reference
  (its module docstring states the masking rule by position and the absorbed-MLA maths);
- ``backend.py``: :class:`AttentionBackend`, what a backend supplies (decode, prefill) and what it inherits
  (metadata built once per step, KV writes, graph buffers); ``metadata.py``: that per-step metadata;
  ``prefill_batch.py``: a step's prefill requests as a few padded groups (one attention call each);
- ``torch_backend.py`` (the CPU path) and ``triton_backend.py`` (Triton paged decode, SDPA prefill);
  ``selector.py``: ``--attention-backend auto|torch|triton``;
- ``graph.py``: persistent decode metadata for CUDA graphs; ``ops.py``: what the model layers call.
- ``options.py``: per-layer options every backend honours (a sliding window, attention sinks).

The reference functions stay importable from here (``runner.attention.paged_attention`` etc.).
"""
from __future__ import annotations

from runner.attention.backend import AttentionBackend
from runner.attention.metadata import PagedAttentionMetadata
from runner.attention.ops import mha_attention, mla_attention
from runner.attention.reference import paged_attention, paged_mla_attention, write_kv
from runner.attention.selector import make_attention_backend, resolve_attention_backend

__all__ = ["AttentionBackend", "PagedAttentionMetadata", "make_attention_backend", "mha_attention",
           "mla_attention", "paged_attention", "paged_mla_attention", "resolve_attention_backend", "write_kv"]
