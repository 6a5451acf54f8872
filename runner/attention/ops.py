"""What the model layers call: write this step's KV, then attend, for MHA/GQA and for absorbed MLA.

The metadata a layer is handed decides the path, by type:

- :class:`PagedAttentionMetadata` (the engine's eager steps): the backend that built it, no host sync;
- :class:`GraphDecodeMetadata` (CUDA-graph capture): the backend that built the persistent buffers;
- :class:`CommonAttentionMetadata` (a model called directly, as tests and the parity checks do): the plain
  torch reference (``reference.py``), which may sync the host and is never what an engine step runs.

Anything else is a ``TypeError`` naming the type.
"""
from __future__ import annotations

from typing import Any

import torch

from runner.attention import reference
from runner.attention.cache_layout import absorbed_mla, mha_cache_views
from runner.attention.metadata import GraphDecodeMetadata, PagedAttentionMetadata
from runner.attention.options import AttentionOptions
from ubatch.slicing import CommonAttentionMetadata


def _check(meta: Any) -> None:
    if not isinstance(meta, (PagedAttentionMetadata, GraphDecodeMetadata)):
        raise TypeError(f"attention metadata of type {type(meta).__name__}: expected PagedAttentionMetadata "
                        "(AttentionBackend.build_metadata), GraphDecodeMetadata or CommonAttentionMetadata")


def mha_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, meta: Any,
                  scale: float, positions: torch.Tensor | None = None,
                  options: AttentionOptions | None = None) -> torch.Tensor:
    """Write ``key``/``value [T, Hkv, D]`` into ``kv_cache [NB, BS, 2, Hkv, D]``, then ``q [T, Hq, D]`` ->
    ``[T, Hq, D]``. ``positions`` is read by the reference path only (the backends derive positions from
    the metadata: queries are the last ``q_len`` positions of each request). ``options``: the layer's sliding
    window and attention sinks (``options.py``)."""
    if isinstance(meta, CommonAttentionMetadata):
        reference.write_kv(kv_cache, meta.slot_mapping, key, value)
        return reference.paged_attention(q, kv_cache, meta, scale, positions, options)
    _check(meta)
    meta.backend.write_kv(kv_cache, meta, torch.stack((key, value), dim=1))
    return meta.backend.attend(q, *mha_cache_views(kv_cache), meta, scale, options)


def mla_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, cache_entry: torch.Tensor, kv_cache: torch.Tensor,
                  meta: Any, scale: float, w_uk: torch.Tensor, w_uv: torch.Tensor,
                  positions: torch.Tensor | None = None) -> torch.Tensor:
    """Write ``cache_entry [T, L + R]`` into the latent cache, then absorbed MLA -> ``[T, H, dv]``."""
    if isinstance(meta, CommonAttentionMetadata):
        reference.write_kv(kv_cache, meta.slot_mapping, cache_entry)
        return reference.paged_mla_attention(q_nope, q_rope, kv_cache, meta, scale, w_uk, w_uv, positions)
    _check(meta)
    meta.backend.write_kv(kv_cache, meta, cache_entry)
    return absorbed_mla(q_nope, q_rope, kv_cache, meta, scale, w_uk, w_uv)
