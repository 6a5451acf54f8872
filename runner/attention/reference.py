"""Paged attention in plain torch over :class:`CommonAttentionMetadata`: the tests' reference.

Masking is by position (a query at position ``p`` sees its request's keys at positions ``<= p``), which makes
prefill, decode, chunked prefill and a request split across two ubatches one case. Numerics mirror HF eager
attention. These functions may sync the host and have data-dependent shapes: fine for a reference, never
inside an engine step. MLA attends with absorbed weights (MQA over the cached latent), identical to HF's
expand-then-attend without materialising per-head K/V.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from runner.attention.options import AttentionOptions, sinks_of, softmax_with_sinks, visible, window_of
from ubatch.slicing import CommonAttentionMetadata


def write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor | None = None) -> None:
    """Scatter this step's KV into the paged cache.

    MHA: ``kv_cache [NB, BS, 2, Hkv, D]``, ``key``/``value [T, Hkv, D]``.
    MLA: ``kv_cache [NB, BS, L + R]``, ``key [T, L + R]`` (latent and rope key concatenated), no value.
    Slots ``< 0`` (padding tokens) are skipped.
    """
    num_tokens = key.shape[0]
    slots = slot_mapping[:num_tokens]
    flat = kv_cache.view(-1, *kv_cache.shape[2:])
    entry = key if value is None else torch.stack((key, value), dim=1)
    valid = slots >= 0
    if not bool(valid.all()):
        slots, entry = slots[valid], entry[valid]
    flat.index_copy_(0, slots, entry.to(flat.dtype))


def _query_positions(meta: CommonAttentionMetadata, positions: torch.Tensor | None, num_tokens: int,
                     device: torch.device) -> torch.Tensor:
    """Positions of the query tokens; derived as ``seq_len - q_len + j`` when none are given."""
    if positions is None:
        positions = meta.positions
    if positions is not None:
        return positions.to(device=device, dtype=torch.int64)
    qsl, seq = meta.query_start_loc_cpu.to(torch.int64), meta.seq_lens_cpu.to(torch.int64)
    out = torch.zeros(num_tokens, dtype=torch.int64)
    for i in range(meta.num_reqs):
        s, e = int(qsl[i]), int(qsl[i + 1])
        out[s:e] = torch.arange(int(seq[i]) - (e - s), int(seq[i]))
    return out.to(device)


def request_slots(block_table_row: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions ``[0, n)`` of one request (device ops only; ``n`` is a host int)."""
    pos = torch.arange(n, device=block_table_row.device)
    return block_table_row[pos // block_size].to(torch.int64) * block_size + pos % block_size


def per_request_prefill(kind: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: Any,
                        scale: float) -> dict[int, torch.Tensor]:
    """The backends' former prefill, request by request over a ``PagedAttentionMetadata``'s ``prefills``: batch
    row -> output row ``[Hq, Dv]`` of every prefill query. ``kind`` ``"torch"``: the torch backend's einsums;
    ``"sdpa"``: the Triton backend's ``scaled_dot_product_attention`` (``is_causal`` for a fresh prompt, else a
    bottom-right-aligned boolean mask). The reference the batched prefill (``prefill_batch.py``) is tested and
    benchmarked against; some fifteen launches per request, so never what an engine step runs."""
    if kind not in ("torch", "sdpa"):
        raise ValueError(f"per_request_prefill kind must be 'torch' or 'sdpa', got {kind!r}")
    bs = k_cache.shape[1]
    k_flat, v_flat = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    rows: dict[int, torch.Tensor] = {}
    for p in meta.prefills:
        slots = request_slots(meta.common.block_table[p.index], p.seq_len, bs)
        qi, k, v = q[p.token_start:p.token_stop], k_flat[slots], v_flat[slots]
        lq, s = qi.shape[0], k.shape[0]
        if kind == "torch":
            qpos = torch.arange(s - lq, s, device=q.device)
            res = _attend_one(qi, k, v, qpos, scale)
        else:
            qh, kh, vh = qi.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            if lq == s:
                o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
            else:
                mask = torch.arange(s, device=q.device)[None, :] <= torch.arange(s - lq, s, device=q.device)[:, None]
                o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
            res = o[0].transpose(0, 1)
        rows.update({p.token_start + j: res[j] for j in range(lq)})
    return rows


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor, scale: float,
                options: AttentionOptions | None = None) -> torch.Tensor:
    """``q [Lq, Hq, Dk]``, ``k [S, Hkv, Dk]``, ``v [S, Hkv, Dv]`` -> ``[Lq, Hq, Dv]`` with a position mask."""
    lq, hq, dk = q.shape
    hkv = k.shape[1]
    qg = q.view(lq, hkv, hq // hkv, dk)
    scores = torch.einsum("qhgd,khd->hgqk", qg, k) * scale
    kpos = torch.arange(k.shape[0], device=q.device)
    mask = ~visible(kpos[None, :], qpos[:, None], window_of(options))
    scores = scores.masked_fill(mask, float("-inf"))
    probs = softmax_with_sinks(scores, sinks_of(options), (hkv, hq // hkv, 1, 1), q.dtype)
    return torch.einsum("hgqk,khd->qhgd", probs, v).reshape(lq, hq, v.shape[-1])


def _attend_decodes(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, qpos: torch.Tensor, block_size: int, scale: float,
                    options: AttentionOptions | None = None) -> torch.Tensor:
    """One query per request, batched: ``q [R, Hq, Dk]`` -> ``[R, Hq, Dv]``."""
    r, hq, dk = q.shape
    hkv = k_flat.shape[1]
    smax = int(seq_lens.max())
    pos = torch.arange(smax, device=q.device)
    blocks = block_table[:, pos // block_size].to(torch.int64)
    slots = blocks * block_size + pos % block_size
    k, v = k_flat[slots], v_flat[slots]  # [R, S, Hkv, D]
    qg = q.view(r, hkv, hq // hkv, dk)
    scores = torch.einsum("rhgd,rshd->rhgs", qg, k) * scale
    mask = ~visible(pos[None, :], qpos[:, None], window_of(options)) | (pos[None, :] >= seq_lens[:, None])
    scores = scores.masked_fill(mask[:, None, None, :], float("-inf"))
    probs = softmax_with_sinks(scores, sinks_of(options), (1, hkv, hq // hkv, 1), q.dtype)
    # A shorter request's slots past its seq_len were never written (the cache is not zero-filled), and a
    # zero weight times what they hold can still be NaN: zero those values, not just their weights.
    v = v.masked_fill(mask[:, :, None, None], 0)
    return torch.einsum("rhgs,rshd->rhgd", probs, v).reshape(r, hq, v.shape[-1])


def _paged_attend(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, meta: CommonAttentionMetadata,
                  block_size: int, scale: float, positions: torch.Tensor | None,
                  options: AttentionOptions | None = None) -> torch.Tensor:
    num_tokens = q.shape[0]
    out = q.new_zeros(num_tokens, q.shape[1], v_flat.shape[-1])
    qpos_all = _query_positions(meta, positions, num_tokens, q.device)
    qsl = meta.query_start_loc_cpu.tolist()
    seq = meta.seq_lens_cpu.tolist()
    decode_reqs = [i for i in range(meta.num_reqs) if qsl[i + 1] - qsl[i] == 1]
    if len(decode_reqs) > 1:
        idx = torch.tensor(decode_reqs, device=q.device)
        tok = torch.tensor([qsl[i] for i in decode_reqs], device=q.device)
        sl = torch.tensor([seq[i] for i in decode_reqs], device=q.device, dtype=torch.int64)
        out[tok] = _attend_decodes(q[tok], k_flat, v_flat, meta.block_table.to(q.device)[idx], sl,
                                   qpos_all[tok], block_size, scale, options)
        done = set(decode_reqs)
    else:
        done = set()
    for i in range(meta.num_reqs):
        s, e = qsl[i], qsl[i + 1]
        if e == s or i in done:
            continue
        slots = request_slots(meta.block_table[i].to(q.device), seq[i], block_size)
        out[s:e] = _attend_one(q[s:e], k_flat[slots], v_flat[slots], qpos_all[s:e], scale, options)
    return out


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: CommonAttentionMetadata, scale: float,
                    positions: torch.Tensor | None = None, options: AttentionOptions | None = None) -> torch.Tensor:
    """MHA/GQA over an MHA cache ``[NB, BS, 2, Hkv, D]``: ``q [T, Hq, D]`` -> ``[T, Hq, D]``.

    Query head ``h`` uses KV head ``h // (Hq // Hkv)`` (HF ``repeat_kv``). ``positions`` defaults to
    ``meta.positions``, then to ``seq_len - q_len + j``. Padding tokens (past ``query_start_loc[-1]``) get
    zeros. ``options``: a sliding window and attention sinks (``options.py``).
    """
    if options is not None:
        options.check_heads(q.shape[1])
    if kv_cache.dim() != 5 or kv_cache.shape[2] != 2:
        raise ValueError(f"expected an MHA cache [NB, BS, 2, Hkv, D], got {tuple(kv_cache.shape)}")
    if q.shape[1] % kv_cache.shape[3]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {kv_cache.shape[3]} KV heads")
    flat = kv_cache.view(-1, *kv_cache.shape[2:])
    return _paged_attend(q, flat[:, 0], flat[:, 1], meta, kv_cache.shape[1], scale, positions, options)


def paged_mla_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                        meta: CommonAttentionMetadata, scale: float, w_uk: torch.Tensor, w_uv: torch.Tensor,
                        positions: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed MLA over a latent cache ``[NB, BS, L + R]``.

    ``q_nope [T, H, dn]``, ``q_rope [T, H, R]`` (already rotated), ``w_uk [H, dn, L]`` and ``w_uv [H, dv, L]``
    (slices of ``kv_b_proj.weight``). Returns ``[T, H, dv]``. ``scale`` is the un-absorbed one
    (``(dn + R) ** -0.5`` times any yarn mscale): absorption leaves every score unchanged.
    """
    latent_dim = w_uk.shape[-1]
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != latent_dim + q_rope.shape[-1]:
        raise ValueError(f"expected an MLA cache [NB, BS, {latent_dim}+{q_rope.shape[-1]}], "
                         f"got {tuple(kv_cache.shape)}")
    q_latent = torch.einsum("thd,hdl->thl", q_nope, w_uk)
    q_cat = torch.cat((q_latent, q_rope), dim=-1)
    flat = kv_cache.view(-1, 1, kv_cache.shape[-1])
    out_latent = _paged_attend(q_cat, flat, flat[..., :latent_dim], meta, kv_cache.shape[1], scale, positions)
    return torch.einsum("thl,hvl->thv", out_latent, w_uv)
