"""FP8 checkpoints in the released layout load and run exactly as their dequantised twin, with FP8 in memory.

Small transformers models (Qwen3-MoE; DeepSeek-V3 with MLA, a shared expert, a dense first layer; GLM-4.5 with
biased projections) are written by ``tests/fp8_checkpoint.py`` as FP8 checkpoints (128 x 128 blocks with partial
ones at the edges, per-expert names, ``modules_to_not_convert``, an index over shards; and per tensor) and as a
twin holding the dequantised weights.
On the CPU every FP8 weight is dequantised to the compute dtype before its GEMM, so in fp32 the logits must equal
the twin's bit for bit; greedy tokens must equal transformers' on the dequantised weights.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fp8_checkpoint import Fp8Pair, write_fp8_pair  # noqa: E402
from module_paths import experts_of, tensor_at  # noqa: E402
from runner.attention.kv_cache import allocate_kv_caches, blocks_needed  # noqa: E402
from runner.core.kv_blocks import BlockPool  # noqa: E402
from runner.models.base import MoECausalLM  # noqa: E402
from runner.models.loader import CheckpointError, load_config, load_model  # noqa: E402
from runner.models.quantization.fp8_linear import Fp8Linear  # noqa: E402
from test_models_parity import BLOCK, PROMPTS, fresh_cache, greedy_generate, run_step  # noqa: E402
from ubatch.fp8 import FP8_DTYPE, dequantize_blocks, quantize_blocks  # noqa: E402
from ubatch.modular_moe.config import MoEParallelConfig  # noqa: E402

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# hidden 192 = 1.5 blocks, experts' 96 rows = 0.75 of a block, the dense MLP's 320 = 2.5 blocks
QWEN = dict(vocab_size=256, hidden_size=192, intermediate_size=320, moe_intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=48, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, mlp_only_layers=[1], initializer_range=0.1, rope_theta=10000.0)
# DeepSeek-V3's layout: kv_a_proj_with_mqa has 144 + 16 = 160 rows (1.25 blocks), as the real one has 4.5
DSV3 = dict(vocab_size=256, hidden_size=192, intermediate_size=320, moe_intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
            topk_group=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=160, kv_lora_rank=144,
            qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, routed_scaling_factor=2.5,
            initializer_range=0.1, eos_token_id=None)
# GLM-4.5's layout (GLM-4.5-FP8 ships so): biased q/k/v, q/k norm, partial RoPE, DeepSeek-V3's router
GLM4 = dict(vocab_size=256, hidden_size=192, intermediate_size=320, moe_intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=48, n_routed_experts=8, num_experts_per_tok=2,
            n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, attention_bias=True,
            use_qk_norm=True, routed_scaling_factor=2.5, initializer_range=0.1, max_position_embeddings=256,
            eos_token_id=None, bos_token_id=None, pad_token_id=None)
NOT_CONVERT = ["model.layers.0.self_attn.o_proj", "model.layers.*.mlp.gate"]


def make_hf(kind: str) -> PreTrainedModel:
    torch.manual_seed(0)
    if kind == "qwen3":
        cfg = transformers.Qwen3MoeConfig(**QWEN, attn_implementation="eager")
        return transformers.Qwen3MoeForCausalLM(cfg).eval()
    if kind == "glm4":
        model = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**GLM4, attn_implementation="eager"))
    else:
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**DSV3, attn_implementation="eager"))
    with torch.no_grad():  # HF zeroes the correction bias and the attention biases; make them matter
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                t.normal_(0, 0.05)
            elif name.endswith("bias"):
                t.normal_(0, 0.5)
    return model.eval()


VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {  # name -> (model, write_fp8_pair keyword arguments)
    "qwen3-block": ("qwen3", dict(not_convert=NOT_CONVERT)),
    "qwen3-block-sharded": ("qwen3", dict(shards=3)),
    "qwen3-per-tensor": ("qwen3", dict(block=None)),
    "qwen3-per-tensor-1d": ("qwen3", dict(block=None, scalar_scales=False)),
    "dsv3-block": ("dsv3", dict()),
    "glm4-block": ("glm4", dict()),
}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory):
    """``written(variant) -> (hf_model, Fp8Pair)``, each written once per module."""
    models: dict[str, PreTrainedModel] = {}
    pairs: dict[str, Fp8Pair] = {}

    def get(variant: str) -> tuple[PreTrainedModel, Fp8Pair]:
        kind, kwargs = VARIANTS[variant]
        if kind not in models:
            models[kind] = make_hf(kind)
        if variant not in pairs:
            pairs[variant] = write_fp8_pair(models[kind], tmp_path_factory.mktemp(variant), **kwargs)
        return models[kind], pairs[variant]
    return get


def prefill_logits(model: MoECausalLM, kv_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if kv_dtype == torch.float32:
        alloc = fresh_cache(model)
    else:
        model.bind_kv_caches(allocate_kv_caches(model.kv_cache_specs(), 64, BLOCK, kv_dtype))
        alloc = BlockPool(64)
    blocks = [alloc.allocate(blocks_needed(len(p), BLOCK)) for p in PROMPTS]
    return run_step(model, sum(PROMPTS, []), [0] * len(PROMPTS), [len(p) for p in PROMPTS], blocks)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_equal_the_dequantised_model_exactly(written, variant: str) -> None:
    _, pair = written(variant)
    fp8, _ = load_model(str(pair.fp8))
    reference, _ = load_model(str(pair.reference))
    assert torch.equal(prefill_logits(fp8), prefill_logits(reference))


@pytest.mark.parametrize("variant", ["qwen3-block", "dsv3-block"])
def test_bf16_compute_equals_the_dequantised_model_in_bf16(written, variant: str) -> None:
    """Dequantising in fp32 and rounding once to bf16 gives the bf16 weights the twin loads: equal logits."""
    _, pair = written(variant)
    fp8, _ = load_model(str(pair.fp8), dtype=torch.bfloat16)
    reference, _ = load_model(str(pair.reference), dtype=torch.bfloat16)
    assert torch.equal(prefill_logits(fp8, torch.bfloat16), prefill_logits(reference, torch.bfloat16))


@pytest.mark.parametrize("variant", ["qwen3-block", "dsv3-block", "glm4-block"])
def test_greedy_tokens_equal_transformers_on_the_dequantised_weights(written, variant: str) -> None:
    hf, pair = written(variant)
    dequantised = type(hf).from_pretrained(pair.reference, attn_implementation="eager").eval()  # per-expert names
    fp8, _ = load_model(str(pair.fp8))
    ours = greedy_generate(fp8, PROMPTS, 8, chunked={1: 3})
    for p, out in zip(PROMPTS, ours, strict=True):
        ref = dequantised.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)
        assert out == ref[0, len(p):].tolist()


@pytest.mark.parametrize("variant", ["qwen3-block", "dsv3-block", "qwen3-per-tensor"])
def test_quantised_weights_stay_fp8_in_memory(written, variant: str) -> None:
    """Exactly the checkpoint's FP8 weights are float8 (1 byte each), with fp32 scales; the rest is fp32."""
    _, pair = written(variant)
    model, _ = load_model(str(pair.fp8))
    params = dict(model.named_parameters())
    fp8_params = {n for n, p in params.items() if p.dtype == FP8_DTYPE}
    dense = {n for n in pair.quantised if ".mlp.experts." not in n}
    moe = {n.split(".mlp.experts.")[0] for n in pair.quantised if ".mlp.experts." in n}
    assert fp8_params == dense | {f"{m}.mlp.experts.{w}" for m in moe for w in ("w13_weight", "w2_weight")}
    assert {n for n, p in params.items() if p.dtype not in (FP8_DTYPE, torch.float32)} == set()
    assert all(params[f"{n}_scale_inv"].dtype == torch.float32 for n in dense)
    fp8_bytes = sum(params[n].numel() * params[n].element_size() for n in fp8_params)
    assert fp8_bytes == sum(params[n].numel() for n in fp8_params)  # one byte per weight
    for name in NOT_CONVERT[:1] if variant == "qwen3-block" else ():
        assert not isinstance(model.get_submodule(name), Fp8Linear)
    assert isinstance(model.get_submodule("model.layers.1.self_attn.o_proj"), Fp8Linear)


