"""GLM4-MoE (HF ``Glm4MoeForCausalLM`` names and numerics): DeepSeek-V3's MoE block over GQA attention.

- MoE: :class:`DeepseekV2MoE` as is (``Glm4MoeConfig`` is a DeepSeek config with V3's router fixed: sigmoid
  scores, ``e_score_correction_bias``, group-limited top-k, ``routed_scaling_factor``, shared experts), and
  the first ``first_k_dense_replace`` layers dense;
- attention: :class:`GQAAttention` with biased q/k/v (``attention_bias``; the output projection has none),
  q/k RMSNorm when ``use_qk_norm``, and RoPE on the first ``partial_rotary_factor`` of each head.

Multi-token-prediction layers (``num_nextn_predict_layers``, stored past the last layer) are skipped.
"""
from __future__ import annotations

import torch
from torch import nn

from runner.attention.kv_cache import KVCacheSpec
from runner.models.base import DecoderModel, MoECausalLM, moe_or_dense_layer
from runner.models.configs import Glm4MoeConfig
from runner.models.deepseek_v2 import DeepseekV2MoE, add_mlp_spec
from runner.models.gqa_attention import GQAAttention, GQAConfig, gqa_kv_cache_specs, gqa_layer_shapes
from runner.models.layers import RotaryEmbedding
from runner.models.schedules import ScheduledFusedMoE
from runner.models.weights import WeightSpec
from ubatch.modular_moe.config import MoEParallelConfig


def attention_config(c: Glm4MoeConfig) -> GQAConfig:
    assert c.head_dim is not None and c.num_key_value_heads is not None
    return GQAConfig(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                     qkv_bias=c.attention_bias, qk_norm=c.use_qk_norm, norm_eps=c.rms_norm_eps)


class Glm4MoeForCausalLM(MoECausalLM):
    """``forward(input_ids [T], positions [T]) -> hidden [T, H]``; ``compute_logits(hidden) -> fp32 [T, V]``."""

    def __init__(self, config: Glm4MoeConfig, parallel: MoEParallelConfig | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(config, parallel, dtype)

        def make_layer(i: int) -> nn.Module:
            return moe_or_dense_layer(config, i, GQAAttention(attention_config(config), dtype),
                                      lambda: DeepseekV2MoE(config, self.moe_runtime, dtype, self.dbo_schedule),
                                      dtype)

        self.model = DecoderModel(config, make_layer, dtype)
        self.rotary_emb = RotaryEmbedding(config.rotary_dim, config.rope, interleaved=False)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return gqa_kv_cache_specs(self.model.layers)

    def _build_spec(self) -> WeightSpec:
        c = self.config
        e = c.n_routed_experts
        shapes = self._common_shapes()
        rename: dict[str, str] = {}
        moe_layers: dict[int, ScheduledFusedMoE] = {}
        for i, layer in enumerate(self.model.decoder_layers()):
            p = f"model.layers.{i}."
            shapes.update(gqa_layer_shapes(p, layer))
            add_mlp_spec(layer, i, shapes, rename, moe_layers)
        return WeightSpec(shapes=shapes, num_hidden_layers=c.num_hidden_layers, num_experts=e,
                          moe_intermediate_size=c.moe_intermediate_size, hidden_size=c.hidden_size,
                          moe_layers=moe_layers,
                          local_experts=self.parallel.local_expert_range(e),
                          num_extra_layers=c.num_nextn_predict_layers, tied_lm_head=c.tie_word_embeddings,
                          rename=rename)
