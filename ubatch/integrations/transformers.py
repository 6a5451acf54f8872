"""Make an unmodified Hugging Face MoE model DBO-capable with one call.

:func:`make_dbo_capable` swaps every sparse MoE block of a Qwen3-MoE, Qwen2-MoE, Mixtral or OLMoE model for a
:class:`DBOSparseMoeBlock`: the same router (bit-compatible), Qwen2-MoE's shared expert, and a ``FusedMoE``
holding this EP rank's experts, whose kernel has the ``dbo_yield`` points. Families differ as data
(:data:`FAMILIES`); transformers 5.x and 4.x layouts are told apart by layout, anything else raises. Run the
ubatched forward with ``use_cache=False`` (ubatches' KV caches cannot be merged); router logits are not
recorded, and the patched ``state_dict`` is not a transformers checkpoint.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ubatch import trace
from ubatch.modular_moe.config import MoEParallelConfig
from ubatch.modular_moe.layer import FusedMoE
from ubatch.modular_moe.runtime import MoERuntime


@dataclass(frozen=True)
class BlockFamily:
    """One transformers sparse-block class and what this module must know about it."""

    module: str  # the transformers module that defines the block
    block_class: str
    num_experts_attr: str  # the config attribute holding the expert count ...
    intermediate_attr: str  # ... and one expert's intermediate size
    always_renormalize: bool = False  # Mixtral: top-k weights renormalised; others follow norm_topk_prob
    expert_proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # 4.x per-expert MLPs
    shared_expert: bool = False  # Qwen2-MoE: ``shared_expert`` scaled by ``sigmoid(shared_expert_gate(x))``

    def num_experts(self, config: Any) -> int:
        return int(getattr(config, self.num_experts_attr))

    def intermediate_size(self, config: Any) -> int:
        return int(getattr(config, self.intermediate_attr))

    def renormalize(self, config: Any) -> bool:
        return self.always_renormalize or bool(config.norm_topk_prob)


_MODELS = "transformers.models."
FAMILIES: dict[str, BlockFamily] = {
    "qwen3_moe": BlockFamily(_MODELS + "qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock", "num_experts",
                             "moe_intermediate_size"),
    "qwen2_moe": BlockFamily(_MODELS + "qwen2_moe.modeling_qwen2_moe", "Qwen2MoeSparseMoeBlock", "num_experts",
                             "moe_intermediate_size", shared_expert=True),
    "mixtral": BlockFamily(_MODELS + "mixtral.modeling_mixtral", "MixtralSparseMoeBlock", "num_local_experts",
                           "intermediate_size", always_renormalize=True, expert_proj_names=("w1", "w3", "w2")),
    "olmoe": BlockFamily(_MODELS + "olmoe.modeling_olmoe", "OlmoeSparseMoeBlock", "num_experts",
                         "intermediate_size"),
}


class _Gate(nn.Module):
    """Holds the router weight under transformers' name (``mlp.gate.weight``)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)


class GatedSharedExpert(nn.Module):
    """Qwen2-MoE's shared expert, ``sigmoid(gate(x)) * mlp(x)``, run by FusedMoE's kernel beside the routed ones."""

    def __init__(self, mlp: nn.Module, gate: nn.Module) -> None:
        super().__init__()
        self.mlp, self.gate = mlp, gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.sigmoid(self.gate(x)) * self.mlp(x)


class DBOSparseMoeBlock(nn.Module):
    """A sparse block over a FusedMoE: ``[..., H] -> [..., H]`` (or with router logits, as 4.x).

    A shared expert keeps transformers' module and names (``shared_expert``, ``shared_expert_gate``).
    """

    def __init__(self, gate_weight: torch.Tensor, experts: FusedMoE, return_router_logits: bool,
                 shared: GatedSharedExpert | None = None) -> None:
        super().__init__()
        self.gate = _Gate(gate_weight)
        if shared is not None:  # before `experts`, so these are the parameters' first (transformers') names
            self.shared_expert, self.shared_expert_gate = shared.mlp, shared.gate
        self.experts = experts
        self.return_router_logits = return_router_logits

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        with trace.compute_span("gate", "R"):
            router_logits = F.linear(flat, self.gate.weight)  # the activation dtype, as transformers computes it
        out = self.experts(flat, router_logits).reshape(shape)
        return (out, router_logits) if self.return_router_logits else out


def _block_classes() -> dict[type[nn.Module], BlockFamily]:
    """The sparse-block classes of the installed transformers (a family it does not have is left out)."""
    try:
        importlib.import_module("transformers")
    except ImportError as e:
        raise ImportError(f"make_dbo_capable needs transformers installed: {e}") from e
    found: dict[type[nn.Module], BlockFamily] = {}
    for family in FAMILIES.values():
        try:
            module = importlib.import_module(family.module)
        except ImportError:
            continue
        cls = module.__dict__.get(family.block_class)
        if isinstance(cls, type):
            found[cls] = family
    return found


