"""Paged KV cache: per-layer cache specs, cache tensors, the persistent block table and step metadata.

Layout (one tensor per layer, ``[num_blocks, block_size, *spec.per_token_shape]``):
- MHA/GQA: per token ``(2, num_kv_heads, head_size)`` — key at index 0, value at index 1;
- MLA: per token ``(kv_lora_rank + qk_rope_head_dim,)`` — the normalised latent followed by the rotated
  rope key (vLLM's MLA layout), 1/(2*H) of an expanded MHA cache.
A token at position ``p`` of a request lives in slot ``block_table[req, p // block_size] * block_size +
p % block_size``; slot ``-1`` marks a padding token whose KV is never written.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ubatch.slicing import CommonAttentionMetadata


@dataclass(frozen=True)
class KVCacheSpec:
    """What one layer caches per token. ``kind`` is ``"mha"`` (K and V heads) or ``"mla"`` (latent)."""

    kind: str
    per_token_shape: tuple[int, ...]

    @classmethod
    def mha(cls, num_kv_heads: int, head_size: int) -> KVCacheSpec:
        return cls("mha", (2, num_kv_heads, head_size))

    @classmethod
    def mla(cls, kv_lora_rank: int, qk_rope_head_dim: int) -> KVCacheSpec:
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


def copy_from_host_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Copy the host tensor ``src`` into ``dst`` (a persistent buffer a captured graph reads) without making the
    host wait: as :func:`host_to_device`, through pinned memory on CUDA, which torch's caching host allocator keeps
    alive until the copy has run."""
    if dst.device.type == "cuda":
        return dst.copy_(src.pin_memory(), non_blocking=True)
    return dst.copy_(src)


#: Byte alignment of each array in a packed host-to-device copy (the widest dtype packed: int64).
PACK_ALIGN = 8