def test_expert_parallel_ranks_keep_their_own_fp8_experts_and_scales(written) -> None:
    _, pair = written("qwen3-block")
    full, _ = load_model(str(pair.fp8))
    whole = experts_of(full, 0)
    for rank in range(2):
        model, _ = load_model(str(pair.fp8), parallel=MoEParallelConfig(ep_rank=rank, ep_size=2))
        experts = experts_of(model, 0)
        mine = slice(4 * rank, 4 * rank + 4)
        for name in ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"):
            ours, ref = getattr(experts, name), getattr(whole, name)[mine]
            assert ours.dtype == ref.dtype and torch.equal(ours.view(torch.uint8) if ours.dtype == FP8_DTYPE else ours,
                                                           ref.view(torch.uint8) if ref.dtype == FP8_DTYPE else ref)


def test_the_fp8_model_runs_two_dbo_ubatches_like_one_batch(written) -> None:
    from runner.attention.kv_cache import build_attention_metadata
    from ubatch.forward_context import set_forward_context
    from ubatch.slicing import maybe_create_ubatch_slices
    from ubatch.wrapper import UBatchWrapper

    _, pair = written("dsv3-block")
    model, _ = load_model(str(pair.fp8))
    lens = [len(p) for p in PROMPTS]
    alloc = fresh_cache(model)
    blocks = [alloc.allocate(blocks_needed(n, BLOCK)) for n in lens]
    plain = run_step(model, sum(PROMPTS, []), [0, 0, 0], lens, blocks)
    wrapper = UBatchWrapper(model)
    try:
        meta = build_attention_metadata([0, 0, 0], lens, blocks, BLOCK)
        slices, _ = maybe_create_ubatch_slices(True, lens, sum(lens), len(lens))
        with torch.no_grad(), set_forward_context(meta, ubatch_slices=slices):
            logits = model.compute_logits(wrapper(torch.tensor(sum(PROMPTS, [])), meta.positions))
        assert wrapper.num_ubatched_steps == 1
    finally:
        wrapper.close()
    torch.testing.assert_close(logits, plain, atol=1e-5, rtol=1e-5)


