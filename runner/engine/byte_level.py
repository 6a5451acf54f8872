"""Each token's bytes for a byte-level BPE tokenizer (GPT-2, Qwen, Llama 3), so the incremental detokenizer can
decode a window in Python instead of a call into the Rust tokenizer per token.

A Rust tokenizer whose decoder is exactly ``decoders.ByteLevel`` decodes a run of vocabulary tokens as their
bytes (each character of a token string maps to one byte by GPT-2's table) joined and read as UTF-8, every
invalid sequence a U+FFFD: Rust's ``from_utf8_lossy``, which replaces the same maximal invalid subparts as
Python's ``bytes.decode("utf-8", "replace")``. Added tokens (special or not) and ids outside the vocabulary are
decoded otherwise: they have no bytes here, and a window holding one is decoded by the tokenizer.
"""
from __future__ import annotations

from typing import Any

from runner.engine.tokenizer import Tokenizer, rust_backend


def _unicode_to_bytes() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable character table, character to byte (``bytes_to_unicode``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class ByteLevelTable:
    """Token id -> its bytes, filled on first use; None for a token the byte-level rule does not cover."""

    def __init__(self, backend: Any) -> None:  # third-party: the tokenizers library's Rust tokenizer
        self._backend = backend
        self._char_bytes = _unicode_to_bytes()
        self._added = set(backend.get_added_tokens_decoder())
        self._bytes: dict[int, bytes | None] = {}

    def get(self, token: int) -> bytes | None:
        try:
            return self._bytes[token]
        except KeyError:
            got = self._bytes[token] = self._lookup(token)
            return got

    def _lookup(self, token: int) -> bytes | None:
        if token in self._added or token < 0:
            return None
        piece = self._backend.id_to_token(token)
        if piece is None:
            return None
        try:
            return bytes(self._char_bytes[c] for c in piece)
        except KeyError:  # a character outside GPT-2's table: the decoder keeps the piece's own bytes; not ours
            return None


def byte_level_table(tokenizer: Tokenizer) -> ByteLevelTable | None:
    """The table for ``tokenizer`` when its Rust decoder is exactly byte-level, else None (module docstring)."""
    backend = rust_backend(tokenizer)
    if backend is None:
        return None
    from tokenizers import decoders

    return ByteLevelTable(backend) if type(backend.decoder) is decoders.ByteLevel else None
