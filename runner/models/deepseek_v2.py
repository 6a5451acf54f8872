"""DeepSeek-V2 / -V3 (MLA attention, shared + routed experts) with HF-compatible names and numerics.

One class body serves both; the config says which router and RoPE layout apply:
- V3: sigmoid scores + ``e_score_correction_bias`` + group-limited top-k (group score = sum of its top-2),
  ``norm_topk_prob`` renormalisation, ``routed_scaling_factor``; RoPE on interleaved pairs when
  ``rope_interleave`` (HF default) else neox.
- V2: softmax scores, ``greedy`` top-k or ``group_limited_greedy`` (groups scored by their best expert);
  RoPE on interleaved pairs. ``norm_topk_prob`` is honoured as in DeepSeek's original code and vLLM (HF
  5.23's V2 router ignores it; all released V2 configs set it false).

The MLA cache holds ``[latent | rotated rope key]`` per token; attention uses absorbed ``kv_b_proj``
weights (see ``runner/attention/reference.py``). Softmax scale = ``qk_head_dim ** -0.5``, times yarn's
``mscale(factor, mscale_all_dim) ** 2`` only when yarn RoPE is configured.

Attention is two methods, ``prepare`` (ATTN-0: the MLA down/up projections) and ``core`` (ATTN-1: KV write,
core attention, output projection), so the ``deepseek`` DBO schedule (``runner/models/schedules.py``) can
yield between them; under the default ``moe`` schedule a layer runs them back to back.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from runner.attention.kv_cache import KVCacheSpec
from runner.attention.ops import mla_attention
from runner.config import DBO_SCHEDULES
from runner.models.base import DecoderLayer, DecoderModel, MoECausalLM, current_attn_metadata, moe_or_dense_layer
from runner.models.configs import DeepseekV2Config
from runner.models.layers import DenseMLP, RMSNorm, RotaryEmbedding, yarn_softmax_mscale
from runner.models.quantization.fp8_linear import linear_weight
from runner.models.schedules import (
    DEFAULT_DBO_SCHEDULE,
    DBOSchedule,
    ScheduledFusedMoE,
    pipeline_epilogue,
    pipeline_prologue,
    stage_boundary,
)
from runner.models.weights import WeightSpec
from ubatch import trace
from ubatch.modular_moe.config import MoEParallelConfig
from ubatch.modular_moe.runtime import MoERuntime

# HF builds q_a_layernorm / kv_a_layernorm with the RMSNorm default eps, not config.rms_norm_eps.
_LORA_NORM_EPS = 1e-6


class DeepseekV2Attention(nn.Module):
    """Multi-head latent attention over a paged latent cache."""

    uses_attention_backend = True  # KV write and attention go through runner.attention.ops

    def __init__(self, config: DeepseekV2Config, dtype: torch.dtype | None) -> None:
        super().__init__()
        c = config
        h, nh = c.hidden_size, c.num_attention_heads
        self.num_heads, self.q_lora_rank, self.kv_lora_rank = nh, c.q_lora_rank, c.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = c.qk_nope_head_dim, c.qk_rope_head_dim
        self.v_head_dim = c.v_head_dim
        qk = c.qk_head_dim
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(h, nh * qk, bias=False, dtype=dtype)
        else:
            self.q_a_proj = nn.Linear(h, c.q_lora_rank, bias=c.attention_bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, _LORA_NORM_EPS, dtype)
            self.q_b_proj = nn.Linear(c.q_lora_rank, nh * qk, bias=False, dtype=dtype)
        self.kv_a_proj_with_mqa = nn.Linear(h, c.kv_lora_rank + c.qk_rope_head_dim, bias=c.attention_bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, _LORA_NORM_EPS, dtype)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, nh * (c.qk_nope_head_dim + c.v_head_dim), bias=False, dtype=dtype)
        self.o_proj = nn.Linear(nh * c.v_head_dim, h, bias=c.attention_bias, dtype=dtype)
        self.scaling = qk ** -0.5 * yarn_softmax_mscale(c.rope)
        self.kv_cache: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, rope: RotaryEmbedding,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.core(positions, *self.prepare(hidden, rope, cos, sin))

    def prepare(self, hidden: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ATTN-0: down/up projections -> ``(q_nope [T,H,dn], rotated q_rope [T,H,R], cache entry [T,L+R])``."""
        t = hidden.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q_nope, q_rope = q.view(t, self.num_heads, -1).split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rope, k_rope = rope.rotate(q_rope, cos, sin), rope.rotate(k_rope, cos, sin)
        return q_nope, q_rope, torch.cat((latent, k_rope), dim=-1)

    def core(self, positions: torch.Tensor, q_nope: torch.Tensor, q_rope: torch.Tensor,
             cache_entry: torch.Tensor) -> torch.Tensor:
        """ATTN-1: write this step's latent KV, attend over the paged cache, project out -> ``[T, hidden]``."""
        if self.kv_cache is None:
            raise RuntimeError("no KV cache bound; call bind_kv_caches() first")
        meta = current_attn_metadata()
        w = linear_weight(self.kv_b_proj, q_nope.dtype).view(
            self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:]
        out = mla_attention(q_nope, q_rope, cache_entry, self.kv_cache, meta, self.scaling, w_uk, w_uv, positions)
        return self.o_proj(out.reshape(q_nope.shape[0], -1))


