"""Unmodified transformers MoE models (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral, OLMoE) made
DBO-capable by ``make_dbo_capable``, run as batch-split ubatches.

Reference: the same model, unpatched. Logits are compared DBO off and on, on one rank and on two EP ranks
(threads over gloo). Exact equality where the arithmetic is the same (one rank: DBO off against the whole
batch, DBO on against each half of the batch run alone), a 1e-5 bound where it cannot be (EP combines the
top-k copies in another order; a half batch's matmuls round differently from the whole batch's).
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")

from ubatch import UBatchConfig, UBatchSlice, UBatchWrapper, set_forward_context  # noqa: E402
from ubatch.integrations.transformers import (  # noqa: E402
    FAMILIES,
    DBOSparseMoeBlock,
    fused_moe_from_block,
    make_dbo_capable,
)
from ubatch.modular_moe.config import MoEParallelConfig  # noqa: E402
from ubatch.modular_moe.layer import FusedMoE  # noqa: E402
from ubatch.modular_moe.router import select_experts  # noqa: E402
from ubatch.modular_moe.runtime import MoERuntime  # noqa: E402
from ubatch.testing.thread_ranks import run_thread_ranks  # noqa: E402
from ubatch.wrapper import batch_ubatch_slices, merge_ubatch_outputs  # noqa: E402

BATCH, SEQ = 4, 9
CONFIG: dict[str, Any] = dict(  # transformers config kwargs
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
    norm_topk_prob=True, mlp_only_layers=[1], initializer_range=0.1, attn_implementation="eager")
MOE_LAYERS = 2  # layer 1 is dense (mlp_only_layers)
SMALL = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             num_experts_per_tok=2, initializer_range=0.1, attn_implementation="eager")
# family -> (config class, model class, config, MoE layers); each family's own features on
MODELS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", CONFIG, MOE_LAYERS),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {**SMALL, "num_experts": 8, "moe_intermediate_size": 32, "intermediate_size": 96,
                   "shared_expert_intermediate_size": 48, "mlp_only_layers": [1], "norm_topk_prob": False}, 2),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {**SMALL, "num_local_experts": 8, "intermediate_size": 32}, 3),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              {**SMALL, "num_experts": 8, "intermediate_size": 32, "norm_topk_prob": False}, 3),
}
_built: dict[str, nn.Module] = {}


def hf_model(family: str) -> nn.Module:
    """The family's reference model, built once per session (tests patch deep copies)."""
    if family not in _built:
        cfg_name, model_name, config, _ = MODELS[family]
        torch.manual_seed(0)
        _built[family] = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**config)).eval()
    return _built[family]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = model.get_submodule("model.layers")
    assert isinstance(layers, nn.ModuleList)
    return layers


def first_layer_experts(model: nn.Module) -> FusedMoE:
    """The patched model's first MoE layer's experts (layer 0 is sparse in every family here)."""
    experts = model.get_submodule("model.layers.0.mlp.experts")
    assert isinstance(experts, FusedMoE)
    return experts


@pytest.fixture(scope="module")
def reference() -> nn.Module:
    return hf_model("qwen3_moe")


def batch(rank: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    return {"input_ids": torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g), "attention_mask": mask}


def ubatched(model: nn.Module, inputs: dict[str, Any], executor: str = "greenlet", **kwargs: Any) -> tuple[Any, list]:
    wrapper = UBatchWrapper(model, UBatchConfig(split_dim="batch", executor=executor, handoff_timeout_s=30))
    try:
        with torch.no_grad(), set_forward_context(ubatch_slices=batch_ubatch_slices(BATCH)):
            return wrapper(**inputs, **kwargs), wrapper.last_yield_counts
    finally:
        wrapper.close()


def plain(model: nn.Module, inputs: dict[str, Any], **kwargs: Any) -> Any:
    with torch.no_grad():
        return model(**inputs, use_cache=False, **kwargs)


