"""Prefill attention as a few padded groups (``runner/attention/prefill_batch.py``) equals the per-request path
it replaced, and its launches do not grow with the number of requests.

The reference is the per-request loop the backends ran before (``reference.per_request_prefill``: the cache
slots of each request, then one attention call per request: the torch backend's einsums, the Triton backend's
``scaled_dot_product_attention`` with ``is_causal`` or a bottom-right-aligned boolean mask). Both run over a
cache whose unwritten slots hold NaN, so a padded key that read one would show. Batches: fresh prompts of
different lengths, chunked prefill with earlier context, a decode+prefill mixed step, a request cut across two
ubatches; GQA ratios 1, 2, 4 and 8 and an MLA-like shape (one key head, value narrower than the key); block
sizes 4 and 16; fp32 on CPU.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from runner.attention import reference
from runner.attention.backend import AttentionBackend
from runner.attention.kv_cache import build_attention_metadata
from runner.attention.metadata import PagedAttentionMetadata
from runner.attention.prefill_batch import PAD_FACTOR, PAD_SLACK, group_prefills
from runner.attention.torch_backend import TorchAttentionBackend
from runner.attention.triton_backend import TritonAttentionBackend
from ubatch.slicing import padded_ubatch_slices, split_attn_metadata

D = 8


def per_request_prefill(name: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: PagedAttentionMetadata, scale: float) -> dict[int, torch.Tensor]:
    """Batch row -> output row of every prefill query, request by request, as backend ``name`` ran it."""
    return reference.per_request_prefill("torch" if name == "torch" else "sdpa", q, k_cache, v_cache, meta, scale)


def backend_for(name: str) -> AttentionBackend:
    if name == "torch":
        return TorchAttentionBackend()

    def no_decode(*args, **kwargs):  # these tests compare prefill rows only
        raise AssertionError("no decode expected here")

    if name != "triton":
        raise ValueError(f"unknown attention backend {name!r}: torch or triton")
    return TritonAttentionBackend(decode_fn=no_decode)


class Step:
    """Requests with ``ctx`` cached tokens and ``qlen`` new ones over a paged cache of block size ``bs``, with
    every slot no request wrote holding NaN; K and V written for the new tokens."""

    def __init__(self, ctx: list[int], qlen: list[int], bs: int, hq: int, hkv: int, dv: int = D,
                 seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        need = [-(-(c + q) // bs) for c, q in zip(ctx, qlen, strict=True)]
        num_blocks = sum(need) + 3
        ids = torch.randperm(num_blocks, generator=g).tolist()  # requests' blocks interleave
        self.blocks, at = [], 0
        for n in need:
            self.blocks.append(ids[at:at + n])
            at += n
        self.ctx, self.qlen, self.bs = ctx, qlen, bs
        self.common = build_attention_metadata(ctx, qlen, self.blocks, bs)
        self.k_cache = torch.full((num_blocks, bs, hkv, D), float("nan"))
        self.v_cache = torch.full((num_blocks, bs, hkv, dv), float("nan"))
        kf, vf = self.k_cache.view(-1, hkv, D), self.v_cache.view(-1, hkv, dv)
        for b, n in zip(self.blocks, (c + q for c, q in zip(ctx, qlen, strict=True)), strict=True):
            slots = [b[p // bs] * bs + p % bs for p in range(n)]
            kf[slots] = torch.randn(n, hkv, D, generator=g)
            vf[slots] = torch.randn(n, hkv, dv, generator=g)
        self.q = torch.randn(sum(qlen), hq, D, generator=g)


def check_equal(name: str, step: Step, metas: list[PagedAttentionMetadata], row_slices: list[slice]) -> int:
    """Every prefill query row of the batched path equals the per-request path; returns how many were compared."""
    backend = backend_for(name)
    compared = 0
    for meta, rows in zip(metas, row_slices, strict=True):
        q = step.q[rows]
        want = per_request_prefill(name, q, step.k_cache, step.v_cache, meta, 0.3)
        got = backend.attend(q, step.k_cache, step.v_cache, meta, 0.3) if meta.decode is None else None
        if got is None:  # decode rows too: attend the prefill groups only, through a metadata without decodes
            got = backend.attend(q, step.k_cache, step.v_cache, _without_decodes(meta), 0.3)
        assert torch.isfinite(got).all()
        for row, ref in want.items():
            torch.testing.assert_close(got[row], ref, rtol=1e-5, atol=1e-6)
        compared += len(want)
    return compared


def _without_decodes(meta: PagedAttentionMetadata) -> PagedAttentionMetadata:
    from dataclasses import replace

    return replace(meta, decode=None)


CASES = {
    "fresh prompts": ([0, 0, 0, 0], [7, 3, 12, 5]),
    "same-length prompts": ([0, 0, 0], [6, 6, 6]),  # the plain causal group
    "chunked with context": ([9, 0, 21, 4], [5, 8, 3, 11]),
    "decode + prefill": ([0, 8, 4, 2, 11, 17], [6, 1, 1, 3, 1, 9]),
    "long chunk + short prompts": ([300, 0, 0, 0, 0], [100, 2, 3, 2, 4]),  # two groups by the padding rule
}
GQA = [(4, 4), (4, 2), (8, 2), (8, 1)]


@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize("hq, hkv", GQA, ids=[f"{a}q{b}kv" for a, b in GQA])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", ["torch", "triton"])
def test_batched_prefill_equals_the_per_request_path(name: str, case: str, hq: int, hkv: int, bs: int) -> None:
    ctx, qlen = CASES[case]
    step = Step(ctx, qlen, bs, hq, hkv)
    meta = backend_for(name).build_metadata(step.common)
    num_prefills = sum(1 for q in qlen if q > 1)
    assert len(meta.prefills) == num_prefills
    assert sum(g.num_reqs for g in meta.prefill_groups) == num_prefills
    assert len(meta.prefill_groups) == (2 if case == "long chunk + short prompts" else 1)
    assert [g.causal for g in meta.prefill_groups] == [case == "same-length prompts"] * len(meta.prefill_groups)
    compared = check_equal(name, step, [meta], [slice(0, sum(qlen))])
    assert compared == sum(q for q in qlen if q > 1)


@pytest.mark.parametrize("case", ["same-length prompts", "chunked with context"])
def test_triton_prefill_sdpa_leaves_cudnn_out(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both SDPA forms (the causal group and the folded-bias group) run with cuDNN attention disabled and flash
    / memory-efficient / math allowed (``PREFILL_SDPA_ORDER``); equality with the per-request path is the test
    above."""
    import runner.attention.triton_backend as tb

    seen: list[tuple[bool, bool, bool, bool]] = []
    real = tb.F.scaled_dot_product_attention

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        b = torch.backends.cuda
        seen.append((b.cudnn_sdp_enabled(), b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(),
                     b.math_sdp_enabled()))
        return real(*args, **kwargs)

    ctx, qlen = CASES[case]
    step = Step(ctx, qlen, 4, 4, 2)
    backend = backend_for("triton")
    meta = backend.build_metadata(step.common)
    want = backend.attend(step.q, step.k_cache, step.v_cache, meta, 0.3)
    monkeypatch.setattr(tb.F, "scaled_dot_product_attention", recording)  # F is torch's module: patch, call, check
    got = backend.attend(step.q, step.k_cache, step.v_cache, meta, 0.3)
    monkeypatch.undo()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert seen and all(flags == (False, True, True, True) for flags in seen), seen
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after the call


