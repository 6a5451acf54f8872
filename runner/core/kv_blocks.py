"""The scheduler's KV-block bookkeeping: which block ids of the paged cache are in use, by how many requests, and
which free ones still hold a cached prefix (vLLM V1's ``BlockPool``).

The cache tensors themselves, and the step metadata that reads them, are the model runner's
(``runner/attention/kv_cache.py``); the scheduler only hands out ids.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class OutOfKVBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free (the scheduler should preempt)."""


class BlockPool:
    """``num_blocks`` block ids, shared by reference count, with a prefix cache over full blocks.

    - A block in use has a reference count: one per request holding it (requests with a common prefix share it).
    - A block may carry the content hash of the full block it holds (``runner/core/block_hash.py``), registered
      by :meth:`register`; :meth:`cached_prefix` finds the longest run of such blocks for a chain of hashes.
    - A block whose count drops to 0 is free. One without a hash goes back to the plain free list (lowest id
      handed out first, deterministic); one with a hash keeps its content in an LRU of evictable blocks, where
      a later request may find it (:meth:`touch` takes it back). :meth:`allocate` uses the plain free list
      first and evicts from the LRU, oldest first, only when that is empty: eviction drops the hash.

    Double frees and foreign ids raise, because a block freed twice would later be shared by two requests that
    each write it, silently corrupting both.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # unhashed, a stack: lowest id on top
        self._evictable: OrderedDict[int, None] = OrderedDict()  # hashed and free, least recently freed first
        self._refs = [0] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self.num_evictions = 0  # cached blocks reused for new content (their hash dropped), cumulative

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (plain free ones and evictable cached ones)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a registered hash, in use or evictable."""
        return len(self._by_hash)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_blocks

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks, each with one reference and no hash: plain free ones first, then the least recently
        freed cached ones (their hashes dropped)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free_blocks:
            raise OutOfKVBlocksError(
                f"out of KV-cache blocks: requested {n}, free {self.num_free_blocks} of {self.num_blocks}")
        k = min(n, len(self._free))
        blocks = [self._free.pop() for _ in range(k)]
        for _ in range(n - k):
            block, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block)]
            blocks.append(block)
        self.num_evictions += n - k
        refs = self._refs
        for b in blocks:
            refs[b] = 1
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block, in order; a block left unreferenced becomes free (evictable, most
        recently freed last, when it holds a hash: free a request's blocks last one first, so its tail, the
        part least likely shared, is evicted first)."""
        refs = self._refs
        for b in blocks:
            if not 0 <= b < self.num_blocks or refs[b] == 0:
                raise ValueError(f"block {b} is not allocated (double free or foreign id)")
            refs[b] -= 1
            if refs[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    # ------------------------------------------------------------------ prefix cache
    def cached_prefix(self, block_hashes: Sequence[bytes]) -> list[int]:
        """The blocks holding the longest leading run of ``block_hashes`` (not yet referenced: :meth:`touch`)."""
        found = []
        by_hash = self._by_hash
        for h in block_hashes:
            b = by_hash.get(h)
            if b is None:
                break
            found.append(b)
        return found

    def num_evictable(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` are free (cached, unreferenced): taking them leaves that many fewer free."""
        refs = self._refs
        return sum(1 for b in blocks if refs[b] == 0)

    def touch(self, blocks: Iterable[int]) -> None:
        """Add one reference to each of these cached blocks (a request found them: :meth:`cached_prefix`)."""
        refs = self._refs
        for b in blocks:
            if b not in self._hash_of:
                raise ValueError(f"block {b} holds no cached prefix: only cached blocks are shared")
            if refs[b] == 0:
                del self._evictable[b]
            refs[b] += 1

    def register(self, block: int, block_hash: bytes) -> bool:
        """Record that ``block`` (in use, full, its KV written by a step already scheduled) holds the content
        ``block_hash``. False, and nothing changes, when another block already holds that content (the duplicate
        stays unhashed and is freed as a plain block) or this one already has a hash."""
        if not 0 <= block < self.num_blocks or self._refs[block] == 0:
            raise ValueError(f"block {block} is not allocated: only a block in use can be registered")
        if block_hash in self._by_hash or block in self._hash_of:
            return False
        self._by_hash[block_hash] = block
        self._hash_of[block] = block_hash
        return True

    def reset(self) -> bool:
        """Drop every cached hash (their blocks become plain free blocks); False, changing nothing, while any
        block is in use (vLLM's ``reset_prefix_cache``: a request still holding a block would keep it hashed)."""
        if self.num_free_blocks != self.num_blocks:
            return False
        self._by_hash.clear()
        self._hash_of.clear()
        self._evictable.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))
        return True