# ---- the patch ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(MODELS))
def test_every_sparse_block_becomes_a_fused_moe_with_the_same_weights(family: str) -> None:
    reference = hf_model(family)
    model = make_dbo_capable(copy.deepcopy(reference))
    patched = 0
    for mine, theirs in zip(decoder_layers(model), decoder_layers(reference), strict=True):
        if not type(theirs.mlp).__name__.endswith("SparseMoeBlock"):
            assert type(mine.mlp) is type(theirs.mlp)  # dense layers untouched
            continue
        patched += 1
        assert isinstance(mine.mlp, DBOSparseMoeBlock)
        assert torch.equal(mine.mlp.gate.weight, theirs.get_parameter("mlp.gate.weight"))
        assert torch.equal(mine.mlp.experts.w13_weight, theirs.get_parameter("mlp.experts.gate_up_proj"))
        assert torch.equal(mine.mlp.experts.w2_weight, theirs.get_parameter("mlp.experts.down_proj"))
        if family == "qwen2_moe":  # the shared expert and its gate kept, with transformers' names
            for name in ("shared_expert_gate.weight", "shared_expert.up_proj.weight"):
                assert torch.equal(mine.mlp.get_parameter(name), theirs.get_parameter(f"mlp.{name}"))
            shared = mine.mlp.experts.shared_experts
            assert shared is not None and shared.gate is mine.mlp.shared_expert_gate
        assert mine.mlp.experts.renormalize == (family in ("qwen3_moe", "mixtral"))
    assert patched == MODELS[family][3]
    assert all(m.runtime is model.moe_runtime for m in model.modules() if hasattr(m, "local_expert_range"))


def test_a_patched_or_non_moe_model_is_refused(reference: nn.Module) -> None:
    model = make_dbo_capable(copy.deepcopy(reference))
    with pytest.raises(ValueError, match="make_dbo_capable was already applied"):
        make_dbo_capable(model)
    with pytest.raises(ValueError, match="has no MoE config"):
        make_dbo_capable(nn.Linear(2, 2))


def test_routing_is_bit_compatible_with_the_transformers_router(reference: nn.Module) -> None:
    router = reference.get_submodule("model.layers.0.mlp.gate")
    h = torch.randn(64, CONFIG["hidden_size"], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, hf_weights, hf_ids = router(h)
        logits = F.linear(h, reference.get_parameter("model.layers.0.mlp.gate.weight"))
        weights, ids = select_experts(logits, CONFIG["num_experts_per_tok"], True)
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)


def test_an_ep_rank_keeps_only_its_experts(reference: nn.Module) -> None:
    parallel = MoEParallelConfig(ep_rank=1, ep_size=2, all2all_backend="torch_ll", ep_groups=[object(), object()])
    model = make_dbo_capable(copy.deepcopy(reference), parallel)
    experts = first_layer_experts(model)
    assert experts.local_expert_range == range(4, 8)
    assert torch.equal(experts.w13_weight, reference.get_parameter("model.layers.0.mlp.experts.gate_up_proj")[4:])


