"""Capturable uniform-decode attention: fixed shapes, persistent metadata, padding into a null block.

The eager backend (``runner/attention.py``) loops over requests with shapes read from the batch and
``write_kv`` checks for padding slots with a device sync, so it cannot be captured in a CUDA graph. This
one serves decode batches (one query token per request) with shapes fixed at capture time:

- metadata lives in persistent buffers (:class:`DecodeMetadataBuffers`) sized ``[max_reqs, max_blocks]``;
  a replay only refills them, so the graph's pointers stay valid;
- each request attends over all ``max_blocks * block_size`` key positions, masked by ``seq_lens``
  (the cost of fixed shapes: work scales with ``max_model_len``, not with the actual context);
- padding requests get ``seq_len = 1`` and a block table full of the reserved *null block*, and padding
  tokens write their KV into it instead of being skipped — no data-dependent branch, finite outputs.

Numerics mirror the eager decode path (scores in the activation dtype, softmax in fp32).

The models call ``write_kv`` / ``paged_attention`` / ``paged_mla_attention`` from ``runner.attention``;
:func:`capturable_attention` routes those calls here for the duration of a capture when the forward
context carries a :class:`GraphDecodeMetadata` (replays run no Python, so nothing is patched at run time).
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

import runner.attention as _eager
from ubatch.forward_context import maybe_get_forward_context
from ubatch.slicing import CommonAttentionMetadata


@dataclass
class GraphDecodeMetadata:
    """One (micro)batch's view of the persistent decode buffers: rows ``[start, stop)`` of each."""

    seq_lens: torch.Tensor  # int32 [R]; padding rows hold 1
    block_table: torch.Tensor  # int32 [R, max_blocks]; padding entries hold the null block
    slot_mapping: torch.Tensor  # int64 [R]; padding tokens write to the null block
    key_block_index: torch.Tensor  # int64 [S] = arange(S) // block_size, S = max_blocks * block_size
    key_offset: torch.Tensor  # int64 [S] = arange(S) % block_size
    key_positions: torch.Tensor  # int64 [S] = arange(S)
    block_size: int
    max_query_len: int = 1

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]


