"""The content hash of a full KV block, chained over its predecessors (vLLM's ``hash_block_tokens``).

A block's KV depends on every token before it, so its key is ``H(parent's hash, its token ids, extra keys)``:
two requests share a block exactly when their token ids agree up to its end. ``H`` is SHA-256 over fixed-width
bytes (each token id a little-endian int64, each extra key too, after a count), never Python's ``hash()``: the
value is the same in every process and every run (no ``PYTHONHASHSEED``), and finding two different token
sequences with one digest is as hard as a SHA-256 collision, so a hit is never a different prompt in practice.
The first block's parent is :data:`ROOT_HASH`, a fixed constant.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

#: The parent of a request's first block: the digest of a fixed label (no random seed, so every process agrees).
ROOT_HASH = hashlib.sha256(b"ubatch prefix cache: root block").digest()


def hash_block_tokens(parent: bytes, token_ids: Sequence[int], extra_keys: Sequence[int] = ()) -> bytes:
    """The 32-byte digest of one full block whose predecessor's digest is ``parent``."""
    if len(parent) != 32:
        raise ValueError(f"a parent block hash is 32 bytes (a SHA-256 digest), got {len(parent)}")
    values = struct.pack(f"<{len(token_ids) + 1 + len(extra_keys)}q", *token_ids, len(extra_keys), *extra_keys)
    return hashlib.sha256(parent + values).digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int) -> None:
    """Append to ``hashes`` (a request's chain so far) the digests of the full blocks in ``token_ids``: the tokens
    of the blocks that follow, a whole number of blocks."""
    if len(token_ids) % block_size:
        raise ValueError(f"{len(token_ids)} tokens are not a whole number of blocks of {block_size}")
    parent = hashes[-1] if hashes else ROOT_HASH
    for start in range(0, len(token_ids), block_size):
        block = token_ids[start:start + block_size]
        if min(block) < 0:
            raise ValueError(f"block {len(hashes)} holds a placeholder token ({min(block)}): only known tokens are "
                             "hashed")
        parent = hash_block_tokens(parent, block)
        hashes.append(parent)
