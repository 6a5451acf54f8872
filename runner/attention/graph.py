"""CUDA-graph decode through the attention backends: fixed shapes, persistent metadata, a null block.

A graph replays the pointers and grid sizes it was captured with, so graph decode metadata lives in
persistent buffers (:class:`DecodeMetadataBuffers`, ``[max_reqs, max_blocks]``) that a replay only refills:

- each view (:class:`GraphDecodeMetadata`) names the backend that built the buffers; a layer handed one
  calls that backend's decode on every row (``runner/attention/ops.py``), the same call as an eager step's
  decode group, so the Triton backend's graphs read each request's blocks only up to its ``seq_len``;
- padding requests get ``seq_len = 1`` and a block table full of the reserved *null block*, and padding
  tokens write their KV into it instead of being skipped: no data-dependent branch, finite outputs.

:func:`capturable_attention` is what ``cudagraph.GraphRunner`` asks for: nothing is patched (the metadata's
type routes the layers); it reports how many layers go through the backend interface, so a model with its
own attention is named in a warning.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from runner.attention.backend import AttentionBackend
from runner.attention.cache_layout import absorbed_mla, mha_cache_views
from runner.attention.metadata import GraphDecodeMetadata
from runner.attention.torch_backend import TorchAttentionBackend
from ubatch.slicing import CommonAttentionMetadata

__all__ = ["DecodeMetadataBuffers", "GraphDecodeMetadata", "capturable_attention", "graph_paged_attention",
           "graph_paged_mla_attention", "graph_write_kv"]


class DecodeMetadataBuffers:
    """Persistent metadata for every decode graph; one set shared by all sizes (graphs replay one at a time).

    Per-ubatch metadata are disjoint row views (ubatch ``i`` owns its token rows, one request per token),
    so the two ubatches never share mutable state — the bug behind vLLM #48659. ``backend`` computes the
    decode (default: the plain-torch one; the engine passes its ``--attention-backend``).
    """

    def __init__(self, max_reqs: int, max_blocks: int, block_size: int, null_block: int,
                 device: torch.device | str, backend: AttentionBackend | None = None) -> None:
        if max_reqs < 1 or max_blocks < 1 or block_size < 1 or null_block < 0:
            raise ValueError(f"bad decode buffer shape: max_reqs={max_reqs}, max_blocks={max_blocks}, "
                             f"block_size={block_size}, null_block={null_block}")
        self.backend = TorchAttentionBackend() if backend is None else backend
        self.max_reqs, self.max_blocks, self.block_size, self.null_block = max_reqs, max_blocks, block_size, null_block
        self.null_slot = null_block * block_size
        self.seq_lens = torch.ones(max_reqs, dtype=torch.int32, device=device)
        self.block_table = torch.full((max_reqs, max_blocks), null_block, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((max_reqs,), self.null_slot, dtype=torch.int64, device=device)

    def view(self, start: int, stop: int) -> GraphDecodeMetadata:
        return GraphDecodeMetadata(self.backend, self.seq_lens[start:stop], self.block_table[start:stop],
                                   self.slot_mapping[start:stop])

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


# ---- graph decode outside a model (tests): the same backend calls runner/attention/ops.py makes ----------
def graph_write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor | None = None) -> None:
    """Write every row's KV: padding rows point at the null block, so no slot is skipped and nothing branches."""
    flat = kv_cache.view(-1, *kv_cache.shape[2:])
    entry = key if value is None else torch.stack((key, value), dim=1)
    flat.index_copy_(0, slot_mapping[: key.shape[0]], entry.to(flat.dtype))


def graph_paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: GraphDecodeMetadata, scale: float,
                          positions: torch.Tensor | None = None) -> torch.Tensor:
    """Decode GQA over an MHA cache ``[NB, BS, 2, Hkv, D]`` through ``meta.backend`` (``positions`` unused:
    decode queries sit at ``seq_len - 1``, so the causal mask is the ``seq_lens`` mask)."""
    return meta.backend.attend(q, *mha_cache_views(kv_cache), meta, scale)


def graph_paged_mla_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                              meta: GraphDecodeMetadata, scale: float, w_uk: torch.Tensor, w_uv: torch.Tensor,
                              positions: torch.Tensor | None = None) -> torch.Tensor:
    """Decode absorbed MLA over a latent cache ``[NB, BS, L + R]`` through ``meta.backend``."""
    return absorbed_mla(q_nope, q_rope, kv_cache, meta, scale, w_uk, w_uv)


@contextlib.contextmanager
def capturable_attention(model: torch.nn.Module) -> Iterator[int]:
    """Yields how many of the model's layers go through the backend interface (0: the model has its own
    attention, which must then be capturable itself). Patches nothing: graph metadata routes the layers."""
    yield sum(1 for m in model.modules() if getattr(type(m), "uses_attention_backend", False))
