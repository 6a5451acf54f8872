"""Model configs parsed from a Hugging Face ``config.json`` dict, with HF's field names.

Why our own dataclasses instead of ``transformers`` configs: the runner must load a checkpoint without
transformers installed, and it must fail loudly on features the models here do not implement (quantised
weights in a scheme other than FP8, unsupported RoPE scaling, sliding windows) instead of silently computing
something else.
Unknown keys are ignored, so newer config files still load.

Aliases handled (all seen in the wild):
- Qwen3-MoE (``standard_configs.py``): ``num_experts`` (original checkpoints) or ``num_local_experts``;
- DeepSeek: ``n_routed_experts`` / ``num_local_experts``; ``num_nextn_predict_layers`` / ``num_mtp_layers``;
- RoPE: top-level ``rope_theta`` + ``rope_scaling`` (transformers 4 / original repos) or a
  ``rope_parameters`` dict (transformers 5). Supported types: ``default``, ``yarn`` and ``llama3``.
- dtype: ``torch_dtype`` (transformers 4) or ``dtype`` (transformers 5).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from runner.models.quantization.scheme import Fp8Scheme, parse_quantization_config

_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16}
SUPPORTED_ROPE_TYPES = ("default", "yarn", "llama3")


@dataclass
class RopeConfig:
    """Normalised RoPE parameters (HF ``rope_parameters`` semantics)."""

    rope_theta: float = 10000.0
    rope_type: str = "default"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3

    @classmethod
    def from_hf(cls, d: dict[str, Any], max_position_embeddings: int) -> RopeConfig:
        params = d.get("rope_parameters")
        params = dict(d.get("rope_scaling") or {}) if params is None else dict(params)
        if "rope_theta" not in params or params["rope_theta"] is None:
            params["rope_theta"] = d.get("rope_theta", 10000.0)
        rope_type = params.get("rope_type") or params.get("type") or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported RoPE scaling type {rope_type!r} (rope_parameters/rope_scaling = {params}); "
                             f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        cfg = cls(rope_theta=float(params["rope_theta"]), rope_type=rope_type)
        for name in ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
                     "low_freq_factor", "high_freq_factor"):
            if params.get(name) is not None:
                setattr(cfg, name, float(params[name]))
        if "truncate" in params and params["truncate"] is not None:
            cfg.truncate = bool(params["truncate"])
        if rope_type == "llama3":
            missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                       if params.get(k) is None]
            if missing:
                raise ValueError(f"llama3 RoPE scaling needs {', '.join(missing)} (rope_parameters = {params})")
            cfg.original_max_position_embeddings = int(params["original_max_position_embeddings"])
        if rope_type == "yarn":
            cfg.original_max_position_embeddings = int(
                d.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                or max_position_embeddings)
        return cfg


def _filter(cls: type, d: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in d.items() if k in names}


def _common_checks(d: dict[str, Any]) -> None:
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}: only 'silu' (SwiGLU) is implemented")


@dataclass
class BaseMoEConfig:
    """Fields shared by every supported architecture."""

    architectures: list[str] = field(default_factory=list)
    model_type: str = ""
    vocab_size: int = 32000
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    moe_intermediate_size: int = 64
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    rope_theta: float = 10000.0
    rope: RopeConfig = field(default_factory=RopeConfig)
    quantization: Fp8Scheme | None = None  # quantization_config (runner/models/quantization/scheme.py)

    @property
    def dtype(self) -> torch.dtype | None:
        return _DTYPES.get(self.torch_dtype) if self.torch_dtype else None

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else [self.eos_token_id]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BaseMoEConfig:
        """Parse ``config.json``'s fields; each architecture's config defines it."""
        raise NotImplementedError(f"{cls.__name__} does not parse a config.json")

    @classmethod
    def _prepare(cls, d: dict[str, Any]) -> dict[str, Any]:
        _common_checks(d)
        out = dict(d)
        out.setdefault("torch_dtype", d.get("dtype"))
        out["quantization"] = parse_quantization_config(d.get("quantization_config"))
        if out.get("num_key_value_heads") is None:
            out["num_key_value_heads"] = out.get("num_attention_heads", 4)
        return out

    def _finish(self, d: dict[str, Any]) -> None:
        self.rope = RopeConfig.from_hf(d, self.max_position_embeddings)
        self.rope_theta = self.rope.rope_theta

    def check_context_length(self, max_model_len: int) -> None:
        """Raise ``ValueError`` if this model cannot serve contexts of ``max_model_len`` tokens (default: any)."""


@dataclass
class DeepseekV2Config(BaseMoEConfig):
    """DeepSeek-V2 and -V3 (``model_type`` tells which router HF uses)."""

    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    n_routed_experts: int = 8
    n_shared_experts: int | None = 1
    first_k_dense_replace: int = 0
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    topk_method: str | None = None
    scoring_func: str | None = None
    rope_interleave: bool | None = None
    num_nextn_predict_layers: int = 0
    mlp_bias: bool = False

    @property
    def is_v3(self) -> bool:
        return self.model_type == "deepseek_v3" or "DeepseekV3ForCausalLM" in self.architectures

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeepseekV2Config:
        out = cls._prepare(d)
        if "n_routed_experts" not in out and "num_local_experts" in out:
            out["n_routed_experts"] = out["num_local_experts"]
        if out.get("num_nextn_predict_layers") is None:
            out["num_nextn_predict_layers"] = out.get("num_mtp_layers") or 0
        cfg = cls(**_filter(cls, out))
        cfg.first_k_dense_replace = cfg.first_k_dense_replace or 0
        if cfg.is_v3:
            # HF's DeepseekV3TopkRouter always uses sigmoid + correction bias + group-limited top-k
            # (noaux_tc), whatever topk_method says; the original repo's V3 configs say exactly that.
            cfg.scoring_func = cfg.scoring_func or "sigmoid"
            cfg.topk_method = cfg.topk_method or "noaux_tc"
            cfg.rope_interleave = True if cfg.rope_interleave is None else cfg.rope_interleave
            cfg.n_group = cfg.n_group or 1
            cfg.topk_group = cfg.topk_group or 1
        else:
            cfg.scoring_func = cfg.scoring_func or "softmax"
            cfg.topk_method = cfg.topk_method or "greedy"
            cfg.rope_interleave = True  # V2 rotates interleaved pairs (HF uses complex multiplication)
        if cfg.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"unsupported DeepSeek topk_method {cfg.topk_method!r}")
        if cfg.scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"unsupported DeepSeek scoring_func {cfg.scoring_func!r}")
        if cfg.topk_method in ("group_limited_greedy", "noaux_tc") and (not cfg.n_group or not cfg.topk_group):
            raise ValueError(f"topk_method={cfg.topk_method!r} needs n_group and topk_group")
        cfg._finish(d)
        return cfg

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace and self.n_routed_experts > 0


GPT_OSS_LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass
class GptOssConfig(BaseMoEConfig):
    """gpt-oss: every layer MoE (router and expert biases, clamped SwiGLU), attention sinks, and layers that
    alternate a sliding window with full attention (``layer_types``; HF's default: even layers windowed)."""

    head_dim: int | None = None
    num_local_experts: int = 8
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_bias: bool = True

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GptOssConfig:
        quant = d.get("quantization_config")
        if quant:
            method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
            raise ValueError(f"gpt-oss checkpoints quantized with {method!r} (quantization_config.quant_method) "
                             "are not supported yet: use a bf16 checkpoint (its experts as gate_up_proj / "
                             "down_proj tensors, not *_blocks / *_scales)")
        out = cls._prepare(d)
        out["moe_intermediate_size"] = out.get("intermediate_size", cls.intermediate_size)  # the experts' width
        cfg = cls(**_filter(cls, out))
        if cfg.head_dim is None:
            cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
        if cfg.layer_types is None:
            cfg.layer_types = [GPT_OSS_LAYER_TYPES[i % 2] for i in range(cfg.num_hidden_layers)]
        if len(cfg.layer_types) != cfg.num_hidden_layers:
            raise ValueError(f"layer_types has {len(cfg.layer_types)} entries for {cfg.num_hidden_layers} layers")
        for t in cfg.layer_types:
            if t not in GPT_OSS_LAYER_TYPES:
                raise ValueError(f"unsupported layer type {t!r} in layer_types; supported: "
                                 f"{', '.join(GPT_OSS_LAYER_TYPES)}")
        if "sliding_attention" in cfg.layer_types and (cfg.sliding_window is None or cfg.sliding_window < 1):
            raise ValueError(f"layer_types has sliding_attention layers but sliding_window={cfg.sliding_window!r}")
        cfg._finish(d)
        return cfg

    def is_moe_layer(self, layer_idx: int) -> bool:
        return True

    def layer_window(self, layer_idx: int) -> int | None:
        """The sliding window of layer ``layer_idx``, ``None`` for a full-attention layer."""
        assert self.layer_types is not None
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None


@dataclass
class Glm4MoeConfig(DeepseekV2Config):
    """GLM-4.5/4.6 MoE: DeepSeek-V3's router (sigmoid scores, ``e_score_correction_bias``, ``n_group`` /
    ``topk_group``, ``routed_scaling_factor``), shared experts and ``first_k_dense_replace`` leading dense
    layers, over GQA attention with biased q/k/v, optional q/k RMSNorm and RoPE on the first
    ``partial_rotary_factor`` of each head (``rope_parameters`` in transformers 5, top level before)."""

    head_dim: int | None = None
    use_qk_norm: bool = False
    partial_rotary_factor: float = 0.5
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True

    @property
    def rotary_dim(self) -> int:
        assert self.head_dim is not None
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Glm4MoeConfig:
        out = dict(d)
        # HF's Glm4MoeTopkRouter: always sigmoid + correction bias + group-limited top-k
        out["scoring_func"], out["topk_method"] = "sigmoid", "noaux_tc"
        out.setdefault("n_group", 1)
        out.setdefault("topk_group", 1)
        params = d.get("rope_parameters") or {}
        factor = params.get("partial_rotary_factor", d.get("partial_rotary_factor"))
        out["partial_rotary_factor"] = 0.5 if factor is None else factor
        cfg = super().from_dict(out)
        assert isinstance(cfg, Glm4MoeConfig)
        if cfg.head_dim is None:
            cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
        if not 0 < cfg.partial_rotary_factor <= 1 or cfg.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor={cfg.partial_rotary_factor} must give an even rotary width "
                             f"in (0, head_dim={cfg.head_dim}]")
        return cfg
