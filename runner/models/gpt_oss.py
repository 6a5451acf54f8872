"""gpt-oss (HF ``GptOssForCausalLM`` names and numerics): what it adds is configuration of shared parts.

- attention: :class:`GQAAttention` with q/k/v/o biases, attention sinks, and the sliding window on the layers
  ``layer_types`` marks ``sliding_attention`` (the engine's backends honour both, ``runner/attention/options.py``);
- MoE on every layer: a router with a bias (``mlp.router``), top-k of its logits softmaxed over the k (the same
  weights as a softmax over all experts renormalised over the top k), experts with biases and the clamped
  SwiGLU (``swiglu_alpha``/``swiglu_limit``), in the shared :class:`FusedMoE` with its DBO yields;
- the checkpoint's fused experts (``gate_up_proj [E, H, 2I]`` with gate and up columns alternating, biases
  likewise) are split per expert by the loader (``WeightSpec.fused_layout = "gpt_oss"``).

bf16 checkpoints load; MXFP4-quantized ones are refused by the config (``GptOssConfig``).
"""
from __future__ import annotations

import torch
from torch import nn

from runner.attention.kv_cache import KVCacheSpec
from runner.models.base import DecoderModel, MoECausalLM, moe_or_dense_layer
from runner.models.configs import GptOssConfig
from runner.models.gqa_attention import GQAAttention, GQAConfig, gqa_kv_cache_specs, gqa_layer_shapes
from runner.models.layers import RotaryEmbedding
from runner.models.weights import WeightSpec
from ubatch import trace
from ubatch.modular_moe.config import MoEParallelConfig
from ubatch.modular_moe.layer import FusedMoE
from ubatch.modular_moe.runtime import MoERuntime
from ubatch.modular_moe.types import ClampedSwiGLU


def attention_config(c: GptOssConfig, layer_idx: int) -> GQAConfig:
    assert c.head_dim is not None and c.num_key_value_heads is not None
    return GQAConfig(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                     qkv_bias=c.attention_bias, o_bias=c.attention_bias, norm_eps=c.rms_norm_eps,
                     sliding_window=c.layer_window(layer_idx), sinks=True)


class GptOssMoE(nn.Module):
    """``router`` (biased linear, logits in fp32 for routing) + FusedMoE with expert biases and clamped SwiGLU."""

    def __init__(self, c: GptOssConfig, runtime: MoERuntime, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.router = nn.Linear(c.hidden_size, c.num_local_experts, bias=True, dtype=dtype)
        self.experts = FusedMoE(c.num_local_experts, c.num_experts_per_tok, c.hidden_size, c.intermediate_size,
                                renormalize=True, scoring_func="softmax", runtime=runtime, params_dtype=dtype,
                                expert_bias=True, activation=ClampedSwiGLU(c.swiglu_alpha, c.swiglu_limit))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with trace.compute_span("gate", "R"):
            logits = self.router(hidden).float()
        return self.experts(hidden, logits)


class GptOssForCausalLM(MoECausalLM):
    """``forward(input_ids [T], positions [T]) -> hidden [T, H]``; ``compute_logits(hidden) -> fp32 [T, V]``."""

    def __init__(self, config: GptOssConfig, parallel: MoEParallelConfig | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(config, parallel, dtype)

        def make_layer(i: int) -> nn.Module:
            return moe_or_dense_layer(config, i, GQAAttention(attention_config(config, i), dtype),
                                      lambda: GptOssMoE(config, self.moe_runtime, dtype), dtype)

        self.model = DecoderModel(config, make_layer, dtype)
        assert config.head_dim is not None
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope, interleaved=False)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return gqa_kv_cache_specs(self.model.layers)

    def _build_spec(self) -> WeightSpec:
        c = self.config
        h, e = c.hidden_size, c.num_local_experts
        shapes = self._common_shapes()
        moe_layers = {}
        for i, layer in enumerate(self.model.decoder_layers()):
            p = f"model.layers.{i}."
            shapes.update(gqa_layer_shapes(p, layer))
            shapes[f"{p}mlp.router.weight"] = (e, h)
            shapes[f"{p}mlp.router.bias"] = (e,)
            assert isinstance(layer.mlp, GptOssMoE)  # every gpt-oss layer is MoE
            moe_layers[i] = layer.mlp.experts
        return WeightSpec(shapes=shapes, num_hidden_layers=c.num_hidden_layers, num_experts=e,
                          moe_intermediate_size=c.intermediate_size, hidden_size=h, moe_layers=moe_layers,
                          local_experts=self.parallel.local_expert_range(e), tied_lm_head=c.tie_word_embeddings,
                          expert_bias=True, fused_layout="gpt_oss")
