"""Capture sizes: the vLLM-like ladder, ``--cuda-graph-sizes`` parsing, and padding a batch to a bucket.

A FULL graph has fixed shapes, so one graph serves exactly one token count. We capture a ladder of sizes
and pad each decode batch up to the nearest one: dense steps at small sizes (where a padded token costs
the most relative to the batch) and coarser ones higher up, where 8 or 16 extra tokens are noise.
Everything here is plain Python so the bucketing can be table-tested on a machine without a GPU.
"""
from __future__ import annotations

import bisect
import logging
import re
from collections.abc import Iterable, Sequence

logger = logging.getLogger("ubatch.cudagraph")

#: below this the ladder steps by 8, above it by 16 (vLLM's default pattern)
_FINE_LADDER_END = 256


def default_capture_sizes(max_size: int) -> list[int]:
    """``[1, 2, 4, 8, 16, 24, ..., 256, 272, 288, ...]`` up to ``max_size``, which is always included.

    ``max_size`` is appended when it is not on the ladder, so the largest decode batch the scheduler can
    form (``--max-num-seqs``) still gets a graph instead of silently running eager.
    """
    if max_size < 1:
        raise ValueError(f"the largest capture size must be >= 1, got {max_size}")
    ladder = [1, 2, 4, *range(8, _FINE_LADDER_END + 1, 8), *range(_FINE_LADDER_END + 16, max_size + 1, 16)]
    sizes = [s for s in ladder if s <= max_size]
    if sizes[-1] != max_size:
        sizes.append(max_size)
    return sizes


def parse_cuda_graph_sizes(text: str) -> list[int]:
    """Parse ``--cuda-graph-sizes``: integers separated by commas and/or spaces, e.g. ``"1,2,4,8"``.

    Follows vLLM: several values are the capture list itself (sorted, duplicates dropped); a *single*
    value ``N`` means "the default ladder up to N". Raises ``ValueError`` naming the offending value,
    suitable as an argparse ``type=`` (argparse turns it into ``argument --cuda-graph-sizes: ...``).
    """
    if not isinstance(text, str):
        raise ValueError(f"--cuda-graph-sizes expects a string of integers, got {text!r}")
    items = [t for t in re.split(r"[,\s]+", text.strip()) if t]
    if not items:
        raise ValueError(f"--cuda-graph-sizes: no sizes in {text!r}; expected e.g. '1,2,4,8' or '256'")
    values: list[int] = []
    for item in items:
        try:
            value = int(item, 10)
        except ValueError:
            raise ValueError(f"--cuda-graph-sizes: {item!r} is not an integer (in {text!r})") from None
        if value < 1:
            raise ValueError(f"--cuda-graph-sizes: {value} is not a positive size (in {text!r})")
        values.append(value)
    if len(values) == 1:
        return default_capture_sizes(values[0])
    return sorted(set(values))


def resolve_capture_sizes(requested: Iterable[int] | str | None, max_num_seqs: int,
                          max_num_batched_tokens: int) -> list[int]:
    """The sizes to capture: ``requested`` (or the default ladder) clipped to what a step can hold.

    A uniform-decode batch has one token per request, so it never exceeds ``max_num_seqs``; nor can any
    step exceed ``max_num_batched_tokens`` (the persistent input buffers are that long). Sizes above the
    limit are dropped with a warning rather than rejected: a config shared across machines stays usable.
    """
    limit = min(max_num_seqs, max_num_batched_tokens)
    if limit < 1:
        raise ValueError(f"no capture size fits: max_num_seqs={max_num_seqs}, "
                         f"max_num_batched_tokens={max_num_batched_tokens}")
    if requested is None:
        return default_capture_sizes(limit)
    sizes = parse_cuda_graph_sizes(requested) if isinstance(requested, str) else sorted(set(int(s) for s in requested))
    bad = [s for s in sizes if s < 1]
    if bad:
        raise ValueError(f"--cuda-graph-sizes: {bad[0]} is not a positive size")
    kept = [s for s in sizes if s <= limit]
    if len(kept) < len(sizes):
        logger.warning("dropping CUDA graph sizes %s: larger than min(--max-num-seqs, --max-num-batched-tokens)=%d",
                       [s for s in sizes if s > limit], limit)
    if not kept:
        raise ValueError(f"--cuda-graph-sizes {sizes}: every size exceeds the largest possible decode batch ({limit})")
    return kept


def pad_to_capture_size(num_tokens: int, sizes: Sequence[int]) -> int | None:
    """Smallest size in the sorted ``sizes`` that holds ``num_tokens``; ``None`` when none does (or n <= 0)."""
    if num_tokens <= 0 or not sizes:
        return None
    i = bisect.bisect_left(sizes, num_tokens)
    return sizes[i] if i < len(sizes) else None
