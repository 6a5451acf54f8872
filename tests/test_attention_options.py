"""Per-layer attention options (``runner/attention/options.py``): a sliding window and attention sinks.

Checked three ways: the plain-torch reference against a dense fp64 computation written out here from the
definitions (window ``(p - W, p]``, a sink as one more softmax column with no value); every CPU backend
(torch, the Triton backend with its kernel under the interpreter and with the stand-in) against the reference
over the cases of ``test_attention_backends.py`` (decode, prefill, chunked, mixed, a request cut across two
ubatches, CUDA-graph decode rows), caches NaN wherever no request wrote; and the Triton decode kernel alone
over several splits, windows shorter and longer than a split, so both the window's first key and the sink's
single count (split 0 only) are exercised.
"""
from __future__ import annotations

import pytest
import torch

from runner.attention.graph import DecodeMetadataBuffers
from runner.attention.ops import mha_attention
from runner.attention.options import AttentionOptions
from runner.attention.torch_backend import TorchAttentionBackend
from runner.attention.triton_backend import TritonAttentionBackend
from runner.attention.triton_paged_decode import paged_decode_attention
from test_attention_backends import BS, CASES, CPU_BACKENDS, NUM_BLOCKS, Batch, check
from test_triton_paged_decode import BS as KERNEL_BS
from test_triton_paged_decode import make_case
from ubatch.slicing import padded_ubatch_slices, split_attn_metadata

HQ = 4
SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0])
OPTIONS = {
    "window": AttentionOptions(sliding_window=3),
    "sinks": AttentionOptions(sinks=SINKS),
    "both": AttentionOptions(sliding_window=4, sinks=SINKS),
}


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: list[int], opts: AttentionOptions) -> torch.Tensor:
    """``q [L, Hq, D]`` at positions ``qpos`` over one request's keys ``k/v [S, Hkv, D]`` (position = index),
    in fp64, straight from the definitions."""
    hkv = k.shape[1]
    rep = q.shape[1] // hkv
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    for i, p in enumerate(qpos):
        lo = 0 if opts.sliding_window is None else max(0, p - opts.sliding_window + 1)
        s = torch.einsum("hd,shd->hs", q[i].double(), k[lo:p + 1]) * 0.3
        if opts.sinks is not None:
            s = torch.cat((s, opts.sinks.double()[:, None]), dim=1)
        w = torch.softmax(s, dim=1)[:, : p + 1 - lo]
        out[i] = torch.einsum("hs,shd->hd", w, v[lo:p + 1])
    return out


def decode_standin(q, k_cache, v_cache, block_table, seq_lens, scale, *, out=None, sliding_window=None,
                   sinks=None):
    """The kernel's API (options included) row by row from :func:`dense` (a stand-in: it syncs)."""
    bs = k_cache.shape[1]
    res = q.new_zeros(q.shape[0], q.shape[1], v_cache.shape[-1])
    opts = AttentionOptions(sliding_window, sinks)
    for i, n in enumerate(seq_lens.tolist()):
        if n:
            pos = torch.arange(n)
            slots = block_table[i, pos // bs].long() * bs + pos % bs
            k, v = k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]
            res[i] = dense(q[i:i + 1] * (scale / 0.3), k, v, [n - 1], opts)[0].to(q.dtype)
    return res if out is None else out.copy_(res)


BACKENDS = {
    "torch": TorchAttentionBackend,
    "triton-standin": lambda: TritonAttentionBackend(decode_fn=decode_standin),
    "triton": TritonAttentionBackend,
}


class OptionsBatch(Batch):
    options: AttentionOptions

    def run(self, meta, rows: slice, cache: torch.Tensor) -> torch.Tensor:
        return mha_attention(self.q[rows], self.k[rows], self.v[rows], cache, meta, 0.3, options=self.options)


def make_batch(ctx: list[int], qlen: list[int], padded: int, options: str, seed: int = 0) -> OptionsBatch:
    batch = OptionsBatch(ctx, qlen, padded, mla=False, seed=seed)
    batch.options = OPTIONS[options]
    return batch


