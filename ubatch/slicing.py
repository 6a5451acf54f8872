"""Splitting one forward step into micro-batches: token/request slices and per-ubatch attention metadata.

Two split strategies feed the same slicer. ``tokens`` (vLLM DBO) cuts at ``padded // n`` so every DP rank,
padded alike, gets identical ubatch sizes. ``balanced`` (SGLang TBO) picks the sequence boundary that best
balances the two halves and falls back to a token-level "two-chunk" cut when that is too lopsided;
:func:`balanced_split_points` turns its answer into a ``split_point`` for :func:`maybe_create_ubatch_slices`.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

FORWARD_MODES = ("extend", "decode", "target_verify", "idle")
PAD_SLOT_ID = -1


@dataclass
class CommonAttentionMetadata:
    """Backend-agnostic description of one step's attention batch (the vLLM shape).

    `query_start_loc` holds cumulative query lengths (``[num_reqs + 1]``, int32); `seq_lens` the full
    length each request will have after this step (context + new tokens). The ``*_cpu`` twins let split
    logic run without a device sync.
    """

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor | None = None
    causal: bool = True

    @classmethod
    def from_lens(cls, query_lens: Sequence[int], seq_lens: Sequence[int], *, block_size: int = 16,
                  num_reqs_padded: int | None = None, num_tokens_padded: int | None = None,
                  device: torch.device | str = "cpu") -> CommonAttentionMetadata:
        """Build a self-consistent batch (request i owns a private run of KV blocks) for dummy runs and tests.

        Padding follows vLLM: padded requests have query length 0 and seq_len 0, padded tokens write to
        ``PAD_SLOT_ID`` at position 0, so padded slices can be split like real ones.
        """
        q, s = _as_lens("query_lens", query_lens), _as_lens("seq_lens", seq_lens)
        if len(q) != len(s) or any(si < qi for qi, si in zip(q, s, strict=True)):
            raise ValueError(f"need query_len <= seq_len per request, got query_lens={q}, seq_lens={s}")
        n_reqs = len(q) if num_reqs_padded is None else num_reqs_padded
        n_toks = sum(q) if num_tokens_padded is None else num_tokens_padded
        if n_reqs < len(q) or n_toks < sum(q):
            raise ValueError(f"padding ({n_reqs} reqs, {n_toks} tokens) below the real ({len(q)}, {sum(q)})")
        q_pad = torch.tensor(q + [0] * (n_reqs - len(q)), dtype=torch.int32)
        seq = torch.tensor(s + [0] * (n_reqs - len(q)), dtype=torch.int32)
        qsl = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(q_pad, 0, dtype=torch.int32)])
        width = max(1, -(-max(s, default=0) // block_size))
        block_table = torch.arange(n_reqs * width, dtype=torch.int32).view(n_reqs, width)
        req = torch.repeat_interleave(torch.arange(n_reqs), q_pad.long())  # owning request of each real token
        pos = (torch.arange(len(req)) - qsl[req] + (seq - q_pad)[req]).long()
        slots = block_table[req, pos // block_size].long() * block_size + pos % block_size
        n_pad = n_toks - len(req)
        positions = torch.cat([pos, torch.zeros(n_pad, dtype=torch.int64)])
        slot_mapping = torch.cat([slots, torch.full((n_pad,), PAD_SLOT_ID, dtype=torch.int64)])
        return cls(query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq.to(device),
                   seq_lens_cpu=seq, num_reqs=n_reqs, num_actual_tokens=n_toks, max_query_len=max(q, default=0),
                   max_seq_len=max(s, default=0), block_table=block_table.to(device),
                   slot_mapping=slot_mapping.to(device), positions=positions.to(device))


@dataclass
class UBatchSlice:
    """The requests and tokens of one ubatch; a request cut by a boundary is in both neighbours."""

    request_slice: slice
    token_slice: slice

    def is_empty(self) -> bool:
        return self.request_slice.stop <= self.request_slice.start or self.token_slice.stop <= self.token_slice.start

    @property
    def num_tokens(self) -> int:
        return self.token_slice.stop - self.token_slice.start

    @property
    def num_reqs(self) -> int:
        return self.request_slice.stop - self.request_slice.start


UBatchSlices = list[UBatchSlice]


def _require_num_ubatches(num_ubatches: int) -> None:
    if isinstance(num_ubatches, bool) or not isinstance(num_ubatches, (int, np.integer)) or num_ubatches < 2:
        raise ValueError(f"num_ubatches must be an int >= 2, got {num_ubatches!r}")


def _require_non_negative(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def _require_split_args(forward_mode: str, threshold: float) -> None:
    if forward_mode not in FORWARD_MODES:
        raise ValueError(f"unknown forward_mode {forward_mode!r}; expected one of {FORWARD_MODES}")
    if not 0.0 <= threshold <= 0.5:
        raise ValueError(f"threshold must lie in [0, 0.5], got {threshold}")


def _as_lens(name: str, lens: Sequence[int] | np.ndarray) -> list[int]:
    """Per-request token counts as Python ints; negatives name the offending request."""
    arr = np.asarray(lens)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    out = [int(x) for x in arr]
    for i, x in enumerate(out):
        if x < 0:
            raise ValueError(f"{name}[{i}] = {x} is negative")
    return out


def is_last_ubatch_empty(orig_num_tokens: int, padded_num_tokens: int, num_ubatches: int) -> bool:
    """True when cutting at ``padded // n`` leaves nothing real for the last ubatch.

    The cut uses the padded count, so DP coordination must call this with the *min* real and *max*
    padded count over ranks; it is conservative (an exact fit counts as empty).
    """
    _require_num_ubatches(num_ubatches)
    _require_non_negative("orig_num_tokens", orig_num_tokens)
    _require_non_negative("padded_num_tokens", padded_num_tokens)
    return (padded_num_tokens // num_ubatches) * (num_ubatches - 1) >= orig_num_tokens


def check_ubatch_thresholds(num_tokens: int, uniform_decode: bool, decode_threshold: int = 32,
                            prefill_threshold: int = 512) -> bool:
    """Local vote: ubatching only pays off once each half still has enough tokens to hide an all-to-all."""
    _require_non_negative("num_tokens", num_tokens)
    _require_non_negative("decode_threshold", decode_threshold)
    _require_non_negative("prefill_threshold", prefill_threshold)
    return num_tokens >= (decode_threshold if uniform_decode else prefill_threshold)


def _inner_boundaries(split_point: int | Sequence[int] | None, num_tokens_padded: int,
                      num_ubatches: int) -> list[int]:
    """The ``n - 1`` inner cuts: from an int width (``split_point * i``), an explicit list, or by default the
    padded count's equal share, so that DP ranks padded to the same count cut at the same rows."""
    if split_point is None:
        split_point = num_tokens_padded // num_ubatches
    if isinstance(split_point, (int, np.integer)) and not isinstance(split_point, bool):
        _require_non_negative("split_point", int(split_point))
        return [int(split_point) * i for i in range(1, num_ubatches)]
    if isinstance(split_point, bool):
        raise TypeError(f"split_point must be an int or a list of ints, got {split_point!r}")
    inner = [int(p) for p in split_point]
    if len(inner) != num_ubatches - 1:
        raise ValueError(f"split_point={inner} must hold num_ubatches - 1 = {num_ubatches - 1} boundaries")
    return inner


