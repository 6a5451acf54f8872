"""What an attention backend reads in a layer, built once per step (and per ubatch) before the forward.

A layer must not make the host wait for the GPU: a sync in one DBO ubatch stops the CPU from launching the
other ubatch's work. So everything a layer needs that is not already a device tensor of
:class:`CommonAttentionMetadata` is worked out here, on the host, from its ``*_cpu`` twins:

- the prefill requests as a few padded groups (``prefill_batch.py``): their index arrays built with numpy and
  sent in one copy, so a layer attends every prefill request in a handful of launches; the decode batch's
  longest sequence as a host int (no ``int(seq_lens.max())`` in a layer);
- the number of real tokens (the rest are padding rows with slot ``-1``, always at the tail), so the KV write
  needs no ``bool((slots >= 0).all())``;
- the decode requests (query length 1) as one group: rows ``[0, R)`` when they are the batch's first
  requests (every decode step), else device index tensors made by two small pinned, non-blocking copies.

``build_paged_metadata`` runs per ubatch on that ubatch's split ``CommonAttentionMetadata``
(``ubatch.slicing.split_attn_metadata``), so the UBatchWrapper gets a list it does not split again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from runner.attention.kv_cache import host_to_device
from runner.attention.options import AttentionOptions
from runner.attention.prefill_batch import PrefillGroup, build_prefill_groups
from ubatch.slicing import CommonAttentionMetadata


class AttentionBackendLike(Protocol):
    """What metadata needs to know of ``runner.attention.backend.AttentionBackend`` (no import cycle)."""

    @property
    def name(self) -> str: ...

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: Any,
               scale: float, options: AttentionOptions | None = None) -> torch.Tensor: ...

    def write_kv(self, kv_cache: torch.Tensor, meta: Any, entry: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class DecodeGroup:
    """The (micro)batch's requests with one query token: ``block_table``/``seq_lens`` rows per request.

    ``token_index`` is ``None`` when the group is the first ``num_reqs`` requests (their tokens are then rows
    ``[0, num_reqs)``): plain slices, no gather.
    """

    num_reqs: int
    block_table: torch.Tensor  # int32 [R, max_blocks]
    seq_lens: torch.Tensor  # int32 [R]; the query sits at seq_len - 1
    max_seq_len: int  # host-side: the longest of them
    token_index: torch.Tensor | None = None  # int64 [R]: their query rows in the batch


@dataclass(frozen=True)
class PrefillRequest:
    """A request with more than one query token (prefill, chunked prefill, part of a cut request)."""

    index: int  # row in the batch's request tables
    token_start: int
    token_stop: int
    seq_len: int  # its queries are the last ``token_stop - token_start`` positions of ``[0, seq_len)``


@dataclass(frozen=True)
class PagedAttentionMetadata:
    """One (micro)batch's attention metadata for ``backend``; every field a layer reads is ready."""

    backend: AttentionBackendLike
    common: CommonAttentionMetadata
    num_tokens: int  # rows of the (micro)batch, padding included
    num_real_tokens: int  # rows with a KV slot: ``[0, num_real_tokens)``
    slot_mapping: torch.Tensor  # int64 [num_real_tokens]
    decode: DecodeGroup | None
    prefills: tuple[PrefillRequest, ...]  # what the groups hold, per request (tests, logs)
    prefill_groups: tuple[PrefillGroup, ...] = ()  # what a layer attends: a few groups, whatever len(prefills)

    @property
    def num_reqs(self) -> int:
        return self.common.num_reqs


@dataclass
class GraphDecodeMetadata:
    """One (micro)batch's view of the persistent CUDA-graph decode buffers (``graph.DecodeMetadataBuffers``):
    one request per row, fixed shapes; padding rows read and write the reserved null block."""

    backend: AttentionBackendLike
    seq_lens: torch.Tensor  # int32 [R]; padding rows hold 1
    block_table: torch.Tensor  # int32 [R, max_blocks]; padding entries hold the null block
    slot_mapping: torch.Tensor  # int64 [R]; padding tokens write to the null block
    max_query_len: int = 1

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]


def build_paged_metadata(backend: AttentionBackendLike, common: CommonAttentionMetadata) -> PagedAttentionMetadata:
    """Host-side work for one (micro)batch; device work is slicing, for a mixed batch two small copies, and for
    prefill requests one copy of their groups' index arrays plus a mask per group.

    Vectorised over the requests (numpy views of the ``*_cpu`` tensors): only prefill requests get a Python
    object each (``prefills``, for tests and logs); layers read ``prefill_groups``.
    """
    qsl = common.query_start_loc_cpu.numpy()
    seq = common.seq_lens_cpu.numpy()
    num_reqs = common.num_reqs
    if len(qsl) != num_reqs + 1 or len(seq) != num_reqs:
        raise ValueError(f"metadata for {num_reqs} requests has {len(qsl)} query offsets and {len(seq)} "
                         "sequence lengths")
    num_real = int(qsl[-1]) if len(qsl) else 0
    num_tokens = common.slot_mapping.shape[0]
    if num_real > num_tokens:
        raise ValueError(f"{num_real} real tokens but a slot mapping of {num_tokens} rows")
    q = np.diff(qsl)
    is_decode = q == 1
    num_decodes = int(np.count_nonzero(is_decode))
    prefills: tuple[PrefillRequest, ...] = ()
    groups: tuple[PrefillGroup, ...] = ()
    if num_decodes < num_reqs:
        multi = np.flatnonzero(q > 1)
        short = multi[seq[multi] < q[multi]]
        if short.size:
            i = int(short[0])
            raise ValueError(f"request {i} has {int(q[i])} query tokens but seq_len {int(seq[i])}")
        prefills = tuple(PrefillRequest(i, s, e, n) for i, s, e, n in
                         zip(multi.tolist(), qsl[multi].tolist(), qsl[multi + 1].tolist(), seq[multi].tolist(),
                             strict=True))
        groups = build_prefill_groups(multi.astype(np.int64), qsl[multi].astype(np.int64),
                                      q[multi].astype(np.int64), seq[multi].astype(np.int64),
                                      common.block_table.device)
    decode = None
    if num_decodes:
        longest = int(seq[is_decode].max())
        if num_decodes == num_reqs or bool(is_decode[:num_decodes].all()):  # the first R requests: rows [0, R)
            r = num_decodes
            decode = DecodeGroup(r, common.block_table[:r], common.seq_lens[:r], longest)
        else:
            device = common.block_table.device
            idx = np.flatnonzero(is_decode)
            req = host_to_device(torch.from_numpy(idx), device)
            tok = host_to_device(torch.from_numpy(qsl[idx].astype(np.int64)), device)
            decode = DecodeGroup(num_decodes, common.block_table.index_select(0, req),
                                 common.seq_lens.index_select(0, req), longest, tok)
    return PagedAttentionMetadata(backend, common, num_tokens, num_real, common.slot_mapping[:num_real],
                                  decode, prefills, groups)
