"""The attention-backend interface: one object serves eager steps and CUDA-graph decode (vLLM's attention
backends, reduced to what this engine needs).

A backend supplies two computations and inherits the rest:

- :meth:`AttentionBackend.decode`: one query token per request, reading the paged cache through a block
  table, the query at position ``seq_len - 1`` (the Triton kernel's contract,
  ``runner/attention/triton_paged_decode.py``);
- :meth:`AttentionBackend.prefill`: a padded group of prefill requests at once, ``[R, Lmax]`` queries (request
  ``r``'s are the last ``L_r`` positions of ``[0, S_r)``) against ``[R, Smax]`` keys gathered from the cache,
  under a mask that is causal bottom-right aligned per request and hides the padding
  (``runner/attention/prefill_batch.py``: why batched, and how requests are grouped).

The base class builds per-step metadata (:meth:`build_metadata`, before the forward), writes KV and splits a
batch into its decode group and its prefill groups (:meth:`attend`): a step's attention is a handful of
launches per layer whatever its number of requests, with no host sync; CUDA-graph decode metadata
(``graph.DecodeMetadataBuffers(..., backend=...)``) routes every row to the same :meth:`decode`. A layer
never picks a backend: the metadata it is handed names the backend that built it (``runner/attention/ops.py``).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from runner.attention.metadata import GraphDecodeMetadata, PagedAttentionMetadata, build_paged_metadata
from runner.attention.options import AttentionOptions
from runner.attention.prefill_batch import PrefillGroup
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
               out: torch.Tensor | None = None, options: AttentionOptions | None = None) -> torch.Tensor:
        """``q [R, Hq, Dk]`` -> ``[R, Hq, Dv]``; request ``r`` sees keys ``[0, seq_lens[r])``.

        ``max_seq_len`` is a host-side bound on ``seq_lens`` (``None`` under graph capture: the block table's
        width bounds it). ``out``, when given, receives the result (a contiguous ``[R, Hq, Dv]`` tensor).
        ``options``: a sliding window (only the last ``W`` of those keys) and attention sinks (``options.py``).
        """

    @abstractmethod
    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: PrefillGroup,
                scale: float, options: AttentionOptions | None = None) -> torch.Tensor:
        """``q [R, Lmax, Hq, Dk]``, ``k [R, Smax, Hkv, Dk]``, ``v [R, Smax, Hkv, Dv]`` -> ``[R, Lmax, Hq, Dv]``.

        ``group.mask`` bool ``[R, Lmax, Smax]``, True = attend; no row is all False, and every key (padding
        included) is finite. ``group.causal``: the mask is the plain causal one (``Lmax == Smax``, no padding),
        which a kernel may take instead. ``group.memo`` keeps what a backend derives from the mask for the
        step's other layers. Query head ``h`` uses KV head ``h // (Hq // Hkv)``. ``options``: a sliding window
        (``group.visible(window)`` is the mask then, never plain causal) and attention sinks (``options.py``).
        """

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
               meta: PagedAttentionMetadata | GraphDecodeMetadata, scale: float,
               options: AttentionOptions | None = None) -> torch.Tensor:
        """``q [T, Hq, Dk]`` over the paged cache -> ``[T, Hq, Dv]``; padding rows get zeros (eager) or
        finite values from the null block (graph). ``options``: the layer's window and sinks, to every call."""
        if q.shape[1] % k_cache.shape[2]:
            raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} KV heads")
        if options is not None:
            options.check_heads(q.shape[1])
        if not isinstance(meta, PagedAttentionMetadata):  # graph decode: one request per row, fixed shapes
            if q.shape[0] != meta.num_reqs:
                raise ValueError(f"{q.shape[0]} query tokens for {meta.num_reqs} decode rows: one token per "
                                 "request expected")
            return self.decode(q, k_cache, v_cache, meta.block_table, meta.seq_lens, None, scale, options=options)
        if q.shape[0] != meta.num_tokens:
            raise ValueError(f"{q.shape[0]} query rows for metadata of {meta.num_tokens} tokens")
        out = q.new_zeros(q.shape[0], q.shape[1], v_cache.shape[-1])
        group = meta.decode
        if group is not None:
            if group.token_index is None:
                self.decode(q[: group.num_reqs], k_cache, v_cache, group.block_table, group.seq_lens,
                            group.max_seq_len, scale, out=out[: group.num_reqs], options=options)
            else:
                res = self.decode(q.index_select(0, group.token_index), k_cache, v_cache, group.block_table,
                                  group.seq_lens, group.max_seq_len, scale, options=options)
                out.index_copy_(0, group.token_index, res)
        if meta.prefill_groups:
            block_size, hq, hkv = k_cache.shape[1], q.shape[1], k_cache.shape[2]
            k_flat, v_flat = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
            for g in meta.prefill_groups:  # a few groups (prefill_batch.group_prefills), not one per request
                r, lq, s = g.num_reqs, g.max_query_len, g.max_seq_len
                slots = g.key_slots(meta.common.block_table, block_size)
                res = self.prefill(q.index_select(0, g.query_rows).view(r, lq, hq, q.shape[2]),
                                   k_flat.index_select(0, slots).view(r, s, hkv, k_flat.shape[-1]),
                                   v_flat.index_select(0, slots).view(r, s, hkv, v_flat.shape[-1]),
                                   g, scale, options).reshape(r * lq, hq, out.shape[-1])
                if g.real_index is not None:
                    res = res.index_select(0, g.real_index)
                out.index_copy_(0, g.out_rows, res)
        return out