def _token_boundaries(split_point: int | Sequence[int] | None, num_tokens: int, num_tokens_padded: int,
                      num_ubatches: int) -> list[int]:
    """``[0, b1, ..., b_{n-1}, num_tokens]``, rejecting any split that would leave a ubatch empty."""
    bounds = [0, *_inner_boundaries(split_point, num_tokens_padded, num_ubatches), num_tokens]
    for i in range(num_ubatches):
        if bounds[i + 1] <= bounds[i]:
            raise ValueError(f"ubatch {i} would be empty: token boundaries {bounds} (num_tokens={num_tokens}, "
                             f"num_tokens_padded={num_tokens_padded}, num_ubatches={num_ubatches})")
    return bounds


def _slice_for_tokens(cu_num_tokens: np.ndarray, start: int, end: int) -> UBatchSlice:
    """Requests overlapping ``[start, end)``: the one holding ``start`` up to the last one starting before ``end``.

    A zero-length request sitting exactly on a boundary overlaps no token range and lands in no ubatch;
    it has nothing to compute, so this is harmless.
    """
    req_start = int(np.searchsorted(cu_num_tokens, start, side="right")) - 1
    req_stop = int(np.searchsorted(cu_num_tokens, end, side="left"))
    return UBatchSlice(slice(req_start, req_stop), slice(start, end))


