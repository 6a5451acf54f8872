"""The GPU backend: Triton split-KV paged decode, SDPA prefill.

Decode reads each request's blocks through the block table up to its ``seq_len``
(``runner/attention/triton_paged_decode.py``): nothing of size requests x max_model_len is materialised, in
eager steps or inside a CUDA graph, and the grid depends on shapes only, so the same call is captured.
Prefill runs ``torch.nn.functional.scaled_dot_product_attention`` per request (flash / cuDNN / efficient on
a GPU, GQA through ``enable_gqa``) on the keys gathered for that request: a causal mask when the request
has no earlier context (every query sees the keys up to itself), else the bottom-right-aligned mask of
chunked prefill and of the second part of a request cut across two ubatches.

The decode function is a constructor argument so tests can run the plumbing against a stand-in with the
kernel's API; the engine always passes the kernel (:func:`load_paged_decode_kernel`).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from runner.attention.backend import AttentionBackend

PagedDecodeFn = Callable[..., torch.Tensor]  # paged_decode_attention's signature


def load_paged_decode_kernel() -> PagedDecodeFn:
    """The Triton kernel (imported here so ``runner.attention`` imports without Triton)."""
    from runner.attention.triton_paged_decode import paged_decode_attention

    return paged_decode_attention


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, decode_fn: PagedDecodeFn | None = None) -> None:
        self.decode_fn = load_paged_decode_kernel() if decode_fn is None else decode_fn

    def __repr__(self) -> str:
        return f"TritonAttentionBackend(decode_fn={getattr(self.decode_fn, '__module__', '?')}." \
               f"{getattr(self.decode_fn, '__name__', '?')})"

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, max_seq_len: int | None, scale: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
        return self.decode_fn(q, k_cache, v_cache, block_table, seq_lens, scale, out=out)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        lq, s = q.shape[0], k.shape[0]
        qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, H, L, D]
        if lq == s:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
        else:
            kpos = torch.arange(s, device=q.device)
            mask = kpos[None, :] <= torch.arange(s - lq, s, device=q.device)[:, None]  # [L, S], True = attend
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
