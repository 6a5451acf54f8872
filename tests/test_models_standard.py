"""Mixtral, Qwen2-MoE, OLMoE, Llama, Qwen2 and Qwen3 (the standard decoder, ``runner/models/standard.py``)
against transformers in float32, from checkpoints transformers wrote with each family's features switched on
(``standard_families.py``): prefill logits; greedy tokens through the engine on one rank with DBO on every step
(MoE families; a dense model says DBO has nothing to overlap and runs without it) and over DP=2 with expert
parallelism and DBO; Mixtral's two checkpoint layouts and its sliding-window rule; config refusals.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")

from transformers import GenerationMixin, PreTrainedModel  # noqa: E402

from devices import device_for  # noqa: E402
from runner.attention.kv_cache import allocate_kv_caches, blocks_needed, build_attention_metadata  # noqa: E402
from runner.core.kv_blocks import BlockPool  # noqa: E402
from runner.distributed.launch import launch  # noqa: E402
from runner.models.loader import iter_checkpoint, load_model  # noqa: E402
from runner.models.registry import parse_config  # noqa: E402
from runner.models.standard import StandardSparseMoeBlock  # noqa: E402
from runner.models.standard_configs import StandardConfig  # noqa: E402
from runner.sampling_params import SamplingParams  # noqa: E402
from standard_families import DENSE_FAMILIES, FAMILIES, MOE_FAMILIES, MOE_LAYERS, make_hf  # noqa: E402
from ubatch.forward_context import set_forward_context  # noqa: E402
from ubatch.modular_moe.config import MoEParallelConfig  # noqa: E402
from ubatch.modular_moe.layer import FusedMoE  # noqa: E402

PROMPTS = [[5, 17, 99, 3, 42], [7, 8, 9, 10, 11, 12, 13, 14, 15], [200, 1, 33], [64, 65, 66, 67]]
MAX_TOKENS = 8
# DBO on every step: two ubatches from 2 tokens on, no cost model (4 requests decode together: every step has >= 4)
DBO_EVERY_STEP = dict(enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=2,
                      dbo_cost_model="off")
ENGINE: dict[str, Any] = dict(dtype="float32", max_num_seqs=8, max_model_len=128, dist_timeout_s=60.0)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory):
    """``saved(family) -> (hf_model, checkpoint_dir)``, each family built and saved once per module."""
    cache: dict[str, tuple[PreTrainedModel, Path]] = {}

    def get(family: str) -> tuple[PreTrainedModel, Path]:
        if family not in cache:
            hf = hf_model(family)
            path = tmp_path_factory.mktemp(family)
            hf.save_pretrained(path)
            cache[family] = (hf, path)
        return cache[family]
    return get


def hf_model(family: str, **overrides: Any) -> PreTrainedModel:
    """``make_hf``'s transformers model, typed as one."""
    hf = make_hf(family, **overrides)
    assert isinstance(hf, PreTrainedModel)
    return hf


def hf_greedy(hf: PreTrainedModel, prompts: list[list[int]], max_new: int = MAX_TOKENS) -> list[list[int]]:
    assert isinstance(hf, GenerationMixin)  # a ...ForCausalLM
    out = []
    for p in prompts:
        with torch.no_grad():
            ids = hf.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


def engine_greedy(path: str, device: str, dp: int, extra: dict[str, Any]) -> dict[str, Any]:
    """Rank body (also run in-process for one rank): greedy tokens, steps and ubatched steps."""
    from runner import LLM

    dist = dict(data_parallel_size=dp, enable_expert_parallel=True) if dp > 1 else {}
    llm = LLM(model=path, device=device, **ENGINE, **dist, **extra)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
        return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "steps": llm.last_stats.num_steps,
                "ubatched": llm.last_stats.num_ubatched_steps}
    finally:
        llm.close()