class Expert4x(nn.Module):
    """One 4.x per-expert SwiGLU MLP under the family's projection names (``gate_proj``... or Mixtral's ``w1``...)."""

    def __init__(self, hidden: int, inter: int, names: tuple[str, str, str]) -> None:
        super().__init__()
        self.names = names
        for name, (n_in, n_out) in zip(names, ((hidden, inter), (hidden, inter), (inter, hidden)), strict=True):
            self.add_module(name, nn.Linear(n_in, n_out, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (self.get_submodule(n) for n in self.names)
        return down(F.silu(gate(x)) * up(x))


class SparseBlock4x(nn.Module):
    """transformers 4.x's Qwen3-MoE / Mixtral sparse block (nn.Linear gate, per-expert MLPs, returns the router
    logits too), rebuilt for the layout test; its forward follows 4.5x line for line."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, inter: int, names: tuple[str, str, str]) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.gate: nn.Module = nn.Linear(hidden, num_experts, bias=False)  # the layout test swaps in another
        self.experts = nn.ModuleList(Expert4x(hidden, inter, names) for _ in range(num_experts))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, h = hidden_states.shape
        hidden_states = hidden_states.view(-1, h)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for e in range(self.num_experts):
            idx, top_x = torch.where(expert_mask[e])
            out = self.experts[e](hidden_states[top_x]) * routing_weights[top_x, idx, None]
            final.index_add_(0, top_x, out.to(hidden_states.dtype))
        return final.reshape(b, s, h), router_logits


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_transformers_4x_layout_converts_too(family: str) -> None:
    cfg_name, _, kwargs, _ = MODELS[family]
    config = getattr(transformers, cfg_name)(**kwargs)
    spec = FAMILIES[family]
    block = SparseBlock4x(spec.num_experts(config), config.num_experts_per_tok, config.hidden_size,
                          spec.intermediate_size(config), spec.expert_proj_names).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    x = torch.randn(2, 5, config.hidden_size, generator=torch.Generator().manual_seed(2))
    ours = fused_moe_from_block(block, config, MoERuntime(), spec)
    with torch.no_grad():
        want, want_logits = block(x)
        got, got_logits = ours(x)
    assert torch.equal(got_logits, want_logits)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    block.experts = block.experts[:4]
    with pytest.raises(ValueError, match="the block has 4 experts, the config says 8"):
        fused_moe_from_block(block, config, MoERuntime(), spec)
    block.gate = nn.Identity()
    with pytest.raises(ValueError, match=f"unsupported {spec.block_class} layout"):
        fused_moe_from_block(block, config, MoERuntime(), spec)


# ---- logits: one rank ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("family, executor", [(f, "greenlet") for f in MODELS] + [("qwen3_moe", "threads")])
def test_one_rank_logits_equal_the_unpatched_model(family: str, executor: str) -> None:
    reference = hf_model(family)
    model = make_dbo_capable(copy.deepcopy(reference))
    inputs = batch()
    want = plain(reference, inputs).logits
    assert torch.equal(plain(model, inputs).logits, want)  # DBO off: the same arithmetic, bit for bit
    out, yields = ubatched(model, inputs, executor, use_cache=False)
    halves = torch.cat([plain(reference, {k: v[a:b] for k, v in inputs.items()}).logits
                        for a, b in ((0, BATCH // 2), (BATCH // 2, BATCH))])
    assert torch.equal(out.logits, halves)  # each ubatch is the unpatched model on its half, bit for bit
    torch.testing.assert_close(out.logits, want, rtol=0, atol=1e-5)
    assert yields == [2 * MODELS[family][3]] * 2
    assert type(out) is type(plain(reference, inputs)) and out.past_key_values is None


def test_hidden_states_merge_along_the_batch(reference: nn.Module) -> None:
    model = make_dbo_capable(copy.deepcopy(reference))
    inputs = batch()
    out, _ = ubatched(model, inputs, use_cache=False, output_hidden_states=True)
    want = plain(reference, inputs, output_hidden_states=True).hidden_states
    assert len(out.hidden_states) == len(want)
    for got, ref in zip(out.hidden_states, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_the_kv_cache_must_be_off(reference: nn.Module) -> None:
    model = make_dbo_capable(copy.deepcopy(reference))
    with pytest.raises(TypeError, match="DynamicCache objects into one KV cache.*use_cache=False"):
        ubatched(model, batch(), use_cache=True)


# ---- logits: two EP ranks over gloo -----------------------------------------------------------------------
@pytest.mark.parametrize("family, backend", [(f, "torch_ll") for f in MODELS] + [("qwen3_moe", "torch_ht")])
def test_two_ep_ranks_logits_equal_the_unpatched_model(family: str, backend: str) -> None:
    reference = hf_model(family)
    want = [plain(reference, batch(r)).logits for r in (0, 1)]

    def rank_main(rank: int, groups: list[Any]) -> dict[str, Any]:
        parallel = MoEParallelConfig(ep_rank=rank, ep_size=2, all2all_backend=backend, ep_groups=groups,
                                     max_dispatch_tokens_per_rank=BATCH * SEQ, emulate_link="latency_us=200")
        model = make_dbo_capable(copy.deepcopy(reference), parallel)
        off = plain(model, batch(rank)).logits
        on, yields = ubatched(model, batch(rank), use_cache=False)
        return {"off": off, "on": on.logits, "yields": yields,
                "local": first_layer_experts(model).local_expert_range}

    results = run_thread_ranks(2, rank_main, num_groups=2, timeout_s=120)
    for rank, res in enumerate(results):
        assert res["local"] == range(4 * rank, 4 * rank + 4)
        torch.testing.assert_close(res["off"], want[rank], rtol=0, atol=1e-5)
        torch.testing.assert_close(res["on"], want[rank], rtol=0, atol=1e-5)
        assert res["yields"] == [2 * MODELS[family][3]] * 2


# ---- the wrapper's batch split -------------------------------------------------------------------------------
def _batch_slices(bounds: list[tuple[int, int]]) -> list[UBatchSlice]:
    return [UBatchSlice(slice(a, b), slice(a, b)) for a, b in bounds]


@pytest.mark.parametrize("bounds, message", [
    ([(0, 2), (2, 6)], "cover 6 batch rows but no tensor argument has 6 rows"),
    ([(0, 1), (2, 4)], "starts at batch row 2 but the previous one ends at 1: a gap would drop batch rows"),
    ([(0, 3), (2, 4)], "starts at batch row 2 but the previous one ends at 3: an overlap would duplicate"),
])
def test_batch_slices_must_partition_the_batch(bounds: list[tuple[int, int]], message: str) -> None:
    w = UBatchWrapper(lambda x: x, UBatchConfig(split_dim="batch"))
    try:
        with set_forward_context(ubatch_slices=_batch_slices(bounds)), pytest.raises(ValueError, match=message):
            w(torch.zeros(4, 3))
    finally:
        w.close()


def test_batch_split_slices_dim_0_by_sequence_and_merges_in_order() -> None:
    seen: list[tuple[int, ...]] = []

    def model(x: torch.Tensor, scale: float) -> tuple[torch.Tensor, None]:
        seen.append(tuple(x.shape))
        return x * scale, None

    w = UBatchWrapper(model, UBatchConfig(split_dim="batch"))
    x = torch.arange(5 * 3.0).view(5, 3)
    try:
        with set_forward_context(ubatch_slices=batch_ubatch_slices(5)):
            out, none = w(x, scale=2.0)
        assert seen == [(3, 3), (2, 3)] and torch.equal(out, 2 * x) and none is None
        mask = torch.ones(15, dtype=torch.bool)
        with (
            set_forward_context(ubatch_slices=batch_ubatch_slices(5), real_token_mask=mask),
            pytest.raises(ValueError, match="split_dim='batch' cannot slice real_token_mask"),
        ):
            w(x, scale=1.0)
        with (
            set_forward_context(attn_metadata=object(), ubatch_slices=batch_ubatch_slices(5)),
            pytest.raises(ValueError, match="split_dim='batch' takes no attention metadata"),
        ):
            w(x, scale=1.0)
    finally:
        w.close()


def test_batch_split_settings_are_validated() -> None:
    bounds = [(s.request_slice.start, s.request_slice.stop) for s in batch_ubatch_slices(7, 3)]
    assert bounds == [(0, 3), (3, 5), (5, 7)]
    with pytest.raises(ValueError, match="a batch of 1 sequences cannot be split into 2 ubatches"):
        batch_ubatch_slices(1)
    with pytest.raises(ValueError, match="split_dim must be one of tokens, batch, got 'seq'"):
        UBatchConfig(split_dim="seq")
    with pytest.raises(TypeError, match="cannot merge 0-dim ubatch outputs"):
        merge_ubatch_outputs([torch.tensor(1.0), torch.tensor(2.0)])