@pytest.mark.parametrize("options", list(OPTIONS))
def test_reference_equals_the_definition(options: str) -> None:
    ctx, qlen = [6, 0, 9], [3, 7, 1]
    batch = make_batch(ctx, qlen, sum(qlen), options)
    out = batch.reference()
    flat = batch.ref_cache.view(-1, 2, 2, 8)  # written by the reference run: context and this step's keys
    start = 0
    for blocks, c, n in zip(batch.blocks, ctx, qlen, strict=True):
        pos = torch.arange(c + n)
        kv = flat[torch.tensor(blocks)[pos // BS] * BS + pos % BS]
        want = dense(batch.q[start:start + n], kv[:, 0], kv[:, 1], list(range(c, c + n)), batch.options)
        torch.testing.assert_close(out[start:start + n].double(), want, rtol=1e-5, atol=1e-5)
        start += n
    plain = Batch(ctx, qlen, sum(qlen), mla=False).reference()
    assert not torch.allclose(out, plain, atol=1e-3)  # the options changed the result


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_backend_equals_reference(name: str, case: str, options: str) -> None:
    ctx, qlen, padded = CASES[case]
    batch = make_batch(ctx, qlen, padded, options)
    ref = batch.reference()
    meta = BACKENDS[name]().build_metadata(batch.common)
    check(batch, batch.run(meta, slice(0, padded), batch.cache), ref)


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_backend_over_ubatches_with_a_cut_request(name: str) -> None:
    ctx, qlen, padded = [4, 2, 5], [5, 4, 1], 12
    batch = make_batch(ctx, qlen, padded, "both", seed=1)
    ref = batch.reference()
    backend = BACKENDS[name]()
    slices = padded_ubatch_slices(qlen, padded, 2)
    metas = [backend.build_metadata(m) for m in split_attn_metadata(slices, batch.common)]
    check(batch, torch.cat([batch.run(m, s.token_slice, batch.cache) for m, s in zip(metas, slices, strict=True)]), ref)


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_graph_decode_rows(name: str) -> None:
    ctx, padded = [5, 9, 3], 4
    batch = make_batch(ctx, [1] * len(ctx), padded, "both", seed=2)
    ref = batch.reference()
    buffers = DecodeMetadataBuffers(8, 5, BS, null_block=NUM_BLOCKS, device="cpu", backend=BACKENDS[name]())
    buffers.fill(batch.common, padded)
    out = torch.cat([batch.run(m, slice(2 * i, 2 * i + 2), batch.cache)
                     for i, m in enumerate(buffers.views(padded, (2, 2)))])
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:3], ref[:3], rtol=2e-5, atol=2e-5)


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="sliding_window must be a positive int or None, got 0"):
        AttentionOptions(sliding_window=0)
    batch = make_batch([3], [1], 1, "sinks")
    batch.options = AttentionOptions(sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="3 attention sinks for 4 query heads"):
        batch.reference()


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("window", [None, 5, 13, 40])
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_decode_kernel_window_and_sinks(window: int | None, splits: int) -> None:
    """Requests of 0 to 37 keys, GQA 4:2, fp32; windows below, inside and above a split's length."""
    case = make_case([37, 9, 0, 22], HQ, 2, 16, 16, layout="mha")
    out = paged_decode_attention(*case.args(), num_splits=splits, sliding_window=window, sinks=SINKS)
    for r, n in enumerate(case.seq_lens.tolist()):
        if n == 0:
            assert (out[r] == 0).all()
            continue
        pos = torch.arange(n)
        blocks, slots = case.block_table[r, pos // KERNEL_BS].long(), pos % KERNEL_BS
        opts = AttentionOptions(sliding_window=window, sinks=SINKS)
        want = dense(case.q[r:r + 1] * (case.scale / 0.3), case.k_cache[blocks, slots], case.v_cache[blocks, slots],
                     [n - 1], opts)
        torch.testing.assert_close(out[r:r + 1].double(), want, rtol=1e-5, atol=1e-5)
