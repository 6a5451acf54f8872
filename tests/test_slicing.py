"""Table-driven tests for ubatch.slicing, with the vectors of the anchors' own unit tests.

vLLM: ``tests/v1/attention/test_attention_splitting.py`` (``slice_query_start_locs``, metadata slicing,
``split_attn_metadata``, ``test_prefill_split_across_ubatches``) and the DP padding rules of
``vllm/v1/worker/ubatch_utils.py``. SGLang: ``test/srt/test_two_batch_overlap.py``
(``TestTwoBatchOverlapUnitTest``: ``compute_split_seq_index`` / ``compute_split_token_index`` and the
CUDA-graph capture fallback to physical rows) and ``python/sglang/srt/two_batch_overlap.py``.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_sequence_split import SeqFields, split_sequence_fields, tbo_padded_len
from ubatch.slicing import (
    CommonAttentionMetadata,
    UBatchSlice,
    balanced_split_points,
    check_ubatch_thresholds,
    compute_split_seq_index,
    compute_split_token_index,
    is_last_ubatch_empty,
    is_two_chunk_split,
    make_metadata_with_slice,
    maybe_create_ubatch_slices,
    slice_query_start_locs,
    split_attn_metadata,
    split_num_tokens_non_padded,
)


def _us(reqs: tuple[int, int], toks: tuple[int, int]) -> UBatchSlice:
    return UBatchSlice(slice(*reqs), slice(*toks))


def _qlens(meta: CommonAttentionMetadata) -> list[int]:
    return (meta.query_start_loc_cpu[1:] - meta.query_start_loc_cpu[:-1]).tolist()


# ------------------------------------------------------------------------------------------ UBatchSlice


def test_ubatch_slice_basics() -> None:
    s = _us((1, 3), (4, 10))
    assert (s.num_tokens, s.num_reqs, s.is_empty()) == (6, 2, False)
    assert _us((1, 1), (4, 10)).is_empty() and _us((1, 3), (4, 4)).is_empty()


@pytest.mark.parametrize("orig,padded,n,expected", [
    (10, 10, 2, False), (5, 10, 2, True), (6, 10, 2, False), (1, 1, 2, False), (0, 0, 2, True),
    (7, 12, 3, True), (9, 12, 3, False), (8, 8, 4, False), (6, 8, 4, True),
])
def test_is_last_ubatch_empty(orig: int, padded: int, n: int, expected: bool) -> None:
    assert is_last_ubatch_empty(orig, padded, n) is expected


@pytest.mark.parametrize("num_tokens,uniform_decode,expected", [
    (31, True, False), (32, True, True), (100, False, False), (511, False, False), (512, False, True),
    (0, True, False),
])
def test_check_ubatch_thresholds(num_tokens: int, uniform_decode: bool, expected: bool) -> None:
    assert check_ubatch_thresholds(num_tokens, uniform_decode) is expected


def test_check_ubatch_thresholds_custom() -> None:
    assert check_ubatch_thresholds(16, True, decode_threshold=16, prefill_threshold=256)
    assert not check_ubatch_thresholds(255, False, decode_threshold=16, prefill_threshold=256)


# --------------------------------------------------------------------------------- maybe_create_ubatch_slices

# (num_scheduled_tokens, padded tokens, padded reqs, n, split_point, unpadded [(reqs),(toks)], padded last)
SLICE_VECTORS = [
    ([1] * 8, 8, 8, 2, None, [((0, 4), (0, 4)), ((4, 8), (4, 8))], ((4, 8), (4, 8))),
    ([1] * 7, 8, 8, 2, None, [((0, 4), (0, 4)), ((4, 7), (4, 7))], ((4, 8), (4, 8))),
    ([8, 8], 16, 2, 2, None, [((0, 1), (0, 8)), ((1, 2), (8, 16))], ((1, 2), (8, 16))),
    ([8, 8], 16, 2, 2, 4, [((0, 1), (0, 4)), ((0, 2), (4, 16))], ((0, 2), (4, 16))),
    ([8, 8], 16, 2, 2, 12, [((0, 2), (0, 12)), ((1, 2), (12, 16))], ((1, 2), (12, 16))),
    ([5, 7, 8], 24, 4, 2, None, [((0, 2), (0, 12)), ((2, 3), (12, 20))], ((2, 4), (12, 24))),
    ([10], 10, 1, 2, None, [((0, 1), (0, 5)), ((0, 1), (5, 10))], ((0, 1), (5, 10))),
    ([3, 3, 3], 9, 3, 3, None, [((0, 1), (0, 3)), ((1, 2), (3, 6)), ((2, 3), (6, 9))], ((2, 3), (6, 9))),
    ([12], 12, 1, 3, None, [((0, 1), (0, 4)), ((0, 1), (4, 8)), ((0, 1), (8, 12))], ((0, 1), (8, 12))),
    ([4, 4, 4], 14, 5, 3, [2, 7], [((0, 1), (0, 2)), ((0, 2), (2, 7)), ((1, 3), (7, 12))], ((1, 5), (7, 14))),
    ([498, 502], 1000, 2, 2, [498], [((0, 1), (0, 498)), ((1, 2), (498, 1000))], ((1, 2), (498, 1000))),
]


@pytest.mark.parametrize("lens,padded,reqs_padded,n,split,expected,expected_padded_last", SLICE_VECTORS)
def test_maybe_create_ubatch_slices(lens, padded, reqs_padded, n, split, expected, expected_padded_last) -> None:
    unpadded, padded_slices = maybe_create_ubatch_slices(True, np.array(lens), padded, reqs_padded, n, split)
    assert unpadded is not None and padded_slices is not None  # should_ubatch=True
    assert unpadded == [_us(r, t) for r, t in expected]
    assert padded_slices[:-1] == unpadded[:-1]
    assert padded_slices[-1] == _us(*expected_padded_last)
    assert sum(s.num_tokens for s in padded_slices) == padded


def test_maybe_create_ubatch_slices_disabled() -> None:
    assert maybe_create_ubatch_slices(False, np.array([1, 2]), 3, 2) == (None, None)


@pytest.mark.parametrize("lens,padded,n,split,match", [
    ([1] * 5, 10, 2, None, r"ubatch 1 would be empty"),
    ([1], 1, 2, None, r"ubatch 0 would be empty"),
    ([4, 4], 8, 2, 8, r"ubatch 1 would be empty"),
    ([4, 4], 8, 3, [5, 5], r"ubatch 1 would be empty"),
    ([4, 4], 8, 2, [3, 5], r"split_point=\[3, 5\] must hold num_ubatches - 1 = 1"),
    ([4, 4], 8, 2, -3, r"split_point must be >= 0, got -3"),
    ([4, -1], 8, 2, None, r"num_scheduled_tokens\[1\] = -1 is negative"),
    ([4, 4], 7, 2, None, r"num_tokens_padded=7 is smaller than the 8"),
    ([4, 4], 8, 1, None, r"num_ubatches must be an int >= 2, got 1"),
])
def test_maybe_create_ubatch_slices_rejects(lens, padded, n, split, match) -> None:
    with pytest.raises(ValueError, match=match):
        maybe_create_ubatch_slices(True, np.array(lens), padded, len(lens), n, split)


def test_maybe_create_ubatch_slices_rejects_too_few_padded_reqs() -> None:
    with pytest.raises(ValueError, match=r"num_reqs_padded=1 is smaller than the 2"):
        maybe_create_ubatch_slices(True, np.array([4, 4]), 8, 1)


# ------------------------------------------------------------------------------------ slice_query_start_locs

QSL = torch.tensor([0, 5, 12, 20, 35, 50], dtype=torch.int32)


@pytest.mark.parametrize("name,req_slice,expected", [
    ("basic_slice_middle", slice(1, 3), [0, 7, 15]),
    ("slice_from_beginning", slice(0, 2), [0, 5, 12]),
    ("slice_to_end", slice(3, 5), [0, 15, 30]),
    ("single_element_slice", slice(2, 3), [0, 8]),
    ("full_tensor_slice", slice(0, 5), [0, 5, 12, 20, 35, 50]),
    ("slice_bounds_edge_cases", slice(3, 4), [0, 15]),
])
def test_slice_query_start_locs(name: str, req_slice: slice, expected: list[int]) -> None:
    out = slice_query_start_locs(QSL, req_slice)
    assert out.tolist() == expected
    out[0] += 1  # a fresh tensor: editing it must not touch the input
    assert QSL.tolist() == [0, 5, 12, 20, 35, 50]


# ------------------------------------------------------------------------------------ metadata slicing


def test_from_lens_builds_consistent_batch() -> None:
    common = CommonAttentionMetadata.from_lens([2, 3], [5, 3], block_size=4, num_reqs_padded=3, num_tokens_padded=7)
    assert common.query_start_loc.tolist() == [0, 2, 5, 5] and common.seq_lens.tolist() == [5, 3, 0]
    assert common.block_table.tolist() == [[0, 1], [2, 3], [4, 5]]
    assert common.positions is not None and common.positions.tolist() == [3, 4, 0, 1, 2, 0, 0]
    assert common.slot_mapping.tolist() == [3, 4, 8, 9, 10, -1, -1]
    assert (common.num_reqs, common.num_actual_tokens, common.max_query_len, common.max_seq_len) == (3, 7, 3, 5)


def test_make_metadata_with_slice_decode_batch() -> None:
    common = CommonAttentionMetadata.from_lens([1, 1], [32, 40])
    meta = make_metadata_with_slice(_us((0, 1), (0, 1)), common)
    assert (meta.num_reqs, meta.num_actual_tokens, meta.max_query_len) == (1, 1, 1)
    assert meta.query_start_loc.tolist() == [0, 1] and meta.query_start_loc_cpu.tolist() == [0, 1]
    assert meta.seq_lens.tolist() == [32] and meta.seq_lens_cpu.tolist() == [32]


def test_make_metadata_with_slice_mixed_batch() -> None:
    common = CommonAttentionMetadata.from_lens([1, 1, 5], [32, 40, 48])
    meta = make_metadata_with_slice(_us((1, 3), (1, 7)), common)
    assert (meta.num_reqs, meta.num_actual_tokens, meta.max_query_len) == (2, 6, 5)
    assert meta.query_start_loc.tolist() == [0, 1, 6]
    assert meta.seq_lens.tolist() == [40, 48]
    assert torch.equal(meta.block_table, common.block_table[1:3])
    assert torch.equal(meta.slot_mapping, common.slot_mapping[1:7])
    assert meta.positions is not None and common.positions is not None
    assert torch.equal(meta.positions, common.positions[1:7])


def test_split_attn_metadata_decode_batch() -> None:
    n = 64
    common = CommonAttentionMetadata.from_lens([1] * n, [100 + i for i in range(n)])
    slices, _ = maybe_create_ubatch_slices(True, np.ones(n, dtype=np.int32), n, n)
    assert slices is not None  # should_ubatch=True
    first, second = split_attn_metadata(slices, common)
    assert (first.num_reqs, first.num_actual_tokens, second.num_reqs, second.num_actual_tokens) == (32, 32, 32, 32)
    assert first.seq_lens.tolist() == list(range(100, 132))
    assert second.seq_lens.tolist() == list(range(132, 164))
    assert first.query_start_loc.tolist() == list(range(33)) and first.max_query_len == 1
    assert first.max_seq_len == second.max_seq_len == common.max_seq_len == 163


@pytest.mark.parametrize("seq_lens,query_lens,split_point,expected_first_reqs,expected_second_reqs", [
    ([32, 40], [8, 8], 12, 2, 1),  # split inside request 1
    ([32, 40], [8, 8], 4, 1, 2),  # split inside request 0
    ([20, 40, 9], [10, 16, 4], 18, 2, 2),  # split inside the middle request, context on every side
])
def test_prefill_split_across_ubatches(seq_lens, query_lens, split_point, expected_first_reqs,
                                       expected_second_reqs) -> None:
    common = CommonAttentionMetadata.from_lens(query_lens, seq_lens)
    before = (common.query_start_loc.clone(), common.seq_lens.clone(), common.seq_lens_cpu.clone())
    num_tokens = common.num_actual_tokens
    slices, _ = maybe_create_ubatch_slices(True, np.array(query_lens), num_tokens, len(query_lens),
                                           split_point=split_point)
    assert slices is not None  # should_ubatch=True
    first, second = split_attn_metadata(slices, common)
    assert (first.num_actual_tokens, second.num_actual_tokens) == (split_point, num_tokens - split_point)
    assert (first.num_reqs, second.num_reqs) == (expected_first_reqs, expected_second_reqs)
    qsl = common.query_start_loc_cpu.numpy()
    split_req = int(np.searchsorted(qsl, split_point, side="right") - 1)
    first_chunk = split_point - int(qsl[split_req])
    assert _qlens(first)[-1] == first_chunk
    assert _qlens(first)[-1] + _qlens(second)[0] == query_lens[split_req]
    context = [s - q for s, q in zip(seq_lens, query_lens, strict=True)]
    assert int(first.seq_lens[-1]) == int(first.seq_lens_cpu[-1]) == context[split_req] + first_chunk
    assert first.seq_lens[:-1].tolist() == seq_lens[:split_req]
    assert int(second.seq_lens[0]) == seq_lens[split_req]
    assert second.seq_lens.tolist() == seq_lens[split_req:]
    assert first.positions is not None and second.positions is not None
    assert torch.equal(first.positions[-1:] + 1, second.positions[:1])
    for t, b in zip((common.query_start_loc, common.seq_lens, common.seq_lens_cpu), before, strict=True):
        assert torch.equal(t, b)  # inputs never mutated


def test_split_attn_metadata_padded_uniform_decode() -> None:
    """Padded last ubatch: zero-length padded requests, slot_mapping covers the padding."""
    common = CommonAttentionMetadata.from_lens([1] * 6, [10] * 6, num_reqs_padded=8, num_tokens_padded=8)
    _, padded = maybe_create_ubatch_slices(True, np.ones(6, dtype=np.int32), 8, 8)
    assert padded is not None  # should_ubatch=True
    first, second = split_attn_metadata(padded, common)
    assert (first.num_reqs, first.num_actual_tokens, second.num_reqs, second.num_actual_tokens) == (4, 4, 4, 4)
    assert _qlens(second) == [1, 1, 0, 0] and second.seq_lens.tolist() == [10, 10, 0, 0]
    assert second.slot_mapping.tolist()[-2:] == [-1, -1] and second.max_query_len == 1


def test_metadata_request_spanning_three_ubatches() -> None:
    common = CommonAttentionMetadata.from_lens([12], [20])
    slices, _ = maybe_create_ubatch_slices(True, np.array([12]), 12, 1, num_ubatches=3)
    assert slices is not None  # should_ubatch=True
    metas = split_attn_metadata(slices, common)
    assert [_qlens(m) for m in metas] == [[4], [4], [4]]
    assert [m.seq_lens.tolist() for m in metas] == [[12], [16], [20]]


def test_max_query_len_falls_back_for_dummy_run() -> None:
    common = CommonAttentionMetadata.from_lens([0, 0], [0, 0], num_tokens_padded=2)
    common.max_query_len = 7
    meta = make_metadata_with_slice(_us((0, 2), (0, 2)), common)
    assert meta.max_query_len == 7


@pytest.mark.parametrize("ubatch_slice,match", [
    (_us((1, 1), (0, 3)), r"empty ubatch slice"),
    (_us((0, 2), (9, 12)), r"token_slice start 9 is not inside request 0"),
    (_us((1, 4), (8, 16)), r"request_slice slice\(1, 4, None\) outside"),
])
def test_make_metadata_with_slice_rejects(ubatch_slice: UBatchSlice, match: str) -> None:
    common = CommonAttentionMetadata.from_lens([8, 8], [32, 40])
    with pytest.raises(ValueError, match=match):
        make_metadata_with_slice(ubatch_slice, common)


# ---------------------------------------------------------------------------------------- SGLang split

# extend_lens, (seq, tok) at th=0.48, (seq, tok) at th=0, child A lens, child B lens, B first prefix +=
SGLANG_EXTEND_VECTORS = [
    ([], (0, 0), (0, 0), None, None, None),
    ([42], (0, 21), (0, 0), [21], [21], 21),
    ([42, 999], (1, 520), (1, 42), [42, 478], [521], 478),
    ([999, 42], (0, 520), (1, 999), [520], [479, 42], 520),
    ([498, 502], (1, 498), (1, 498), [498], [502], 0),
    ([4096] * 4, (2, 8192), (2, 8192), [4096] * 2, [4096] * 2, 0),
    ([4095, 4096, 4096, 4096, 1], (2, 8191), (2, 8191), [4095, 4096], [4096, 4096, 1], 0),
    ([1, 4095, 4096, 4096, 4096], (3, 8192), (3, 8192), [1, 4095, 4096], [4096, 4096], 0),
    ([4097, 4096, 4096, 4095, 1], (2, 8193), (2, 8193), [4097, 4096], [4096, 4095, 1], 0),
    ([1, 1, 1, 1, 99999], (4, 50001), (4, 4), [1, 1, 1, 1, 49997], [50002], 49997),
    ([99999, 1, 1, 1, 1], (0, 50001), (1, 99999), [50001], [49998, 1, 1, 1, 1], 50001),
    ([100, 2000], (1, 1050), (1, 100), [100, 950], [1050], 950),
    ([4000], (0, 2000), (0, 0), [2000], [2000], 2000),
    ([1], (0, 0), (0, 0), None, None, None),
    ([1, 2], (1, 1), (1, 1), [1], [2], 0),
    ([1, 3], (1, 2), (1, 1), [1, 1], [2], 1),
    ([2, 1], (0, 1), (1, 2), [1], [1, 1], 1),
]


@pytest.mark.parametrize("lens,at_048,at_0,a_lens,b_lens,b_prefix", SGLANG_EXTEND_VECTORS)
def test_compute_split_extend(lens, at_048, at_0, a_lens, b_lens, b_prefix) -> None:
    for th, expected in ((0.48, at_048), (0.0, at_0)):
        seq = compute_split_seq_index("extend", sum(lens), lens, None, threshold=th)
        assert (seq, compute_split_token_index(seq, "extend", lens, None, threshold=th)) == expected
    assert is_two_chunk_split(lens) is bool(b_prefix)  # the seq-count guard keeps [1] and [1, 2] plain
    assert not is_two_chunk_split(lens, threshold=0.0)


@pytest.mark.parametrize("lens,th,expected", [
    ([1, 2, 1], 0.0, (2, 3)),  # |left - right| ties at i=1 and i=2: the later index wins
    ([2, 2, 2], 0.0, (2, 4)),
    ([1, 2, 1], 0.48, (1, 2)),  # left share 3/4 is outside [0.48, 0.52]: cut request 1
    ([2, 2, 2], 0.48, (1, 3)),
    ([2, 2, 2], 0.5, (1, 3)),  # t = 0.5: anything but an exact half is two-chunk
    ([3, 3], 0.5, (1, 3)),
    ([10, 1, 100], 0.48, (2, 55)),  # left share 11/111 at the best boundary: cut the long request
])
def test_compute_split_extend_ties_and_thresholds(lens: list[int], th: float, expected: tuple[int, int]) -> None:
    seq = compute_split_seq_index("extend", sum(lens), lens, None, threshold=th)
    assert (seq, compute_split_token_index(seq, "extend", lens, None, threshold=th)) == expected


@pytest.mark.parametrize("lens,at_048,at_0,a_lens,b_lens,b_prefix", SGLANG_EXTEND_VECTORS)
def test_balanced_split_children(lens, at_048, at_0, a_lens, b_lens, b_prefix) -> None:
    """The balanced boundary fed through the vLLM slicer reproduces SGLang's children, context 7 each."""
    points = balanced_split_points(lens)
    if a_lens is None:
        assert points is None
        return
    assert points == [at_048[1]]
    context = 7
    common = CommonAttentionMetadata.from_lens(lens, [n + context for n in lens])
    slices, _ = maybe_create_ubatch_slices(True, np.array(lens), sum(lens), len(lens), split_point=points)
    assert slices is not None  # should_ubatch=True
    a, b = split_attn_metadata(slices, common)
    assert (_qlens(a), _qlens(b)) == (a_lens, b_lens)
    assert int(b.seq_lens[0]) - _qlens(b)[0] == context + b_prefix
    assert b.seq_lens.tolist() == [n + context for n in lens[len(lens) - len(b_lens):]]
    if b_prefix:  # two-chunk: A gets exactly T // 2 tokens and its last seq_len stops after its chunk
        assert a.num_actual_tokens == sum(lens) // 2
        assert int(a.seq_lens[-1]) == context + a_lens[-1]
        assert is_two_chunk_split(lens)