def _with_quant(src: Path, dst: Path, quant: object) -> Path:
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    return dst


@pytest.mark.parametrize("quant, match", [
    ({"quant_method": "mxfp4"}, r"quant_method='mxfp4' are not supported"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, r"quant_method='awq' are not supported"),
    ({"quant_method": "gptq", "bits": 4}, r"quant_method='gptq' are not supported"),
    ({"quant_method": "compressed-tensors", "config_groups": {}}, r"quant_method='compressed-tensors' are not"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, r"activation_scheme='static' are not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2", "activation_scheme": "dynamic"}, r"fmt='e5m2' are not supported"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128]},
     r"weight_block_size must be two positive integers"),
    ({"quant_method": "fp8"}, r"need quantization_config.activation_scheme"),
])
def test_other_schemes_are_refused_naming_the_scheme(written, tmp_path: Path, quant: dict, match: str) -> None:
    _, pair = written("qwen3-block")
    path = _with_quant(pair.fp8, tmp_path / "bad", quant)
    with pytest.raises(CheckpointError, match=match):
        load_config(path)


def test_a_scale_where_modules_to_not_convert_says_bf16_is_an_error(written, tmp_path: Path) -> None:
    _, pair = written("qwen3-block-sharded")  # every decoder linear FP8
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in pair.fp8.iterdir():
        (bad / f.name).symlink_to(f)
    (bad / "config.json").unlink()
    config = json.loads((pair.fp8 / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["model.layers.1.self_attn.q_proj"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"modules_to_not_convert lists 'model.layers.1.self_attn.q_proj'"):
        load_model(str(bad))


def test_an_fp8_weight_without_its_scale_is_an_error(written, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    _, pair = written("qwen3-block")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((pair.fp8 / "config.json").read_text())
    tensors = load_file(str(pair.fp8 / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight_scale_inv"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model.layers.1.self_attn.k_proj.weight' is torch.float8_e4m3fn, "
                                               r"but the model holds it as torch.float32"):
        load_model(str(bad))


def test_online_fp8_equals_quantise_then_dequantise(written, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """``quantization='fp8'`` on the unquantised twin quantises per 128 x 128 block while loading: the same model
    as the twin's weights quantised and dequantised by the reference recipe."""
    _, pair = written("dsv3-block")
    with caplog.at_level(logging.INFO, logger="ubatch.models"):
        online, _ = load_model(str(pair.reference), quantization="fp8")
    assert "quantising the unquantised checkpoint online to FP8 e4m3 weights with one scale per 128x128 block" \
        in caplog.text
    assert tensor_at(online, "model.layers.0.mlp.down_proj.weight").dtype == FP8_DTYPE  # the dense first layer too
    assert experts_of(online, 1).w13_weight.dtype == FP8_DTYPE
    assert tensor_at(online, "model.layers.1.mlp.gate.weight").dtype == torch.float32  # routers stay
    again = tmp_path / "requantised"
    again.mkdir()
    (again / "config.json").write_text((pair.reference / "config.json").read_text())
    from safetensors.torch import save_file

    state = dict(pair.reference_state)
    for n in pair.quantised:
        state[n] = dequantize_blocks(*quantize_blocks(state[n], (128, 128)), (128, 128))
    save_file({n: t.contiguous() for n, t in state.items()}, str(again / "model.safetensors"))
    reference, _ = load_model(str(again))
    assert torch.equal(prefill_logits(online), prefill_logits(reference))


def test_quantization_fp8_on_an_fp8_checkpoint_changes_nothing(written, caplog: pytest.LogCaptureFixture) -> None:
    _, pair = written("qwen3-block")
    with caplog.at_level(logging.INFO, logger="ubatch.models"):
        flagged, _ = load_model(str(pair.fp8), quantization="fp8")
    assert "as the checkpoint holds them (--quantization fp8 has nothing to do)" in caplog.text
    plain, _ = load_model(str(pair.fp8))
    a, b = flagged.state_dict(), plain.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)) if a[name].dtype == FP8_DTYPE \
            else torch.equal(a[name], b[name])


def test_an_unknown_quantization_argument_is_refused() -> None:
    with pytest.raises(ValueError, match=r"quantization='awq' is not supported by this engine"):
        load_model("tiny-qwen3-moe", quantization="awq")


@pytest.mark.parametrize("module, match", [
    ("lm_head", r"an FP8 lm_head is not supported"),
    ("model.layers.0.mlp.gate", r"FP8 router gates are not supported"),
])
def test_fp8_where_the_engine_reads_plain_weights_is_refused(written, tmp_path: Path, module: str,
                                                             match: str) -> None:
    from safetensors.torch import load_file, save_file

    _, pair = written("qwen3-block-sharded")
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((pair.fp8 / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config))
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(pair.fp8.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    tensors[f"{module}.weight"], tensors[f"{module}.weight_scale_inv"] = quantize_blocks(
        tensors[f"{module}.weight"], (128, 128))
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=match):
        load_model(str(bad))
