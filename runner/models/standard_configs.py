"""Configs of the "standard" decoder families: GQA attention, then a SwiGLU MLP or a routed-expert block.

Llama, Qwen2, Qwen3 (dense) and Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE (MoE) differ only in a few switches, so one
:class:`StandardConfig` holds them under one set of names and each family's ``from_dict`` maps its
``config.json`` onto it (Mixtral and OLMoE call the expert size ``intermediate_size``, Mixtral calls the
expert count ``num_local_experts``, ...). The model built from it is ``runner/models/standard.py``'s; a new
family of this shape is a ``from_dict`` here and a few lines in its own model file.

Switches: ``qkv_bias`` / ``o_bias`` (projection biases), ``qk_norm`` (``"none"``, ``"per_head"``: RMSNorm
over each head's ``head_dim`` as Qwen3, ``"whole"``: over the whole q / k projection as OLMoE), ``clip_qkv``
(OLMoE clamps q, k, v), ``num_experts`` (0: dense), ``shared_expert_intermediate_size`` (0: none; Qwen2-MoE
gates it with a sigmoid), ``decoder_sparse_step`` / ``mlp_only_layers`` (which layers are MoE).

Mixtral's ``sliding_window`` is a per-layer attention option (``runner/attention/options.py``); Qwen2's and
Qwen3's switches (``use_sliding_window``, ``max_window_layers``, ``layer_types``) are refused.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from runner.models.configs import BaseMoEConfig, _filter

QK_NORMS = ("none", "per_head", "whole")


_Config = TypeVar("_Config", bound="StandardConfig")

@dataclass
class StandardConfig(BaseMoEConfig):
    """One decoder family's settings under the shared names (see the module docstring)."""

    head_dim: int | None = None
    num_experts: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    shared_expert_intermediate_size: int = 0
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: str = "none"
    clip_qkv: float | None = None
    sliding_window: int | None = None

    #: the family's name in error messages
    family: ClassVar[str] = "standard"

    @classmethod
    def _build(cls: type[_Config], out: dict[str, Any], d: dict[str, Any]) -> _Config:
        if out.get("mlp_only_layers") is None:
            out["mlp_only_layers"] = []
        cfg = cls(**_filter(cls, out))
        if cfg.head_dim is None:
            cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
        if cfg.qk_norm not in QK_NORMS:
            raise ValueError(f"internal: qk_norm {cfg.qk_norm!r} is not one of {QK_NORMS}")
        if cfg.num_experts and not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
            raise ValueError(f"num_experts_per_tok={cfg.num_experts_per_tok} must be in [1, {cfg.num_experts}] "
                             f"(the number of experts)")
        cfg._finish(d)
        return cfg

    @staticmethod
    def _refuse_sliding_layers(family: str, d: dict[str, Any]) -> None:
        """Qwen2 / Qwen3 style switches (``use_sliding_window``, ``layer_types``): refused when on."""
        sliding = [i for i, t in enumerate(d.get("layer_types") or []) if t == "sliding_attention"]
        if d.get("use_sliding_window") or sliding:
            where = f"layer_types marks layers {sliding} sliding_attention" if sliding else "use_sliding_window=true"
            raise ValueError(f"{family} with sliding-window attention is not supported ({where})")

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Qwen2-MoE's rule (HF ``Qwen2MoeDecoderLayer``); with the defaults every layer of an MoE family."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)


@dataclass
class LlamaConfig(StandardConfig):
    family: ClassVar[str] = "LlamaForCausalLM"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        out = cls._prepare(d)
        bias = bool(out.get("attention_bias", False))
        out.update(num_experts=0, qkv_bias=bias, o_bias=bias, mlp_bias=bool(out.get("mlp_bias", False)),
                   qk_norm="none", sliding_window=None)
        return cls._build(out, d)