@pytest.mark.parametrize("mode,num_tokens,tnps,expected", [
    ("decode", 0, 1, (0, 0)), ("decode", 100, 1, (50, 50)), ("decode", 99, 1, (49, 49)),
    ("decode", 1, None, (0, 0)), ("target_verify", 28, 4, (3, 12)), ("idle", 0, None, (0, 0)),
])
def test_compute_split_decode_verify_idle(mode: str, num_tokens: int, tnps, expected) -> None:
    seq = compute_split_seq_index(mode, num_tokens, None, tnps)
    assert (seq, compute_split_token_index(seq, mode, None, tnps)) == expected


@pytest.mark.parametrize("lens,mode,tnps,expected", [
    ([1] * 100, "decode", None, [50]), ([1] * 99, "decode", None, [49]), ([1], "decode", None, None),
    ([4] * 7, "target_verify", 4, [12]), ([], "idle", None, None), ([1] * 100, "extend", None, [50]),
])
def test_balanced_split_points_uniform(lens, mode: str, tnps, expected) -> None:
    assert balanced_split_points(lens, mode, tnps) == expected


@pytest.mark.parametrize("split_tok,n,expected", [(2, 8, (2, 6)), (2, 0, (0, 0)), (8, 9, (8, 1)), (4, 3, (3, 0))])
def test_split_num_tokens_non_padded(split_tok: int, n: int, expected: tuple[int, int]) -> None:
    assert split_num_tokens_non_padded(split_tok, n) == expected


