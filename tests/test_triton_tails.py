"""The fused pointwise tails (``fused_tails``) against the torch ops they replace, and the setting itself.

The kernels (``runner/models/kernels/add_rms_norm.py``, ``runner/models/kernels/qk_norm_rope.py``,
``ubatch/modular_moe/fused_router.py``) run in Triton's CPU interpreter (``triton_interpreter``) in fp32 on tiny
shapes: non-power-of-two widths, one token, partial rotary, both RoPE layouts, every router option. A whole
tiny Qwen3-MoE with the tails forced on gives the torch path's logits and greedy tokens, every tail having run
as a kernel. The setting: a bad value, and ``on`` without CUDA, are errors naming it; ``auto`` on CPU is torch.
"""
from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from runner.config import ConfigError, RunnerConfig
from runner.models.configs import RopeConfig
from runner.models.layers import RMSNorm, RotaryEmbedding
from ubatch.fused_tails import resolve_fused_tails
from ubatch.modular_moe.router import select_experts


def assert_tight(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32 agreement up to the order of a sum's additions."""
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


@pytest.fixture(autouse=True)
def _needs_triton() -> None:
    pytest.importorskip("triton")


def _norm(n: int, seed: int, eps: float = 1e-6) -> RMSNorm:
    norm = RMSNorm(n, eps)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n, generator=torch.Generator().manual_seed(seed)))
    return norm


# ------------------------------------------------------------------------------------ residual add + RMSNorm
@pytest.mark.triton_interpreter
@pytest.mark.parametrize("shape", [(1, 64), (5, 100), (3, 7, 48), (2, 33)], ids=str)
def test_add_rms_norm_matches_torch(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x, residual = torch.randn(shape, generator=g) * 3, torch.randn(shape, generator=g)
    norm = _norm(shape[-1], seed=1, eps=1e-5)
    ref_out, ref_res = norm.add_and_norm(x, residual)
    ref_plain = norm(x)
    norm.fused = True
    out, res = norm.add_and_norm(x, residual)
    assert torch.equal(res, ref_res)  # one fp32 add: exact
    assert_tight(out, ref_out)
    assert_tight(norm(x), ref_plain)
    first, passed = norm.add_and_norm(x, None)  # a first layer: no residual yet
    assert_tight(first, ref_plain)
    assert passed is x


def test_add_rms_norm_rejects_mismatched_inputs() -> None:
    from runner.models.kernels.add_rms_norm import add_rms_norm

    with pytest.raises(ValueError, match=r"weight has shape \(8,\), expected \(16,\)"):
        add_rms_norm(torch.zeros(2, 16), None, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(torch.zeros(2, 16), torch.zeros(2, 16, dtype=torch.float64), torch.ones(16), 1e-6)


# ------------------------------------------------------------------------------------------- q/k norm + RoPE
ROPE_CASES = {  # name: (T, Hq, Hk, head_dim, rotary dim, interleaved, q/k norm)
    "qwen3": (3, 4, 2, 64, 64, False, True),
    "one-token": (1, 8, 1, 32, 32, False, True),
    "odd-head-dim": (2, 3, 3, 48, 48, False, True),
    "partial-rotary": (3, 4, 2, 64, 32, False, True),
    "interleaved": (2, 4, 2, 32, 32, True, True),
    "interleaved-partial": (2, 2, 2, 48, 24, True, True),
    "rope-alone": (3, 4, 2, 64, 64, False, False),
    "rope-alone-partial": (2, 4, 4, 40, 20, False, False),
}


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_qk_norm_rope_matches_torch(case: str) -> None:
    t, hq, hk, d, rot, interleaved, with_norm = ROPE_CASES[case]
    g = torch.Generator().manual_seed(len(case))
    q, k = torch.randn(t, hq, d, generator=g) * 2, torch.randn(t, hk, d, generator=g)
    rope = RotaryEmbedding(rot, RopeConfig(rope_theta=10000.0), interleaved=interleaved)
    cos, sin = rope.cos_sin(torch.tensor([0, 7, 300])[:t], torch.float32)
    q_norm, k_norm = (_norm(d, 2), _norm(d, 3, eps=1e-5)) if with_norm else (None, None)
    ref_q, ref_k = rope.norm_and_rotate(q, k, cos, sin, q_norm, k_norm)
    rope.fused = True
    out_q, out_k = rope.norm_and_rotate(q, k, cos, sin, q_norm, k_norm)
    assert_tight(out_q, ref_q)
    assert_tight(out_k, ref_k)


@pytest.mark.triton_interpreter
def test_qk_norm_rope_reads_strided_heads() -> None:
    """q and k as views of one fused projection (a head stride larger than head_dim), as a qkv split gives."""
    g = torch.Generator().manual_seed(9)
    qkv = torch.randn(2, 6, 32, generator=g)
    q, k = qkv[:, :4], qkv[:, 4:]
    rope = RotaryEmbedding(32, RopeConfig(rope_theta=10000.0))
    cos, sin = rope.cos_sin(torch.tensor([3, 4]), torch.float32)
    ref = rope.norm_and_rotate(q, k, cos, sin, _norm(32, 4), _norm(32, 5))
    rope.fused = True
    for out, want in zip(rope.norm_and_rotate(q, k, cos, sin, _norm(32, 4), _norm(32, 5)), ref, strict=True):
        assert_tight(out, want)


def test_qk_norm_rope_rejects_bad_inputs() -> None:
    from runner.models.kernels.qk_norm_rope import qk_norm_rope

    q, k = torch.zeros(2, 4, 16), torch.zeros(2, 2, 16)
    cos = sin = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="rot_dim=18"):
        qk_norm_rope(q, k, cos, sin, 18)
    with pytest.raises(ValueError, match=r"cos is \(2, 4\)"):
        qk_norm_rope(q, k, torch.zeros(2, 4), sin, 16)
    with pytest.raises(ValueError, match="both q_weight and k_weight"):
        qk_norm_rope(q, k, cos, sin, 16, q_weight=torch.ones(16))
    with pytest.raises(ValueError, match="unit stride"):
        qk_norm_rope(q.transpose(1, 2).contiguous().transpose(1, 2), k, cos, sin, 16)
    rope = RotaryEmbedding(16, RopeConfig(rope_theta=10000.0))
    with pytest.raises(ValueError, match="both q_norm and k_norm"):
        rope.norm_and_rotate(q, k, cos, sin, _norm(16, 0), None)


# ------------------------------------------------------------------------------------------- router top-k
@pytest.mark.triton_interpreter
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("top_k,scale", [(1, 1.0), (4, 1.0), (2, 2.5)])
def test_router_matches_select_experts(scoring: Any, renormalize: bool, top_k: int, scale: float) -> None:
    g = torch.Generator().manual_seed(top_k)
    from ubatch.modular_moe.fused_router import fused_select_experts

    for t, e in ((1, 8), (5, 60), (3, 128)):
        logits = torch.randn(t, e, generator=g) * 2  # continuous values: no ties
        weights, ids = fused_select_experts(logits, top_k, renormalize, scoring, scale)
        ref_w, ref_ids = select_experts(logits, top_k, renormalize, scoring, routed_scaling_factor=scale)
        assert ids.dtype == torch.int64 and weights.dtype == torch.float32
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-7)


