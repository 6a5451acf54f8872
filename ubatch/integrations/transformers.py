"""Make an unmodified Hugging Face ``Qwen3MoeForCausalLM`` DBO-capable with one call.

:func:`make_dbo_capable` swaps every ``Qwen3MoeSparseMoeBlock`` of the model for a
:class:`DBOQwen3MoeSparseMoeBlock`: the same gate weight (the router stays bit-compatible: fp32 softmax over
the activation-dtype logits, top-k, optional renormalisation, as ``ubatch.modular_moe.router`` mirrors) and a
:class:`~ubatch.modular_moe.layer.FusedMoE` that takes over the experts -- this EP rank's share only; the
transformers expert tensors are released. The ``dbo_yield`` points are inside FusedMoE's kernel, so the
rest of the model needs no change: run transformers' own ``forward`` through
``UBatchWrapper(model, UBatchConfig(split_dim="batch"))`` under ``set_forward_context(ubatch_slices=
batch_ubatch_slices(batch_size))`` and each ubatch is a slice of the batch (see ``examples/
wrap_transformers_model.py``).

Supported transformers versions (checked by layout, not by version number):

- 5.x (tested: 5.23, the version in this project's environment): ``mlp.gate`` is a ``Qwen3MoeTopKRouter``
  with ``weight [E, H]``; ``mlp.experts`` holds fused ``gate_up_proj [E, 2I, H]`` (gate rows, then up rows)
  and ``down_proj [E, H, I]``; the block returns the hidden states. Router logits for
  ``output_router_logits`` are recorded by transformers from the router module, which is replaced here:
  they are not recorded (an inference integration; no auxiliary loss).
- 4.51 - 4.57 (Qwen3-MoE appeared in 4.51): ``mlp.gate`` is an ``nn.Linear(H, E)``; ``mlp.experts`` is a
  ``ModuleList`` of per-expert ``gate_proj``/``up_proj [I, H]`` and ``down_proj [H, I]``; the block returns
  ``(hidden_states, router_logits)``, which the replacement keeps.

Anything else raises ``ValueError`` naming what was found. The KV cache: each ubatch would build its own
``past_key_values``, which cannot be merged into one cache object, so run the ubatched forward with
``use_cache=False`` (the wrapper's merge raises a clear error otherwise); prefill-style scoring and
generation by re-running the full sequence work, incremental decoding with transformers' cache does not.
The patched model's ``state_dict`` is not a transformers checkpoint (expert names and EP sharding differ).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ubatch import trace
from ubatch.modular_moe.config import MoEParallelConfig
from ubatch.modular_moe.layer import FusedMoE
from ubatch.modular_moe.runtime import MoERuntime


class _Gate(nn.Module):
    """Holds the router weight under transformers' name (``mlp.gate.weight``)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)


class DBOQwen3MoeSparseMoeBlock(nn.Module):
    """Qwen3-MoE's sparse block over a FusedMoE: ``[..., H] -> [..., H]`` (or with router logits, as 4.x)."""

    def __init__(self, gate_weight: torch.Tensor, experts: FusedMoE, return_router_logits: bool) -> None:
        super().__init__()
        self.gate = _Gate(gate_weight)
        self.experts = experts
        self.return_router_logits = return_router_logits

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        with trace.compute_span("gate", "R"):
            router_logits = F.linear(flat, self.gate.weight)  # the activation dtype, as transformers computes it
        out = self.experts(flat, router_logits).reshape(shape)
        return (out, router_logits) if self.return_router_logits else out


def _sparse_block_class() -> type:
    try:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    except ImportError as e:
        raise ImportError("make_dbo_capable needs transformers >= 4.51 (the first release with Qwen3-MoE) "
                          f"installed: {e}") from e
    return Qwen3MoeSparseMoeBlock


def fused_moe_from_block(block: nn.Module, config: Any, runtime: MoERuntime) -> DBOQwen3MoeSparseMoeBlock:
    """The DBO-capable replacement of one transformers sparse block (either layout; see the module doc)."""
    num_experts, top_k = config.num_experts, config.num_experts_per_tok
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    gate = block.gate
    experts = block.experts
    if isinstance(gate, nn.Linear) and isinstance(experts, nn.ModuleList):
        layout, gate_weight = "4.x", gate.weight
    elif hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj") and hasattr(gate, "weight"):
        layout, gate_weight = "5.x", gate.weight
    else:
        raise ValueError(f"unsupported Qwen3-MoE block layout (gate {type(gate).__name__}, experts "
                         f"{type(experts).__name__}); make_dbo_capable knows transformers 4.51-4.57 (nn.Linear gate, "
                         "ModuleList of experts) and 5.x (router module, fused gate_up_proj/down_proj)")
    if tuple(gate_weight.shape) != (num_experts, hidden):
        raise ValueError(f"gate weight has shape {tuple(gate_weight.shape)}, expected {(num_experts, hidden)}")
    dtype = gate_weight.dtype
    fused = FusedMoE(num_experts, top_k, hidden, inter, renormalize=bool(config.norm_topk_prob),
                     scoring_func="softmax", runtime=runtime, params_dtype=dtype).to(gate_weight.device)
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
            for e in fused.local_expert_range:
                mlp = experts[e]
                fused.load_expert_weight(e, "gate", mlp.gate_proj.weight)
                fused.load_expert_weight(e, "up", mlp.up_proj.weight)
                fused.load_expert_weight(e, "down", mlp.down_proj.weight)
    return DBOQwen3MoeSparseMoeBlock(gate_weight, fused, return_router_logits=layout == "4.x")


def make_dbo_capable(model: nn.Module, parallel: MoEParallelConfig | None = None) -> nn.Module:
    """Replace every Qwen3-MoE sparse block of ``model`` (in place) by a FusedMoE-backed one; returns ``model``.

    ``parallel``: this rank's expert-parallel settings (default: one rank, no all-to-all). Under EP each
    rank keeps its own experts only, so build the model with the *same* weights on every rank (same seed or
    checkpoint). The layers share one :class:`MoERuntime` (one backend, one modelled link), kept as
    ``model.moe_runtime``. Raises ``ValueError`` if the model has no Qwen3-MoE sparse block (or was already
    patched).
    """
    block_cls = _sparse_block_class()
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_experts_per_tok"):
        raise ValueError(f"{type(model).__name__} has no Qwen3-MoE config (config.num_experts_per_tok missing)")
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, block_cls)]
    if not targets:
        patched = any(isinstance(m, DBOQwen3MoeSparseMoeBlock) for m in model.modules())
        raise ValueError(f"{type(model).__name__} has no transformers Qwen3MoeSparseMoeBlock"
                         + (": make_dbo_capable was already applied" if patched else
                            "; make_dbo_capable supports Qwen3MoeForCausalLM / Qwen3MoeModel"))
    runtime = MoERuntime(parallel)
    for name, block in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, fused_moe_from_block(block, config, runtime))
    model.moe_runtime = runtime
    return model
