"""The dense FP8 linears' GEMM over the CPU DeepGEMM stand-in (``tests/standins/deep_gemm.py``: ``fp8_gemm_nt``).

First the stand-in's ``fp8_fp4_gemm_nt``: the fp32 product of its dequantised operands rounded to bf16, upstream's
parameters, and upstream's refusals. Then :class:`Fp8Linear` through it against the dequantised reference, within a
bound derived from e4m3 rounding of the activations; the selection rules; and the engine, a tiny DeepSeek-V3-layout
FP8 checkpoint whose linears run the stand-in GEMM, greedy tokens against the same engine dequantising.
"""
from __future__ import annotations

import inspect
import logging
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from runner.models.quantization.dense_fp8_gemm import DEQUANTIZE, DEQUANTIZED, DenseFp8Gemm, select_dense_fp8_gemm
from runner.models.quantization.fp8_linear import Fp8Linear
from standins import deep_gemm as dg
from ubatch.fp8 import quantize_blocks
from ubatch.modular_moe.experts.deep_gemm_experts import per_token_cast_to_fp8, per_token_dequant

# e4m3 keeps 3 mantissa bits: rounding a normal value errs by at most 2^-4 of it; below the smallest normal
# (2^-6 of the group's scale unit) the spacing is 2^-9 units, so at most 2^-10 of the group's scale.
E4M3_REL, E4M3_SUB = 2.0**-4, 2.0**-10
BF16_REL = 2.0**-8  # the GEMM's bf16 output: half an ulp of 8 significant bits


@pytest.fixture(autouse=True)
def hopper() -> Iterator[None]:
    dg.set_arch_major(9)
    yield
    dg.set_arch_major(9)