class DeepseekV2MoE(nn.Module):
    """fp32 gate logits (as HF) -> FusedMoE, which routes and overlaps the shared experts with comm."""

    def __init__(self, config: DeepseekV2Config, runtime: MoERuntime, dtype: torch.dtype | None,
                 schedule: DBOSchedule) -> None:
        super().__init__()
        c = config
        self.gate = nn.Linear(c.hidden_size, c.n_routed_experts, bias=False, dtype=dtype)
        self.shared_experts = DenseMLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts, dtype,
                                       bias=c.mlp_bias) if c.n_shared_experts else None
        grouped = c.topk_method in ("noaux_tc", "group_limited_greedy")
        self.experts = ScheduledFusedMoE(
            c.n_routed_experts, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size,
            renormalize=bool(c.norm_topk_prob), scoring_func=c.scoring_func,
            num_expert_group=c.n_group if grouped else None, topk_group=c.topk_group if grouped else None,
            use_correction_bias=c.topk_method == "noaux_tc", routed_scaling_factor=c.routed_scaling_factor,
            group_scoring="max" if c.topk_method == "group_limited_greedy" else "top2_sum",
            shared_experts=self.shared_experts, runtime=runtime, params_dtype=dtype, schedule=schedule)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with trace.compute_span("gate", "R"):
            logits = F.linear(hidden.float(), self.gate.weight.float())
        return self.experts(hidden, logits)

    def checkpoint_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """HF tensor name -> shape for the gate, its correction bias and the shared experts (routed experts go by
        rule, ``WeightSpec``), ``prefix`` being ``model.layers.{i}.mlp.``."""
        e, h = self.gate.out_features, self.gate.in_features
        shapes: dict[str, tuple[int, ...]] = {f"{prefix}gate.weight": (e, h)}
        shapes.update({name: (e,) for name in self.checkpoint_renames(prefix)})
        if self.shared_experts is not None:
            shapes.update(self.shared_experts.checkpoint_shapes(f"{prefix}shared_experts."))
        return shapes

    def checkpoint_renames(self, prefix: str) -> dict[str, str]:
        """The checkpoint's gate holds the correction bias that our experts hold."""
        if self.experts.e_score_correction_bias is None:
            return {}
        return {f"{prefix}gate.e_score_correction_bias": f"{prefix}experts.e_score_correction_bias"}


def add_mlp_spec(layer: DecoderLayer, i: int, shapes: dict[str, tuple[int, ...]], rename: dict[str, str],
                 moe_layers: dict[int, ScheduledFusedMoE]) -> None:
    """Layer ``i``'s MLP in a weight spec: its checkpoint tensors, and a DeepSeek MoE block's renames and experts."""
    mlp = layer.mlp
    assert isinstance(mlp, (DeepseekV2MoE, DenseMLP))  # moe_or_dense_layer's two kinds
    shapes.update(mlp.checkpoint_shapes(f"model.layers.{i}.mlp."))
    if isinstance(mlp, DeepseekV2MoE):
        rename.update(mlp.checkpoint_renames(f"model.layers.{i}.mlp."))
        moe_layers[i] = mlp.experts


