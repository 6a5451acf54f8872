"""Our Qwen3-MoE / DeepSeek models vs Hugging Face transformers: logits, greedy generation, loading rules."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from safetensors.torch import save_file

if TYPE_CHECKING:
    from transformers import PreTrainedModel

transformers = pytest.importorskip("transformers")

from runner.attention.kv_cache import allocate_kv_caches, blocks_needed, build_attention_metadata  # noqa: E402
from runner.core.kv_blocks import BlockPool  # noqa: E402
from runner.engine.tokenizer import encode, load_tokenizer  # noqa: E402
from runner.models.base import MoECausalLM  # noqa: E402
from runner.models.loader import iter_checkpoint, load_model, resolve_model_path  # noqa: E402
from runner.models.registry import get_model_class, parse_config  # noqa: E402
from ubatch.forward_context import set_forward_context  # noqa: E402
from ubatch.modular_moe.config import MoEParallelConfig  # noqa: E402
from ubatch.modular_moe.layer import FusedMoE  # noqa: E402

BLOCK = 4
PROMPTS = [[5, 17, 99, 3, 42], [7, 8, 9, 10, 11, 12, 13, 14, 15], [200, 1, 33]]

QWEN = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, mlp_only_layers=[1], initializer_range=0.1, rope_theta=10000.0)
DSV3 = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
            topk_group=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, routed_scaling_factor=2.5,
            initializer_range=0.1, eos_token_id=None)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {  # transformers config class, model class, kwargs
    "qwen3": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", QWEN),
    "dsv3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", DSV3),
    "dsv3-noqlora-neox": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {**DSV3, "q_lora_rank": None,
                                                                          "rope_interleave": False}),
    "dsv3-yarn": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {**DSV3, "max_position_embeddings": 256,
                                                                  "rope_parameters": YARN}),
    "dsv2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {**{k: v for k, v in DSV3.items() if k not in (
        "n_group", "topk_group")}, "q_lora_rank": None, "n_shared_experts": 2, "routed_scaling_factor": 1.0}),
    "dsv2-grouped": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {**DSV3, "q_lora_rank": None,
                                                                    "topk_method": "group_limited_greedy",
                                                                    "routed_scaling_factor": 1.0}),
}


def make_hf(variant: str, seed: int = 0) -> PreTrainedModel:
    cfg_name, model_name, kwargs = VARIANTS[variant]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_name)(**kwargs, attn_implementation="eager")
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():  # HF inits the correction bias to zero; make it matter
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0, 0.05)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory):
    """``saved(variant) -> (hf_model, checkpoint_dir)``, each variant built and saved once per module."""
    cache: dict[str, tuple[PreTrainedModel, Path]] = {}

    def get(variant: str) -> tuple[PreTrainedModel, Path]:
        if variant not in cache:
            hf = make_hf(variant)
            path = tmp_path_factory.mktemp(variant)
            hf.save_pretrained(path)
            cache[variant] = (hf, path)
        return cache[variant]
    return get


def run_step(model: MoECausalLM, ids: list[int], ctx: list[int], qlen: list[int],
             blocks: list[list[int]]) -> torch.Tensor:
    meta = build_attention_metadata(ctx, qlen, blocks, BLOCK)
    with torch.no_grad(), set_forward_context(meta):
        return model.compute_logits(model(torch.tensor(ids), meta.positions))


def fresh_cache(model: MoECausalLM, num_blocks: int = 64) -> BlockPool:
    model.bind_kv_caches(allocate_kv_caches(model.kv_cache_specs(), num_blocks, BLOCK, torch.float32))
    return BlockPool(num_blocks)


def assert_rel_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    err = (ours - ref).abs().max().item() / ref.abs().max().item()
    assert err <= rel, f"relative error {err:.2e} > {rel:.0e}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_logits_match_hf(saved, variant: str) -> None:
    hf, path = saved(variant)
    model, _ = load_model(str(path))
    alloc = fresh_cache(model)
    blocks = [alloc.allocate(blocks_needed(len(p), BLOCK)) for p in PROMPTS]
    logits = run_step(model, sum(PROMPTS, []), [0] * len(PROMPTS), [len(p) for p in PROMPTS], blocks)
    for p, ours in zip(PROMPTS, logits.split([len(p) for p in PROMPTS]), strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].float()
        assert_rel_close(ours, ref)


def test_prefill_split_into_two_microbatches_matches_whole(saved) -> None:
    """A request straddling the ubatch boundary: part 2 has the full seq_len and reads part 1's KV."""
    hf, path = saved("dsv3")
    model, _ = load_model(str(path))
    lens = [len(p) for p in PROMPTS]
    alloc = fresh_cache(model)
    blocks = [alloc.allocate(blocks_needed(n, BLOCK)) for n in lens]
    whole = run_step(model, sum(PROMPTS, []), [0, 0, 0], lens, blocks)
    # ubatch 0: prompt 0 and the first 4 tokens of prompt 1; ubatch 1: the rest of prompt 1 and prompt 2.
    part0 = run_step(model, PROMPTS[0] + PROMPTS[1][:4], [0, 0], [lens[0], 4], blocks[:2])
    part1 = run_step(model, PROMPTS[1][4:] + PROMPTS[2], [4, 0], [lens[1] - 4, lens[2]], blocks[1:])
    torch.testing.assert_close(torch.cat([part0, part1]), whole, atol=1e-5, rtol=1e-5)