def fp8_weight(n: int, k: int, seed: int = 0, block: tuple[int, int] | None = (128, 128)
               ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    g = torch.Generator().manual_seed(seed)
    blk = block if block is not None else (n, k)
    q, scale = quantize_blocks(torch.randn(n, k, generator=g) / k**0.5, blk)
    return q, scale, blk


def layer(n: int, k: int, gemm: DenseFp8Gemm, bias: bool = False, block: tuple[int, int] | None = (128, 128),
          dtype: torch.dtype = torch.float32) -> Fp8Linear:
    q, scale, blk = fp8_weight(n, k, block=block)
    lin = Fp8Linear(k, n, bias, block, bias_dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(q)
        lin.weight_scale_inv.copy_(scale)
        if lin.bias is not None:
            lin.bias.copy_(torch.linspace(-1, 1, n))
    lin.gemm = gemm
    return lin


STANDIN = select_dense_fp8_gemm(torch.device("cpu"), dg)


# ------------------------------------------------------------------------------------------ the stand-in GEMM
def test_fp8_gemm_nt_is_the_product_of_the_dequantised_operands() -> None:
    g = torch.Generator().manual_seed(3)
    a = per_token_cast_to_fp8(torch.randn(37, 256, generator=g))
    qb, sb, _ = fp8_weight(576, 256)
    d = torch.empty(37, 576, dtype=torch.bfloat16)
    dg.fp8_gemm_nt(a, (qb, sb), d)
    w = qb.float() * sb.repeat_interleave(128, 0)[:576].repeat_interleave(128, 1)
    assert torch.equal(d, (per_token_dequant(*a) @ w.t()).to(torch.bfloat16))
    assert dg.fp8_gemm_nt is dg.fp8_fp4_gemm_nt


# DeepGEMM main 54e2261, csrc/apis/gemm.hpp: the py::arg list of fp8_fp4_gemm_nt (bound also as fp8_gemm_nt)
DEEP_GEMM_MAIN_GEMM_NT_ARGS = ("a", "b", "d", "c", "recipe", "recipe_a", "recipe_b", "compiled_dims",
                               "disable_ue8m0_cast")


def test_fp8_gemm_nt_has_deepgemm_mains_arguments() -> None:
    params = inspect.signature(dg.fp8_fp4_gemm_nt).parameters.values()
    assert tuple(p.name for p in params) == DEEP_GEMM_MAIN_GEMM_NT_ARGS
    assert [p.name for p in params if p.default is inspect.Parameter.empty] == ["a", "b", "d"]


@pytest.mark.parametrize("fault,match", [
    ("accumulate", "not c.has_value"),  # SM90's 1D2D kernel (128 x 128 B scales) does not accumulate
    ("d_fp32", "kBFloat16"),
    ("a_mn_major", "Major::K"),
    ("sfa_per_block", "sfa: sf.size"),
    ("sfb_strided", "SM90 sfb layout"),
    ("b_bf16", "kFloat8_e4m3fn"),
])
def test_fp8_gemm_nt_refuses_what_deep_gemm_refuses(fault: str, match: str) -> None:
    qa, sfa = per_token_cast_to_fp8(torch.randn(8, 256))
    qb, sfb, _ = fp8_weight(128, 256)
    d = torch.empty(8, 128, dtype=torch.bfloat16)
    c = None
    if fault == "accumulate":
        c = torch.zeros_like(d)
    elif fault == "d_fp32":
        d = d.float()
    elif fault == "a_mn_major":
        qa = qa.t().contiguous().t()
    elif fault == "sfa_per_block":
        sfa = sfa[::128]
    elif fault == "sfb_strided":
        sfb = torch.zeros(1, 4)[:, ::2].expand(1, 2)
    else:
        qb = qb.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=match):
        dg.fp8_gemm_nt((qa, sfa), (qb, sfb), d, c=c)


# ------------------------------------------------------------------------------------------ Fp8Linear
def activation_error_bound(x: torch.Tensor, lin: Fp8Linear, ref: torch.Tensor) -> torch.Tensor:
    """Per output element: e4m3 rounding of each activation (2^-4 of it, or 2^-10 of its group's scale when
    subnormal) times the weight's magnitude, plus bf16 rounding of the result; the weight is the same exact
    FP8 matrix in both paths, so nothing else differs (fp32 accumulation error is below 2^-20 here)."""
    rows = x.reshape(-1, lin.in_features).float()
    _, sf = per_token_cast_to_fp8(rows)
    per_elem = torch.maximum(E4M3_REL * rows.abs(), E4M3_SUB * sf.repeat_interleave(128, dim=1))
    w = lin.dequantized_weight(torch.float32).abs()
    bound = per_elem @ w.t() + BF16_REL * (ref.reshape(rows.shape[0], -1).abs() + per_elem @ w.t())
    return bound.reshape(ref.shape) * 1.001 + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_through_deep_gemm_is_within_the_activation_rounding_of_the_dequantised_reference(
        dtype: torch.dtype, bias: bool) -> None:
    lin = layer(576, 512, STANDIN, bias, dtype=dtype)  # kv_a_proj's 576 rows: 4.5 blocks
    assert lin.uses_fp8_gemm() and "gemm=deep_gemm" in repr(lin)
    x = torch.randn(2, 9, 512, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = lin(x)
    ref = torch.nn.functional.linear(x.float(), lin.dequantized_weight(torch.float32),
                                     lin.bias.float() if lin.bias is not None else None)
    assert out.dtype == dtype and out.shape == (2, 9, 576)
    err = (out.float() - ref).abs()
    bound = activation_error_bound(x, lin, ref)
    if dtype == torch.bfloat16:
        bound = bound + BF16_REL * ref.abs()  # the output cast to bf16 once more, and the bias added in bf16
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"
    assert err.max().item() > 0  # the activations really went through FP8


def test_the_gemm_gets_exactly_the_checkpoints_weight_and_the_tokens_1x128_quantisation() -> None:
    seen: list[tuple[torch.Tensor, ...]] = []

    def recording(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor], d: torch.Tensor) -> None:
        seen.append((*a, *b))
        dg.fp8_gemm_nt(a, b, d)

    lin = layer(128, 256, DenseFp8Gemm("deep_gemm", "recording", recording))
    x = torch.randn(5, 256)
    lin(x)
    (qa, sfa, qb, sfb), = seen
    want_q, want_sf = per_token_cast_to_fp8(x)
    assert torch.equal(qa.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(sfa, want_sf)
    assert qb is lin.weight and sfb is lin.weight_scale_inv  # the checkpoint's own values and scales, no copy


@pytest.mark.parametrize("n,k,block", [(96, 256, (128, 128)), (128, 192, (128, 128)), (128, 256, None)],
                         ids=["out_96", "in_192", "per_tensor"])
def test_layers_deep_gemm_does_not_take_dequantise_exactly(n: int, k: int, block: tuple[int, int] | None) -> None:
    lin = layer(n, k, STANDIN, block=block)
    assert not lin.uses_fp8_gemm() and "gemm=dequantize" in repr(lin)
    x = torch.randn(3, k)
    assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.dequantized_weight(torch.float32)))