@pytest.mark.triton_interpreter
def test_router_ties_go_to_the_lower_id_and_strided_logits() -> None:
    from ubatch.modular_moe.fused_router import fused_select_experts

    logits = torch.zeros(2, 6)
    logits[1, [1, 4]] = 1.0
    weights, ids = fused_select_experts(logits, 3, True)
    assert ids.tolist() == [[0, 1, 2], [1, 4, 0]]
    torch.testing.assert_close(weights[0], torch.full((3,), 1 / 3))
    wide = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    view = wide[:, ::2]  # a column stride of 2: copied to unit stride first
    assert torch.equal(fused_select_experts(view, 2, False)[1], select_experts(view, 2, False)[1])


def test_router_rejects_what_select_experts_rejects() -> None:
    from ubatch.modular_moe.fused_router import fused_select_experts

    with pytest.raises(ValueError, match=r"top_k=9 must be in \[1, num_experts=8\]"):
        fused_select_experts(torch.zeros(2, 8), 9, True)
    with pytest.raises(ValueError, match="unknown scoring_func 'tanh'"):
        fused_select_experts(torch.zeros(2, 8), 2, True, "tanh")  # type: ignore[arg-type]


def test_grouped_or_biased_routing_stays_on_torch() -> None:
    from ubatch.modular_moe.layer import FusedMoE

    plain = FusedMoE(8, 2, 16, 8)
    grouped = FusedMoE(8, 2, 16, 8, num_expert_group=4, topk_group=2)
    biased = FusedMoE(8, 2, 16, 8, scoring_func="sigmoid", use_correction_bias=True)
    for layer in (plain, grouped, biased):
        layer.fused_router = True
    assert plain.routes_fused and not grouped.routes_fused and not biased.routes_fused


