"""The standard decoder on the paged-attention runner: GQA attention, then a SwiGLU MLP or a routed-expert block.

One body serves Llama, Qwen2, Qwen3 (dense) and Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE (MoE), with Hugging Face's names
and numerics; what differs is a :class:`~runner.models.standard_configs.StandardConfig` switch (projection
biases, q/k RMSNorm per head or over the whole projection, ``clip_qkv``, which layers are MoE, a gated shared
expert, top-k renormalisation) or, for checkpoint names, a family's ``checkpoint_aliases``. A family file is
then a subclass naming its config and aliases.

Tokens are flattened (``[T]``, all requests of the (micro)batch back to back); attention reads its batch
layout from ``get_forward_context().attn_metadata`` on every call -- never from module state -- because the
two DBO ubatch threads run these same module objects alternately, each with its own metadata. The metadata's
type picks the attention path (``runner/attention/ops.py``): the engine's backend, graph decode, or the
plain-torch reference for a model called with ``CommonAttentionMetadata``. The MoE block is a FusedMoE,
whose kernel holds the DBO yield points and the all-to-all.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from runner.attention.kv_cache import KVCacheSpec
from runner.attention.ops import mha_attention
from runner.attention.options import AttentionOptions
from runner.models.base import DecoderModel, MoECausalLM, current_attn_metadata, moe_or_dense_layer
from runner.models.layers import DenseMLP, RMSNorm, RotaryEmbedding
from runner.models.standard_configs import StandardConfig
from runner.models.weights import WeightSpec
from ubatch import trace
from ubatch.modular_moe.config import MoEParallelConfig
from ubatch.modular_moe.layer import FusedMoE
from ubatch.modular_moe.runtime import MoERuntime


class StandardAttention(nn.Module):
    """GQA over a paged KV cache: projections (with the family's biases), optional q/k RMSNorm and clamp,
    neox-style RoPE."""

    uses_attention_backend = True  # KV write and attention go through runner.attention.ops

    def __init__(self, config: StandardConfig, dtype: torch.dtype | None) -> None:
        super().__init__()
        c = config
        h, d, nkv = c.hidden_size, c.head_dim, c.num_key_value_heads
        assert d is not None and nkv is not None  # filled when the config is parsed
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, nkv, d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=c.qkv_bias, dtype=dtype)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=c.qkv_bias, dtype=dtype)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=c.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=c.o_bias, dtype=dtype)
        self.qk_norm = c.qk_norm
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if c.qk_norm == "per_head":
            self.q_norm, self.k_norm = RMSNorm(d, c.rms_norm_eps, dtype), RMSNorm(d, c.rms_norm_eps, dtype)
        elif c.qk_norm == "whole":
            self.q_norm = RMSNorm(self.num_heads * d, c.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.num_kv_heads * d, c.rms_norm_eps, dtype)
        self.clip_qkv = c.clip_qkv
        # Mixtral's optional window: a query at position p sees keys (p - W, p] (runner/attention/options.py)
        self.options = AttentionOptions(sliding_window=c.sliding_window) if c.sliding_window else None
        self.scaling = d ** -0.5
        self.kv_cache: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, rope: RotaryEmbedding,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("no KV cache bound; call bind_kv_caches() first")
        meta = current_attn_metadata()
        t = hidden.shape[0]
        q, k, v = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        if self.qk_norm == "whole":  # OLMoE: over the whole projection, before the clamp and the head split
            assert self.q_norm is not None and self.k_norm is not None
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (x.clamp(-self.clip_qkv, self.clip_qkv) for x in (q, k, v))
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "per_head":  # Qwen3: each head's head_dim, fused with RoPE under fused_tails
            q, k = rope.norm_and_rotate(q, k, cos, sin, self.q_norm, self.k_norm)
        else:
            q, k = rope.norm_and_rotate(q, k, cos, sin)
        out = mha_attention(q, k, v, self.kv_cache, meta, self.scaling, positions, self.options)
        return self.o_proj(out.reshape(t, -1))


class GatedSharedExpert(nn.Module):
    """Qwen2-MoE's shared expert, ``sigmoid(gate(x)) * mlp(x)``: FusedMoE adds it to the routed output."""

    def __init__(self, mlp: DenseMLP, gate: nn.Linear) -> None:
        super().__init__()
        self.mlp, self.gate = mlp, gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(x)) * self.mlp(x)


