"""SGLang TBO's per-sequence rewrite of a two-chunk split and its attention-TP padding, as a reference.

The slicer places a request cut by a two-chunk split in both ubatches itself (``ubatch.slicing``); these two
functions state SGLang's arithmetic for that cut, which ``test_slicing.py`` checks against our split index.
"""
from __future__ import annotations

from typing import NamedTuple


class SeqFields(NamedTuple):
    """One child's view of a sequence; its extend length is ``seq_len - prefix_len``."""

    prefix_len: int
    seq_len: int


def split_sequence_fields(prefix_len: int, extend_len: int, left: int) -> tuple[SeqFields, SeqFields]:
    """Per-child (prefix, seq_len) of a sequence whose first ``left`` new tokens go to child A.

    A stops after its chunk (``seq_len = prefix + left``); B computes the rest and reads A's chunk as
    prefix (``prefix += left``), keeping the full ``seq_len``.
    """
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    if not 0 < left < extend_len:
        raise ValueError(f"left={left} must lie strictly inside extend_len={extend_len}")
    return SeqFields(prefix_len, prefix_len + left), SeqFields(prefix_len + left, prefix_len + extend_len)


def tbo_padded_len(num_tokens: int, attn_tp_size: int) -> int:
    """Round up so each attention-TP rank gets an equal share of the child's tokens."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if attn_tp_size < 1:
        raise ValueError(f"attn_tp_size must be >= 1, got {attn_tp_size}")
    return -(-num_tokens // attn_tp_size) * attn_tp_size