def test_by_default_an_fp8_linear_dequantises() -> None:
    lin = Fp8Linear(256, 128, False, (128, 128))
    assert lin.gemm is DEQUANTIZED and not lin.uses_fp8_gemm()


def test_real_deep_gemm_on_hopper_is_within_the_same_bound() -> None:
    """On an sm_90 GPU with DeepGEMM: the loader's choice is deep_gemm, and the real kernel meets the bound the
    stand-in does (its fp32 accumulation order differs, far below the activation rounding)."""
    pytest.importorskip("deep_gemm")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper (sm_90) GPU")
    gemm = select_dense_fp8_gemm(torch.device("cuda"))
    assert gemm.kernel == "deep_gemm", gemm.reason
    lin = layer(576, 512, gemm, bias=True, dtype=torch.bfloat16).cuda()
    x = torch.randn(33, 512, generator=torch.Generator().manual_seed(1)).bfloat16().cuda()
    out = lin(x).float().cpu()
    lin_cpu = lin.cpu()
    ref = torch.nn.functional.linear(x.cpu().float(), lin_cpu.dequantized_weight(torch.float32),
                                     lin_cpu.bias.float() if lin_cpu.bias is not None else None)
    bound = activation_error_bound(x.cpu(), lin_cpu, ref) + BF16_REL * ref.abs()
    assert bool(((out - ref).abs() <= bound).all())


# ------------------------------------------------------------------------------------------ selection
def test_the_cpu_dequantises_and_says_so() -> None:
    gemm = select_dense_fp8_gemm(torch.device("cpu"))
    assert gemm.kernel == DEQUANTIZE and gemm.fp8_gemm_nt is None and "cpu" in gemm.reason


def test_a_given_module_is_used_and_named() -> None:
    assert STANDIN.kernel == "deep_gemm" and STANDIN.fp8_gemm_nt is dg.fp8_fp4_gemm_nt
    assert "standins.deep_gemm" in STANDIN.reason


def test_a_module_without_the_gemm_is_refused_by_name() -> None:
    with pytest.raises(ImportError, match="fp8_fp4_gemm_nt"):
        select_dense_fp8_gemm(torch.device("cpu"), types.ModuleType("old_deep_gemm"))


# ------------------------------------------------------------------------------------------ the engine
# DeepSeek-V3's layout sized so most linears are whole 128-column blocks: q_a/q_b/o_proj, the dense MLP and the
# shared expert run the FP8 GEMM; kv_a_proj_with_mqa (208 rows, not a multiple of 64) and kv_b_proj (192
# columns; MLA reads it dequantised anyway) do not.
DSV3_128 = dict(vocab_size=256, hidden_size=256, intermediate_size=384, moe_intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                topk_group=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=256, kv_lora_rank=192,
                qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, routed_scaling_factor=2.5,
                initializer_range=0.1, eos_token_id=None)
