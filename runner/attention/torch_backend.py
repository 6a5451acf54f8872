"""The plain-torch backend: the CPU path, with the reference's numerics (``reference.py``).

Scores in the activation dtype, softmax in fp32, cast back (HF eager attention). Decode gathers each
request's keys up to the batch's longest sequence (a host int from the step metadata); under a CUDA graph,
where no host int can change between replays, up to the block table's width, i.e. ``max_model_len``, which
makes graph memory grow with requests x max_model_len: on a GPU the Triton backend is the one to capture.
Prefill attends each padded group of requests (``prefill_batch.py``) with two einsums and one softmax, in
slices of requests whose scores fit ``SCORE_BUDGET`` (one slice for a step of short prompts). A layer's sliding
window narrows both masks and its sinks join each softmax as one more column (``options.py``).
"""
from __future__ import annotations

import torch

from runner.attention.backend import AttentionBackend
from runner.attention.options import AttentionOptions, sinks_of, softmax_with_sinks, window_of
from runner.attention.prefill_batch import PrefillGroup

#: score elements a prefill slice may hold (16 MiB in fp32). Past that each elementwise pass over the scores
#: (scale, mask, softmax, cast) runs from DRAM instead of the cache: a group of 8 requests of 256 queries over
#: 1024 keys and 16 heads took twice the time of the same requests one by one on the CPU.
SCORE_BUDGET = 1 << 22


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, max_seq_len: int | None, scale: float,
               out: torch.Tensor | None = None, options: AttentionOptions | None = None) -> torch.Tensor:
        r, hq, dk = q.shape
        hkv, block_size = k_cache.shape[2], k_cache.shape[1]
        span = block_table.shape[1] * block_size if max_seq_len is None else max_seq_len
        pos = torch.arange(span, device=q.device)
        slots = (block_table[:, pos // block_size].to(torch.int64) * block_size + pos % block_size).view(-1)
        # index_select, not advanced indexing: the same gather, about 1.7x faster on the CPU
        k = k_cache.flatten(0, 1).index_select(0, slots).view(r, span, hkv, -1)  # [R, S, Hkv, D]
        v = v_cache.flatten(0, 1).index_select(0, slots).view(r, span, hkv, -1)
        qg = q.view(r, hkv, hq // hkv, dk)
        scores = torch.einsum("rhgd,rshd->rhgs", qg, k) * scale
        mask = pos[None, :] >= seq_lens[:, None]
        window = window_of(options)
        if window is not None:
            mask = mask | (pos[None, :] < seq_lens[:, None] - window)
        scores = scores.masked_fill(mask[:, None, None, :], float("-inf"))
        probs = softmax_with_sinks(scores, sinks_of(options), (1, hkv, hq // hkv, 1), q.dtype)
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

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: PrefillGroup,
                scale: float, options: AttentionOptions | None = None) -> torch.Tensor:
        """A padded group (``AttentionBackend.prefill``) under its mask, the reference's numerics, in slices of
        requests whose scores stay within ``SCORE_BUDGET`` elements (one slice for a step of short prompts)."""
        r, lq, hq, dk = q.shape
        window, sinks = window_of(options), sinks_of(options)
        # once per step (and window), not per layer
        hidden = group.memo(("hidden", window), lambda: ~group.visible(window)[:, None, None])
        per_req = hq * lq * k.shape[1]
        step = max(1, SCORE_BUDGET // per_req)
        if step >= r:
            return _prefill_slice(q, k, v, hidden, scale, sinks)
        return torch.cat([_prefill_slice(q[i:i + step], k[i:i + step], v[i:i + step], hidden[i:i + step], scale,
                                         sinks) for i in range(0, r, step)])


def _prefill_slice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor,
                   scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
    r, lq, hq, dk = q.shape
    hkv = k.shape[2]
    qg = q.view(r, lq, hkv, hq // hkv, dk)
    scores = torch.einsum("rqhgd,rshd->rhgqs", qg, k) * scale
    scores = scores.masked_fill(hidden, float("-inf"))
    probs = softmax_with_sinks(scores, sinks, (1, hkv, hq // hkv, 1, 1), q.dtype)
    return torch.einsum("rhgqs,rshd->rqhgd", probs, v).reshape(r, lq, hq, v.shape[-1])
