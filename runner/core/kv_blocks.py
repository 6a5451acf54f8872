"""The scheduler's KV-block bookkeeping: which block ids of the paged cache each request holds.

The cache tensors themselves, and the step metadata that reads them, are the model runner's
(``runner/attention/kv_cache.py``); the scheduler only hands out ids.
"""
from __future__ import annotations

from collections.abc import Sequence


class OutOfKVBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free (the scheduler should preempt)."""


class BlockAllocator:
    """Free-list allocator over ``num_blocks`` block ids.

    Blocks are handed out lowest-id first (a sorted free list would cost O(n log n); a stack of ids pushed
    in reverse gives the same deterministic order for a fresh allocator and O(1) operations). Double frees
    and foreign ids raise, because a block freed twice would later be shared by two requests and silently
    corrupt both.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise OutOfKVBlocksError(
                f"out of KV-cache blocks: requested {n}, free {len(self._free)} of {self.num_blocks}")
        blocks = [self._free.pop() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"block {b} is not allocated (double free or foreign id)")
            self._used.remove(b)
            self._free.append(b)