class DeepseekV2DecoderLayer(DecoderLayer):
    """A decoder layer that, on the staged pipeline's steps, ends a stage between ATTN-0 and ATTN-1.

    Attention is then traced as two spans (``attn0``/``A0``, ``attn1``/``A1``) instead of one ``attention``
    span, since another ubatch runs in between. The boundary is in every layer, dense ones included, so
    the number of yields never depends on which layers are MoE.
    """

    self_attn: DeepseekV2Attention

    def __init__(self, *args: Any, schedule: DBOSchedule, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.schedule = schedule

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.schedule.staged():
            return super().forward(positions, hidden, residual, rope, cos, sin)
        with trace.compute_span("residual", "N"):
            normed, residual = self.input_layernorm.add_and_norm(hidden, residual)
        with trace.compute_span("attn0", "A0", layer=self.layer_idx):
            prepared = self.self_attn.prepare(normed, rope, cos, sin)
        stage_boundary()
        with trace.compute_span("attn1", "A1", layer=self.layer_idx):
            attn = self.self_attn.core(positions, *prepared)
        with trace.compute_span("mlp_norm", "N"):
            normed, residual = self.post_attention_layernorm.add_and_norm(attn, residual)
        return self.mlp(normed), residual  # gate + routing (the rest of ATTN-1), then dispatch, SHARED, MLP, combine


class DeepseekV2ForCausalLM(MoECausalLM):
    """``forward(input_ids [T], positions [T]) -> hidden [T, H]``; ``compute_logits(hidden) -> fp32 [T, V]``.

    ``dbo_schedule``: ``"moe"`` (default) or ``"deepseek"`` (see ``runner/models/schedules.py``); also
    settable later with :meth:`set_dbo_schedule`.
    """

    supported_dbo_schedules = DBO_SCHEDULES

    def __init__(self, config: DeepseekV2Config, parallel: MoEParallelConfig | None = None,
                 dtype: torch.dtype | None = None, dbo_schedule: str = DEFAULT_DBO_SCHEDULE) -> None:
        super().__init__(config, parallel, dtype)
        self.set_dbo_schedule(dbo_schedule)
        schedule = self.dbo_schedule

        def make_layer(i: int) -> nn.Module:
            return moe_or_dense_layer(config, i, DeepseekV2Attention(config, dtype),
                                      lambda: DeepseekV2MoE(config, self.moe_runtime, dtype, schedule), dtype,
                                      mlp_bias=config.mlp_bias,
                                      layer_cls=functools.partial(DeepseekV2DecoderLayer, schedule=schedule))

        self.model = DecoderModel(config, make_layer, dtype)
        self.rotary_emb = RotaryEmbedding(config.qk_rope_head_dim, config.rope,
                                          interleaved=bool(config.rope_interleave))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        staged = self.dbo_schedule.staged()
        if staged:
            pipeline_prologue()  # ubatch 1 starts one stage behind ubatch 0
        hidden = super().forward(input_ids, positions)
        if staged:
            pipeline_epilogue()  # ubatch 0's matching last boundary: equal yield counts
        return hidden

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        c = self.config
        return [KVCacheSpec.mla(c.kv_lora_rank, c.qk_rope_head_dim)] * c.num_hidden_layers

    def _build_spec(self) -> WeightSpec:
        c = self.config
        h, nh = c.hidden_size, c.num_attention_heads
        shapes = self._common_shapes()
        rename: dict[str, str] = {}
        moe_layers: dict[int, ScheduledFusedMoE] = {}
        for i, layer in enumerate(self.model.decoder_layers()):
            p = f"model.layers.{i}."
            a = f"{p}self_attn."
            if c.q_lora_rank is None:
                shapes[f"{a}q_proj.weight"] = (nh * c.qk_head_dim, h)
            else:
                shapes[f"{a}q_a_proj.weight"] = (c.q_lora_rank, h)
                shapes[f"{a}q_a_layernorm.weight"] = (c.q_lora_rank,)
                shapes[f"{a}q_b_proj.weight"] = (nh * c.qk_head_dim, c.q_lora_rank)
                if c.attention_bias:
                    shapes[f"{a}q_a_proj.bias"] = (c.q_lora_rank,)
            shapes[f"{a}kv_a_proj_with_mqa.weight"] = (c.kv_lora_rank + c.qk_rope_head_dim, h)
            shapes[f"{a}kv_a_layernorm.weight"] = (c.kv_lora_rank,)
            shapes[f"{a}kv_b_proj.weight"] = (nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
            shapes[f"{a}o_proj.weight"] = (h, nh * c.v_head_dim)
            if c.attention_bias:
                shapes[f"{a}kv_a_proj_with_mqa.bias"] = (c.kv_lora_rank + c.qk_rope_head_dim,)
                shapes[f"{a}o_proj.bias"] = (h,)
            shapes[f"{p}input_layernorm.weight"] = (h,)
            shapes[f"{p}post_attention_layernorm.weight"] = (h,)
            add_mlp_spec(layer, i, shapes, rename, moe_layers)
        return WeightSpec(shapes=shapes, num_hidden_layers=c.num_hidden_layers, num_experts=c.n_routed_experts,
                          moe_intermediate_size=c.moe_intermediate_size, hidden_size=h, moe_layers=moe_layers,
                          local_experts=self.parallel.local_expert_range(c.n_routed_experts),
                          num_extra_layers=c.num_nextn_predict_layers, tied_lm_head=c.tie_word_embeddings,
                          rename=rename)



class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """Same body; V3 behaviour comes from the config (``model_type='deepseek_v3'``)."""
