"""Refusing a text prompt that cannot fit before tokenizing it, and giving the memory of a large one back.

Tokenizing costs time in proportion to the text (seconds for megabytes), in the one tokenizer thread every request
shares, so a prompt that is certain to exceed ``max_model_len`` is refused by its length in characters first. The
bound is exact up to normalization: a token covers at most ``L`` characters of text, ``L`` the longest entry of
the tokenizer's vocabulary (byte-level vocabularies spell one character per byte, so this over-counts multi-byte
text, which only loosens the bound), so a text of ``n`` characters needs at least ``n / L`` tokens. Unicode
normalization can merge a few characters into one (NFKC composes at most three, as Hangul jamo); a factor of
``NORMALIZATION_SLACK`` covers it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

from runner.entrypoints.openai.errors import bad_request

NORMALIZATION_SLACK = 4
# After tokenizing a text this long, the allocator's free memory is handed back to the system.
LARGE_TEXT_CHARS = 1 << 20


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int:
    """The most characters a text prompt that fits in ``max_model_len`` tokens can have."""
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    return NORMALIZATION_SLACK * max(longest, 1) * max_model_len


def check_prompt_chars(text: str, limit: int, param: str) -> None:
    if len(text) > limit:
        raise bad_request(f"{param} has {len(text)} characters, more than any prompt of this model's maximum "
                          f"context length could hold ({limit} characters): shorten it", param)


@functools.cache
def _malloc_trim() -> Any:
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return getattr(libc, "malloc_trim", None)


def release_memory_after(text: str) -> None:
    """Give the allocator's free pages back after tokenizing a large text (glibc keeps them otherwise: the
    server's resident memory would stay at its peak)."""
    trim = _malloc_trim() if len(text) >= LARGE_TEXT_CHARS else None
    if trim is not None:
        trim(0)