def test_torch_backend_slices_a_large_group_and_gets_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scores beyond ``SCORE_BUDGET`` are computed a few requests at a time: the same results."""
    from runner.attention import torch_backend

    monkeypatch.setattr(torch_backend, "SCORE_BUDGET", 4 * 12 * 24 * 2)  # two requests of the group per slice
    step = Step([9, 0, 21, 4, 0], [5, 8, 3, 11, 12], 4, hq=4, hkv=2, seed=5)
    meta = TorchAttentionBackend().build_metadata(step.common)
    assert [(g.num_reqs, g.max_query_len, g.max_seq_len) for g in meta.prefill_groups] == [(5, 12, 24)]
    assert check_equal("torch", step, [meta], [slice(0, 39)]) == 39


@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize("name", ["torch", "triton"])
def test_mla_shape_one_key_head_and_a_narrower_value(name: str, bs: int) -> None:
    step = Step([5, 0, 13], [6, 9, 4], bs, hq=4, hkv=1, dv=6, seed=1)
    meta = backend_for(name).build_metadata(step.common)
    assert check_equal(name, step, [meta], [slice(0, 19)]) == 19


@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize("name", ["torch", "triton"])
def test_a_request_cut_across_two_ubatches(name: str, bs: int) -> None:
    """Ubatch 0 ends inside request 1 (its first 5 tokens), ubatch 1 holds its last 4 and request 2: the second
    part attends with the full seq_len, its first part's keys already in the cache."""
    ctx, qlen = [4, 2, 6], [5, 9, 7]
    step = Step(ctx, qlen, bs, hq=4, hkv=2, seed=2)
    slices = padded_ubatch_slices(qlen, sum(qlen), 2)
    assert [s.token_slice for s in slices] == [slice(0, 10), slice(10, 21)]
    metas = [backend_for(name).build_metadata(m) for m in split_attn_metadata(slices, step.common)]
    assert [[(p.token_stop - p.token_start, p.seq_len) for p in m.prefills] for m in metas] == \
        [[(5, 9), (5, 7)], [(4, 11), (7, 13)]]
    assert check_equal(name, step, metas, [s.token_slice for s in slices]) == 21


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_attend_with_decodes_fills_every_row(name: str) -> None:
    """A mixed step through ``attend`` as a layer calls it: decode rows from the decode path, prefill rows from
    the groups, none left at zero."""
    from test_attention_backends import paged_decode_standin

    step = Step([0, 8, 4, 2, 11], [6, 1, 1, 3, 1], 4, hq=4, hkv=2, seed=3)
    backend = TorchAttentionBackend() if name == "torch" else TritonAttentionBackend(decode_fn=paged_decode_standin)
    meta = backend.build_metadata(step.common)
    assert meta.decode is not None and meta.decode.token_index is not None
    out = backend.attend(step.q, step.k_cache, step.v_cache, meta, 0.3)
    want = per_request_prefill(name, step.q, step.k_cache, step.v_cache, meta, 0.3)
    assert sorted(want) == [0, 1, 2, 3, 4, 5, 8, 9, 10]
    for row, ref in want.items():
        torch.testing.assert_close(out[row], ref, rtol=1e-5, atol=1e-6)
    assert (out.abs().sum(dim=(1, 2)) > 0).all()