@dataclass
class Qwen2Config(StandardConfig):
    family: ClassVar[str] = "Qwen2ForCausalLM"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Qwen2Config:
        cls._refuse_sliding_layers(cls.family, d)
        out = cls._prepare(d)
        out.update(num_experts=0, qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm="none", sliding_window=None)
        return cls._build(out, d)


@dataclass
class Qwen3Config(StandardConfig):
    family: ClassVar[str] = "Qwen3ForCausalLM"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Qwen3Config:
        cls._refuse_sliding_layers(cls.family, d)
        out = cls._prepare(d)
        bias = bool(out.get("attention_bias", False))
        out.update(num_experts=0, qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm="per_head",
                   sliding_window=None)
        return cls._build(out, d)


@dataclass
class MixtralConfig(StandardConfig):
    """Experts of ``intermediate_size``, softmax then top-k renormalised, an optional ``sliding_window``."""

    family: ClassVar[str] = "MixtralForCausalLM"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MixtralConfig:
        out = cls._prepare(d)
        out.update(num_experts=out.get("num_local_experts", 8), moe_intermediate_size=out["intermediate_size"],
                   norm_topk_prob=True, qkv_bias=False, o_bias=False, qk_norm="none", decoder_sparse_step=1,
                   mlp_only_layers=[], shared_expert_intermediate_size=0)
        return cls._build(out, d)


@dataclass
class Qwen2MoeConfig(StandardConfig):
    """QKV bias, a sigmoid-gated shared expert, ``decoder_sparse_step`` / ``mlp_only_layers``."""

    family: ClassVar[str] = "Qwen2MoeForCausalLM"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Qwen2MoeConfig:
        cls._refuse_sliding_layers(cls.family, d)
        out = cls._prepare(d)
        if "num_experts" not in out and "num_local_experts" in out:
            out["num_experts"] = out["num_local_experts"]
        out.update(num_experts=out.get("num_experts", 60), qkv_bias=bool(out.get("qkv_bias", True)), o_bias=False,
                   qk_norm="none", sliding_window=None, moe_intermediate_size=out["moe_intermediate_size"],
                   shared_expert_intermediate_size=out["shared_expert_intermediate_size"] or 0)
        return cls._build(out, d)


@dataclass
class OlmoeConfig(StandardConfig):
    """Experts of ``intermediate_size``; q/k RMSNorm over the whole projection; optional ``clip_qkv``."""

    family: ClassVar[str] = "OlmoeForCausalLM"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OlmoeConfig:
        out = cls._prepare(d)
        if "num_experts" not in out and "num_local_experts" in out:
            out["num_experts"] = out["num_local_experts"]
        bias = bool(out.get("attention_bias", False))
        out.update(num_experts=out.get("num_experts", 64), moe_intermediate_size=out["intermediate_size"],
                   qkv_bias=bias, o_bias=bias, qk_norm="whole", decoder_sparse_step=1, mlp_only_layers=[],
                   shared_expert_intermediate_size=0, sliding_window=None, head_dim=None)
        return cls._build(out, d)


@dataclass
class Qwen3MoeConfig(StandardConfig):
    """Qwen3's attention (per-head q/k RMSNorm, ``attention_bias``) with routed experts of
    ``moe_intermediate_size``, ``decoder_sparse_step`` / ``mlp_only_layers``; ``num_experts`` is also read as
    ``num_local_experts``."""

    family: ClassVar[str] = "Qwen3MoeForCausalLM"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Qwen3MoeConfig:
        cls._refuse_sliding_layers(cls.family, d)
        out = cls._prepare(d)
        if "num_experts" not in out and "num_local_experts" in out:
            out["num_experts"] = out["num_local_experts"]
        bias = bool(out.get("attention_bias", False))
        out.update(num_experts=out.get("num_experts", 8), qkv_bias=bias, o_bias=bias, qk_norm="per_head",
                   sliding_window=None, shared_expert_intermediate_size=0)
        return cls._build(out, d)
