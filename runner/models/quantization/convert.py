"""Make a built model FP8 where its checkpoint is (or everywhere, for online quantisation), and quantise a bf16
checkpoint's tensors as they are read.

The model is built as usual (on the meta device), then :func:`apply_fp8` swaps the planned ``nn.Linear`` layers
for :class:`~runner.models.quantization.fp8_linear.Fp8Linear` and turns the planned MoE layers' experts FP8, and
adds the scale tensors to the model's weight spec, so loading checks them like any other tensor.

- From an FP8 checkpoint (:func:`plan_from_checkpoint`) a module is FP8 exactly when the checkpoint holds its scale
  tensor. Router gates (read as plain weights by the routers) and the LM head never are, and a module that
  ``modules_to_not_convert`` lists must not be.
- Online (:func:`plan_online`, ``--quantization fp8`` on a bf16 checkpoint): every linear layer of the decoder
  layers but the router gates, and every MoE layer's experts, as vLLM's ``fp8`` method does;
  :func:`quantize_online` turns each of their weights into FP8 values and block scales while it streams by,
  which is the released format, so the rest of loading is the same.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from runner.models.base import MoECausalLM
from runner.models.quantization.dense_fp8_gemm import DEQUANTIZED, DenseFp8Gemm
from runner.models.quantization.fp8_linear import Fp8Linear
from runner.models.quantization.scheme import Fp8Scheme
from runner.models.weights import EXPERT_RE, canonical_name, wants_weight
from ubatch.fp8 import quantize_blocks, scale_shape

#: linear layers whose weight the routers read directly: they stay in the model's dtype
ROUTER_SUFFIXES = (".mlp.gate", ".shared_expert_gate", ".mlp.router")
logger = logging.getLogger(__name__)


@dataclass
class Fp8Plan:
    """Which modules of a model hold FP8: linear layers by name, MoE layers by index."""

    scheme: Fp8Scheme
    linears: set[str] = field(default_factory=set)
    moe_layers: set[int] = field(default_factory=set)


def _linears(net: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in net.named_modules() if isinstance(m, nn.Linear)}


def plan_from_checkpoint(net: MoECausalLM, scheme: Fp8Scheme, tensor_names: Iterable[str]) -> Fp8Plan:
    """The modules with a ``scheme.scale_name`` tensor in the checkpoint; ``ValueError`` naming a scale that
    belongs to no linear layer, to a router gate, or to a module ``modules_to_not_convert`` lists."""
    spec = net.weight_spec()
    linears = _linears(net)
    plan = Fp8Plan(scheme)
    suffix = f".{scheme.scale_name}"
    other = ".weight_scale" if scheme.block is not None else ".weight_scale_inv"
    for raw in tensor_names:
        name = canonical_name(spec, raw)
        if name.endswith(other):
            raise ValueError(f"unexpected weight {raw!r}: a checkpoint with {scheme.describe()} names its scales "
                             f"'{scheme.scale_name}'")
        if not name.endswith(suffix):
            continue
        module = name[: -len(suffix)]
        m = EXPERT_RE.match(f"{module}.weight")
        if m and int(m.group(1)) in spec.moe_layers:
            plan.moe_layers.add(int(m.group(1)))
            continue
        if not wants_weight(spec, name):  # e.g. DeepSeek-V3's multi-token-prediction layer
            continue
        if scheme.skips(module):
            raise ValueError(f"weight {raw!r}: quantization_config.modules_to_not_convert lists {module!r}, but the "
                             "checkpoint holds it in FP8")
        if module == "lm_head":  # the engine reads the model's dtype off its first parameter, the LM head
            raise ValueError(f"weight {raw!r}: an FP8 lm_head is not supported; keep it in bf16")
        if module.endswith(ROUTER_SUFFIXES):
            raise ValueError(f"weight {raw!r}: FP8 router gates are not supported (the router reads its weight "
                             "in full precision); keep the gate in bf16")
        if module not in linears:
            raise ValueError(f"unexpected weight {raw!r}: {module!r} is not a linear layer of this "
                             f"{type(net).__name__}")
        plan.linears.add(module)
    if plan.moe_layers and plan.moe_layers != set(spec.moe_layers):
        plain = sorted(set(spec.moe_layers) - plan.moe_layers)
        raise ValueError(f"the checkpoint's experts are FP8 in MoE layers {sorted(plan.moe_layers)} but not in "
                         f"{plain}; mixed expert precisions are not supported")
    return plan


def plan_online(net: MoECausalLM, scheme: Fp8Scheme) -> Fp8Plan:
    """Every decoder-layer linear but the router gates, and every MoE layer (vLLM's online ``fp8``)."""
    spec = net.weight_spec()
    linears = {name for name in _linears(net) if name.startswith("model.layers.")
               and not name.endswith(ROUTER_SUFFIXES) and f"{name}.weight" in spec.shapes}
    return Fp8Plan(scheme, linears, set(spec.moe_layers))


def apply_fp8(net: MoECausalLM, plan: Fp8Plan, gemm: DenseFp8Gemm = DEQUANTIZED) -> None:
    """Swap the plan's linear layers for FP8 ones running ``gemm``, make its MoE layers' experts FP8, and list
    the scales in the model's weight spec; logs which GEMM the linear layers run and why."""
    spec = net.weight_spec()
    scheme = plan.scheme
    replaced: dict[int, Fp8Linear] = {}
    for name, linear in _linears(net).items():
        if name in plan.linears:
            replaced[id(linear)] = Fp8Linear.replacing(linear, scheme.block)
            fp8 = replaced[id(linear)]
            fp8.gemm = gemm
            scale = f"{name}.{scheme.scale_name}"
            spec.shapes[scale] = scale_shape(fp8.out_features, fp8.in_features, fp8.block)
            if scale != f"{name}.weight_scale_inv":
                spec.rename[scale] = f"{name}.weight_scale_inv"
    for parent in list(net.modules()):  # every reference, so a layer held twice is replaced in both places
        for child_name, child in list(parent.named_children()):
            if id(child) in replaced:
                setattr(parent, child_name, replaced[id(child)])
    _log_dense_gemm(gemm, list(replaced.values()))
    for layer in plan.moe_layers:
        moe = spec.moe_layers[layer]
        moe.use_fp8_weights(scheme.block)
        spec.expert_scale = scheme.scale_name
        spec.expert_scale_blocks = moe.fp8_blocks


def _log_dense_gemm(gemm: DenseFp8Gemm, layers: list[Fp8Linear]) -> None:
    if not layers:
        return
    fast = sum(layer.uses_fp8_gemm() for layer in layers)
    if fast == len(layers) or gemm.kernel == DEQUANTIZED.kernel:
        logger.info("dense FP8 linears: all %d run %s (%s)", len(layers), gemm.kernel, gemm.reason)
        return
    others = sorted({(layer.out_features, layer.in_features, layer.block) for layer in layers
                     if not layer.uses_fp8_gemm()})
    logger.info("dense FP8 linears: %d of %d run %s (%s); %d dequantise, their [out, in] shapes and blocks %s are "
                "not ones it takes (128 x 128 blocks, in a multiple of 128, out of 64)", fast, len(layers),
                gemm.kernel, gemm.reason, len(layers) - fast, others)


def quantize_online(weights: Iterable[tuple[str, torch.Tensor]], net: MoECausalLM,
                    plan: Fp8Plan) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each planned weight replaced by its FP8 values and ``weight_scale_inv``
    blocks (the names an FP8 checkpoint would hold); everything else passes through."""
    spec = net.weight_spec()
    block = plan.scheme.block
    assert block is not None, "online quantisation is block-wise"
    for raw, tensor in weights:
        name = canonical_name(spec, raw)
        m = EXPERT_RE.match(name)
        planned = (m is not None and m.group(4) == "weight" and int(m.group(1)) in plan.moe_layers) or (
            name.endswith(".weight") and name[: -len(".weight")] in plan.linears)
        if not planned:
            yield name, tensor
            continue
        q, scale = quantize_blocks(tensor, block)
        yield name, q
        yield f"{name}_scale_inv", scale