def maybe_create_ubatch_slices(should_ubatch: bool, num_scheduled_tokens: np.ndarray | Sequence[int],
                               num_tokens_padded: int, num_reqs_padded: int, num_ubatches: int = 2,
                               split_point: int | list[int] | None = None
                               ) -> tuple[UBatchSlices | None, UBatchSlices | None]:
    """(unpadded, padded) slices; the padded list differs only in its last slice, stretched over the padding.

    The default cut is ``num_tokens_padded // num_ubatches`` so that all DP ranks (padded to the same
    count) run same-sized ubatches; the last real boundary is the real token count. An int
    ``split_point`` sets the width (boundaries at ``split_point * i``), a list gives the ``n - 1`` inner
    boundaries explicitly (e.g. from :func:`balanced_split_points`). Raises ``ValueError`` rather than
    return an empty ubatch.
    """
    if not should_ubatch:
        return None, None
    _require_num_ubatches(num_ubatches)
    lens = _as_lens("num_scheduled_tokens", num_scheduled_tokens)
    cu = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    num_tokens = int(cu[-1])
    if num_tokens_padded < num_tokens:
        raise ValueError(f"num_tokens_padded={num_tokens_padded} is smaller than the {num_tokens} scheduled tokens")
    if num_reqs_padded < len(lens):
        raise ValueError(f"num_reqs_padded={num_reqs_padded} is smaller than the {len(lens)} scheduled requests")
    bounds = _token_boundaries(split_point, num_tokens, num_tokens_padded, num_ubatches)
    slices = [_slice_for_tokens(cu, s, e) for s, e in itertools.pairwise(bounds)]
    last = slices[-1]
    padded_last = UBatchSlice(slice(last.request_slice.start, num_reqs_padded),
                              slice(last.token_slice.start, num_tokens_padded))
    return slices, [*slices[:-1], padded_last]


def padded_ubatch_slices(num_scheduled_tokens: np.ndarray | Sequence[int], num_tokens_padded: int,
                         num_ubatches: int = 2, split_point: int | list[int] | None = None) -> UBatchSlices:
    """Slices over the whole padded batch, where a ubatch may hold padding only.

    :func:`maybe_create_ubatch_slices` (vLLM's) refuses a ubatch without real tokens. Under SGLang's DP rule
    an idle rank, or one whose real tokens end before the cut, still runs every ubatch so the MoE
    collectives match; its padding-only ubatches get an empty request slice (``[num_reqs, num_reqs)``) and
    their rows are routed nowhere by the MoE layers. The cut is ``num_tokens_padded // num_ubatches``
    unless ``split_point`` gives it (an int width or the ``n - 1`` inner boundaries); every ubatch keeps at
    least one row.
    """
    _require_num_ubatches(num_ubatches)
    lens = _as_lens("num_scheduled_tokens", num_scheduled_tokens)
    cu = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    num_tokens, num_reqs = int(cu[-1]), len(lens)
    if num_tokens_padded < num_tokens:
        raise ValueError(f"num_tokens_padded={num_tokens_padded} is smaller than the {num_tokens} scheduled tokens")
    bounds = [0, *_inner_boundaries(split_point, num_tokens_padded, num_ubatches), num_tokens_padded]
    if any(b <= a for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"ubatch boundaries {bounds} over {num_tokens_padded} padded tokens leave a ubatch "
                         "without a single row")
    out = []
    for start, end in itertools.pairwise(bounds):
        if start >= num_tokens:
            out.append(UBatchSlice(slice(num_reqs, num_reqs), slice(start, end)))
        else:
            real = _slice_for_tokens(cu, start, min(end, num_tokens))
            out.append(UBatchSlice(real.request_slice, slice(start, end)))
    return out