class DecodeMetadataBuffers:
    """Persistent metadata for every decode graph; one set shared by all sizes (graphs replay one at a time).

    Per-ubatch metadata are disjoint row views (ubatch ``i`` owns its token rows, one request per token),
    so the two ubatches never share mutable state — the bug behind vLLM #48659.
    """

    def __init__(self, max_reqs: int, max_blocks: int, block_size: int, null_block: int,
                 device: torch.device | str) -> None:
        if max_reqs < 1 or max_blocks < 1 or block_size < 1 or null_block < 0:
            raise ValueError(f"bad decode buffer shape: max_reqs={max_reqs}, max_blocks={max_blocks}, "
                             f"block_size={block_size}, null_block={null_block}")
        self.max_reqs, self.max_blocks, self.block_size, self.null_block = max_reqs, max_blocks, block_size, null_block
        self.null_slot = null_block * block_size
        self.seq_lens = torch.ones(max_reqs, dtype=torch.int32, device=device)
        self.block_table = torch.full((max_reqs, max_blocks), null_block, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((max_reqs,), self.null_slot, dtype=torch.int64, device=device)
        pos = torch.arange(max_blocks * block_size, dtype=torch.int64, device=device)
        self.key_positions, self.key_block_index, self.key_offset = pos, pos // block_size, pos % block_size

    def view(self, start: int, stop: int) -> GraphDecodeMetadata:
        return GraphDecodeMetadata(self.seq_lens[start:stop], self.block_table[start:stop],
                                   self.slot_mapping[start:stop], self.key_block_index, self.key_offset,
                                   self.key_positions, self.block_size)

    def views(self, num_tokens: int, ubatch_sizes: Sequence[int] = ()) -> list[GraphDecodeMetadata]:
        """``[whole batch]`` without DBO, else one view per ubatch in token order."""
        if num_tokens > self.max_reqs:
            raise ValueError(f"{num_tokens} decode tokens exceed the buffers' {self.max_reqs} rows")
        if not ubatch_sizes:
            return [self.view(0, num_tokens)]
        if sum(ubatch_sizes) != num_tokens:
            raise ValueError(f"ubatch sizes {tuple(ubatch_sizes)} do not add up to {num_tokens} tokens")
        out, start = [], 0
        for size in ubatch_sizes:
            out.append(self.view(start, start + size))
            start += size
        return out

    def fill_padding(self, num_tokens: int) -> None:
        """Every row a padding request: what a capture runs on (any valid data would do)."""
        self.seq_lens[:num_tokens].fill_(1)
        self.block_table[:num_tokens].fill_(self.null_block)
        self.slot_mapping[:num_tokens].fill_(self.null_slot)

    def fill(self, meta: CommonAttentionMetadata, num_tokens: int) -> None:
        """Copy a uniform-decode batch's metadata into rows ``[0, num_tokens)``; rows past its requests pad.

        Device-to-device copies and fills only (no host sync); they are stream-ordered before the replay.
        """
        n = meta.num_reqs
        if meta.num_actual_tokens != n or (n and meta.max_query_len != 1):
            raise ValueError(f"not a uniform-decode batch: {meta.num_actual_tokens} tokens for {n} requests, "
                             f"max_query_len={meta.max_query_len}")
        if not n <= num_tokens <= self.max_reqs:
            raise ValueError(f"cannot pad {n} decode requests to {num_tokens} rows (buffers hold {self.max_reqs})")
        if meta.max_seq_len > self.max_blocks * self.block_size:
            raise ValueError(f"a request of {meta.max_seq_len} tokens exceeds the graph buffers' "
                             f"{self.max_blocks * self.block_size} (max_model_len)")
        width = min(meta.block_table.shape[1], self.max_blocks)  # columns past the longest request are unread
        self.seq_lens[:n].copy_(meta.seq_lens[:n])
        self.seq_lens[n:num_tokens].fill_(1)
        self.block_table[:n, :width].copy_(meta.block_table[:n, :width])
        self.block_table[:n, width:].fill_(self.null_block)
        self.block_table[n:num_tokens].fill_(self.null_block)
        self.slot_mapping[:n].copy_(meta.slot_mapping[:n])
        self.slot_mapping[n:num_tokens].fill_(self.null_slot)


# ---- the capturable kernels ------------------------------------------------------------------------
def graph_write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor | None = None) -> None:
    """``write_kv`` without the padding check: every slot is valid (padding points at the null block)."""
    flat = kv_cache.view(-1, *kv_cache.shape[2:])
    entry = key if value is None else torch.stack((key, value), dim=1)
    flat.index_copy_(0, slot_mapping[: key.shape[0]], entry.to(flat.dtype))


