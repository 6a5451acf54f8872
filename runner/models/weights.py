"""Hugging Face tensor names -> model parameters, with expert-parallel filtering and strict checking.

A model's :class:`WeightSpec` (exact names and shapes) says where each tensor goes, which tensors a rank must
see and what a built-in tiny checkpoint holds; a missing, mis-shaped or unknown tensor is an error, because a
silently skipped one gives a model that runs and emits garbage. Experts load per expert, fused (transformers
5's in-memory layout) or in gpt-oss's fused layout, each EP rank keeping its own; ``aliases`` rewrite a family's
other names (Mixtral's ``block_sparse_moe``) first.

FP8 checkpoints add a scale tensor per quantised matrix (``<module>.weight_scale_inv``, or ``weight_scale`` for
per-tensor scales, which may be stored as a scalar: it loads as a 1 x 1 grid); the spec lists the linear layers'
scales by name and the experts' by rule (``expert_scale``), and an FP8 tensor never loads into a bf16 parameter
or the reverse, since a cast would silently drop or miss its scales.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from ubatch.fp8 import FP8_DTYPE, scale_shape
from ubatch.modular_moe.layer import FusedMoE

EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\."
                       r"(weight|bias|weight_scale_inv|weight_scale)$")
SCALE_KINDS = ("weight_scale_inv", "weight_scale")
FUSED_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
FUSED_LAYOUTS = ("stacked", "gpt_oss")
LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
SHARD_OF = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
ALWAYS_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


@dataclass
class WeightSpec:
    """What a model's HF checkpoint holds (non-expert tensors by name; experts by rule)."""

    shapes: dict[str, tuple[int, ...]]
    num_hidden_layers: int
    num_experts: int
    moe_intermediate_size: int
    hidden_size: int
    moe_layers: Mapping[int, FusedMoE]
    local_experts: range
    num_extra_layers: int = 0
    tied_lm_head: bool = False
    rename: dict[str, str] = field(default_factory=dict)
    #: (regex, replacement) pairs applied in order to every checkpoint name (:func:`canonical_name`)
    aliases: tuple[tuple[re.Pattern[str], str], ...] = ()
    expert_bias: bool = False  # experts have biases (gpt-oss)
    fused_layout: str = "stacked"  # how fused expert tensors are laid out (FUSED_LAYOUTS, module docstring)
    #: the experts' FP8 scale tensor kind (``weight_scale_inv`` / ``weight_scale``) when they are FP8
    expert_scale: str | None = None
    #: the scale blocks of (gate and up, down) when the experts are FP8
    expert_scale_blocks: tuple[tuple[int, int], tuple[int, int]] | None = None

    def __post_init__(self) -> None:
        if self.fused_layout not in FUSED_LAYOUTS:
            raise ValueError(f"unknown fused expert layout {self.fused_layout!r}; expected one of {FUSED_LAYOUTS}")

    def expert_shape(self, proj: str, kind: str = "weight") -> tuple[int, ...]:
        i, h = self.moe_intermediate_size, self.hidden_size
        if kind in SCALE_KINDS:
            if self.expert_scale_blocks is None:
                raise ValueError(f"this model's experts have no FP8 {kind}")
            b13, b2 = self.expert_scale_blocks
            return scale_shape(h, i, b2) if proj == "down_proj" else scale_shape(i, h, b13)
        if kind == "bias":
            return (h,) if proj == "down_proj" else (i,)
        return (h, i) if proj == "down_proj" else (i, h)

    def expert_kinds(self) -> tuple[str, ...]:
        kinds = ("weight", "bias") if self.expert_bias else ("weight",)
        return kinds + (self.expert_scale,) if self.expert_scale is not None else kinds

    def all_names(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Every tensor of a full (all-experts, per-expert format) checkpoint, with its shape."""
        yield from self.shapes.items()
        for layer in sorted(self.moe_layers):
            for e in range(self.num_experts):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    for kind in self.expert_kinds():
                        yield f"model.layers.{layer}.mlp.experts.{e}.{proj}.{kind}", self.expert_shape(proj, kind)


def _check_shape(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"weight {name!r} has shape {tuple(got)}, expected {tuple(want)}")


def canonical_scale(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A per-tensor FP8 scale (``*.weight_scale``, stored as ``[]`` or ``[1]``) as the 1 x 1 grid it loads into."""
    if name.endswith(".weight_scale") and tensor.dim() < 2 and tensor.numel() == 1:
        return tensor.reshape(1, 1)
    return tensor


def _check_dtype(name: str, tensor: torch.Tensor, target: torch.Tensor) -> None:
    if (tensor.dtype == FP8_DTYPE) != (target.dtype == FP8_DTYPE):
        raise ValueError(f"weight {name!r} is {tensor.dtype}, but the model holds it as {target.dtype} (an FP8 "
                         "weight needs its scale tensor, and quantization_config must say the checkpoint is FP8)")


def canonical_name(spec: WeightSpec, name: str) -> str:
    """A checkpoint tensor's name under the spec's naming (its ``aliases`` applied)."""
    for pattern, replacement in spec.aliases:
        name = pattern.sub(replacement, name)
    return name


def wants_weight(spec: WeightSpec, name: str) -> bool:
    """False for tensors this rank can skip without reading (other ranks' experts, MTP layers, buffers)."""
    name = canonical_name(spec, name)
    if ALWAYS_IGNORED.search(name) or (spec.tied_lm_head and name == "lm_head.weight"):
        return False
    m = LAYER_RE.match(name)
    if m and spec.num_hidden_layers <= int(m.group(1)) < spec.num_hidden_layers + spec.num_extra_layers:
        return False
    m = EXPERT_RE.match(name)
    if m and int(m.group(1)) in spec.moe_layers and int(m.group(2)) < spec.num_experts:
        return int(m.group(2)) in spec.local_experts
    return True


def _fused_shape(spec: WeightSpec, kind: str, bias: bool) -> tuple[int, ...]:
    e, i, h = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
    if bias:
        return (e, 2 * i) if kind == "gate_up_proj" else (e, h)
    if spec.fused_layout == "gpt_oss":
        return (e, h, 2 * i) if kind == "gate_up_proj" else (e, i, h)
    return (e, 2 * i, h) if kind == "gate_up_proj" else (e, h, i)


def _rows(tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of an in-memory tensor (``expand_fused``'s ``read_rows``)."""
    return tensor[start:stop]


def expand_fused(spec: WeightSpec, name: str, shape: tuple[int, ...],
                 read_rows: Callable[[int, int], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Turn a fused expert tensor into per-expert (name, tensor) pairs, reading only local experts' rows."""
    m = FUSED_RE.match(name)
    assert m is not None
    layer, kind, bias = int(m.group(1)), m.group(2), m.group(3) is not None
    if layer not in spec.moe_layers:
        raise ValueError(f"unexpected weight {name!r}: layer {layer} is not an MoE layer")
    if bias and not spec.expert_bias:
        raise ValueError(f"unexpected weight {name!r}: this model's experts have no biases")
    _check_shape(name, shape, _fused_shape(spec, kind, bias))
    i = spec.moe_intermediate_size
    gpt_oss = spec.fused_layout == "gpt_oss"
    suffix = "bias" if bias else "weight"
    r = spec.local_experts
    rows = read_rows(r.start, r.stop)
    prefix = f"model.layers.{layer}.mlp.experts"
    for k, expert in enumerate(r):
        row = rows[k].t() if gpt_oss and not bias else rows[k]  # gpt-oss stores [in, out]: ours is [out, in]
        if kind == "gate_up_proj":
            gate, up = (row[0::2], row[1::2]) if gpt_oss else (row[:i], row[i:])
            yield f"{prefix}.{expert}.gate_proj.{suffix}", gate
            yield f"{prefix}.{expert}.up_proj.{suffix}", up
        else:
            yield f"{prefix}.{expert}.down_proj.{suffix}", row


def load_hf_weights(model: nn.Module, spec: WeightSpec, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors into ``model``; raise on unexpected, mis-shaped or missing tensors."""
    params: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    params.update(dict(model.named_buffers(remove_duplicate=False)))
    loaded: set[str] = set()
    loaded_experts: set[tuple[int, int, str, str]] = set()

    def load_one(name: str, tensor: torch.Tensor) -> None:
        tensor = canonical_scale(name, tensor)
        m = EXPERT_RE.match(name)
        if m and m.group(4) == "bias" and not spec.expert_bias:
            raise ValueError(f"unexpected weight {name!r}: this model's experts have no biases")
        if m and m.group(4) in SCALE_KINDS and m.group(4) != spec.expert_scale:
            raise ValueError(f"unexpected weight {name!r}: this model's experts have no FP8 {m.group(4)}")
        if not wants_weight(spec, name):
            if m:
                _check_shape(name, tensor.shape, spec.expert_shape(m.group(3), m.group(4)))
            return
        if m and int(m.group(1)) in spec.moe_layers and int(m.group(2)) < spec.num_experts:
            layer, expert, proj, kind = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
            _check_shape(name, tensor.shape, spec.expert_shape(proj, kind))
            if kind in SCALE_KINDS:
                if spec.moe_layers[layer].load_expert_scale(expert, SHARD_OF[proj], tensor):
                    loaded_experts.add((layer, expert, proj, kind))
                return
            shard = SHARD_OF[proj] + ("_bias" if kind == "bias" else "")
            if spec.moe_layers[layer].load_expert_weight(expert, shard, tensor):
                loaded_experts.add((layer, expert, proj, kind))
            return
        if name not in spec.shapes:
            raise ValueError(f"unexpected weight {name!r} (not part of this {type(model).__name__} checkpoint)")
        _check_shape(name, tensor.shape, spec.shapes[name])
        target = params.get(spec.rename.get(name, name))
        if target is None:
            raise RuntimeError(f"internal: no parameter for weight {name!r}")
        _check_dtype(name, tensor, target)
        with torch.no_grad():
            target.copy_(tensor)
        loaded.add(name)

    for name, tensor in weights:
        name = canonical_name(spec, name)
        if FUSED_RE.match(name):
            for sub_name, sub in expand_fused(spec, name, tuple(tensor.shape), functools.partial(_rows, tensor)):
                load_one(sub_name, sub)
        else:
            load_one(name, tensor)

    missing = [n for n in spec.shapes if n not in loaded]
    for layer in sorted(spec.moe_layers):
        for e in spec.local_experts:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                for kind in spec.expert_kinds():
                    if (layer, e, proj, kind) not in loaded_experts:
                        missing.append(f"model.layers.{layer}.mlp.experts.{e}.{proj}.{kind}")
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"missing weights: {', '.join(repr(n) for n in missing[:5])}{more}")