# ------------------------------------------------------------------------------------------ a whole model
def _greedy(model: Any, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill every prompt, then ``steps`` decode steps of all requests; the tokens and each step's logits."""
    from runner.attention.kv_cache import allocate_kv_caches, blocks_needed, build_attention_metadata
    from ubatch.forward_context import set_forward_context

    block = 4
    model.bind_kv_caches(allocate_kv_caches(model.kv_cache_specs(), 32, block, torch.float32))
    lens = [len(p) for p in prompts]
    need = [blocks_needed(n + steps, block) for n in lens]
    starts = [sum(need[:i]) for i in range(len(need))]
    blocks = [list(range(s, s + n)) for s, n in zip(starts, need, strict=True)]
    out: list[list[int]] = [[] for _ in prompts]
    all_logits = []
    ids, ctx, qlen = sum(prompts, []), [0] * len(prompts), lens
    for _ in range(steps + 1):
        meta = build_attention_metadata(ctx, qlen, blocks, block)
        with torch.no_grad(), set_forward_context(meta):
            logits = model.compute_logits(model(torch.tensor(ids), meta.positions))
        last = logits[torch.tensor(qlen).cumsum(0) - 1]
        all_logits.append(last)
        for r, tok in enumerate(last.argmax(-1).tolist()):
            out[r].append(tok)
        ctx = [c + q for c, q in zip(ctx, qlen, strict=True)]
        ids, qlen = [o[-1] for o in out], [1] * len(prompts)
    return out, all_logits


def expected_launches(model: Any, forwards: int) -> dict[str, int]:
    """Kernel launches of ``forwards`` forwards with the tails fused: each RMSNorm but the per-head q/k norms
    (which run inside the q/k kernel) once, the q/k kernel once per GQA attention, the router once per MoE layer
    whose routing has no groups and no bias."""
    from runner.models.gqa_attention import GQAAttention
    from runner.models.standard import StandardAttention
    from ubatch.modular_moe.layer import FusedMoE

    modules = list(model.modules())
    attentions = [m for m in modules if isinstance(m, (StandardAttention, GQAAttention))]
    per_head = [m for m in attentions
                if (m.qk_norm == "per_head" if isinstance(m, StandardAttention) else m.q_norm is not None)]
    norms = sum(isinstance(m, RMSNorm) for m in modules) - 2 * len(per_head)
    routers = sum(isinstance(m, FusedMoE) and m.routes_fused for m in modules)
    return {name: forwards * n for name, n in (("add_rms_norm", norms), ("qk_norm_rope", len(attentions)),
                                               ("fused_select_experts", routers)) if n}


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-gpt-oss", "tiny-glm4-moe", "tiny-deepseek-v3"])
def test_tiny_model_with_fused_tails_equals_torch(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 logits of a prefill and three decode steps close to the torch path's, the same greedy tokens, and every
    tail the family has ran as a kernel (DeepSeek: the norms only; its MLA RoPE and grouped routing stay torch)."""
    import runner.models.layers as layers
    import ubatch.modular_moe.layer as moe_layer
    from runner.models.loader import load_model

    launches: Counter[str] = Counter()

    def counted(module: Any, kernel: str) -> None:
        original: Callable[..., Any] = getattr(module, kernel)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            launches[kernel] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, kernel, wrapper)

    for module, kernel in ((layers, "add_rms_norm"), (layers, "qk_norm_rope"), (moe_layer, "fused_select_experts")):
        counted(module, kernel)
    model, _ = load_model(name, cache_dir=tmp_path)
    prompts, steps = [[5, 17, 99, 3, 42], [7, 8, 9]], 3
    ref_tokens, ref_logits = _greedy(model, prompts, steps)
    assert not launches
    model.set_fused_tails(True)
    tokens, logits = _greedy(model, prompts, steps)
    assert tokens == ref_tokens
    for ours, ref in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert dict(launches) == expected_launches(model, steps + 1)
    if name == "tiny-qwen3-moe":  # per forward: two norms a layer and the final one; q/k and router a layer
        layers_n = 4
        assert dict(launches) == {"add_rms_norm": 4 * (2 * layers_n + 1), "qk_norm_rope": 4 * layers_n,
                                  "fused_select_experts": 4 * layers_n}


# ------------------------------------------------------------------------------------------------ on a GPU
@pytest.mark.cuda
@pytest.mark.triton_compiled
def test_cuda_bf16_tails_and_graph_capture() -> None:
    """Qwen3-30B-A3B's shapes in bf16, compiled: each tail within one bf16 rounding of the torch ops and almost
    every element bit-equal (only the sums of squares add in another order), the router's ids equal; captured in
    a CUDA graph and replayed on new inputs written in place, the tails give the eager result exactly."""
    from runner.models.kernels.add_rms_norm import add_rms_norm
    from runner.models.kernels.qk_norm_rope import qk_norm_rope
    from ubatch.modular_moe.fused_router import fused_select_experts

    torch.manual_seed(0)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    t, h, hq, hk, d, e = 64, 2048, 32, 4, 128, 128
    norm, q_norm, k_norm = RMSNorm(h, 1e-6, bf16), RMSNorm(d, 1e-6, bf16), RMSNorm(d, 1e-6, bf16)
    for module in (norm, q_norm, k_norm):
        module.to(dev).requires_grad_(False).weight.normal_(1.0, 0.2)
    rope = RotaryEmbedding(d, RopeConfig(rope_theta=1e6))
    x, res = torch.randn(t, h, device=dev, dtype=bf16), torch.randn(t, h, device=dev, dtype=bf16)
    q, k = torch.randn(t, hq, d, device=dev, dtype=bf16), torch.randn(t, hk, d, device=dev, dtype=bf16)
    cos, sin = rope.cos_sin(torch.arange(t, device=dev) * 37, bf16)
    logits = torch.randn(t, e, device=dev)

    def fused() -> tuple[torch.Tensor, ...]:
        return (*add_rms_norm(x, res, norm.weight, 1e-6),
                *qk_norm_rope(q, k, cos, sin, d, q_weight=q_norm.weight, k_weight=k_norm.weight),
                *fused_select_experts(logits, 8, True))

    eager = fused()
    reference = (*norm.add_and_norm(x, res), *rope.norm_and_rotate(q, k, cos, sin, q_norm, k_norm),
                 *select_experts(logits, 8, True))
    for ours, want in zip(eager, reference, strict=True):
        assert ours.dtype == want.dtype and ours.shape == want.shape
        if want.dtype == torch.int64:
            assert torch.equal(ours, want)
        elif want.dtype == torch.float32:  # the compiled exp is Triton's fast one: a few fp32 ulps
            torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-6)
        else:
            torch.testing.assert_close(ours.float(), want.float(), rtol=2 ** -7, atol=2 ** -6)
            assert (ours == want).float().mean().item() > 0.99
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fused()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused()
    for tensor in (x, res, q, k, cos, sin, logits):
        tensor.copy_(torch.randn_like(tensor))
    graph.replay()
    for replayed, again in zip(captured, fused(), strict=True):
        assert torch.equal(replayed, again)


@pytest.mark.cuda
@pytest.mark.triton_compiled
def test_cuda_engine_greedy_tokens_with_fused_tails_equal_torch(tmp_path: Path) -> None:
    """The engine on a GPU in bf16, CUDA graphs on: ``auto`` fuses the tails there, and its greedy tokens are
    the torch path's."""
    from runner.entrypoints.llm import LLM
    from runner.sampling_params import SamplingParams

    prompts = [[(5 * i + j) % 400 for j in range(6)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for setting in ("off", "auto"):
        llm = LLM(model="tiny-qwen3-moe", cache_dir=str(tmp_path), device="cuda", dtype="bfloat16", max_num_seqs=4,
                  max_model_len=64, fused_tails=setting)
        try:
            assert llm.model_runner.fused_tails is (setting == "auto")
            tokens[setting] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.close()
    assert tokens["auto"] == tokens["off"]


# ------------------------------------------------------------------------------------------------ the setting
def test_fused_tails_setting() -> None:
    from runner.entrypoints.cli import build_parser

    assert RunnerConfig().fused_tails == "auto"
    assert resolve_fused_tails("auto", "cpu") is False and resolve_fused_tails("off", "cpu") is False
    with pytest.raises(ConfigError, match="fused_tails must be one of auto, on, off; got 'yes'") as bad:
        RunnerConfig(fused_tails="yes")
    assert bad.value.flag == "--fused-tails"
    with pytest.raises(ValueError, match="fused_tails must be one of auto, on, off; got 'fast'"):
        resolve_fused_tails("fast", "cpu")
    with pytest.raises(ValueError, match="fused_tails='on' needs a CUDA device.*runs on cpu"):
        resolve_fused_tails("on", "cpu")
    with pytest.raises(ConfigError, match="fused_tails='on' needs a CUDA device") as on_cpu:
        RunnerConfig(fused_tails="on", device="cpu")
    assert on_cpu.value.field == "fused_tails"
    assert build_parser().parse_args(["generate", "--fused-tails", "off"]).fused_tails == "off"
    assert RunnerConfig(fused_tails="off", device="cpu").fused_tails == "off"
