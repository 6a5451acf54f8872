"""Hypothesis properties of ubatch.slicing: slices partition the batch, metadata stays consistent."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ubatch.slicing import (
    CommonAttentionMetadata,
    UBatchSlice,
    balanced_split_points,
    compute_split_seq_index,
    compute_split_token_index,
    is_last_ubatch_empty,
    is_two_chunk_split,
    maybe_create_ubatch_slices,
    split_attn_metadata,
)

LENS = st.lists(st.integers(1, 64), min_size=1, max_size=40)
SETTINGS = settings(max_examples=150, deadline=None)


def _ubatch_owners(num_tokens: int, padded: int, n: int) -> list[int]:
    """Which ubatch each real token lands in, worked out token by token from the documented cut: ubatches
    are ``padded // n`` tokens wide and the last one takes everything from ``(n - 1) * width`` on."""
    width = padded // n
    return [n - 1 if width == 0 else min(t // width, n - 1) for t in range(num_tokens)]


def _expect_empty_ubatch(num_tokens: int, padded: int, n: int) -> bool:
    """The slicer must refuse exactly when some ubatch would own no real token (derived from the inputs
    alone, not from ``is_last_ubatch_empty``, which is tested against it below)."""
    return padded // n == 0 or set(_ubatch_owners(num_tokens, padded, n)) != set(range(n))


@SETTINGS
@given(num_tokens=st.integers(0, 300), pad=st.integers(0, 40), n=st.integers(2, 5))
def test_is_last_ubatch_empty_matches_the_cut(num_tokens: int, pad: int, n: int) -> None:
    """vLLM's check is about the last ubatch only: true exactly when no real token lands in it (with a
    zero width every token lands in the last one, and the *first* ubatches are the empty ones)."""
    padded = num_tokens + pad
    assert is_last_ubatch_empty(num_tokens, padded, n) == (n - 1 not in _ubatch_owners(num_tokens, padded, n))


def _pieces(lens: list[int], slices: list[UBatchSlice]) -> dict[int, list[tuple[int, int]]]:
    """request -> [(ubatch index, tokens of the request in that ubatch)] over the ubatches listing it."""
    cu = np.concatenate([[0], np.cumsum(lens)])
    out: dict[int, list[tuple[int, int]]] = {r: [] for r in range(len(lens))}
    for i, s in enumerate(slices):
        for r in range(s.request_slice.start, s.request_slice.stop):
            overlap = min(cu[r + 1], s.token_slice.stop) - max(cu[r], s.token_slice.start)
            out[r].append((i, int(overlap)))
    return out


@SETTINGS
@given(lens=LENS, n=st.integers(2, 4), pad=st.integers(0, 8), req_pad=st.integers(0, 4))
def test_slices_partition_tokens_and_requests(lens: list[int], n: int, pad: int, req_pad: int) -> None:
    total, padded = sum(lens), sum(lens) + pad
    if _expect_empty_ubatch(total, padded, n):
        with pytest.raises(ValueError, match="would be empty"):
            maybe_create_ubatch_slices(True, np.array(lens), padded, len(lens) + req_pad, n)
        return
    unpadded, padded_slices = maybe_create_ubatch_slices(True, np.array(lens), padded, len(lens) + req_pad, n)
    assert unpadded is not None and padded_slices is not None  # should_ubatch=True
    assert len(unpadded) == len(padded_slices) == n
    for slices, end, reqs_end in ((unpadded, total, len(lens)), (padded_slices, padded, len(lens) + req_pad)):
        assert slices[0].token_slice.start == 0 and slices[-1].token_slice.stop == end
        # neighbouring pairs
        assert all(a.token_slice.stop == b.token_slice.start for a, b in zip(slices, slices[1:], strict=False))
        assert not any(s.is_empty() for s in slices)
        assert slices[0].request_slice.start == 0 and slices[-1].request_slice.stop == reqs_end
        starts = [s.request_slice.start for s in slices]
        stops = [s.request_slice.stop for s in slices]
        assert starts == sorted(starts) and stops == sorted(stops)
    width = padded // n
    for r, pieces in _pieces(lens, unpadded).items():
        ubatches = [i for i, _ in pieces]
        assert ubatches and ubatches == list(range(ubatches[0], ubatches[0] + len(ubatches)))
        assert all(tokens > 0 for _, tokens in pieces), "a listed request must own tokens there"
        assert sum(tokens for _, tokens in pieces) == lens[r]
        if lens[r] <= width:
            assert len(ubatches) <= 2


@SETTINGS
@given(lens=LENS, ctx=st.lists(st.integers(0, 100), min_size=40, max_size=40), n=st.integers(2, 4),
       pad=st.integers(0, 8))
def test_split_metadata_consistent(lens: list[int], ctx: list[int], n: int, pad: int) -> None:
    total, padded = sum(lens), sum(lens) + pad
    if _expect_empty_ubatch(total, padded, n):
        return
    seq_lens = [q + c for q, c in zip(lens, ctx, strict=False)]  # ctx: 40, one per possible request
    common = CommonAttentionMetadata.from_lens(lens, seq_lens)
    before = [t.clone() for t in (common.query_start_loc, common.query_start_loc_cpu, common.seq_lens,
                                  common.seq_lens_cpu, common.slot_mapping)]
    slices, _ = maybe_create_ubatch_slices(True, np.array(lens), padded, len(lens), n)
    assert slices is not None  # should_ubatch=True
    metas = split_attn_metadata(slices, common)
    assert sum(m.num_actual_tokens for m in metas) == total
    assert torch.cat([m.slot_mapping for m in metas]).tolist() == common.slot_mapping.tolist()
    seen: dict[int, int] = {}  # request -> tokens already computed by earlier ubatches
    for m, s in zip(metas, slices, strict=True):
        qsl = m.query_start_loc_cpu
        assert qsl[0] == 0 and bool((qsl[1:] >= qsl[:-1]).all()) and int(qsl[-1]) == m.num_actual_tokens
        assert torch.equal(m.query_start_loc, qsl) and torch.equal(m.seq_lens, m.seq_lens_cpu)
        assert m.max_query_len == int((qsl[1:] - qsl[:-1]).max()) and m.max_seq_len == max(seq_lens)
        for j, r in enumerate(range(s.request_slice.start, s.request_slice.stop)):
            q, sl = int(qsl[j + 1] - qsl[j]), int(m.seq_lens_cpu[j])
            assert sl - q == ctx[r] + seen.get(r, 0), "prefix = context + earlier chunks"
            seen[r] = seen.get(r, 0) + q
            assert sl <= seq_lens[r]
    assert seen == dict(enumerate(lens))
    after = (common.query_start_loc, common.query_start_loc_cpu, common.seq_lens, common.seq_lens_cpu,
             common.slot_mapping)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


@SETTINGS
@given(lens=st.lists(st.integers(1, 4096), min_size=1, max_size=40), th=st.sampled_from([0.0, 0.3, 0.48, 0.5]))
def test_balanced_split_feeds_slicer(lens: list[int], th: float) -> None:
    total = sum(lens)
    seq = compute_split_seq_index("extend", total, lens, None, threshold=th)
    tok = compute_split_token_index(seq, "extend", lens, None, threshold=th)
    assert 0 <= seq <= len(lens) and 0 <= tok <= total
    two_chunk = is_two_chunk_split(lens, threshold=th)
    # a two-chunk cut lands at total // 2 inside sequence ``seq`` -- or on its start (e.g. lens [2, 1, 2]),
    # in which case nothing of ``seq`` goes to child A and the cut is a plain sequence boundary
    cut_inside = two_chunk and sum(lens[:seq]) < tok
    if two_chunk:
        assert tok == total // 2 and sum(lens[:seq]) <= tok < sum(lens[:seq + 1])
    else:
        assert tok == sum(lens[:seq])
    assert not (th == 0.0 and two_chunk)
    points = balanced_split_points(lens, threshold=th)
    if points is None:
        assert tok in (0, total)
        return
    slices, _ = maybe_create_ubatch_slices(True, np.array(lens), total, len(lens), split_point=points)
    assert slices is not None  # should_ubatch=True
    a, b = slices
    assert a.num_tokens == tok and a.num_tokens + b.num_tokens == total
    assert a.request_slice.stop == seq + (1 if cut_inside else 0) and b.request_slice.start == seq