def pack_arrays(arrays: Sequence[np.ndarray], pin: bool = False) -> tuple[torch.Tensor, list[int]]:
    """``arrays`` packed into one uint8 host tensor (pinned when ``pin``), each at an offset aligned to
    :data:`PACK_ALIGN` bytes; returns the tensor and the offsets (see :func:`unpack_arrays`)."""
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // PACK_ALIGN) * PACK_ALIGN
    staging = torch.empty(max(total, PACK_ALIGN), dtype=torch.uint8, pin_memory=pin)
    buf = staging.numpy()
    for a, off in zip(arrays, offsets, strict=True):
        buf[off:off + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return staging, offsets


def unpack_arrays(packed: torch.Tensor, offsets: Sequence[int], arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
    """Views of ``packed`` (from :func:`pack_arrays`, wherever it now is) with the dtypes and shapes of
    ``arrays``."""
    return [packed[off:off + a.nbytes].view(torch.from_numpy(a[:0].reshape(-1)).dtype).view(a.shape)
            for a, off in zip(arrays, offsets, strict=True)]


def arrays_to_device(arrays: Sequence[np.ndarray], device: torch.device | str) -> list[torch.Tensor]:
    """Several host arrays on ``device`` with one copy: packed into one pinned staging tensor and copied
    ``non_blocking`` (one transfer a step instead of one per array, and no host wait, as
    :func:`host_to_device`); on the CPU the arrays themselves, as tensors."""
    device = torch.device(device)
    if device.type == "cpu":
        return [torch.from_numpy(a) for a in arrays]
    staging, offsets = pack_arrays(arrays, pin=device.type == "cuda")
    return unpack_arrays(staging.to(device, non_blocking=True), offsets, arrays)


class BlockTable:
    """Every request's KV block ids, kept from step to step as one numpy array (vLLM V1's persistent block
    table, ``vllm/v1/worker/block_table.py``).

    Row ``r`` holds its request's blocks in its first ``num_blocks[r]`` entries, zeros after them. The scheduler
    owns one with a row per request slot (``runner/core/slots.py``): a row changes only when its request gets a
    new block (:meth:`append`, a block at a time as it crosses a block boundary) and when it gives its blocks
    back (:meth:`clear`). A step's metadata reads the rows of its requests with one vectorised gather, so no
    per-request list is copied or converted per step.

    With the overlap loop the scheduler appends blocks for step N+1 while step N's metadata may be gathered:
    an append only writes entries past what step N's requests use, and a row is cleared only once no step
    in flight uses it, so a gather never sees a block of its own requests change.
    """

    def __init__(self, num_rows: int, max_blocks_per_row: int) -> None:
        if num_rows < 1 or max_blocks_per_row < 1:
            raise ValueError(f"a block table needs >= 1 row and >= 1 block per row, got {num_rows} x "
                             f"{max_blocks_per_row}")
        self.table = np.zeros((num_rows, max_blocks_per_row), dtype=np.int32)
        self.num_blocks = np.zeros(num_rows, dtype=np.int32)

    @classmethod
    def from_lists(cls, block_lists: Sequence[Sequence[int]], max_blocks: int | None = None) -> BlockTable:
        """Row ``i`` = ``block_lists[i]`` (hand-built batches, dummy steps, tests)."""
        width = max([len(b) for b in block_lists], default=0)
        if max_blocks is not None:
            if width > max_blocks:
                raise ValueError(f"a request holds {width} blocks, more than max_blocks={max_blocks}")
            width = max_blocks
        bt = cls(max(len(block_lists), 1), max(width, 1))
        for i, blocks in enumerate(block_lists):
            bt.append(i, blocks)
        return bt

    @property
    def max_blocks_per_row(self) -> int:
        return self.table.shape[1]

    def append(self, row: int, blocks: Sequence[int]) -> None:
        """Give row ``row`` the blocks ``blocks`` after those it holds."""
        n, k = int(self.num_blocks[row]), len(blocks)
        if n + k > self.table.shape[1]:
            raise ValueError(f"block table row {row} would hold {n + k} blocks, more than its "
                             f"{self.table.shape[1]} (max_model_len / block_size)")
        if k:
            self.table[row, n:n + k] = blocks
            self.num_blocks[row] = n + k

    def append_one_each(self, rows: np.ndarray, blocks: Sequence[int]) -> None:
        """Give each row of ``rows`` (distinct) one more block, ``blocks[i]`` to ``rows[i]``."""
        n = self.num_blocks[rows]
        if len(n) and int(n.max()) >= self.table.shape[1]:
            row = int(rows[int(np.argmax(n))])
            raise ValueError(f"block table row {row} would hold {int(n.max()) + 1} blocks, more than its "
                             f"{self.table.shape[1]} (max_model_len / block_size)")
        self.table[rows, n] = blocks
        self.num_blocks[rows] = n + 1

    def clear(self, row: int) -> None:
        """Row ``row`` holds nothing (its request gave its blocks back); zeroed, so padding reads stay zeros."""
        self.table[row, :self.num_blocks[row]] = 0
        self.num_blocks[row] = 0

    def row(self, row: int) -> list[int]:
        return self.table[row, :self.num_blocks[row]].tolist()


@dataclass(frozen=True)
class BlockRows:
    """The block-table rows of a batch's requests: request ``i`` owns ``table`` row ``rows[i]`` and holds its
    first ``held[i]`` blocks for this batch (in an engine step, the blocks its tokens need: the scheduler may
    append more to the row for a later step while this one runs)."""

    table: BlockTable
    rows: np.ndarray  # int64 [num_reqs]
    held: np.ndarray  # int64 [num_reqs]

    @classmethod
    def from_lists(cls, block_lists: Sequence[Sequence[int]], max_blocks: int | None = None) -> BlockRows:
        table = BlockTable.from_lists(block_lists, max_blocks)
        return cls(table, np.arange(len(block_lists), dtype=np.int64), table.num_blocks[:len(block_lists)].copy())

    def __len__(self) -> int:
        return len(self.rows)


@dataclass
class AttentionArrays:
    """A batch's attention metadata on the host (:func:`attention_arrays`): query offsets ``[R + 1]`` and sequence
    lengths ``[R]`` (int32), the block table ``[R, width]`` (int32), the slot mapping and positions
    ``[num_tokens]`` (int64; padding tokens at slot -1, position 0)."""

    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_table: np.ndarray
    slot_mapping: np.ndarray
    positions: np.ndarray
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int


#: ``(num_reqs, width, num_tokens)`` -> the arrays :func:`attention_arrays` fills: query offsets, sequence lengths,
#: block table, slot mapping, positions (their old contents are overwritten).
ArrayBuffers = Callable[[int, int, int], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]


def _new_arrays(num_reqs: int, width: int, num_tokens: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    return (np.empty(num_reqs + 1, dtype=np.int32), np.empty(num_reqs, dtype=np.int32),
            np.empty((num_reqs, width), dtype=np.int32), np.empty(num_tokens, dtype=np.int64),
            np.empty(num_tokens, dtype=np.int64))


def attention_arrays(context_lens: Sequence[int] | np.ndarray, query_lens: Sequence[int] | np.ndarray,
                     blocks: Sequence[Sequence[int]] | BlockRows, block_size: int,
                     num_padded_tokens: int | None = None, max_blocks: int | None = None,
                     buffers: ArrayBuffers = _new_arrays) -> AttentionArrays:
    """The host half of :func:`build_attention_metadata` (same arguments): the arrays, written into
    ``buffers(num_reqs, width, num_tokens)`` (new arrays by default; the model runner's persistent staging
    buffers, ``runner/worker/step_inputs.py``)."""
    rows = blocks if isinstance(blocks, BlockRows) else BlockRows.from_lists(blocks, max_blocks)
    ctx = np.asarray(context_lens, dtype=np.int64).reshape(-1)
    q = np.asarray(query_lens, dtype=np.int64).reshape(-1)
    num_reqs = len(q)
    if not (len(ctx) == num_reqs == len(rows)):
        raise ValueError("context_lens, query_lens and blocks must have one entry per request")
    seq = ctx + q
    need = (seq + (block_size - 1)) // block_size
    if (need > rows.held).any():
        i = int(np.flatnonzero(need > rows.held)[0])
        raise ValueError(f"request {i} needs {int(need[i])} blocks for {int(seq[i])} tokens, has "
                         f"{int(rows.held[i])}")
    num_actual = int(q.sum())
    num_tokens = num_actual if num_padded_tokens is None else num_padded_tokens
    if num_tokens < num_actual:
        raise ValueError(f"num_padded_tokens={num_padded_tokens} < actual tokens {num_actual}")
    width = max(int(rows.held.max()) if num_reqs else 0, 1)
    if max_blocks is not None:
        if width > max_blocks:
            raise ValueError(f"a request holds {width} blocks, more than max_blocks={max_blocks}")
        width = max_blocks
    qsl, seq32, block_table, slot_mapping, positions = buffers(num_reqs, width, num_tokens)
    qsl[0] = 0
    np.cumsum(q, out=qsl[1:])
    cols = min(width, rows.table.max_blocks_per_row)  # held <= what a row holds <= the table's width
    if cols < width:
        block_table[:, cols:] = 0
    if num_reqs:
        block_table[:, :cols] = rows.table.table[rows.rows, :cols]
        if int(rows.held.min()) < cols:
            # Zero past each request's own blocks: what the scheduler appended for a later step reads as padding.
            block_table[:, :cols] *= np.arange(cols) < rows.held[:, None]
    positions[num_actual:] = 0
    slot_mapping[num_actual:] = -1
    if num_actual:
        if num_actual == num_reqs and int(q.min()) == 1:  # one token per request (decode)
            pos, token_req = ctx, np.arange(num_reqs)
        else:
            token_req = np.repeat(np.arange(num_reqs), q)
            pos = np.arange(num_actual, dtype=np.int64) - np.repeat(qsl[:-1] - ctx, q)
        positions[:num_actual] = pos
        slot_mapping[:num_actual] = block_table[token_req, pos // block_size] * np.int64(block_size) \
            + pos % block_size
    seq32[:] = seq
    return AttentionArrays(qsl, seq32, block_table, slot_mapping, positions, num_actual,
                           int(q.max()) if num_reqs else 0, int(seq.max()) if num_reqs else 0)


def build_attention_metadata(context_lens: Sequence[int] | np.ndarray, query_lens: Sequence[int] | np.ndarray,
                             blocks: Sequence[Sequence[int]] | BlockRows, block_size: int,
                             device: torch.device | str = "cpu", num_padded_tokens: int | None = None,
                             max_blocks: int | None = None) -> CommonAttentionMetadata:
    """Metadata for a batch where request ``i`` has ``context_lens[i]`` cached tokens and computes
    ``query_lens[i]`` new ones at positions ``context..context+query-1``.

    Covers prefill (context 0), decode (query 1), chunked prefill and the second half of a split request
    (context = tokens already written by the previous chunk/ubatch). ``blocks``: each request's block list,
    or the rows of a persistent :class:`BlockTable` (the engine's steps). ``num_padded_tokens`` appends padding
    tokens (slot -1, position 0) for graph-sized batches; ``max_blocks`` fixes the block table's width.

    Vectorised over the batch with numpy (:func:`attention_arrays`, no per-request Python): positions, sequence
    lengths, the block table (a gather of the requests' rows, zero past each request's blocks) and the slot
    mapping ``block_table[req(t), pos // bs] * bs + pos % bs``. The test suite checks it against the
    per-request builder it replaced (``tests/reference_metadata.py``).
    """
    a = attention_arrays(context_lens, query_lens, blocks, block_size, num_padded_tokens, max_blocks)
    # Built on the host; the device's five tensors are one pinned, non-blocking copy (no host sync).
    qsl_dev, seq_dev, block_table_dev, slot_mapping_dev, positions_dev = arrays_to_device(
        (a.query_start_loc, a.seq_lens, a.block_table, a.slot_mapping, a.positions), device)
    return CommonAttentionMetadata(
        query_start_loc=qsl_dev, query_start_loc_cpu=torch.from_numpy(a.query_start_loc),
        seq_lens=seq_dev, seq_lens_cpu=torch.from_numpy(a.seq_lens),
        num_reqs=len(a.seq_lens), num_actual_tokens=a.num_actual_tokens,
        max_query_len=a.max_query_len, max_seq_len=a.max_seq_len,
        block_table=block_table_dev, slot_mapping=slot_mapping_dev, positions=positions_dev, causal=True,
    )