def _decode_attend(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, meta: GraphDecodeMetadata,
                   scale: float) -> torch.Tensor:
    """``q [R, Hq, Dk]`` over every key position of each request's blocks, masked by ``seq_lens``."""
    r, hq, dk = q.shape
    if r != meta.num_reqs:
        raise ValueError(f"{r} query tokens for {meta.num_reqs} decode rows: one token per request expected")
    hkv = k_flat.shape[1]
    blocks = meta.block_table[:, meta.key_block_index].to(torch.int64)  # [R, S]
    slots = blocks * meta.block_size + meta.key_offset
    k, v = k_flat[slots], v_flat[slots]  # [R, S, Hkv, D]
    qg = q.view(r, hkv, hq // hkv, dk)
    scores = torch.einsum("rhgd,rshd->rhgs", qg, k) * scale
    mask = meta.key_positions[None, :] >= meta.seq_lens[:, None]
    scores = scores.masked_fill(mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    # Slots past seq_len were never written (the caches are not zero-filled): a zero weight times whatever
    # they hold could still be NaN, so their values are zeroed, not just weighted by zero.
    v = v.masked_fill(mask[:, :, None, None], 0)
    return torch.einsum("rhgs,rshd->rhgd", probs, v).reshape(r, hq, v.shape[-1])


def graph_paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: GraphDecodeMetadata, scale: float,
                          positions: torch.Tensor | None = None) -> torch.Tensor:
    """Decode GQA over an MHA cache ``[NB, BS, 2, Hkv, D]`` (``positions`` unused: decode queries sit at
    ``seq_len - 1``, so the causal mask is the ``seq_lens`` mask)."""
    if kv_cache.dim() != 5 or kv_cache.shape[2] != 2:
        raise ValueError(f"expected an MHA cache [NB, BS, 2, Hkv, D], got {tuple(kv_cache.shape)}")
    flat = kv_cache.view(-1, *kv_cache.shape[2:])
    return _decode_attend(q, flat[:, 0], flat[:, 1], meta, scale)


def graph_paged_mla_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                              meta: GraphDecodeMetadata, scale: float, w_uk: torch.Tensor, w_uv: torch.Tensor,
                              positions: torch.Tensor | None = None) -> torch.Tensor:
    """Decode absorbed MLA over a latent cache ``[NB, BS, L + R]`` (same maths as the eager one)."""
    latent_dim = w_uk.shape[-1]
    q_latent = torch.einsum("thd,hdl->thl", q_nope, w_uk)
    q_cat = torch.cat((q_latent, q_rope), dim=-1)
    flat = kv_cache.view(-1, 1, kv_cache.shape[-1])
    out_latent = _decode_attend(q_cat, flat, flat[..., :latent_dim], meta, scale)
    return torch.einsum("thl,hvl->thv", out_latent, w_uv)


# ---- routing the models' calls during a capture --------------------------------------------------------
_ORIGINALS = {"paged_attention": _eager.paged_attention, "paged_mla_attention": _eager.paged_mla_attention,
              "write_kv": _eager.write_kv}


def _context_metadata() -> Any:
    fc = maybe_get_forward_context()
    return None if fc is None else fc.attn_metadata


def _paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: Any, scale: float,
                     positions: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(meta, GraphDecodeMetadata):
        return graph_paged_attention(q, kv_cache, meta, scale, positions)
    return _ORIGINALS["paged_attention"](q, kv_cache, meta, scale, positions)


def _paged_mla_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, meta: Any,
                         scale: float, w_uk: torch.Tensor, w_uv: torch.Tensor,
                         positions: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(meta, GraphDecodeMetadata):
        return graph_paged_mla_attention(q_nope, q_rope, kv_cache, meta, scale, w_uk, w_uv, positions)
    return _ORIGINALS["paged_mla_attention"](q_nope, q_rope, kv_cache, meta, scale, w_uk, w_uv, positions)


def _write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor | None = None) -> None:
    # write_kv gets no metadata argument: the thread's (ubatch's) forward context says which batch this is
    if isinstance(_context_metadata(), GraphDecodeMetadata):
        return graph_write_kv(kv_cache, slot_mapping, key, value)
    return _ORIGINALS["write_kv"](kv_cache, slot_mapping, key, value)


_DISPATCHERS = {"paged_attention": _paged_attention, "paged_mla_attention": _paged_mla_attention,
                "write_kv": _write_kv}


@contextlib.contextmanager
def capturable_attention(model: torch.nn.Module) -> Iterator[int]:
    """Route the model's ``runner.attention`` calls through dispatchers for the block; yields how many
    names were rerouted (0: the model has its own attention, which must then be capturable itself).

    The dispatchers fall back to the eager functions for any other metadata, so an eager step inside
    the block still works. Module globals are restored on exit, even on error; nesting is harmless.
    """
    modules = {sys.modules.get(type(m).__module__) for m in model.modules()} | {_eager}
    saved = []
    for mod in modules:
        for name, replacement in _DISPATCHERS.items():
            if mod is not None and getattr(mod, name, None) is _ORIGINALS[name]:
                setattr(mod, name, replacement)
                saved.append((mod, name))
    try:
        yield len(saved)
    finally:
        for mod, name in saved:
            setattr(mod, name, _ORIGINALS[name])