class StandardSparseMoeBlock(nn.Module):
    """Gate (logits in the activation dtype, softmax in fp32 in the router, as HF) + FusedMoE, with the
    family's shared expert (HF names ``shared_expert`` / ``shared_expert_gate``) run by the MoE kernel."""

    def __init__(self, config: StandardConfig, runtime: MoERuntime, dtype: torch.dtype | None) -> None:
        super().__init__()
        c = config
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False, dtype=dtype)
        shared = None
        if c.shared_expert_intermediate_size:  # registered before `experts`: these are the HF parameter names
            self.shared_expert = DenseMLP(c.hidden_size, c.shared_expert_intermediate_size, dtype)
            self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False, dtype=dtype)
            shared = GatedSharedExpert(self.shared_expert, self.shared_expert_gate)
        self.experts = FusedMoE(c.num_experts, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size,
                                renormalize=c.norm_topk_prob, scoring_func="softmax", shared_experts=shared,
                                runtime=runtime, params_dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with trace.compute_span("gate", "R"):
            logits = self.gate(hidden).float()
        return self.experts(hidden, logits)


class StandardCausalLM(MoECausalLM):
    """``forward(input_ids [T], positions [T]) -> hidden [T, H]``; ``compute_logits(hidden) -> fp32 [T, V]``.

    A family subclass may set ``checkpoint_aliases``: ``(regex, replacement)`` pairs that rewrite its
    checkpoints' tensor names to the HF names used here (``runner/models/weights.py``).
    """

    checkpoint_aliases: tuple[tuple[str, str], ...] = ()

    def __init__(self, config: StandardConfig, parallel: MoEParallelConfig | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(config, parallel, dtype)

        def make_layer(i: int) -> nn.Module:
            return moe_or_dense_layer(config, i, StandardAttention(config, dtype),
                                      lambda: StandardSparseMoeBlock(config, self.moe_runtime, dtype), dtype,
                                      mlp_bias=config.mlp_bias)

        self.model = DecoderModel(config, make_layer, dtype)
        assert config.head_dim is not None
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope, interleaved=False)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        c = self.config
        return [KVCacheSpec.mha(c.num_key_value_heads, c.head_dim)] * c.num_hidden_layers

    def _build_spec(self) -> WeightSpec:
        c: StandardConfig = self.config
        h, d, kv_heads = c.hidden_size, c.head_dim, c.num_key_value_heads
        assert d is not None and kv_heads is not None  # filled when the config is parsed
        nq, nkv = c.num_attention_heads * d, kv_heads * d
        shapes = self._common_shapes()
        moe_layers = {}

        def linear(name: str, out_features: int, in_features: int, bias: bool) -> None:
            shapes[f"{name}.weight"] = (out_features, in_features)
            if bias:
                shapes[f"{name}.bias"] = (out_features,)

        def mlp(prefix: str, inter: int, bias: bool) -> None:
            linear(f"{prefix}gate_proj", inter, h, bias)
            linear(f"{prefix}up_proj", inter, h, bias)
            linear(f"{prefix}down_proj", h, inter, bias)

        for i, layer in enumerate(self.model.layers):
            p = f"model.layers.{i}."
            a = f"{p}self_attn."
            linear(f"{a}q_proj", nq, h, c.qkv_bias)
            linear(f"{a}k_proj", nkv, h, c.qkv_bias)
            linear(f"{a}v_proj", nkv, h, c.qkv_bias)
            linear(f"{a}o_proj", h, nq, c.o_bias)
            if c.qk_norm != "none":
                per_head = c.qk_norm == "per_head"
                shapes[f"{a}q_norm.weight"] = (d,) if per_head else (nq,)
                shapes[f"{a}k_norm.weight"] = (d,) if per_head else (nkv,)
            shapes[f"{p}input_layernorm.weight"] = (h,)
            shapes[f"{p}post_attention_layernorm.weight"] = (h,)
            if isinstance(layer.mlp, StandardSparseMoeBlock):
                shapes[f"{p}mlp.gate.weight"] = (c.num_experts, h)
                if c.shared_expert_intermediate_size:
                    mlp(f"{p}mlp.shared_expert.", c.shared_expert_intermediate_size, False)
                    shapes[f"{p}mlp.shared_expert_gate.weight"] = (1, h)
                moe_layers[i] = layer.mlp.experts
            else:
                mlp(f"{p}mlp.", c.intermediate_size, c.mlp_bias)
        return WeightSpec(shapes=shapes, num_hidden_layers=c.num_hidden_layers, num_experts=c.num_experts,
                          moe_intermediate_size=c.moe_intermediate_size, hidden_size=h, moe_layers=moe_layers,
                          local_experts=self.parallel.local_expert_range(c.num_experts),
                          tied_lm_head=c.tie_word_embeddings,
                          aliases=tuple((re.compile(p), r) for p, r in self.checkpoint_aliases))