PROMPTS = [[5, 17, 99, 3, 42], [7, 8, 9, 10, 11, 12, 13, 14, 15], [200, 1, 33]]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def dsv3_pair(tmp_path_factory: pytest.TempPathFactory) -> Any:
    transformers = pytest.importorskip("transformers")
    from fp8_checkpoint import write_fp8_pair

    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**DSV3_128, attn_implementation="eager"))
    return write_fp8_pair(hf.eval(), tmp_path_factory.mktemp("dsv3-128"))


def counting_deep_gemm(calls: list[int]) -> types.ModuleType:
    """The stand-in's ``fp8_gemm_nt`` behind a counter, as a module (what the loader takes)."""
    module = types.ModuleType("counting_deep_gemm")
    fn: Callable[..., None] = dg.fp8_fp4_gemm_nt

    def gemm(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        fn(*args, **kwargs)

    module.fp8_fp4_gemm_nt = gemm  # type: ignore[attr-defined]
    return module


def transformers_with_fp8_activations(reference: Path, names: list[str]) -> list[list[int]]:
    """transformers' greedy tokens on the dequantised weights, the inputs of ``names`` rounded to e4m3 per token
    per 128 columns and their outputs to bf16: the FP8 GEMM's arithmetic, written independently of the engine."""
    import transformers

    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(reference, attn_implementation="eager").eval()

    def quantise_input(_: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x = args[0]
        q, sf = per_token_cast_to_fp8(x.reshape(-1, x.shape[-1]))
        return (per_token_dequant(q, sf).reshape(x.shape).to(x.dtype),)

    def round_output(_: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return out.to(torch.bfloat16).to(out.dtype)

    for name in names:
        hf.get_submodule(name).register_forward_pre_hook(quantise_input)
        hf.get_submodule(name).register_forward_hook(round_output)
    out = []
    for p in PROMPTS:
        ids = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


def test_the_engine_runs_the_dense_linears_through_deep_gemm(dsv3_pair: Any, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """The stand-in given to the loader: the linears DeepGEMM takes run it (and the loader logs how many), the
    rest dequantise, and greedy tokens with DBO on every step equal transformers' with the same FP8 activation
    rounding on those layers. (Against plain dequantised transformers they differ: the rounding moves this random
    model's logits by up to a third of their spread, more than its top-1 margins.)"""
    import functools

    from runner import LLM
    from runner.models import loader
    from runner.sampling_params import SamplingParams
    from runner.worker import model_runner

    calls: list[int] = []
    monkeypatch.setattr(model_runner, "load_model",
                        functools.partial(loader.load_model, deep_gemm_module=counting_deep_gemm(calls)))
    with caplog.at_level(logging.INFO, logger="runner.models.quantization.convert"):
        engine = LLM(model=str(dsv3_pair.fp8), device="cpu", dtype="float32", max_num_seqs=4, enable_dbo=True,
                     dbo_decode_token_threshold=2, dbo_prefill_token_threshold=4, dbo_cost_model="off")
    try:
        outs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                               use_tqdm=False)
        got = [list(o.outputs[0].token_ids) for o in outs]
        ubatched = engine.last_stats.num_ubatched_steps
        layers = {n: m for n, m in engine.model_runner.model.named_modules() if isinstance(m, Fp8Linear)}
    finally:
        engine.close()
    fast = sorted(name for name, m in layers.items() if m.uses_fp8_gemm())
    assert {"model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj",
            "model.layers.1.mlp.shared_experts.gate_proj"} <= set(fast)
    assert not layers["model.layers.0.self_attn.kv_a_proj_with_mqa"].uses_fp8_gemm()
    assert len(calls) > 0 and ubatched > 0
    assert any(f"{len(fast)} of {len(layers)} run deep_gemm" in r.getMessage() for r in caplog.records)
    assert got == transformers_with_fp8_activations(dsv3_pair.reference, fast)