def slice_query_start_locs(query_start_loc: torch.Tensor, request_slice: slice) -> torch.Tensor:
    """Re-base cumulative query offsets to the slice's first request; always a fresh tensor, never a view."""
    return query_start_loc[request_slice.start:request_slice.stop + 1] - query_start_loc[request_slice.start]


def _rebased_locs(query_start_loc: torch.Tensor, request_slice: slice, skipped_front: int,
                  skipped_back: int) -> torch.Tensor:
    """Offsets for a slice whose first request lost ``skipped_front`` and last lost ``skipped_back`` tokens."""
    locs = slice_query_start_locs(query_start_loc, request_slice)
    if skipped_front:
        locs[1:] -= skipped_front
    if skipped_back:
        locs[-1] -= skipped_back
    return locs


def _trim_last(seq_lens: torch.Tensor, skipped_back: int) -> torch.Tensor:
    """Clone before editing: the caller's tensor may be read by the other ubatch or a captured graph."""
    if not skipped_back:
        return seq_lens
    out = seq_lens.clone()
    out[-1] -= skipped_back
    return out


def make_metadata_with_slice(ubatch_slice: UBatchSlice, common: CommonAttentionMetadata) -> CommonAttentionMetadata:
    """Metadata for one ubatch, treating a cut request like a chunked prefill.

    The part before the cut sees ``seq_len = context + its chunk``; the part after keeps the full
    ``seq_len`` and reads the first part's KV as prefix, which is correct because ubatch i's attention
    for every layer is enqueued before ubatch i+1's. The token slice may end inside padding.
    """
    reqs, toks = ubatch_slice.request_slice, ubatch_slice.token_slice
    num_real = int(common.query_start_loc_cpu[-1])
    if reqs.stop <= reqs.start and toks.stop > toks.start and toks.start >= num_real:  # all padding
        return _padding_only_metadata(toks, common)
    if ubatch_slice.is_empty():
        raise ValueError(f"cannot build attention metadata for empty ubatch slice {ubatch_slice}")
    locs = common.query_start_loc_cpu
    if reqs.start < 0 or reqs.stop > len(locs) - 1:
        raise ValueError(f"request_slice {reqs} outside the batch's {len(locs) - 1} requests")
    first_start, first_end = int(locs[reqs.start]), int(locs[reqs.start + 1])
    if not first_start <= toks.start < max(first_end, first_start + 1):  # zero-length: dummy runs
        raise ValueError(f"token_slice start {toks.start} is not inside request {reqs.start} "
                         f"(tokens [{first_start}, {first_end}))")
    skipped_front = toks.start - first_start
    skipped_back = max(0, int(locs[reqs.stop]) - toks.stop)
    qsl_cpu = _rebased_locs(locs, reqs, skipped_front, skipped_back)
    seq_lens_cpu = _trim_last(common.seq_lens_cpu[reqs], skipped_back)
    max_query_len = int((qsl_cpu[1:] - qsl_cpu[:-1]).abs().max()) or common.max_query_len
    return CommonAttentionMetadata(
        query_start_loc=_rebased_locs(common.query_start_loc, reqs, skipped_front, skipped_back),
        query_start_loc_cpu=qsl_cpu,
        seq_lens=_trim_last(common.seq_lens[reqs], skipped_back),
        seq_lens_cpu=seq_lens_cpu,
        num_reqs=ubatch_slice.num_reqs,
        num_actual_tokens=ubatch_slice.num_tokens,
        max_query_len=max_query_len,
        max_seq_len=max(int(seq_lens_cpu.max()), common.max_seq_len),
        block_table=common.block_table[reqs],
        slot_mapping=common.slot_mapping[toks],
        positions=None if common.positions is None else common.positions[toks],
        causal=common.causal,
    )