def greedy_generate(model: MoECausalLM, prompts: list[list[int]], max_new: int,
                    chunked: dict[int, int]) -> list[list[int]]:
    """Continuous batching: all requests every step; request r's prompt goes in chunks of ``chunked[r]``."""
    alloc = fresh_cache(model)
    num_free = alloc.num_free_blocks
    tokens = [list(p) for p in prompts]
    done = [0] * len(prompts)
    blocks: list[list[int]] = [[] for _ in prompts]
    while any(len(t) - len(p) < max_new for t, p in zip(tokens, prompts, strict=True)):
        reqs, ctx, qlen, ids = [], [], [], []
        for r, t in enumerate(tokens):
            if len(t) - len(prompts[r]) >= max_new:
                continue
            n = min(len(t) - done[r], chunked.get(r, len(t)))
            blocks[r] += alloc.allocate(blocks_needed(done[r] + n, BLOCK) - len(blocks[r]))
            reqs.append(r)
            ctx.append(done[r])
            qlen.append(n)
            ids.extend(t[done[r]: done[r] + n])
        logits = run_step(model, ids, ctx, qlen, [blocks[r] for r in reqs])
        ends = torch.tensor(qlen).cumsum(0) - 1
        for r, n, end in zip(reqs, qlen, ends.tolist(), strict=True):
            done[r] += n
            if done[r] == len(tokens[r]):
                tokens[r].append(int(logits[end].argmax()))
    for b in blocks:
        alloc.free(b)
    assert alloc.num_free_blocks == num_free
    return [t[len(p):] for t, p in zip(tokens, prompts, strict=True)]


@pytest.mark.parametrize("variant", ["qwen3", "dsv3", "dsv2-grouped"])
def test_greedy_generation_matches_hf(saved, variant: str) -> None:
    hf, path = saved(variant)
    model, _ = load_model(str(path))
    ours = greedy_generate(model, PROMPTS, 16, chunked={1: 3})
    for p, out in zip(PROMPTS, ours, strict=True):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out == ref[0, len(p):].tolist()