class OpCounter(TorchDispatchMode):
    """The aten ops that compute something (views, ``_unsafe_view`` included, launch nothing), by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket is not torch.ops.aten._unsafe_view:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_launches_do_not_grow_with_the_number_of_prefill_requests(name: str) -> None:
    """The same ops, as many times, for 2 and for 24 prompts (one group each), in a layer after the first (the
    key slots and the mask's bias are made once per step)."""
    counts = []
    for n in (2, 24):
        step = Step([3] * n, [5] * n, 4, hq=4, hkv=2, seed=4)
        backend = backend_for(name)
        meta = backend.build_metadata(step.common)
        assert len(meta.prefill_groups) == 1
        backend.attend(step.q, step.k_cache, step.v_cache, meta, 0.3)  # the first layer
        with OpCounter() as counter:
            backend.attend(step.q, step.k_cache, step.v_cache, meta, 0.3)
        counts.append(counter.ops)
    assert counts[0] == counts[1]
    assert sum(counts[0].values()) <= 16, counts[0]


# ---- the grouping rule ----------------------------------------------------------------------------------------
def joins(q: np.ndarray, s: np.ndarray, group: np.ndarray, i: int) -> bool:
    """Whether request ``i`` may join ``group`` (the module docstring's rule, restated)."""
    before = len(group) * int(q[group].max()) * int(s[group].max())
    both = np.append(group, i)
    after, real = len(both) * int(q[both].max()) * int(s[both].max()), int((q[both] * s[both]).sum())
    return after - before <= PAD_FACTOR * int(q[i] * s[i]) or after - real <= PAD_SLACK


@pytest.mark.parametrize("q, s, sizes", [
    ([16] * 32, [16] * 32, [32]),  # a batch of same-length prompts: one group
    ([512] + [16] * 31, [2048] + [16] * 31, [1, 31]),  # a long chunk is not padded to, nor pads, short prompts
    ([2 ** k for k in range(4, 12)], [2 ** k for k in range(4, 12)], [1, 1, 1, 2, 3]),  # spread over 2**7
    ([3, 7, 2, 9], [3, 20, 2, 9], [4]),  # small: padding is cheaper than a launch
    ([640, 600, 500, 200], [640, 600, 500, 200], [3, 1]),  # similar sizes together
])
def test_groups_cover_every_request_once_and_keep_the_padding_rule(q: list[int], s: list[int],
                                                                   sizes: list[int]) -> None:
    qa, sa = np.array(q, dtype=np.int64), np.array(s, dtype=np.int64)
    groups = group_prefills(qa, sa)
    assert [len(g) for g in groups] == sizes
    assert sorted(np.concatenate(groups).tolist()) == list(range(len(q)))
    for g in groups:  # each member joined by the rule; the group computes at most 2x its scores + the slack
        assert all(joins(qa, sa, g[:k], g[k]) for k in range(1, len(g)))
        padded, real = len(g) * int(qa[g].max()) * int(sa[g].max()), int((qa[g] * sa[g]).sum())
        assert padded <= PAD_FACTOR * real + PAD_SLACK
    for a, b in zip(groups, groups[1:], strict=False):  # a group is closed only when the next request may not join it
        assert not joins(qa, sa, a, b[0])
