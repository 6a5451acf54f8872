"""The ``grouped_mm`` experts (``torch._grouped_mm``) against the torch reference, and ``--experts-backend auto``.

``torch._grouped_mm`` runs on CPU in the torch this project tests with, so every equality here runs on CPU;
the CUDA rules (fused kernel only on 9.x/10.x, bf16-only) are exercised by faking the device capability,
and the one thing only a GPU can show -- capture into a CUDA graph with no host sync -- is a ``cuda`` test.
Every equality also asserts that the grouped GEMM really ran (calls counted through a wrapper that follows
``torch._grouped_mm``'s signature), so a backend that silently fell back elsewhere would fail.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from cudagraph.dispatch import capture_blocker
from moe_harness import StackWeights, run_ep
from runner.config import RunnerConfig, experts_backends
from test_moe_ep import YIELDS_PER_LAYER, check, rank_inputs
from ubatch.log_once import forget_logged
from ubatch.modular_moe.config import MoEParallelConfig
from ubatch.modular_moe.experts import EXPERTS_CHOICES, grouped_mm_experts, make_experts, resolve_experts_backend
from ubatch.modular_moe.experts.grouped_mm_experts import GroupedMMExperts, gemm_dtype_for
from ubatch.modular_moe.experts.torch_experts import TorchExperts
from ubatch.modular_moe.layer import FusedMoE
from ubatch.modular_moe.types import ExpertMLPExtras, ExpertTokens

T, H, I, E, K = 24, 32, 64, 6, 3  # noqa: E741  (I: the experts' intermediate size, the kernels' notation)
CAPACITY = 10
# (rtol, atol) against the fp32-intermediate torch reference. fp32: summation order only. bf16/fp16: the
# grouped GEMM rounds its gate/up output to the input dtype before SiLU (the reference keeps it in fp32), so
# two roundings instead of one: 4 ulp of the output's dtype, relative, plus a small absolute floor.
TOLERANCES = {
    torch.float32: (1e-5, 1e-6),
    torch.float16: (4 * 2.0**-10, 1e-3),
    torch.bfloat16: (4 * 2.0**-7, 1e-2),
}
DTYPES = list(TOLERANCES)


@pytest.fixture
def gemm_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter]:
    """Counts ``torch._grouped_mm`` calls by form ("2d" with offs, "3d" batched); thread-safe (ranks are threads)."""
    real = torch._grouped_mm
    calls: Counter = Counter()
    lock = threading.Lock()

    def counting(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None, **kw: Any) -> torch.Tensor:
        with lock:
            calls["2d" if a.dim() == 2 else "3d"] += 1
        return real(a, b, offs=offs, **kw)

    monkeypatch.setattr(torch, "_grouped_mm", counting)
    yield calls


def _weights(dtype: torch.dtype, seed: int = 0, experts: int = E) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(experts, H, I, generator=g) / I**0.5
    return w13.to(dtype), w2.to(dtype)


def _ragged_ids(g: torch.Generator) -> torch.Tensor:
    """Ragged loads: expert 0 gets most routes, expert 4 none at all, expert 5 one; -1 routes scattered, one
    row entirely non-local. Ids are int32, as DeepEP and the bench hand them over."""
    ids = torch.stack([torch.randperm(4, generator=g)[:K] for _ in range(T)])
    ids[ids == 3] = 0  # skew towards expert 0 (a duplicate id in a row is a legal double route)
    ids[2, 0], ids[7, 2], ids[11, 1] = -1, -1, -1
    ids[9] = -1
    ids[13, 1] = 5
    return ids.to(torch.int32)


def _contiguous(dtype: torch.dtype, seed: int = 1) -> ExpertTokens:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    return ExpertTokens("contiguous", hidden, topk_ids=_ragged_ids(g), topk_weights=torch.rand(T, K, generator=g))


def _masked(dtype: torch.dtype, seed: int = 2) -> ExpertTokens:
    """Padding slots hold NaN, as a never-zeroed receive buffer may."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(E, CAPACITY, H, generator=g).to(dtype)
    counts = torch.tensor([4, 0, CAPACITY, 1, 7, 0], dtype=torch.int32)
    for e, n in enumerate(counts.tolist()):
        hidden[e, n:] = float("nan")
    return ExpertTokens("masked", hidden, expert_num_tokens=counts)


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    rtol, atol = TOLERANCES[dtype]
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)