def fused_moe_from_block(block: nn.Module, config: Any, runtime: MoERuntime,
                         family: BlockFamily = FAMILIES["qwen3_moe"]) -> DBOSparseMoeBlock:
    """The DBO-capable replacement of one transformers sparse block (either layout; see the module doc)."""
    num_experts, top_k = family.num_experts(config), config.num_experts_per_tok
    hidden, inter = config.hidden_size, family.intermediate_size(config)
    # transformers' own modules, of either layout: told apart below, by their types and attributes
    gate: Any = block.gate
    experts: Any = block.experts
    if isinstance(gate, nn.Linear) and isinstance(experts, nn.ModuleList):
        layout, gate_weight = "4.x", gate.weight
    elif hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj") and hasattr(gate, "weight"):
        layout, gate_weight = "5.x", gate.weight
    else:
        raise ValueError(f"unsupported {family.block_class} layout (gate {type(gate).__name__}, experts "
                         f"{type(experts).__name__}); make_dbo_capable knows transformers 4.x (nn.Linear gate, "
                         "ModuleList of experts) and 5.x (router module, fused gate_up_proj/down_proj)")
    if tuple(gate_weight.shape) != (num_experts, hidden):
        raise ValueError(f"gate weight has shape {tuple(gate_weight.shape)}, expected {(num_experts, hidden)}")
    shared = GatedSharedExpert(block.get_submodule("shared_expert"), block.get_submodule("shared_expert_gate")) \
        if family.shared_expert else None
    dtype = gate_weight.dtype
    fused = FusedMoE(num_experts, top_k, hidden, inter, renormalize=family.renormalize(config),
                     scoring_func="softmax", shared_experts=shared, runtime=runtime,
                     params_dtype=dtype).to(gate_weight.device)
    with torch.no_grad():
        if layout == "5.x":
            w13, w2 = experts.gate_up_proj, experts.down_proj
            want13, want2 = (num_experts, 2 * inter, hidden), (num_experts, hidden, inter)
            if tuple(w13.shape) != want13 or tuple(w2.shape) != want2:
                raise ValueError(f"fused experts have gate_up_proj {tuple(w13.shape)} and down_proj "
                                 f"{tuple(w2.shape)}; expected {want13} and {want2} (gate rows, then up rows)")
            fused.load_fused_experts(w13, w2)
        else:
            if len(experts) != num_experts:
                raise ValueError(f"the block has {len(experts)} experts, the config says {num_experts}")
            gate_name, up_name, down_name = family.expert_proj_names
            for e in fused.local_expert_range:
                mlp = experts[e]
                fused.load_expert_weight(e, "gate", mlp.get_submodule(gate_name).weight)
                fused.load_expert_weight(e, "up", mlp.get_submodule(up_name).weight)
                fused.load_expert_weight(e, "down", mlp.get_submodule(down_name).weight)
    return DBOSparseMoeBlock(gate_weight, fused, return_router_logits=layout == "4.x", shared=shared)


def make_dbo_capable(model: nn.Module, parallel: MoEParallelConfig | None = None) -> nn.Module:
    """Replace every sparse MoE block of ``model`` (in place) by a FusedMoE-backed one; returns ``model``.

    ``parallel``: this rank's expert-parallel settings (default: one rank, no all-to-all). Under EP each
    rank keeps its own experts only, so build the model with the *same* weights on every rank (same seed or
    checkpoint). The layers share one :class:`MoERuntime` (one backend, one modelled link), kept as
    ``model.moe_runtime``. Raises ``ValueError`` if the model has no sparse block of a family in
    :data:`FAMILIES` (or was already patched).
    """
    classes = _block_classes()
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_experts_per_tok"):
        raise ValueError(f"{type(model).__name__} has no MoE config (config.num_experts_per_tok missing)")
    targets: list[tuple[str, nn.Module, BlockFamily]] = [(name, m, family) for name, m in model.named_modules()
               for cls, family in classes.items() if isinstance(m, cls)]
    if not targets:
        patched = any(isinstance(m, DBOSparseMoeBlock) for m in model.modules())
        known = ", ".join(f.block_class for f in FAMILIES.values())
        raise ValueError(f"{type(model).__name__} has no transformers sparse MoE block"
                         + (": make_dbo_capable was already applied" if patched else
                            f"; make_dbo_capable supports {known}"))
    runtime = MoERuntime(parallel)
    for name, block, family in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, fused_moe_from_block(block, config, runtime, family))
    setattr(model, "moe_runtime", runtime)  # noqa: B010  (a plain attribute: nn.Module's typed __setattr__ is for submodules)
    return model
