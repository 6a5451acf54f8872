"""Paged attention vs a dense causal reference; block-table helpers."""
from __future__ import annotations

import random

import pytest
import torch

from reference_metadata import compute_slot_mapping, make_block_table
from runner.attention import paged_attention, paged_mla_attention, write_kv
from runner.attention.kv_cache import KVCacheSpec, allocate_kv_caches, build_attention_metadata

BLOCK = 4


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q [Lq, Hq, D] at positions qpos; k/v [S, Hkv, D] at positions 0..S-1; GQA by repeat_interleave."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > qpos[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


class PagedSeqs:
    """Requests with full random K/V sequences, shuffled block ids and a step runner."""

    def __init__(self, lens: list[int], hq: int, hkv: int, d: int, num_blocks: int = 64, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.k = [torch.randn(n, hkv, d, generator=g) for n in lens]
        self.v = [torch.randn(n, hkv, d, generator=g) for n in lens]
        self.q = [torch.randn(n, hq, d, generator=g) for n in lens]
        ids = list(range(num_blocks))
        random.Random(seed).shuffle(ids)
        self.blocks = []
        for n in lens:
            nb = -(-n // BLOCK)
            self.blocks.append(ids[:nb])
            ids = ids[nb:]
        self.cache = allocate_kv_caches([KVCacheSpec.mha(hkv, d)], num_blocks, BLOCK, torch.float32)[0]
        self.scale = d ** -0.5

    def step(self, reqs: list[int], ctx: list[int], qlen: list[int], pad: int = 0) -> list[torch.Tensor]:
        """Write this step's KV, attend, return per-request outputs (and check padding rows are zero)."""
        meta = build_attention_metadata(ctx, qlen, [self.blocks[r] for r in reqs], BLOCK,
                                        num_padded_tokens=sum(qlen) + pad)
        sl = [slice(c, c + n) for c, n in zip(ctx, qlen, strict=True)]
        parts = list(zip(reqs, sl, strict=True))
        q = torch.cat([self.q[r][s] for r, s in parts] + [torch.zeros(pad, *self.q[0].shape[1:])])
        k = torch.cat([self.k[r][s] for r, s in parts] + [torch.full((pad, *self.k[0].shape[1:]), 9.0)])
        v = torch.cat([self.v[r][s] for r, s in parts] + [torch.full((pad, *self.v[0].shape[1:]), 9.0)])
        write_kv(self.cache, meta.slot_mapping, k, v)
        out = paged_attention(q, self.cache, meta, self.scale)
        if pad:
            assert torch.all(out[sum(qlen):] == 0)
        return list(out[: sum(qlen)].split(qlen))

    def reference(self, r: int, start: int, stop: int) -> torch.Tensor:
        return dense_reference(self.q[r][start:stop], self.k[r][:stop], self.v[r][:stop],
                               torch.arange(start, stop), self.scale)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
def test_mixed_prefill_decode_chunked(hq: int, hkv: int) -> None:
    lens = [7, 13, 11, 4, 9]
    s = PagedSeqs(lens, hq, hkv, 8)
    # Step 1 fills the context of requests 1..4 (prefill, chunk of 3 for request 2).
    s.step([1, 2, 3, 4], [0, 0, 0, 0], [12, 3, 3, 8])
    # Step 2 mixes: 0 full prefill, 1 decode, 2 chunked continuation, 3 and 4 decodes, plus padding.
    outs = s.step([0, 1, 2, 3, 4], [0, 12, 3, 3, 8], [7, 1, 8, 1, 1], pad=3)
    for r, (c, n), out in zip([0, 1, 2, 3, 4], [(0, 7), (12, 1), (3, 8), (3, 1), (8, 1)], outs, strict=True):
        torch.testing.assert_close(out, s.reference(r, c, c + n), atol=2e-5, rtol=1e-5)


def test_request_split_across_two_microbatches() -> None:
    """The DBO straddle: part 1 keeps seq_len = first chunk, part 2 the full length and reads part 1's KV."""
    s = PagedSeqs([10, 6, 5], 4, 2, 8)
    out_a = s.step([1, 0], [0, 0], [6, 6])          # ubatch 0: request 1 whole, request 0 tokens [0, 6)
    out_b = s.step([0, 2], [6, 0], [4, 5])          # ubatch 1: request 0 tokens [6, 10), request 2 whole
    torch.testing.assert_close(torch.cat([out_a[1], out_b[0]]), s.reference(0, 0, 10), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out_a[0], s.reference(1, 0, 6), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out_b[1], s.reference(2, 0, 5), atol=2e-5, rtol=1e-5)


def test_positions_default_to_seq_len_minus_query() -> None:
    s = PagedSeqs([9, 5], 2, 2, 4)
    s.step([0, 1], [0, 0], [6, 5])
    meta = build_attention_metadata([6, 4], [3, 1], [s.blocks[0], s.blocks[1]], BLOCK)
    q = torch.cat([s.q[0][6:9], s.q[1][4:5]])
    write_kv(s.cache, meta.slot_mapping, torch.cat([s.k[0][6:9], s.k[1][4:5]]), torch.cat([s.v[0][6:9], s.v[1][4:5]]))
    with_pos = paged_attention(q, s.cache, meta, s.scale)
    meta.positions = None
    torch.testing.assert_close(paged_attention(q, s.cache, meta, s.scale), with_pos)
    torch.testing.assert_close(with_pos[:3], s.reference(0, 6, 9), atol=2e-5, rtol=1e-5)


def test_mla_absorbed_matches_expanded_attention() -> None:
    """Absorbed latent attention == HF's expand-with-kv_b_proj-then-attend, on a mixed batch."""
    g = torch.Generator().manual_seed(1)
    h, dn, dr, dv, lat = 3, 8, 4, 6, 10
    lens, ctx = [9, 6, 12], [0, 5, 11]
    w_kv_b = torch.randn(h * (dn + dv), lat, generator=g) / lat ** 0.5
    latent = [torch.randn(n, lat, generator=g) for n in lens]
    k_rope = [torch.randn(n, dr, generator=g) for n in lens]
    q_nope = [torch.randn(n, h, dn, generator=g) for n in lens]
    q_rope = [torch.randn(n, h, dr, generator=g) for n in lens]
    blocks = [[5, 2, 7], [0, 3], [1, 4, 6, 8]]
    cache = allocate_kv_caches([KVCacheSpec.mla(lat, dr)], 9, BLOCK, torch.float32)[0]
    pre = build_attention_metadata([0, 0, 0], ctx, blocks, BLOCK)

    def entries(sl: list[slice]) -> torch.Tensor:
        return torch.cat([torch.cat((latent[i][s], k_rope[i][s]), -1) for i, s in enumerate(sl)])

    write_kv(cache, pre.slot_mapping, entries([slice(0, c) for c in ctx]))
    meta = build_attention_metadata(ctx, [n - c for n, c in zip(lens, ctx, strict=True)], blocks, BLOCK)
    sl = [slice(c, n) for c, n in zip(ctx, lens, strict=True)]
    write_kv(cache, meta.slot_mapping, entries(sl))
    w = w_kv_b.view(h, dn + dv, lat)
    scale = (dn + dr) ** -0.5
    out = paged_mla_attention(torch.cat([q_nope[i][s] for i, s in enumerate(sl)]),
                              torch.cat([q_rope[i][s] for i, s in enumerate(sl)]), cache, meta, scale,
                              w[:, :dn], w[:, dn:])
    refs = []
    for i, s in enumerate(sl):
        kv = (latent[i] @ w_kv_b.T).view(lens[i], h, dn + dv)
        k = torch.cat((kv[..., :dn], k_rope[i][:, None, :].expand(-1, h, -1)), -1)
        q = torch.cat((q_nope[i][s], q_rope[i][s]), -1)
        refs.append(dense_reference(q, k, kv[..., dn:], torch.arange(s.start, s.stop), scale))
    torch.testing.assert_close(out, torch.cat(refs), atol=3e-5, rtol=1e-5)


def test_block_table_and_slot_mapping() -> None:
    table = make_block_table([[3, 1], [7], []], max_blocks=3)
    assert table.dtype == torch.int32 and table.tolist() == [[3, 1, 0], [7, 0, 0], [0, 0, 0]]
    qsl = torch.tensor([0, 3, 5, 5], dtype=torch.int32)
    pos = torch.tensor([2, 3, 4, 0, 1, 0], dtype=torch.int64)  # last token is padding
    slots = compute_slot_mapping(table, qsl, pos, BLOCK)
    assert slots.tolist() == [14, 15, 4, 28, 29, -1]
    with pytest.raises(ValueError, match="needs 2 blocks"):
        build_attention_metadata([3], [2], [[0]], BLOCK)