# ------------------------------------------------------------------------------------ equality with torch


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_contiguous_equals_torch(dtype: torch.dtype, gemm_calls: Counter) -> None:
    w13, w2 = _weights(dtype)
    tokens = _contiguous(dtype)
    out = make_experts("grouped_mm").apply(tokens, w13, w2)
    _close(out, TorchExperts().apply(tokens, w13, w2), dtype)
    assert torch.equal(out[9], torch.zeros(H, dtype=dtype))  # no local expert: exactly nothing
    assert gemm_calls == {"2d": 2}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_masked_equals_torch_and_padding_is_exact_zeros(dtype: torch.dtype, gemm_calls: Counter) -> None:
    w13, w2 = _weights(dtype)
    tokens = _masked(dtype)
    out = make_experts("grouped_mm").apply(tokens, w13, w2)
    _close(out, TorchExperts().apply(tokens, w13, w2), dtype)
    assert not out.isnan().any() and tokens.expert_num_tokens is not None
    for e, n in enumerate(tokens.expert_num_tokens.tolist()):
        assert torch.equal(out[e, n:], torch.zeros(CAPACITY - n, H, dtype=dtype)), f"expert {e} padding"
    assert gemm_calls == {"3d": 2}


def test_rows_past_the_last_offset_contribute_nothing_even_as_nan(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_grouped_mm`` leaves output rows past ``offs[-1]`` undefined: a stand-in with its signature fills them
    with NaN, and the -1 routes must still add exactly nothing."""
    real = torch._grouped_mm
    poisoned: list[int] = []

    def nan_tail(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None, **kw: Any) -> torch.Tensor:
        out = real(a, b, offs=offs, **kw)
        assert offs is not None and offs.dtype == torch.int32
        end = int(offs[-1])
        out[end:] = float("nan")
        poisoned.append(out.shape[0] - end)
        return out

    monkeypatch.setattr(torch, "_grouped_mm", nan_tail)
    w13, w2 = _weights(torch.float32)
    tokens = _contiguous(torch.float32)
    out = GroupedMMExperts().apply(tokens, w13, w2)
    assert tokens.topk_ids is not None
    num_remote = int((tokens.topk_ids < 0).sum())
    assert poisoned == [num_remote, num_remote] and num_remote == 3 + K  # the NaN rows really existed
    _close(out, TorchExperts().apply(tokens, w13, w2), torch.float32)
    assert torch.equal(out[9], torch.zeros(H))


def test_all_remote_and_empty_inputs_give_zeros() -> None:
    w13, w2 = _weights(torch.float32)
    experts = GroupedMMExperts()
    remote = ExpertTokens("contiguous", torch.randn(3, H), topk_ids=torch.full((3, K), -1),
                          topk_weights=torch.ones(3, K))
    assert torch.equal(experts.apply(remote, w13, w2), torch.zeros(3, H))
    empty = ExpertTokens("contiguous", torch.empty(0, H), topk_ids=torch.empty(0, K, dtype=torch.int64),
                         topk_weights=torch.empty(0, K))
    assert experts.apply(empty, w13, w2).shape == (0, H)
    nothing = ExpertTokens("masked", torch.full((E, 4, H), float("nan")),
                           expert_num_tokens=torch.zeros(E, dtype=torch.int32))
    assert torch.equal(experts.apply(nothing, w13, w2), torch.zeros(E, 4, H))


def test_misaligned_views_are_copied_not_rejected() -> None:
    """A masked buffer that is a view 4 bytes into its storage breaks _grouped_mm's 16-byte rule: it is copied."""
    w13, w2 = _weights(torch.float32)
    tokens = _masked(torch.float32)
    storage = torch.empty(tokens.hidden.numel() + 1)
    view = storage[1:].view(tokens.hidden.shape)
    view.copy_(tokens.hidden)
    assert view.data_ptr() % 16
    shifted = ExpertTokens("masked", view, expert_num_tokens=tokens.expert_num_tokens)
    torch.testing.assert_close(GroupedMMExperts().apply(shifted, w13, w2), TorchExperts().apply(tokens, w13, w2),
                               rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------- bad input


def test_bad_input_raises_naming_the_value() -> None:
    experts = GroupedMMExperts()
    w13, w2 = _weights(torch.float32)
    tokens = _masked(torch.float32)
    tokens.expert_num_tokens = torch.tensor([0, CAPACITY + 1, 0, 0, 0, 0])
    with pytest.raises(ValueError, match=rf"expert_num_tokens\[1\]={CAPACITY + 1} exceeds the buffer capacity"):
        experts.apply(tokens, w13, w2)
    g = torch.Generator().manual_seed(0)
    odd_w13, odd_w2 = torch.randn(E, 2 * 6, H, generator=g), torch.randn(E, H, 6, generator=g)
    with pytest.raises(ValueError, match="multiples of 4 for torch.float32.*intermediate=6"):
        experts.apply(_contiguous(torch.float32), odd_w13, odd_w2)
    with pytest.raises(ValueError, match="got torch.float64"):
        experts.apply(_contiguous(torch.float64), w13.double(), w2.double())
    with pytest.raises(ValueError, match="w2 has shape"):
        experts.apply(_contiguous(torch.float32), w13, w2[:, :, :-1])


def test_cuda_rules_by_compute_capability(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Fused kernel on 9.x/10.x only; elsewhere torch's fallback syncs with the host, so grouped_mm refuses.
    On a fused GPU, fp32/fp16 run bf16 GEMMs and say so once; bf16 runs as is."""
    cuda = torch.device("cuda", 0)
    for major, fused in ((8, False), (9, True), (10, True), (12, False)):
        monkeypatch.setattr(grouped_mm_experts, "_capability", lambda d, m=major: (m, 0))
        assert grouped_mm_experts.has_fused_grouped_mm(cuda) is fused
        assert resolve_experts_backend("auto", cuda) == ("grouped_mm" if fused else "torch")
        if not fused:
            with pytest.raises(RuntimeError, match=rf"compute capability 9.x or 10.x.*{major}\.0.*triton"):
                gemm_dtype_for(cuda, torch.bfloat16)
    monkeypatch.setattr(grouped_mm_experts, "_capability", lambda d: (9, 0))
    forget_logged()
    with caplog.at_level(logging.WARNING, logger="ubatch.experts"):
        assert gemm_dtype_for(cuda, torch.bfloat16) is torch.bfloat16
        assert gemm_dtype_for(cuda, torch.float32) is torch.bfloat16
        assert gemm_dtype_for(cuda, torch.float32) is torch.bfloat16
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["experts backend grouped_mm"]
    assert "torch.float32 experts run their GEMMs on bf16-rounded operands" in caplog.text
    assert gemm_dtype_for(torch.device("cpu"), torch.float16) is torch.float16  # CPU: as is
    with pytest.raises(ValueError, match="runs on CPU or CUDA, got device meta"):
        gemm_dtype_for(torch.device("meta"), torch.float32)


# ------------------------------------------------------------------------------------------- auto, config


def test_auto_resolution_and_names(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_experts_backend("auto", "cpu") == "torch"
    assert resolve_experts_backend("auto", torch.device("cpu")) == "torch"
    monkeypatch.setattr(grouped_mm_experts, "_capability", lambda d: (9, 0))
    assert resolve_experts_backend("auto", "cuda") == "grouped_mm"
    assert resolve_experts_backend("auto", torch.device("cuda", 1)) == "grouped_mm"
    for name in ("torch", "triton", "deep_gemm", "grouped_mm"):
        assert resolve_experts_backend(name, "cpu") == resolve_experts_backend(name, "cuda") == name
    with pytest.raises(ValueError, match="unknown experts backend 'cutlass'; expected one of auto, torch"):
        resolve_experts_backend("cutlass", "cpu")
    with pytest.raises(ValueError, match=r"resolve_experts_backend\('auto', device\)"):
        make_experts("auto")
    assert isinstance(make_experts("grouped_mm"), GroupedMMExperts) and make_experts("grouped_mm").name == "grouped_mm"


def test_config_default_is_auto_and_choices() -> None:
    assert RunnerConfig().experts_backend == "auto"
    assert experts_backends() == EXPERTS_CHOICES == ("auto", "torch", "triton", "deep_gemm", "grouped_mm")
    assert RunnerConfig(experts_backend="grouped_mm").experts_backend == "grouped_mm"


def test_capture_blocker() -> None:
    assert capture_blocker("none", "grouped_mm") is None
    assert capture_blocker("torch_ll", "grouped_mm") is None
    reason = capture_blocker("none", "torch")
    assert reason is not None and "nonzero" in reason and "--experts-backend auto" in reason and "grouped_mm" in reason
    with pytest.raises(ValueError, match="resolved experts backend, got 'auto'"):
        capture_blocker("none", "auto")


def test_layer_resolves_auto_by_the_weights_device() -> None:
    layer = FusedMoE(8, 2, 16, 24, parallel=MoEParallelConfig(experts_backend="auto"))
    assert layer.kernel.experts.name == "torch"  # CPU weights
    layer = FusedMoE(8, 2, 16, 24, parallel=MoEParallelConfig(experts_backend="grouped_mm"))
    assert isinstance(layer.kernel.experts, GroupedMMExperts)


# ---------------------------------------------------------------------------------------- EP ranks and DBO

EP_CASES = [("none", [9]), ("torch_ll", [7, 12]), ("torch_ht", [7, 12])]


@pytest.mark.parametrize("dbo", [False, True], ids=["no-dbo", "dbo"])
@pytest.mark.parametrize("backend,sizes", EP_CASES, ids=[f"{b}-ws{len(s)}" for b, s in EP_CASES])
def test_ep_equals_dense(backend: str, sizes: list[int], dbo: bool, gemm_calls: Counter,
                         monkeypatch: pytest.MonkeyPatch) -> None:
    """1 and 2 EP ranks (threads), DBO off and on, against the dense reference (``test_moe_ep.check``, which also
    checks the DBO yields); every experts call went through GroupedMMExperts and its two grouped GEMMs."""
    applies: Counter = Counter()
    lock = threading.Lock()
    real_apply = GroupedMMExperts.apply

    def counting_apply(self: GroupedMMExperts, tokens: ExpertTokens, w13: torch.Tensor,
                       w2: torch.Tensor, extras: ExpertMLPExtras | None = None) -> torch.Tensor:
        with lock:
            applies[tokens.layout] += 1
            applies["with_rows"] += tokens.hidden.shape[0] > 0
        return real_apply(self, tokens, w13, w2, extras)

    monkeypatch.setattr(GroupedMMExperts, "apply", counting_apply)
    weights = StackWeights.random()
    inputs = rank_inputs(sizes)
    results = run_ep(weights, inputs, backend, experts="grouped_mm", dbo=dbo)
    check(weights, inputs, results)
    assert all(res["per_layer"] == YIELDS_PER_LAYER for res in results)
    calls = len(weights.gates) * len(sizes) * (2 if dbo else 1)  # one per layer, rank and ubatch
    layout = "masked" if backend == "torch_ll" else "contiguous"
    assert applies[layout] == calls and sum(applies[k] for k in ("masked", "contiguous")) == calls
    assert sum(gemm_calls.values()) == 2 * applies["with_rows"] and applies["with_rows"] > 0


# --------------------------------------------------------------------------------------------- the engine


def _engine_tokens(experts_backend: str) -> tuple[list[list[int]], str, set[str]]:
    """Greedy tokens of the engine on CPU, on a GPU machine too: there both backends compute float32 exactly,
    so the tokens must be equal. On a GPU ``grouped_mm`` runs bf16 GEMMs (``auto`` picks it there, and
    ``test_cuda_bf16_equals_torch_and_captures_without_host_sync`` compares it with torch's at a bf16
    tolerance), and near-tied logits of the random model may then pick another token."""
    from runner.entrypoints.llm import LLM
    from runner.sampling_params import SamplingParams

    llm = LLM(model="tiny-qwen3-moe", experts_backend=experts_backend, max_num_batched_tokens=32, max_num_seqs=3,
              max_model_len=64, disable_overlap_schedule=True, device="cpu")
    try:
        prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate([5, 9, 3, 12])]
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
        layers = [m for m in llm.model_runner.model.modules() if isinstance(m, FusedMoE)]
        used = {k.experts.name for m in layers for k in m._kernels.values()}
        return [o.outputs[0].token_ids for o in outs], llm.model_runner.experts_backend, used
    finally:
        llm.close()


def test_engine_grouped_mm_gives_the_torch_tokens() -> None:
    tokens, resolved, used = _engine_tokens("grouped_mm")
    ref_tokens, ref_resolved, ref_used = _engine_tokens("auto")  # auto on CPU is torch
    assert (resolved, used) == ("grouped_mm", {"grouped_mm"})
    assert (ref_resolved, ref_used) == ("torch", {"torch"})
    assert all(len(t) == 6 for t in tokens) and len(tokens) == 4
    assert tokens == ref_tokens


# ---------------------------------------------------------------------------------------------------- GPU


@pytest.mark.cuda
def test_cuda_bf16_equals_torch_and_captures_without_host_sync() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    if not grouped_mm_experts.has_fused_grouped_mm(device):
        pytest.skip("torch._grouped_mm has a fused kernel on compute capability 9.x/10.x only")
    g = torch.Generator().manual_seed(0)
    hidden, inter, experts, rows, top_k, cap = 256, 128, 8, 64, 4, 48
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).bfloat16().to(device)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).bfloat16().to(device)
    ids = torch.stack([torch.randperm(experts - 1, generator=g)[:top_k] for _ in range(rows)])  # last expert: none
    ids[::5, 0] = -1
    contiguous = ExpertTokens("contiguous", torch.randn(rows, hidden, generator=g).bfloat16().to(device),
                              topk_ids=ids.to(device), topk_weights=torch.rand(rows, top_k, generator=g).to(device))
    masked_x = torch.randn(experts, cap, hidden, generator=g).bfloat16().to(device)
    counts = torch.tensor([5, 0, cap, 1, 17, 0, 30, 2], dtype=torch.int32, device=device)
    masked_x[torch.arange(cap, device=device).unsqueeze(0) >= counts.unsqueeze(1)] = float("nan")
    masked = ExpertTokens("masked", masked_x, expert_num_tokens=counts)
    backend = GroupedMMExperts()
    for tokens in (contiguous, masked):
        eager = backend.apply(tokens, w13, w2)
        ref = TorchExperts().apply(tokens, w13, w2)
        _close(eager, ref, torch.bfloat16)
        assert not eager.isnan().any()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            backend.apply(tokens, w13, w2)  # warm-up outside the capture (lazy cuBLAS/CUTLASS init)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.cuda.set_sync_debug_mode("error")  # any host sync in apply raises (capture would also fail)
            try:
                captured = backend.apply(tokens, w13, w2)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)  # deterministic: the replay is the eager result bit for bit
