"""Qwen3-MoE on the paged-attention runner (HF ``Qwen3MoeForCausalLM``-compatible names and numerics).

Tokens are flattened (``[T]``, all requests of the (micro)batch back to back); attention reads its batch
layout from ``get_forward_context().attn_metadata`` on every call — never from module state — because the
two DBO ubatch threads run these same module objects alternately, each with its own metadata. The metadata's
type picks the attention path (``runner/attention/ops.py``): the engine's backend, graph decode, or the
plain-torch reference for a model called with ``CommonAttentionMetadata``.
"""
from __future__ import annotations

import torch
from torch import nn

from runner.attention.ops import mha_attention
from runner.attention.kv_cache import KVCacheSpec
from runner.models.configs import Qwen3MoeConfig
from runner.models.layers import RMSNorm, RotaryEmbedding
from runner.models.base import DecoderModel, MoECausalLM, current_attn_metadata, moe_or_dense_layer
from runner.models.weights import WeightSpec
from ubatch import trace
from ubatch.modular_moe.config import MoEParallelConfig
from ubatch.modular_moe.runtime import MoERuntime
from ubatch.modular_moe.layer import FusedMoE


class Qwen3MoeAttention(nn.Module):
    """GQA with per-head RMSNorm on q and k (before RoPE), neox-style RoPE, paged KV cache."""

    uses_attention_backend = True  # KV write and attention go through runner.attention.ops

    def __init__(self, config: Qwen3MoeConfig, dtype: torch.dtype | None) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        bias = config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias, dtype=dtype)
        self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype)
        self.scaling = d ** -0.5
        self.kv_cache: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, rope: RotaryEmbedding,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("no KV cache bound; call bind_kv_caches() first")
        meta = current_attn_metadata()
        t = hidden.shape[0]
        q = self.q_norm(self.q_proj(hidden).view(t, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(hidden).view(t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(hidden).view(t, self.num_kv_heads, self.head_dim)
        q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
        out = mha_attention(q, k, v, self.kv_cache, meta, self.scaling, positions)
        return self.o_proj(out.reshape(t, -1))


class Qwen3MoeSparseMoeBlock(nn.Module):
    """Gate (HF: logits in the activation dtype, softmax in fp32 inside the router) + FusedMoE."""

    def __init__(self, config: Qwen3MoeConfig, runtime: MoERuntime, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False, dtype=dtype)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, renormalize=config.norm_topk_prob,
                                scoring_func="softmax", runtime=runtime, params_dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with trace.compute_span("gate", "R"):
            logits = self.gate(hidden).float()
        return self.experts(hidden, logits)


class Qwen3MoeForCausalLM(MoECausalLM):
    """``forward(input_ids [T], positions [T]) -> hidden [T, H]``; ``compute_logits(hidden) -> fp32 [T, V]``."""

    def __init__(self, config: Qwen3MoeConfig, parallel: MoEParallelConfig | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(config, parallel, dtype)

        def make_layer(i: int) -> nn.Module:
            return moe_or_dense_layer(config, i, Qwen3MoeAttention(config, dtype),
                                      lambda: Qwen3MoeSparseMoeBlock(config, self.moe_runtime, dtype), dtype)

        self.model = DecoderModel(config, make_layer, dtype)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope, interleaved=False)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        c = self.config
        return [KVCacheSpec.mha(c.num_key_value_heads, c.head_dim)] * c.num_hidden_layers

    def _build_spec(self) -> WeightSpec:
        c = self.config
        h, d = c.hidden_size, c.head_dim
        shapes = self._common_shapes()
        moe_layers = {}
        for i, layer in enumerate(self.model.layers):
            p = f"model.layers.{i}."
            attn = {"q_proj": (c.num_attention_heads * d, h), "k_proj": (c.num_key_value_heads * d, h),
                    "v_proj": (c.num_key_value_heads * d, h), "o_proj": (h, c.num_attention_heads * d)}
            for name, shape in attn.items():
                shapes[f"{p}self_attn.{name}.weight"] = shape
                if c.attention_bias:
                    shapes[f"{p}self_attn.{name}.bias"] = (shape[0],)
            shapes[f"{p}self_attn.q_norm.weight"] = (d,)
            shapes[f"{p}self_attn.k_norm.weight"] = (d,)
            shapes[f"{p}input_layernorm.weight"] = (h,)
            shapes[f"{p}post_attention_layernorm.weight"] = (h,)
            if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock):
                shapes[f"{p}mlp.gate.weight"] = (c.num_experts, h)
                moe_layers[i] = layer.mlp.experts
            else:
                i_size = c.intermediate_size
                shapes.update({f"{p}mlp.gate_proj.weight": (i_size, h), f"{p}mlp.up_proj.weight": (i_size, h),
                               f"{p}mlp.down_proj.weight": (h, i_size)})
        return WeightSpec(shapes=shapes, num_hidden_layers=c.num_hidden_layers, num_experts=c.num_experts,
                          moe_intermediate_size=c.moe_intermediate_size, hidden_size=h, moe_layers=moe_layers,
                          local_experts=self.parallel.local_expert_range(c.num_experts),
                          tied_lm_head=c.tie_word_embeddings)