# ---------------------------------------------------------------------------------------------- logits
@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_logits_equal_transformers(saved, family: str) -> None:
    hf, path = saved(family)
    model, _ = load_model(str(path))
    model.bind_kv_caches(allocate_kv_caches(model.kv_cache_specs(), 32, 4, torch.float32))
    alloc = BlockPool(32)
    lens = [len(p) for p in PROMPTS]
    meta = build_attention_metadata([0] * len(PROMPTS), lens, [alloc.allocate(blocks_needed(n, 4)) for n in lens], 4)
    with torch.no_grad(), set_forward_context(meta):
        logits = model.compute_logits(model(torch.tensor(sum(PROMPTS, [])), meta.positions))
    for p, ours in zip(PROMPTS, logits.split(lens), strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5 * ref.abs().max().item())
    moe = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, StandardSparseMoeBlock)]
    assert len(moe) == MOE_LAYERS.get(family, 0) and model.has_moe_layers == bool(moe)


# ---------------------------------------------------------------------------------------------- greedy, one rank
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_greedy_with_dbo_on_every_step_equals_transformers(saved, family: str) -> None:
    hf, path = saved(family)
    result = engine_greedy(str(path), device_for(1), 1, DBO_EVERY_STEP)
    assert result["tokens"] == hf_greedy(hf, PROMPTS)
    assert result["steps"] > 0 and result["ubatched"] == result["steps"]  # every step ran as two ubatches