def test_fused_expert_format_and_ep_sharding(saved, tmp_path: Path) -> None:
    """transformers-5 fused tensors (in memory and on disk) load like per-expert ones; each EP rank keeps its own."""
    hf, path = saved("qwen3")
    full, _ = load_model(str(path))
    state = hf.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    cfg = parse_config(json.loads((path / "config.json").read_text()))
    from_memory = get_model_class("Qwen3MoeForCausalLM")(cfg, None, torch.float32)
    from_memory.load_weights(state.items())
    for (name, a), b in zip(full.state_dict().items(), from_memory.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)

    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    (fused_dir / "config.json").write_text((path / "config.json").read_text())
    half = len(state) // 2  # two shards + index, like large checkpoints
    names = list(state)
    save_file({n: state[n].contiguous() for n in names[:half]}, str(fused_dir / "a.safetensors"))
    save_file({n: state[n].contiguous() for n in names[half:]}, str(fused_dir / "b.safetensors"))
    (fused_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: ("a" if i < half else "b") + ".safetensors" for i, n in enumerate(names)}}))
    for src in (path, fused_dir):
        for rank in range(2):
            model, _ = load_model(str(src), parallel=MoEParallelConfig(ep_rank=rank, ep_size=2))
            experts = model.get_submodule("model.layers.0.mlp.experts")
            assert isinstance(experts, FusedMoE)
            assert experts.local_expert_range == range(4 * rank, 4 * rank + 4)
            assert experts.w13_weight.shape[0] == 4
            ref_gate_up = state["model.layers.0.mlp.experts.gate_up_proj"][4 * rank: 4 * rank + 4]
            torch.testing.assert_close(experts.w13_weight, ref_gate_up, rtol=0, atol=0)
            yielded = [n for n, _ in iter_checkpoint(src, model)]
            expert_ids = {int(n.split(".")[5]) for n in yielded if ".mlp.experts." in n}
            assert expert_ids == set(range(4 * rank, 4 * rank + 4))