def _padding_only_metadata(toks: slice, common: CommonAttentionMetadata) -> CommonAttentionMetadata:
    """A ubatch of padding rows only: no request to attend for, its rows write KV nowhere (padding slots)."""
    empty = slice(0, 0)
    return CommonAttentionMetadata(
        query_start_loc=common.query_start_loc[:1] * 0, query_start_loc_cpu=common.query_start_loc_cpu[:1] * 0,
        seq_lens=common.seq_lens[empty], seq_lens_cpu=common.seq_lens_cpu[empty], num_reqs=0,
        num_actual_tokens=toks.stop - toks.start, max_query_len=0, max_seq_len=0,
        block_table=common.block_table[empty], slot_mapping=common.slot_mapping[toks],
        positions=None if common.positions is None else common.positions[toks], causal=common.causal)


def split_attn_metadata(ubatch_slices: Sequence[UBatchSlice],
                        common: CommonAttentionMetadata) -> list[CommonAttentionMetadata]:
    """One metadata per ubatch, each built fresh so no backend ever shares cached state across ubatches."""
    return [make_metadata_with_slice(s, common) for s in ubatch_slices]


def _balanced_seq_index(lens: Sequence[int]) -> int:
    """Sequence boundary minimising |left - right|; the diff is V-shaped, so stop once it grows (ties: later)."""
    total, left, best, min_diff = sum(lens), 0, 0, float("inf")
    for i in range(1, len(lens)):
        left += lens[i - 1]
        diff = abs(2 * left - total)
        if diff > min_diff:
            break
        best, min_diff = i, diff
    return best


def _cut_seq_index(lens: Sequence[int]) -> int:
    """The sequence holding token ``sum // 2``: the one a two-chunk split cuts in two."""
    half, left = sum(lens) // 2, 0
    for i, n in enumerate(lens):
        left += n
        if left > half:
            return i
    return 0


def is_two_chunk_split(extend_lens: Sequence[int], threshold: float = 0.48) -> bool:
    """Whether the best sequence boundary is so lopsided (left share outside ``[t, 1-t]``) that a token cut wins.

    ``threshold == 0`` disables it. Guard from newer SGLang: if child A would get more sequences than
    tokens (tiny batches such as ``[1]`` or ``[1, 2]``) keep the plain split.
    """
    _require_split_args("extend", threshold)
    extend_lens = _as_lens("extend_lens", extend_lens)
    total = sum(extend_lens)
    left = sum(extend_lens[:_balanced_seq_index(extend_lens)])
    wanted = left < total * threshold or left > total * (1 - threshold)
    return wanted and _cut_seq_index(extend_lens) + 1 <= total // 2


def _extend_lens(extend_lens: Sequence[int] | None) -> list[int]:
    if extend_lens is None:
        raise ValueError("forward_mode 'extend' needs extend_lens, got None")
    return _as_lens("extend_lens", extend_lens)


def _tokens_per_seq(forward_mode: str, token_num_per_seq: int | None) -> int:
    """Decode defaults to one token per sequence; target-verify must say its draft length."""
    if token_num_per_seq is None and forward_mode == "decode":
        return 1
    if token_num_per_seq is None or token_num_per_seq < 1:
        raise ValueError(f"forward_mode {forward_mode!r} needs token_num_per_seq >= 1, got {token_num_per_seq}")
    return int(token_num_per_seq)


