"""Paged KV cache: per-layer cache specs, a block allocator, cache tensors and block-table helpers.

Layout (one tensor per layer, ``[num_blocks, block_size, *spec.per_token_shape]``):
- MHA/GQA: per token ``(2, num_kv_heads, head_size)`` — key at index 0, value at index 1;
- MLA: per token ``(kv_lora_rank + qk_rope_head_dim,)`` — the normalised latent followed by the rotated
  rope key (vLLM's MLA layout), 1/(2*H) of an expanded MHA cache.
A token at position ``p`` of a request lives in slot ``block_table[req, p // block_size] * block_size +
p % block_size``; slot ``-1`` marks a padding token whose KV is never written.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ubatch.slicing import CommonAttentionMetadata


@dataclass(frozen=True)
class KVCacheSpec:
    """What one layer caches per token. ``kind`` is ``"mha"`` (K and V heads) or ``"mla"`` (latent)."""

    kind: str
    per_token_shape: tuple[int, ...]

    @classmethod
    def mha(cls, num_kv_heads: int, head_size: int) -> "KVCacheSpec":
        return cls("mha", (2, num_kv_heads, head_size))

    @classmethod
    def mla(cls, kv_lora_rank: int, qk_rope_head_dim: int) -> "KVCacheSpec":
        return cls("mla", (kv_lora_rank + qk_rope_head_dim,))

    def numel_per_token(self) -> int:
        n = 1
        for d in self.per_token_shape:
            n *= d
        return n

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return self.numel_per_token() * block_size * torch.empty((), dtype=dtype).element_size()


class KVCacheTooLargeError(MemoryError):
    """The KV cache asked for does not fit in the memory available; the message names the flags that size it."""


def available_memory(device: torch.device | str) -> tuple[int, str] | None:
    """(bytes that can still be allocated on ``device``, where the figure comes from), or None if unknown.

    CPU: ``MemAvailable`` of /proc/meminfo, lowered to the cgroup's remaining limit when the process runs in a
    memory-limited container (v2 ``memory.max``, v1 ``memory.limit_in_bytes``). CUDA: the driver's free memory.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"free memory on {device}"
    found: list[tuple[int, str]] = []
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    found.append((int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"))
    except OSError:
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as a, open(usage_file) as b:
                limit, usage = a.read().strip(), int(b.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # "max" or a huge number: no limit
            found.append((max(0, int(limit) - usage), f"the container's memory limit ({limit_file})"))
    return min(found) if found else None


def kv_bytes_per_block(specs: Sequence[KVCacheSpec], block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block id takes over every layer's cache."""
    return sum(s.bytes_per_block(block_size, dtype) for s in specs)


def check_kv_cache_fits(specs: Sequence[KVCacheSpec], num_blocks: int, block_size: int, dtype: torch.dtype,
                        device: torch.device | str) -> None:
    """Raise :class:`KVCacheTooLargeError` before allocating a cache larger than the memory available.

    Without it, an oversized ``--max-num-seqs`` ends in a raw allocator traceback (or, with overcommit, in the
    OOM killer part-way through a run).
    """
    need = kv_bytes_per_block(specs, block_size, dtype) * num_blocks
    avail = available_memory(device)
    if avail is None or need <= avail[0]:
        return
    gib = 1 << 30
    raise KVCacheTooLargeError(
        f"the KV cache needs {need / gib:.2f} GiB ({num_blocks} blocks of {block_size} tokens over {len(specs)} "
        f"layers, {str(dtype).replace('torch.', '')}) but only {avail[0] / gib:.2f} GiB is available "
        f"({avail[1]}); it is sized by --num-kv-blocks (default: enough blocks for --max-num-seqs requests of "
        "--max-model-len tokens) and --block-size: lower --max-num-seqs or --max-model-len, or set --num-kv-blocks")


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def allocate_kv_caches(specs: Sequence[KVCacheSpec], num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """One ``[num_blocks, block_size, *per_token_shape]`` tensor per layer, *not* zero-filled.

    Every reader of the cache only uses slots that were written: the eager attention reads positions below
    each request's ``seq_len``, all written by earlier steps or this one, and the CUDA-graph decode attention
    masks the rest out (scores and values). Zero-filling would touch every page of a cache sized for
    ``max_num_seqs`` full-length requests up front, which is most of a small model's start-up on a CPU.
    Raises :class:`KVCacheTooLargeError` first if the cache cannot fit in the memory available.
    """
    check_kv_cache_fits(specs, num_blocks, block_size, dtype, device)
    return [torch.empty((num_blocks, block_size, *s.per_token_shape), dtype=dtype, device=device) for s in specs]


def host_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device`` without making the host wait: on CUDA it is staged in pinned memory and
    copied ``non_blocking``; on the CPU it is returned as is.

    A pageable host-to-device copy makes the host wait for the copy (and so for everything queued before it
    on the stream); the engine builds each step's metadata while the previous step's forward may still run.
    The pinned staging tensor comes from torch's caching host allocator, which keeps it alive until the
    copy has run, so it is safe to drop right away.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def copy_from_host(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` for a host ``src``, through pinned memory and ``non_blocking`` when ``dst`` is on CUDA
    (see :func:`host_to_device`)."""
    if dst.device.type == "cuda":
        return dst.copy_(src.pin_memory(), non_blocking=True)
    return dst.copy_(src)


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


def build_attention_metadata(context_lens: Sequence[int], query_lens: Sequence[int],
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
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    for i, (s, blocks) in enumerate(zip(seq_lens, block_lists)):
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
            [torch.arange(c, c + q, dtype=torch.int64) for c, q in zip(context_lens, query_lens)])
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
