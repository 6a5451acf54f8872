"""The KV caches are allocated without zero-filling, so no attention path may read a slot it did not write.

Each case fills the cache with NaN except the slots the requests' context occupies, and compares with the
same computation over a clean cache: any read of an unwritten slot that reaches the output shows up as NaN.
The batched decode path is the one at risk (it gathers up to the longest request of the batch), and the
CUDA-graph decode attention (it gathers every key position of a request's blocks). These cases run the
reference and the graph path of the default (torch) backend; ``test_attention_backends.py`` runs every
backend, eager and graph, over NaN-filled caches.
"""
from __future__ import annotations

import torch

import runner.attention as eager_attention
from runner.attention import graph as ga
from runner.attention.kv_cache import build_attention_metadata

BS, NUM_BLOCKS = 4, 40


def _case(kv_shape: tuple[int, ...], ctx: list[int], padded: int, seed: int = 0):
    """A clean cache, the same cache with NaN in every slot no request has written, and the metadata."""
    g = torch.Generator().manual_seed(seed)
    clean = torch.randn((NUM_BLOCKS + 1, BS, *kv_shape), generator=g)
    blocks = [list(range(i * 6, i * 6 + 6)) for i in range(len(ctx))]
    meta = build_attention_metadata(ctx, [1] * len(ctx), blocks, BS, num_padded_tokens=padded)
    written = torch.zeros(NUM_BLOCKS + 1, BS, dtype=torch.bool)
    for b, n in zip(blocks, [c + 1 for c in ctx], strict=True):  # context plus this step's token
        for pos in range(n):
            written[b[pos // BS], pos % BS] = True
    written[NUM_BLOCKS, 0] = True  # the null block's first slot: what padded graph rows write and read
    dirty = clean.clone()
    dirty[~written] = float("nan")
    return clean, dirty, meta


def test_batched_eager_decode_reads_only_written_slots() -> None:
    clean, dirty, meta = _case((2, 2, 8), ctx=[3, 17, 9, 1, 12], padded=5)  # lengths differ a lot
    q = torch.randn(5, 4, 8, generator=torch.Generator().manual_seed(1))
    ref = eager_attention.paged_attention(q, clean, meta, 0.3)
    out = eager_attention.paged_attention(q, dirty, meta, 0.3)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_graph_decode_reads_only_written_slots() -> None:
    clean, dirty, meta = _case((2, 2, 8), ctx=[3, 17, 9], padded=6)
    buffers = ga.DecodeMetadataBuffers(16, 8, BS, null_block=NUM_BLOCKS, device="cpu")
    buffers.fill(meta, 6)
    q = torch.randn(6, 4, 8, generator=torch.Generator().manual_seed(2))
    ref = ga.graph_paged_attention(q, clean, buffers.views(6)[0], 0.3)
    out = ga.graph_paged_attention(q, dirty, buffers.views(6)[0], 0.3)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_graph_mla_decode_reads_only_written_slots() -> None:
    lat, rope, heads, dn, dv = 16, 4, 2, 8, 8
    clean, dirty, meta = _case((lat + rope,), ctx=[5, 14], padded=4)
    buffers = ga.DecodeMetadataBuffers(16, 8, BS, null_block=NUM_BLOCKS, device="cpu")
    buffers.fill(meta, 4)
    g = torch.Generator().manual_seed(3)
    q_nope, q_rope = torch.randn(4, heads, dn, generator=g), torch.randn(4, heads, rope, generator=g)
    w_uk, w_uv = torch.randn(heads, dn, lat, generator=g), torch.randn(heads, dv, lat, generator=g)
    ref = ga.graph_paged_mla_attention(q_nope, q_rope, clean, buffers.views(4)[0], 0.2, w_uk, w_uv)
    out = ga.graph_paged_mla_attention(q_nope, q_rope, dirty, buffers.views(4)[0], 0.2, w_uk, w_uv)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)