def compute_split_seq_index(forward_mode: str, num_tokens: int, extend_lens: Sequence[int] | None,
                            token_num_per_seq: int | None, threshold: float = 0.48) -> int:
    """Index of child B's first sequence (in two-chunk mode: of the sequence cut in two). SGLang semantics.

    Decode and verify put ``floor(bs / 2)`` sequences in child A, so ``bs == 1`` leaves A empty, as upstream.
    """
    _require_split_args(forward_mode, threshold)
    _require_non_negative("num_tokens", num_tokens)
    if forward_mode == "extend":
        lens = _extend_lens(extend_lens)
        if sum(lens) != num_tokens:
            raise ValueError(f"num_tokens={num_tokens} but extend_lens sum to {sum(lens)}")
        return _cut_seq_index(lens) if is_two_chunk_split(lens, threshold) else _balanced_seq_index(lens)
    if forward_mode == "idle":
        if num_tokens != 0:
            raise ValueError(f"forward_mode 'idle' needs num_tokens == 0, got {num_tokens}")
        return 0
    tnps = _tokens_per_seq(forward_mode, token_num_per_seq)
    if num_tokens % tnps:
        raise ValueError(f"num_tokens={num_tokens} is not a multiple of token_num_per_seq={tnps}")
    return (num_tokens // tnps) // 2


def compute_split_token_index(split_seq_index: int, forward_mode: str, extend_lens: Sequence[int] | None,
                              token_num_per_seq: int | None, threshold: float = 0.48) -> int:
    """Token boundary between the children: ``total // 2`` in two-chunk mode, else the sequence boundary."""
    _require_split_args(forward_mode, threshold)
    _require_non_negative("split_seq_index", split_seq_index)
    if forward_mode == "idle":
        return 0
    if forward_mode != "extend":
        return split_seq_index * _tokens_per_seq(forward_mode, token_num_per_seq)
    lens = _extend_lens(extend_lens)
    if split_seq_index > len(lens):
        raise ValueError(f"split_seq_index={split_seq_index} beyond the {len(lens)} sequences")
    return sum(lens) // 2 if is_two_chunk_split(lens, threshold) else sum(lens[:split_seq_index])


def split_num_tokens_non_padded(split_token_index: int, num_tokens: int) -> tuple[int, int]:
    """Real tokens per child when the parent's real count may be below the split (padded / captured batches)."""
    _require_non_negative("split_token_index", split_token_index)
    _require_non_negative("num_tokens", num_tokens)
    return min(split_token_index, num_tokens), max(0, num_tokens - split_token_index)


def balanced_split_points(num_scheduled_tokens: np.ndarray | Sequence[int], forward_mode: str = "extend",
                          token_num_per_seq: int | None = None, threshold: float = 0.48) -> list[int] | None:
    """SGLang's two-way split as a ``split_point`` list for :func:`maybe_create_ubatch_slices`.

    ``None`` when the balanced answer would leave a child empty (decode bs 1, a one-token prefill,
    an idle step): we never run an empty ubatch, so the caller should vote against ubatching.
    A two-chunk cut lands inside a request, which the slicer then places in both ubatches.
    """
    lens = _as_lens("num_scheduled_tokens", num_scheduled_tokens)
    _require_split_args(forward_mode, threshold)
    if forward_mode in ("decode", "target_verify"):
        tnps = _tokens_per_seq(forward_mode, token_num_per_seq)
        if any(n != tnps for n in lens):
            raise ValueError(f"forward_mode {forward_mode!r} needs {tnps} tokens per request, got {lens}")
    num_tokens = sum(lens)
    seq = compute_split_seq_index(forward_mode, num_tokens, lens, token_num_per_seq, threshold)
    tok = compute_split_token_index(seq, forward_mode, lens, token_num_per_seq, threshold)
    return [tok] if 0 < tok < num_tokens else None