def test_capture_count_falls_back_to_physical_rows() -> None:
    """8 physical decode rows, split seq 2 -> children (2, 6)
    (SGLang ``test_capture_count_falls_back_to_physical_rows``)."""
    tok = compute_split_token_index(2, "decode", None, 1)
    assert split_num_tokens_non_padded(tok, 8) == (2, 6)


@pytest.mark.parametrize("n,tp,expected", [(5, 4, 8), (0, 4, 0), (8, 4, 8), (1, 1, 1)])
def test_tbo_padded_len(n: int, tp: int, expected: int) -> None:
    assert tbo_padded_len(n, tp) == expected


@pytest.mark.parametrize("lens,prefix", [([42, 999], 0), ([100, 2000], 0), ([4000], 0), ([1, 3], 5), ([999, 42], 3)])
def test_split_sequence_fields(lens: list[int], prefix: int) -> None:
    """Two-chunk rewrite: left_last = T//2 - sum(lens[:k]); A seq_len = prefix + left; B prefix += left."""
    k = compute_split_seq_index("extend", sum(lens), lens, None)
    left = sum(lens) // 2 - sum(lens[:k])
    a, b = split_sequence_fields(prefix, lens[k], left)
    assert a == SeqFields(prefix, prefix + left) and b == SeqFields(prefix + left, prefix + lens[k])
    assert (a.seq_len - a.prefix_len) + (b.seq_len - b.prefix_len) == lens[k]
    assert sum(lens[:k]) + a.seq_len - a.prefix_len == sum(lens) // 2