def test_missing_misshaped_and_unexpected_weights(saved) -> None:
    hf, path = saved("dsv3")
    model, _ = load_model(str(path))
    state = {k: v for k, v in hf.state_dict().items()}
    missing = dict(state)
    del missing["model.layers.2.self_attn.kv_b_proj.weight"]
    with pytest.raises(ValueError, match=r"missing weights: 'model\.layers\.2\.self_attn\.kv_b_proj\.weight'"):
        model.load_weights(missing.items())
    no_expert = {k: v for k, v in state.items() if k != "model.layers.1.mlp.experts.down_proj"}
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.0\.down_proj\.weight"):
        model.load_weights(no_expert.items())
    bad = dict(state)
    bad["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' has shape \(3, 3\)"):
        model.load_weights(bad.items())
    bad_expert = {**state, "model.layers.1.mlp.experts.3.gate_proj.weight": torch.zeros(2, 2)}
    with pytest.raises(ValueError, match=r"experts\.3\.gate_proj\.weight' has shape"):
        model.load_weights(bad_expert.items())
    extra = {**state, "model.layers.0.self_attn.rogue.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"unexpected weight 'model\.layers\.0\.self_attn\.rogue\.weight'"):
        model.load_weights(extra.items())
    too_many = {**state, "model.layers.1.mlp.experts.8.up_proj.weight": torch.zeros(32, 64)}
    with pytest.raises(ValueError, match="unexpected weight"):
        model.load_weights(too_many.items())
    # Tolerated: rotary buffers of old checkpoints and MTP layers past num_hidden_layers.
    model.load_weights({**state, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(4),
                        "model.layers.3.eh_proj.weight": torch.zeros(2)}.items())


def test_spec_covers_every_parameter(saved) -> None:
    for variant in ("qwen3", "dsv3", "dsv2"):
        _, path = saved(variant)
        model, _ = load_model(str(path))
        spec = model.weight_spec()
        targets = {spec.rename.get(n, n) for n in spec.shapes}
        for name, _ in model.named_parameters():
            assert name in targets or name.endswith(("w13_weight", "w2_weight")), name


def test_unknown_architecture_and_bad_paths(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BloomForCausalLM"]}))
    with pytest.raises(ValueError, match=r"'BloomForCausalLM'.*MixtralForCausalLM.*Qwen3MoeForCausalLM"):
        load_model(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="neither a local directory nor a built-in"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path.parent))
    with pytest.raises(ValueError, match="unsupported RoPE scaling type 'longrope'"):
        parse_config({"architectures": ["Qwen3MoeForCausalLM"], "rope_scaling": {"rope_type": "longrope"}})
    with pytest.raises(ValueError, match="quantized checkpoints"):
        parse_config({"architectures": ["DeepseekV3ForCausalLM"], "quantization_config": {"quant_method": "fp8"}})


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_builtin_tiny_models_cache_and_run(tmp_path: Path, name: str) -> None:
    m1, cfg = load_model(name, cache_dir=tmp_path)
    path = resolve_model_path(name, tmp_path)
    assert path == tmp_path / "models" / name
    stamp = os.stat(path / "model.safetensors").st_mtime_ns
    m2, _ = load_model(name, cache_dir=tmp_path)
    assert os.stat(path / "model.safetensors").st_mtime_ns == stamp
    for (n, a), b in zip(m1.state_dict().items(), m2.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)
    assert not [p for p in (tmp_path / "models").iterdir() if p.name.startswith(".")]
    out = greedy_generate(m1, [[1, 2, 3], [4, 5]], 3, chunked={})
    assert all(len(o) == 3 and all(0 <= t < cfg.vocab_size for t in o) for o in out)
    assert load_tokenizer(name, cache_dir=tmp_path) is None


def test_tokenizer_loaded_when_present(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    path = tmp_path
    (path / "config.json").write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLM"]}))
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"hello": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    loaded = load_tokenizer(str(path))  # only tokenizer.json: transformers' generic fast tokenizer over it
    assert type(loaded).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")
    assert encode(loaded, "hello there") == [0, 1]


@pytest.mark.parametrize("variant", ["qwen3", "dsv3"])
def test_dbo_two_ubatch_threads_match_plain_forward(saved, variant: str) -> None:
    """Real DBO: two ubatch threads share the modules; the straddling request's halves meet through the cache."""
    from ubatch.slicing import maybe_create_ubatch_slices
    from ubatch.wrapper import UBatchWrapper

    _, path = saved(variant)
    model, _ = load_model(str(path))
    lens = [len(p) for p in PROMPTS]
    alloc = fresh_cache(model)
    blocks = [alloc.allocate(blocks_needed(n + 2, BLOCK)) for n in lens]
    plain = run_step(model, sum(PROMPTS, []), [0, 0, 0], lens, blocks)
    wrapper = UBatchWrapper(model)
    try:
        steps = [(sum(PROMPTS, []), [0, 0, 0], lens), ([1, 2, 3], lens, [1, 1, 1])]  # prefill, then a decode
        for step, (ids, ctx, qlen) in enumerate(steps):
            meta = build_attention_metadata(ctx, qlen, blocks, BLOCK)
            slices, _ = maybe_create_ubatch_slices(True, qlen, sum(qlen), len(qlen))
            assert slices is not None  # should_ubatch=True
            if step == 0:
                assert slices[0].request_slice.stop > slices[1].request_slice.start  # request 1 straddles
                for layer in model.model.layers:  # ubatch 1 must find ubatch 0's KV, not the plain run's
                    kv_cache = layer.get_submodule("self_attn").kv_cache
                    assert isinstance(kv_cache, torch.Tensor)
                    kv_cache.zero_()
            with torch.no_grad(), set_forward_context(meta, ubatch_slices=slices):
                logits = model.compute_logits(wrapper(torch.tensor(ids), meta.positions))
            with torch.no_grad(), set_forward_context(meta):
                ref = model.compute_logits(model(torch.tensor(ids), meta.positions))
            torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
            if step == 0:
                torch.testing.assert_close(logits, plain, atol=1e-5, rtol=1e-5)
        assert wrapper.num_ubatched_steps == 2
    finally:
        wrapper.close()
