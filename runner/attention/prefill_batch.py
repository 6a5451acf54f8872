"""A step's prefill requests as a few padded groups: what a layer needs to attend them in a handful of launches,
whatever the number of requests.

Requests are padded to ``[R, Lmax]`` queries and ``[R, Smax]`` keys per group, with a mask causal bottom-right
aligned per request; :func:`group_prefills` keeps a group's padded scores within about twice its real ones
(``PAD_FACTOR``, ``PAD_SLACK``). Padding repeats a request's last key and query, so no unwritten cache slot is
read. Index arrays are built once per step with numpy and copied in one go; key slots are computed by the
first layer that asks. Design: docs/design_notes.md, "Attention backends".
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from runner.attention.kv_cache import host_to_device

PAD_FACTOR = 2.0  # a group's padded score count may be up to this many times its real count ...
PAD_SLACK = 1 << 16  # ... or exceed it by at most this many score entries


@dataclass(frozen=True, eq=False)
class PrefillGroup:
    """Prefill requests attended together, padded to ``max_query_len`` queries and ``max_seq_len`` keys.

    Device tensors (views of one per-step host-to-device copy, plus the mask made from them):
    ``query_rows`` int64 ``[R * Lmax]``: the batch row of each padded query (padding repeats the request's last
    row); ``out_rows`` int64 ``[N]``: the batch rows of the real queries, in padded order; ``real_index`` int64
    ``[N]``: where those sit among the ``R * Lmax`` padded rows, ``None`` when no query row is padding;
    ``req_rows`` int64 ``[R]``: the requests' rows in the block table; ``key_pos`` int64 ``[R, Smax]``: the key
    positions, padding clipped to ``S - 1``; ``mask`` bool ``[R, Lmax, Smax]``, True = attend; ``query_pos``
    int64 ``[R, Lmax, 1]``: each padded query's position (what :meth:`visible` windows the mask by).
    ``causal``: every request is a fresh prompt of exactly ``Lmax == Smax`` tokens, so the mask is the plain
    causal one and a backend may ask its kernel for that instead (never for a windowed layer).
    """

    num_reqs: int
    max_query_len: int
    max_seq_len: int
    causal: bool
    query_rows: torch.Tensor
    out_rows: torch.Tensor
    real_index: torch.Tensor | None
    req_rows: torch.Tensor
    key_pos: torch.Tensor
    mask: torch.Tensor
    query_pos: torch.Tensor
    _memo: dict[Any, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def key_slots(self, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
        """Cache slots of the padded keys, int64 ``[R * Smax]``: ``block_table[req, pos // bs] * bs + pos % bs``.
        Computed on the device on first use for this block size, then reused by every layer of the step."""
        return self.memo(("slots", block_size), lambda: (
            block_table[self.req_rows[:, None], self.key_pos // block_size].to(torch.int64) * block_size
            + self.key_pos % block_size).view(-1))

    def visible(self, window: int | None) -> torch.Tensor:
        """The mask of a layer with a sliding window of ``window`` keys (``options.py``): :attr:`mask` also
        hiding the keys at or before ``query_pos - window``; :attr:`mask` itself for ``None``. Made once per
        step and window. No row is all False: a query always sees its own key."""
        if window is None or window >= self.max_seq_len:
            return self.mask
        return self.memo(("window", window), lambda: self.mask & (
            torch.arange(self.max_seq_len, device=self.mask.device) > self.query_pos - window))

    def plain_causal(self, window: int | None) -> bool:
        """Whether the plain causal mask is this layer's mask (a window at least as long as every request's)."""
        return self.causal and (window is None or window >= self.max_seq_len)

    def memo(self, key: Any, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A per-step tensor derived from this group (slots, a backend's form of the mask), made once: the
        layers of a step share one metadata object, and a DBO ubatch has its own."""
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = make()
        return got


def group_prefills(query_lens: np.ndarray, seq_lens: np.ndarray, pad_factor: float = PAD_FACTOR,
                   pad_slack: int = PAD_SLACK) -> list[np.ndarray]:
    """Split requests (``query_lens``/``seq_lens``, one entry each) into groups attended together: index arrays
    into the inputs. The rule is the module docstring's; one pass over host ints, once per step."""
    order = np.lexsort((-query_lens, -seq_lens))  # by seq_len, then query_len, descending
    groups: list[np.ndarray] = []
    start, n, lmax, smax, real = 0, 0, 0, 0, 0
    for k, (ql, sl) in enumerate(zip(query_lens[order].tolist(), seq_lens[order].tolist(), strict=True)):
        if n:
            lm, sm, rl = max(lmax, ql), max(smax, sl), real + ql * sl
            padded = (n + 1) * lm * sm
            if padded - n * lmax * smax <= pad_factor * ql * sl or padded - rl <= pad_slack:
                n, lmax, smax, real = n + 1, lm, sm, rl
                continue
            groups.append(order[start:k])
        start, n, lmax, smax, real = k, 1, ql, sl, ql * sl
    if n:
        groups.append(order[start:])
    return groups


def build_prefill_groups(req_index: np.ndarray, query_start: np.ndarray, query_lens: np.ndarray,
                         seq_lens: np.ndarray, device: torch.device) -> tuple[PrefillGroup, ...]:
    """The groups of a (micro)batch's prefill requests: request ``req_index[i]`` of the batch has its
    ``query_lens[i]`` queries at batch rows ``query_start[i]...`` and ``seq_lens[i]`` keys.

    All index arrays of all groups are built with numpy and go to the device in one copy; the masks are made
    on the device from them (two small launches per group, once per step).
    """
    parts: list[np.ndarray] = []
    shapes = []
    for members in group_prefills(query_lens, seq_lens):
        ql, sl, qs = query_lens[members], seq_lens[members], query_start[members]
        r, lmax, smax = len(members), int(ql.max()), int(sl.max())
        j = np.minimum(np.arange(lmax)[None, :], ql[:, None] - 1)  # padded query rows repeat the last one
        query_rows = (qs[:, None] + j).reshape(-1)
        query_pos = (sl[:, None] - ql[:, None] + j).reshape(-1)
        real = (np.arange(lmax)[None, :] < ql[:, None]).reshape(-1)
        real_index = np.flatnonzero(real)
        key_pos = np.minimum(np.arange(smax)[None, :], sl[:, None] - 1).reshape(-1)
        padded_rows = len(real_index) < r * lmax
        causal = bool((ql == lmax).all() and (sl == lmax).all() and smax == lmax)
        arrays = [query_rows, query_rows[real_index], req_index[members], key_pos, query_pos]
        if padded_rows:
            arrays.append(real_index)
        parts.extend(arrays)
        shapes.append((r, lmax, smax, causal, [len(a) for a in arrays]))
    if not parts:
        return ()
    flat = host_to_device(torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False)), device)
    groups = []
    offset = 0
    for r, lmax, smax, causal, sizes in shapes:
        views = []
        for size in sizes:
            views.append(flat[offset:offset + size])
            offset += size
        query_rows, out_rows, req_rows, key_pos, query_pos = views[:5]
        real_rows = views[5] if len(views) > 5 else None
        key_pos = key_pos.view(r, smax)
        query_pos = query_pos.view(r, lmax, 1)
        mask = torch.arange(smax, device=device) <= query_pos  # [R, Lmax, Smax]
        groups.append(PrefillGroup(r, lmax, smax, causal, query_rows, out_rows, real_rows, req_rows, key_pos,
                                   mask, query_pos))
    return tuple(groups)