# ---------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("call,match", [
    (lambda: compute_split_seq_index("prefill", 4, [4], None), r"unknown forward_mode 'prefill'"),
    (lambda: compute_split_token_index(0, "mixed", [4], None), r"unknown forward_mode 'mixed'"),
    (lambda: compute_split_seq_index("extend", 4, [4], None, threshold=0.6), r"threshold .* got 0.6"),
    (lambda: compute_split_seq_index("extend", 4, [4], None, threshold=-0.1), r"got -0.1"),
    (lambda: compute_split_seq_index("extend", 5, [4], None), r"num_tokens=5 but extend_lens sum to 4"),
    (lambda: compute_split_seq_index("extend", 4, None, None), r"needs extend_lens, got None"),
    (lambda: compute_split_seq_index("extend", 3, [4, -1], None), r"extend_lens\[1\] = -1 is negative"),
    (lambda: compute_split_seq_index("decode", -2, None, 1), r"num_tokens must be >= 0, got -2"),
    (lambda: compute_split_seq_index("target_verify", 8, None, None), r"token_num_per_seq >= 1, got None"),
    (lambda: compute_split_seq_index("target_verify", 9, None, 4), r"num_tokens=9 is not a multiple"),
    (lambda: compute_split_seq_index("idle", 3, None, None), r"num_tokens == 0, got 3"),
    (lambda: compute_split_token_index(3, "extend", [4, 4], None), r"split_seq_index=3 beyond"),
    (lambda: is_two_chunk_split([4, 4], threshold=0.75), r"got 0.75"),
    (lambda: split_sequence_fields(0, 10, 10), r"left=10 must lie strictly inside extend_len=10"),
    (lambda: split_sequence_fields(-1, 10, 5), r"prefix_len must be >= 0, got -1"),
    (lambda: tbo_padded_len(5, 0), r"attn_tp_size must be >= 1, got 0"),
    (lambda: balanced_split_points([1, 2], "decode"), r"needs 1 tokens per request, got \[1, 2\]"),
    (lambda: is_last_ubatch_empty(-1, 4, 2), r"orig_num_tokens must be >= 0, got -1"),
    (lambda: is_last_ubatch_empty(4, 4, 1), r"num_ubatches must be an int >= 2, got 1"),
    (lambda: check_ubatch_thresholds(-5, True), r"num_tokens must be >= 0, got -5"),
    (lambda: CommonAttentionMetadata.from_lens([3], [2]), r"query_lens=\[3\], seq_lens=\[2\]"),
])
def test_bad_input_names_the_value(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()