@pytest.mark.parametrize("family", DENSE_FAMILIES)
def test_dense_greedy_equals_transformers_and_dbo_has_nothing_to_overlap(saved, family: str,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    hf, path = saved(family)
    with caplog.at_level(logging.WARNING, logger="ubatch.runner"):
        result = engine_greedy(str(path), device_for(1), 1, DBO_EVERY_STEP)
    assert result["tokens"] == hf_greedy(hf, PROMPTS)
    assert result["ubatched"] == 0
    name = FAMILIES[family][1]
    assert f"{name} has no MoE layers: --enable-dbo has nothing to overlap" in caplog.text
    assert "running without it" in caplog.text


# ---------------------------------------------------------------------------------------------- DP=2 + EP
def _all_moe_families(paths: dict[str, str], device: str) -> dict[str, Any]:
    return {family: engine_greedy(path, device, 2, DBO_EVERY_STEP) for family, path in paths.items()}


@pytest.mark.slow
def test_dp2_expert_parallel_dbo_greedy_equals_transformers(saved) -> None:
    paths = {family: str(saved(family)[1]) for family in MOE_FAMILIES}
    per_rank = launch(_all_moe_families, 2, args=(paths, device_for(2)), timeout_s=240, device=device_for(2))
    assert per_rank[0] == per_rank[1]  # every rank returns every output
    for family in MOE_FAMILIES:
        result = per_rank[0][family]
        assert result["tokens"] == hf_greedy(saved(family)[0], PROMPTS), family
        assert result["steps"] > 0 and result["ubatched"] == result["steps"], family  # DBO on every step


# ---------------------------------------------------------------------------------------------- Mixtral layouts
def test_mixtral_loads_the_hub_layout_and_the_fused_one_and_shards_experts(saved, tmp_path: Path) -> None:
    hf, path = saved("mixtral")
    with safe_open(str(path / "model.safetensors"), "pt") as fh:
        keys = set(fh.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in keys  # what transformers writes: the Hub names
    assert "model.layers.0.block_sparse_moe.gate.weight" in keys
    state = hf.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state  # transformers' in-memory names, fused
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((path / "config.json").read_text())
    save_file({n: t.contiguous() for n, t in state.items()}, str(fused / "model.safetensors"))
    hub, _ = load_model(str(path))
    mine, _ = load_model(str(fused))
    for (name, a), b in zip(hub.state_dict().items(), mine.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    for src in (path, fused):
        for rank in range(2):
            model, _ = load_model(str(src), parallel=MoEParallelConfig(ep_rank=rank, ep_size=2))
            experts = model.get_submodule("model.layers.1.mlp.experts")
            assert isinstance(experts, FusedMoE)
            want = state["model.layers.1.mlp.experts.gate_up_proj"][4 * rank: 4 * rank + 4]
            assert torch.equal(experts.w13_weight, want)
            read = {n for n, _ in iter_checkpoint(src, model) if ".experts." in n}
            assert {int(n.split(".")[5]) for n in read} == set(range(4 * rank, 4 * rank + 4))


def _mixtral_with_window(saved, tmp_path: Path, window: int) -> Path:
    _, path = saved("mixtral")
    windowed = tmp_path / f"window{window}"
    windowed.mkdir()
    config = json.loads((path / "config.json").read_text())
    (windowed / "config.json").write_text(json.dumps({**config, "sliding_window": window}))
    (windowed / "model.safetensors").symlink_to(path / "model.safetensors")
    return windowed


def test_mixtral_sliding_window_shorter_than_the_prompts_equals_transformers(saved, tmp_path: Path) -> None:
    """A window of 4 keys under prompts of up to 9 tokens and 8 more generated: the engine (DBO on every step)
    and transformers' windowed attention give the same greedy tokens, and both differ from full attention."""
    hf, _ = saved("mixtral")
    path = _mixtral_with_window(saved, tmp_path, 4)
    full = hf_greedy(hf, PROMPTS)
    hf.config.sliding_window = 4
    try:
        want = hf_greedy(hf, PROMPTS)
    finally:
        hf.config.sliding_window = None
    assert want != full  # the window changes the answer, so the equality below shows it is applied
    got = engine_greedy(str(path), device_for(1), 1, DBO_EVERY_STEP)
    assert got["tokens"] == want and got["ubatched"] == got["steps"] > 0


def test_mixtral_sliding_window_as_long_as_the_context_changes_nothing(saved, tmp_path: Path) -> None:
    hf, _ = saved("mixtral")
    path = _mixtral_with_window(saved, tmp_path, ENGINE["max_model_len"])
    assert engine_greedy(str(path), device_for(1), 1, {})["tokens"] == hf_greedy(hf, PROMPTS)


# ---------------------------------------------------------------------------------------------- configs
def test_qwen2_moe_sparse_step_picks_the_layers_transformers_does() -> None:
    hf = hf_model("qwen2_moe", num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    config = parse_config({**json.loads(hf.config.to_json_string()), "architectures": ["Qwen2MoeForCausalLM"]})
    assert isinstance(config, StandardConfig)
    layers = hf.get_submodule("model.layers")
    assert isinstance(layers, torch.nn.ModuleList)
    want = [type(layer.mlp).__name__ == "Qwen2MoeSparseMoeBlock" for layer in layers]
    assert want == [False, True, False, False, False, True]
    assert [config.is_moe_layer(i) for i in range(6)] == want


@pytest.mark.parametrize("family, edit, message", [
    ("qwen2", {"use_sliding_window": True}, "Qwen2ForCausalLM with sliding-window attention is not supported "
                                            r"\(use_sliding_window=true\)"),
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]},
     r"Qwen3ForCausalLM .* \(layer_types marks layers \[1\] sliding_attention\)"),
    ("qwen2_moe", {"use_sliding_window": True}, "Qwen2MoeForCausalLM with sliding-window attention"),
    ("mixtral", {"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
    ("olmoe", {"num_experts_per_tok": 9}, r"num_experts_per_tok=9 must be in \[1, 8\]"),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}},
     "llama3 RoPE scaling needs low_freq_factor, high_freq_factor, original_max_position_embeddings"),
])
def test_unsupported_settings_are_refused(family: str, edit: dict[str, Any], message: str) -> None:
    cfg_name, model_name, kwargs = FAMILIES[family]
    d = json.loads(getattr(transformers, cfg_name)(**kwargs).to_json_string())
    with pytest.raises(ValueError, match=message):
        parse_config({**d, "architectures": [model_name], **edit})

