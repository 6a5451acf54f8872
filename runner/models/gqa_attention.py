"""Grouped-query attention over the paged cache, with what the model families differ in as configuration.

One module for the GQA families (gpt-oss, GLM4-MoE; Qwen3-MoE's attention is this with ``qk_norm``):
biases on q/k/v and on the output projection, per-head RMSNorm on q and k before RoPE, RoPE on the first
``rope.dim`` features of each head only (partial rotary: GLM4-MoE rotates half), a sliding window and
attention sinks (``runner/attention/options.py``: gpt-oss). Parameter names are Hugging Face's
(``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``, ``k_norm``, ``sinks``), and
:meth:`GQAAttention.checkpoint_shapes` lists them for a model's ``WeightSpec``.

As every layer here, it reads its (micro)batch's metadata from the forward context on each call and builds
its attention options from its own parameters on each call (``runner/models/qwen3_moe.py`` says why).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from runner.attention.kv_cache import KVCacheSpec
from runner.attention.ops import mha_attention
from runner.attention.options import AttentionOptions
from runner.models.base import DecoderLayer, current_attn_metadata
from runner.models.layers import RMSNorm, RotaryEmbedding


@dataclass(frozen=True)
class GQAConfig:
    """One layer's attention: sizes, and the per-family options."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    norm_eps: float = 1e-6
    sliding_window: int | None = None
    sinks: bool = False

    def __post_init__(self) -> None:
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} attention heads are not a multiple of {self.num_kv_heads} KV heads")


class GQAAttention(nn.Module):
    """``forward(positions [T], hidden [T, H], rope, cos, sin) -> [T, H]``: project, norm, rotate, attend."""

    uses_attention_backend = True  # KV write and attention go through runner.attention.ops

    def __init__(self, cfg: GQAConfig, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.cfg = cfg
        h, d, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.q_proj = nn.Linear(h, nh * d, bias=cfg.qkv_bias, dtype=dtype)
        self.k_proj = nn.Linear(h, nkv * d, bias=cfg.qkv_bias, dtype=dtype)
        self.v_proj = nn.Linear(h, nkv * d, bias=cfg.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(nh * d, h, bias=cfg.o_bias, dtype=dtype)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.norm_eps, dtype)
            self.k_norm = RMSNorm(d, cfg.norm_eps, dtype)
        self.sinks = nn.Parameter(torch.zeros(nh, dtype=dtype), requires_grad=False) if cfg.sinks else None
        self.scaling = d ** -0.5
        self.kv_cache: torch.Tensor | None = None

    def options(self) -> AttentionOptions | None:
        if self.cfg.sliding_window is None and self.sinks is None:
            return None
        return AttentionOptions(self.cfg.sliding_window, self.sinks)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, rope: RotaryEmbedding,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("no KV cache bound; call bind_kv_caches() first")
        meta = current_attn_metadata()
        c, t = self.cfg, hidden.shape[0]
        q = self.q_proj(hidden).view(t, c.num_heads, c.head_dim)
        k = self.k_proj(hidden).view(t, c.num_kv_heads, c.head_dim)
        v = self.v_proj(hidden).view(t, c.num_kv_heads, c.head_dim)
        q, k = rope.norm_and_rotate(q, k, cos, sin, self.q_norm, self.k_norm)
        out = mha_attention(q, k, v, self.kv_cache, meta, self.scaling, positions, self.options())
        return self.o_proj(out.reshape(t, -1))

    def checkpoint_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """HF tensor name -> shape for this layer's attention, ``prefix`` being ``model.layers.{i}.self_attn.``."""
        c = self.cfg
        h, d = c.hidden_size, c.head_dim
        shapes: dict[str, tuple[int, ...]] = {}
        for name, shape, bias in (("q_proj", (c.num_heads * d, h), c.qkv_bias),
                                  ("k_proj", (c.num_kv_heads * d, h), c.qkv_bias),
                                  ("v_proj", (c.num_kv_heads * d, h), c.qkv_bias),
                                  ("o_proj", (h, c.num_heads * d), c.o_bias)):
            shapes[f"{prefix}{name}.weight"] = shape
            if bias:
                shapes[f"{prefix}{name}.bias"] = (shape[0],)
        if c.qk_norm:
            shapes[f"{prefix}q_norm.weight"] = (d,)
            shapes[f"{prefix}k_norm.weight"] = (d,)
        if c.sinks:
            shapes[f"{prefix}sinks"] = (c.num_heads,)
        return shapes


def gqa_kv_cache_specs(layers: nn.ModuleList) -> list[KVCacheSpec]:
    """One MHA cache spec per decoder layer whose ``self_attn`` is a :class:`GQAAttention`."""
    specs = []
    for layer in layers:
        attn = layer.self_attn
        assert isinstance(attn, GQAAttention)
        specs.append(KVCacheSpec.mha(attn.cfg.num_kv_heads, attn.cfg.head_dim))
    return specs


def gqa_layer_shapes(prefix: str, layer: DecoderLayer) -> dict[str, tuple[int, ...]]:
    """A decoder layer's checkpoint tensors but its MLP: the attention's and the two norms (``prefix`` being
    ``model.layers.{i}.``)."""
    assert isinstance(layer.self_attn, GQAAttention)
    h = layer.self_attn.cfg.hidden_size
    return {**layer.self_attn.checkpoint_shapes(f"{prefix}self_attn."), f"{prefix}input_layernorm.weight": (h,),
            f"{prefix}post_attention_layernorm.weight": (h,)}
