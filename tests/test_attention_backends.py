"""Every attention backend that runs on CPU equals the plain-torch reference (``runner/attention/reference.py``).

Cases: decode, prefill, chunked prefill, mixed batches whose decode requests are not the first ones, padding
rows, and a request cut across the two ubatches (its second part reads the first part's KV from the cache),
for MHA, GQA and absorbed MLA, eager metadata and CUDA-graph decode metadata. The backend runs over a cache
whose every slot no request wrote holds NaN (the caches are not zero-filled); the reference over the same
values with random numbers there, so a read of an unwritten slot shows up as NaN or as a mismatch.

The Triton backend runs its real kernel under the Triton interpreter (tiny shapes) and also with a
plain-torch stand-in of the kernel's API (``paged_decode_standin``), which checks the plumbing around the
kernel (row selection, ``out=``, graph rows) without the interpreter's cost.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from runner.attention import reference
from runner.attention.backend import AttentionBackend
from runner.attention.graph import DecodeMetadataBuffers
from runner.attention.kv_cache import build_attention_metadata
from runner.attention.ops import mha_attention, mla_attention
from runner.attention.torch_backend import TorchAttentionBackend
from runner.attention.triton_backend import TritonAttentionBackend
from ubatch.slicing import padded_ubatch_slices, split_attn_metadata

BS, NUM_BLOCKS = 4, 48
LAT, ROPE, DN, DV = 12, 4, 8, 6  # MLA dims: latent, rope, q_nope head dim, value head dim


def paged_decode_standin(q, k_cache, v_cache, block_table, seq_lens, scale, *, out=None):
    """The kernel's API in plain torch, row by row over host-read lengths (a test stand-in: it syncs)."""
    r, hq, _ = q.shape
    hkv, bs = k_cache.shape[2], k_cache.shape[1]
    res = q.new_zeros(r, hq, v_cache.shape[-1])
    for i in range(r):
        n = int(seq_lens[i])
        if n == 0:
            continue
        pos = torch.arange(n)
        slots = block_table[i, pos // bs].long() * bs + pos % bs
        k, v = k_cache.flatten(0, 1)[slots].float(), v_cache.flatten(0, 1)[slots].float()
        qi = q[i].float().view(hkv, hq // hkv, -1)
        p = torch.softmax(torch.einsum("hgd,shd->hgs", qi, k) * scale, dim=-1)
        res[i] = torch.einsum("hgs,shd->hgd", p, v).reshape(hq, -1).to(q.dtype)
    if out is None:
        return res
    return out.copy_(res)


BACKENDS = {
    "torch": TorchAttentionBackend,
    "triton-standin": lambda: TritonAttentionBackend(decode_fn=paged_decode_standin),
    "triton": TritonAttentionBackend,
}
CPU_BACKENDS = [pytest.param("torch"), pytest.param("triton-standin"),
                pytest.param("triton", marks=pytest.mark.triton_interpreter)]


@dataclass
class Batch:
    """One step: requests with ``ctx`` tokens cached and ``qlen`` new ones, padded to ``padded`` rows."""

    ctx: list[int]
    qlen: list[int]
    padded: int
    mla: bool
    seed: int = 0

    def __post_init__(self) -> None:
        g = torch.Generator().manual_seed(self.seed)
        per = 4  # blocks per request, in a shuffled order so requests' blocks interleave
        ids = torch.randperm(NUM_BLOCKS, generator=g).tolist()
        self.blocks = [ids[i * per:(i + 1) * per] for i in range(len(self.ctx))]
        self.common = build_attention_metadata(self.ctx, self.qlen, self.blocks, BS, num_padded_tokens=self.padded)
        shape = (LAT + ROPE,) if self.mla else (2, 2, 8)
        self.ref_cache = torch.randn(NUM_BLOCKS + 1, BS, *shape, generator=g)
        self.cache = torch.full_like(self.ref_cache, float("nan"))
        flat_ref, flat = self.ref_cache.view(-1, *shape), self.cache.view(-1, *shape)
        for b, c in zip(self.blocks, self.ctx, strict=True):  # the context the earlier steps wrote
            for pos in range(c):
                slot = b[pos // BS] * BS + pos % BS
                flat[slot] = flat_ref[slot]
        t = self.padded
        if self.mla:
            self.q_nope, self.q_rope = torch.randn(t, 4, DN, generator=g), torch.randn(t, 4, ROPE, generator=g)
            self.entry = torch.randn(t, LAT + ROPE, generator=g)
            self.w_uk, self.w_uv = torch.randn(4, DN, LAT, generator=g), torch.randn(4, DV, LAT, generator=g)
        else:
            self.q = torch.randn(t, 4, 8, generator=g)
            self.k, self.v = torch.randn(t, 2, 8, generator=g), torch.randn(t, 2, 8, generator=g)

    @property
    def num_real(self) -> int:
        return sum(self.qlen)

    def run(self, meta, rows: slice, cache: torch.Tensor) -> torch.Tensor:
        if self.mla:
            return mla_attention(self.q_nope[rows], self.q_rope[rows], self.entry[rows], cache, meta, 0.3,
                                 self.w_uk, self.w_uv)
        return mha_attention(self.q[rows], self.k[rows], self.v[rows], cache, meta, 0.3)

    def reference(self) -> torch.Tensor:
        return self.run(self.common, slice(0, self.padded), self.ref_cache)


def check(batch: Batch, out: torch.Tensor, ref: torch.Tensor, tol: float = 2e-5) -> None:
    n = batch.num_real
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:n], ref[:n], rtol=tol, atol=tol)
    assert (out[n:] == 0).all()  # padding rows: zeros
    written = ~torch.isnan(batch.cache)
    torch.testing.assert_close(batch.cache[written], batch.ref_cache[written], rtol=0, atol=0)


CASES = {
    "decode": ([5, 9, 3, 12], [1, 1, 1, 1], 6),
    "prefill": ([0, 0], [7, 5], 12),
    "chunked": ([6, 3], [5, 4], 9),
    "mixed": ([0, 8, 4, 2, 11], [6, 1, 1, 3, 1], 13),  # decode requests are not the first ones
}


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_backend_equals_reference(name: str, case: str, mla: bool) -> None:
    ctx, qlen, padded = CASES[case]
    batch = Batch(ctx, qlen, padded, mla)
    ref = batch.reference()
    backend = BACKENDS[name]()
    meta = backend.build_metadata(batch.common)
    if case == "decode":
        assert meta.decode is not None and meta.decode.token_index is None and not meta.prefills
    if case == "mixed":
        assert meta.decode is not None and meta.decode.token_index is not None and len(meta.prefills) == 2
    check(batch, batch.run(meta, slice(0, padded), batch.cache), ref)


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_backend_over_ubatches_with_a_cut_request(name: str, mla: bool) -> None:
    """Ubatch 0 ends inside request 1; ubatch 1 holds its tail (reading ubatch 0's KV) and padding."""
    ctx, qlen, padded = [4, 2, 5], [5, 4, 1], 12  # cut at 6: request 1's tokens 5..8 are split 1 + 3
    batch = Batch(ctx, qlen, padded, mla, seed=1)
    ref = batch.reference()
    backend = BACKENDS[name]()
    slices = padded_ubatch_slices(qlen, padded, 2)
    assert [s.token_slice for s in slices] == [slice(0, 6), slice(6, 12)]
    assert slices[0].request_slice.stop - 1 == slices[1].request_slice.start == 1  # request 1 is in both
    metas = [backend.build_metadata(m) for m in split_attn_metadata(slices, batch.common)]
    assert metas[0].decode is not None and metas[0].decode.token_index is not None  # the cut part: 1 token
    outs = [batch.run(m, s.token_slice, batch.cache) for m, s in zip(metas, slices, strict=True)]
    check(batch, torch.cat(outs), ref)


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_graph_decode_equals_reference_with_padding_in_the_null_block(name: str, mla: bool) -> None:
    ctx, padded = [5, 9, 3], 4
    batch = Batch(ctx, [1] * len(ctx), padded, mla, seed=2)
    ref = batch.reference()
    backend: AttentionBackend = BACKENDS[name]()
    buffers = DecodeMetadataBuffers(8, 5, BS, null_block=NUM_BLOCKS, device="cpu", backend=backend)
    buffers.fill(batch.common, padded)
    views = buffers.views(padded, (2, 2))
    outs = [batch.run(m, slice(2 * i, 2 * i + 2), batch.cache) for i, m in enumerate(views)]
    out = torch.cat(outs)
    n = len(ctx)
    assert torch.isfinite(out).all()  # the padding row read the null block its own token wrote
    torch.testing.assert_close(out[:n], ref[:n], rtol=2e-5, atol=2e-5)


def test_reference_for_the_graph_path_is_the_same_op() -> None:
    """The graph entry points keep their signatures (tests call them) and route by backend."""
    from runner.attention import graph as ga

    batch = Batch([5, 9], [1, 1], 2, mla=False, seed=3)
    buffers = ga.DecodeMetadataBuffers(4, 5, BS, null_block=NUM_BLOCKS, device="cpu",
                                       backend=TritonAttentionBackend(decode_fn=paged_decode_standin))
    buffers.fill(batch.common, 2)
    ref = batch.reference()
    ga.graph_write_kv(batch.cache, buffers.slot_mapping[:2], batch.k[:2], batch.v[:2])
    out = ga.graph_paged_attention(batch.q[:2], batch.cache, buffers.views(2)[0], 0.3)
    torch.testing.assert_close(out, ref[:2], rtol=2e-5, atol=2e-5)


def test_metadata_of_an_unknown_type_is_refused() -> None:
    batch = Batch([3], [1], 1, mla=False)
    with pytest.raises(TypeError, match="attention metadata of type dict"):
        mha_attention(batch.q, batch.k, batch.v, batch.cache, {}, 0.3)


def test_query_rows_must_match_the_metadata() -> None:
    batch = Batch([3, 4], [1, 1], 2, mla=False)
    meta = TorchAttentionBackend().build_metadata(batch.common)
    with pytest.raises(ValueError, match="3 query rows for metadata of 2 tokens"):
        k_cache, v_cache = batch.cache.unbind(2)
        TorchAttentionBackend().attend(torch.zeros(3, 4, 8), k_cache, v_cache, meta, 0.3)


def test_reference_module_is_still_importable_from_the_package() -> None:
    import runner.attention as attention

    assert attention.paged_attention is reference.paged_attention and attention.write_kv is reference.write_kv


@pytest.mark.triton_interpreter
def test_bench_support_runs_every_decode_backend_alike() -> None:
    """What benchmarks/bench_gpu.py times (``benchmarks/decode_backends.py``): the same decode through each
    backend, equal results."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "decode_backends.py"
    spec = importlib.util.spec_from_file_location("decode_backends", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    decode_attention_backends = module.decode_attention_backends

    g = torch.Generator().manual_seed(4)
    cache = torch.randn(12, BS, 2, 2, 8, generator=g)
    table = torch.randperm(12, generator=g).to(torch.int32).view(3, 4)
    seq_lens = torch.tensor([5, 16, 1], dtype=torch.int32)
    q = torch.randn(3, 4, 8, generator=g)
    runs = decode_attention_backends(q, cache, table, seq_lens, 0.3)
    assert set(runs) == {"torch", "torch (graph shapes)", "triton"}
    outs = {name: run() for name, run in runs.items()}
    for name, out in outs.items():
        torch.testing.assert_close(out, outs["torch"], rtol=2e-5, atol=2e-5, msg=name)


# ---- the engine's choice: --attention-backend ------------------------------------------------------------
def test_config_and_resolution_of_the_attention_backend() -> None:
    from runner.attention import resolve_attention_backend
    from runner.config import ConfigError, RunnerConfig, make_config
    from runner.entrypoints.cli import build_parser

    assert RunnerConfig().attention_backend == "auto"
    with pytest.raises(ConfigError, match="attention_backend must be one of auto, torch, triton; got 'flash'"):
        RunnerConfig(attention_backend="flash")
    assert make_config(attention_backend="triton").attention_backend == "triton"  # what LLM(...) calls
    args = build_parser().parse_args(["generate", "--attention-backend", "torch"])
    assert args.attention_backend == "torch"
    assert resolve_attention_backend("auto", "cuda") == "triton" and resolve_attention_backend("auto", "cpu") == "torch"
    assert resolve_attention_backend("torch", "cuda") == "torch"
    with pytest.raises(ValueError, match="unknown attention backend 'sdpa'"):
        resolve_attention_backend("sdpa", "cpu")


@pytest.mark.triton_interpreter
def test_engine_tokens_equal_with_torch_and_triton_attention() -> None:
    """The whole engine (prefill, chunked prefill, decode, DBO with a cut request) under each backend, greedy.
    On CPU tensors (the interpreter's mode) also on a GPU machine, where the engine would otherwise pick CUDA."""
    from runner.entrypoints.llm import LLM
    from runner.sampling_params import SamplingParams

    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate([9, 3, 6])]
    tokens = {}
    for name in ("torch", "triton"):
        llm = LLM(model="tiny-qwen3-moe", attention_backend=name, enable_dbo=True, dbo_decode_token_threshold=2,
                  dbo_prefill_token_threshold=4, dbo_cost_model="off", max_num_batched_tokens=8, max_num_seqs=3,
                  block_size=4, max_model_len=32, experts_backend="grouped_mm", device="cpu")
        try:
            assert llm.model_runner.attention_backend.name == name
            greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            outs = llm.generate(prompts, greedy, use_tqdm=False)
            tokens[name] = [o.outputs[0].token_ids for o in outs]
            assert llm.last_stats is not None and llm.last_stats.num_ubatched_steps > 0
        finally:
            llm.close()
    assert tokens["torch"] == tokens["triton"] and all(len(t) == 4 for t in tokens["torch"])
