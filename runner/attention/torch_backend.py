"""The plain-torch backend: the CPU path, with the reference's numerics (``reference.py``).

Scores in the activation dtype, softmax in fp32, cast back (HF eager attention). Decode gathers each
request's keys up to the batch's longest sequence (a host int from the step metadata); under a CUDA graph,
where no host int can change between replays, up to the block table's width, i.e. ``max_model_len``, which
makes graph memory grow with requests x max_model_len: on a GPU the Triton backend is the one to capture.
"""
from __future__ import annotations

import torch

from runner.attention.backend import AttentionBackend


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, max_seq_len: int | None, scale: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
        r, hq, dk = q.shape
        hkv, block_size = k_cache.shape[2], k_cache.shape[1]
        span = block_table.shape[1] * block_size if max_seq_len is None else max_seq_len
        pos = torch.arange(span, device=q.device)
        slots = block_table[:, pos // block_size].to(torch.int64) * block_size + pos % block_size  # [R, S]
        k, v = k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]  # [R, S, Hkv, D]
        qg = q.view(r, hkv, hq // hkv, dk)
        scores = torch.einsum("rhgd,rshd->rhgs", qg, k) * scale
        mask = pos[None, :] >= seq_lens[:, None]
        scores = scores.masked_fill(mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        # Slots past a request's seq_len were never written (the cache is not zero-filled), and a zero weight
        # times what they hold can still be NaN: zero those values, not just their weights. A request with
        # seq_len 0 has no key at all: its softmax row is NaN, so its output is zeroed too.
        v = v.masked_fill(mask[:, :, None, None], 0)
        res = torch.einsum("rhgs,rshd->rhgd", probs, v).reshape(r, hq, v.shape[-1])
        res = res.masked_fill((seq_lens <= 0)[:, None, None], 0)
        if out is None:
            return res
        out.copy_(res)
        return out

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        lq, hq, dk = q.shape
        s, hkv = k.shape[0], k.shape[1]
        qg = q.view(lq, hkv, hq // hkv, dk)
        scores = torch.einsum("qhgd,khd->hgqk", qg, k) * scale
        kpos = torch.arange(s, device=q.device)
        qpos = torch.arange(s - lq, s, device=q.device)
        scores = scores.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.einsum("hgqk,khd->qhgd", probs, v).reshape(lq, hq, v.shape[-1])
