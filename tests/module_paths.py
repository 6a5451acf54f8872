"""Typed access to a model's parts by dotted path (``model.layers.0.mlp.experts``), for tests that inspect a
loaded model: a ``ModuleList`` indexes as ``Module`` and ``Module.__getattr__`` as ``Tensor | Module``, so a chain
of attributes has no useful type; these look the part up and check what it is."""
from __future__ import annotations

import torch

from ubatch.modular_moe.layer import FusedMoE


def tensor_at(module: torch.nn.Module, path: str) -> torch.Tensor:
    """The tensor (parameter, buffer or plain attribute) at dotted ``path`` under ``module``."""
    owner, _, name = path.rpartition(".")
    found = getattr(module.get_submodule(owner), name)
    assert isinstance(found, torch.Tensor), f"{path} is a {type(found).__name__}, not a tensor"
    return found


def experts_of(model: torch.nn.Module, layer: int) -> FusedMoE:
    """Decoder layer ``layer``'s routed experts (``model.layers.{layer}.mlp.experts``)."""
    experts = model.get_submodule(f"model.layers.{layer}.mlp.experts")
    assert isinstance(experts, FusedMoE), f"layer {layer}'s experts are a {type(experts).__name__}"
    return experts
