"""Per-request metadata builders, plain loops over lists and small tensors, kept as test references.

``runner/attention/kv_cache.py`` and ``runner/attention/metadata.py`` build a step's block table, positions,
slot mapping and decode/prefill split with vectorised numpy over the whole batch; the tests check them against
these loops on any batch.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from runner.attention.kv_cache import blocks_needed, host_to_device
from runner.attention.metadata import PrefillRequest
from ubatch.slicing import CommonAttentionMetadata


def make_block_table(block_lists: Sequence[Sequence[int]], max_blocks: int | None = None,
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """Per-request block lists -> int32 ``[num_reqs, max_blocks]`` padded with 0 (never read: seq_lens bound it)."""
    width = max([len(b) for b in block_lists], default=0)
    if max_blocks is not None:
        if width > max_blocks:
            raise ValueError(f"a request holds {width} blocks, more than max_blocks={max_blocks}")
        width = max_blocks
    table = torch.zeros((len(block_lists), max(width, 1)), dtype=torch.int32)
    for i, blocks in enumerate(block_lists):
        if blocks:
            table[i, : len(blocks)] = torch.as_tensor(list(blocks), dtype=torch.int32)
    return table.to(device)


def compute_slot_mapping(block_table: torch.Tensor, query_start_loc: torch.Tensor, positions: torch.Tensor,
                         block_size: int) -> torch.Tensor:
    """Slot of each token: ``block_table[req(t), pos // bs] * bs + pos % bs`` (int64 ``[T]``).

    Tokens past ``query_start_loc[-1]`` (padding) get slot ``-1``.
    """
    qsl = query_start_loc.to(torch.int64)
    num_tokens = positions.shape[0]
    num_actual = int(qsl[-1])
    lens = qsl[1:] - qsl[:-1]
    req = torch.repeat_interleave(torch.arange(lens.shape[0], device=positions.device), lens.to(positions.device))
    pos = positions[:num_actual].to(torch.int64)
    blocks = block_table.to(positions.device)[req, pos // block_size].to(torch.int64)
    slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=positions.device)
    slots[:num_actual] = blocks * block_size + pos % block_size
    return slots


def reference_attention_metadata(context_lens: Sequence[int], query_lens: Sequence[int],
                                 block_lists: Sequence[Sequence[int]], block_size: int,
                                 device: torch.device | str = "cpu", num_padded_tokens: int | None = None,
                                 max_blocks: int | None = None) -> CommonAttentionMetadata:
    """Metadata for a batch where request ``i`` has ``context_lens[i]`` cached tokens and computes
    ``query_lens[i]`` new ones at positions ``context..context+query-1``.

    Covers prefill (context 0), decode (query 1), chunked prefill and the second half of a split request
    (context = tokens already written by the previous chunk/ubatch). ``num_padded_tokens`` appends padding
    tokens (slot -1, position 0) for graph-sized batches.
    """
    if not (len(context_lens) == len(query_lens) == len(block_lists)):
        raise ValueError("context_lens, query_lens and block_lists must have one entry per request")
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    for i, (s, blocks) in enumerate(zip(seq_lens, block_lists, strict=True)):
        if blocks_needed(s, block_size) > len(blocks):
            raise ValueError(f"request {i} needs {blocks_needed(s, block_size)} blocks for {s} tokens, "
                             f"has {len(blocks)}")
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    num_actual = qsl[-1]
    num_tokens = num_actual if num_padded_tokens is None else num_padded_tokens
    if num_tokens < num_actual:
        raise ValueError(f"num_padded_tokens={num_padded_tokens} < actual tokens {num_actual}")
    positions = torch.zeros(num_tokens, dtype=torch.int64)
    if num_actual:
        positions[:num_actual] = torch.cat(
            [torch.arange(c, c + q, dtype=torch.int64) for c, q in zip(context_lens, query_lens, strict=True)])
    qsl_cpu = torch.tensor(qsl, dtype=torch.int32)
    seq_cpu = torch.tensor(seq_lens, dtype=torch.int32)
    block_table = make_block_table(block_lists, max_blocks)
    slot_mapping = compute_slot_mapping(block_table, qsl_cpu, positions, block_size)
    # Built on the host from Python ints; each device tensor is one pinned, non-blocking copy (no host sync).
    return CommonAttentionMetadata(
        query_start_loc=host_to_device(qsl_cpu, device), query_start_loc_cpu=qsl_cpu,
        seq_lens=host_to_device(seq_cpu, device), seq_lens_cpu=seq_cpu,
        num_reqs=len(query_lens), num_actual_tokens=num_actual,
        max_query_len=max(query_lens, default=0), max_seq_len=max(seq_lens, default=0),
        block_table=host_to_device(block_table, device), slot_mapping=host_to_device(slot_mapping, device),
        positions=host_to_device(positions, device), causal=True,
    )


def reference_request_groups(common: CommonAttentionMetadata) -> tuple[list[int], int, tuple[PrefillRequest, ...]]:
    """``build_paged_metadata``'s classification, per request: (decode request indices, their longest
    sequence, the prefill requests)."""
    qsl = common.query_start_loc_cpu.tolist()
    seq = common.seq_lens_cpu.tolist()
    decodes, prefills = [], []
    for i in range(common.num_reqs):
        s, e = qsl[i], qsl[i + 1]
        if e - s == 1:
            decodes.append(i)
        elif e - s > 1:
            prefills.append(PrefillRequest(i, s, e, seq[i]))
    return decodes, max((seq[i] for i in decodes), default=0), tuple(prefills)
