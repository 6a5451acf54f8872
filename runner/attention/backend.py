"""The attention-backend interface: one object serves eager steps and CUDA-graph decode (vLLM's attention
backends, reduced to what this engine needs).

A backend supplies two computations and inherits the rest:

- :meth:`AttentionBackend.decode`: one query token per request, reading the paged cache through a block
  table, the query at position ``seq_len - 1`` (the Triton kernel's contract,
  ``runner/attention/triton_paged_decode.py``);
- :meth:`AttentionBackend.prefill`: one request's queries (the last ``L`` positions of ``[0, S)``) against
  its ``S`` keys, gathered from the cache (a query at position ``p`` sees keys ``<= p``).

The base class builds per-step metadata (:meth:`build_metadata`, before the forward), writes KV and splits a
batch into its decode group and its prefill requests (:meth:`attend`); CUDA-graph decode metadata
(``graph.DecodeMetadataBuffers(..., backend=...)``) routes every row to the same :meth:`decode`. A layer
never picks a backend: the metadata it is handed names the backend that built it (``runner/attention/ops.py``).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from runner.attention.metadata import GraphDecodeMetadata, PagedAttentionMetadata, build_paged_metadata
from runner.attention.reference import request_slots
from ubatch.slicing import CommonAttentionMetadata


class AttentionBackend(ABC):
    """Paged attention over caches viewed as ``[num_blocks, block_size, num_kv_heads, head_dim]``."""

    name: ClassVar[str]

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # ---- the two computations a backend supplies ----------------------------------------------------------
    @abstractmethod
    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, max_seq_len: int | None, scale: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """``q [R, Hq, Dk]`` -> ``[R, Hq, Dv]``; request ``r`` sees keys ``[0, seq_lens[r])``.

        ``max_seq_len`` is a host-side bound on ``seq_lens`` (``None`` under graph capture: the block table's
        width bounds it). ``out``, when given, receives the result (a contiguous ``[R, Hq, Dv]`` tensor).
        """

    @abstractmethod
    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """``q [L, Hq, Dk]`` (positions ``S - L .. S - 1``), ``k [S, Hkv, Dk]``, ``v [S, Hkv, Dv]`` ->
        ``[L, Hq, Dv]``, causal by position."""

    # ---- metadata ---------------------------------------------------------------------------------------------
    def build_metadata(self, common: CommonAttentionMetadata) -> PagedAttentionMetadata:
        """This backend's metadata for one (micro)batch; call it before the forward, once per step/ubatch."""
        return build_paged_metadata(self, common)

    # ---- what a layer calls -------------------------------------------------------------------------------
    def write_kv(self, kv_cache: torch.Tensor, meta: PagedAttentionMetadata | GraphDecodeMetadata,
                 entry: torch.Tensor) -> None:
        """Scatter this step's per-token cache entries (``[T, *per_token_shape]``) into their slots.

        Eager metadata: the first ``num_real_tokens`` rows (padding rows, at the tail, are not written).
        Graph metadata: every row (padding rows write into the reserved null block).
        """
        flat = kv_cache.view(-1, *kv_cache.shape[2:])
        slots = meta.slot_mapping
        flat.index_copy_(0, slots, entry[: slots.shape[0]].to(flat.dtype))

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: PagedAttentionMetadata | GraphDecodeMetadata, scale: float) -> torch.Tensor:
        """``q [T, Hq, Dk]`` over the paged cache -> ``[T, Hq, Dv]``; padding rows get zeros (eager) or
        finite values from the null block (graph)."""
        if q.shape[1] % k_cache.shape[2]:
            raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} KV heads")
        if not isinstance(meta, PagedAttentionMetadata):  # graph decode: one request per row, fixed shapes
            if q.shape[0] != meta.num_reqs:
                raise ValueError(f"{q.shape[0]} query tokens for {meta.num_reqs} decode rows: one token per "
                                 "request expected")
            return self.decode(q, k_cache, v_cache, meta.block_table, meta.seq_lens, None, scale)
        if q.shape[0] != meta.num_tokens:
            raise ValueError(f"{q.shape[0]} query rows for metadata of {meta.num_tokens} tokens")
        out = q.new_zeros(q.shape[0], q.shape[1], v_cache.shape[-1])
        group = meta.decode
        if group is not None:
            if group.token_index is None:
                self.decode(q[: group.num_reqs], k_cache, v_cache, group.block_table, group.seq_lens,
                            group.max_seq_len, scale, out=out[: group.num_reqs])
            else:
                res = self.decode(q.index_select(0, group.token_index), k_cache, v_cache, group.block_table,
                                  group.seq_lens, group.max_seq_len, scale)
                out.index_copy_(0, group.token_index, res)
        if meta.prefills:
            block_size = k_cache.shape[1]
            k_flat, v_flat = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
            table = meta.common.block_table
            for p in meta.prefills:
                slots = request_slots(table[p.index], p.seq_len, block_size)
                out[p.token_start:p.token_stop] = self.prefill(q[p.token_start:p.token_stop], k_flat[slots],
                                                               v_flat[slots], scale)
        return out
