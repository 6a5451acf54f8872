"""The two cache layouts seen as what a backend reads: key and value caches ``[NB, BS, Hkv, D]`` (views).

MHA/GQA ``[NB, BS, 2, Hkv, D]``: key at index 0, value at index 1. MLA ``[NB, BS, L + R]``: absorbed MLA is
MQA with one key head of width ``L + R`` whose value is the latent ``[..., :L]`` (``reference.py``).
"""
from __future__ import annotations

from typing import Any

import torch


def mha_cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[NB, BS, 2, Hkv, D]`` -> key and value caches ``[NB, BS, Hkv, D]`` (strided views, no copy)."""
    if kv_cache.dim() != 5 or kv_cache.shape[2] != 2:
        raise ValueError(f"expected an MHA cache [NB, BS, 2, Hkv, D], got {tuple(kv_cache.shape)}")
    return kv_cache[:, :, 0], kv_cache[:, :, 1]


def mla_cache_views(kv_cache: torch.Tensor, latent_dim: int, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[NB, BS, L + R]`` -> one key head ``[NB, BS, 1, L + R]`` and its latent ``[NB, BS, 1, L]``."""
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != latent_dim + rope_dim:
        raise ValueError(f"expected an MLA cache [NB, BS, {latent_dim}+{rope_dim}], got {tuple(kv_cache.shape)}")
    k = kv_cache.unsqueeze(2)
    return k, k[..., :latent_dim]


def absorbed_mla(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, meta: Any, scale: float,
                 w_uk: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Absorbed MLA attention through ``meta.backend`` (no KV write): ``q_nope`` into latent space with
    ``w_uk``, MQA over the latent cache, the latent output out with ``w_uv`` -> ``[T, H, dv]``."""
    k_cache, v_cache = mla_cache_views(kv_cache, w_uk.shape[-1], q_rope.shape[-1])
    q_latent = torch.einsum("thd,hdl->thl", q_nope, w_uk)
    q_cat = torch.cat((q_latent, q_rope), dim=-1)
    out_latent = meta.backend.attend(q_cat, k_cache, v_cache, meta, scale)
    return torch.einsum("thl,hvl->thv", out_latent, w_uv)
