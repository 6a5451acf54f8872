"""What every causal-LM shell here shares: embed -> decoder layers -> norm, logits, KV binding, weight loading.

A subclass builds ``self.model`` (with ``embed_tokens``, ``layers``, ``norm``) and ``self.rotary_emb``, and says
what differs: its per-layer KV-cache shape (``kv_cache_specs``) and its checkpoint layout (``_build_spec``).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from runner.attention.kv_cache import KVCacheSpec
from runner.models.layers import DenseMLP, RMSNorm, RotaryEmbedding
from runner.models.schedules import DEFAULT_DBO_SCHEDULE, DBOSchedule, check_schedule
from runner.models.weights import WeightSpec, load_hf_weights, wants_weight
from ubatch import trace
from ubatch.forward_context import get_forward_context
from ubatch.modular_moe.config import MoEParallelConfig
from ubatch.modular_moe.layer import FusedMoE
from ubatch.modular_moe.runtime import MoERuntime


def current_attn_metadata() -> Any:
    """This (micro)batch's attention metadata; a clear error when a model is called outside a step.

    Read on every call, never cached on a module: the DBO ubatches run the same modules alternately.
    """
    meta = get_forward_context().attn_metadata
    if meta is None:
        raise RuntimeError("the forward context has no attn_metadata; build one per (micro)batch")
    return meta


def check_and_bind(layers: list[nn.Module], caches: list[torch.Tensor], specs: list[KVCacheSpec]) -> None:
    """Attach one cache tensor per layer after checking its per-token shape against the layer's spec."""
    if len(caches) != len(layers):
        raise ValueError(f"got {len(caches)} KV caches for {len(layers)} layers")
    for i, (layer, cache, spec) in enumerate(zip(layers, caches, specs, strict=True)):
        if tuple(cache.shape[2:]) != spec.per_token_shape:
            raise ValueError(f"KV cache {i} has per-token shape {tuple(cache.shape[2:])}, "
                             f"expected {spec.per_token_shape}")
        layer.get_submodule("self_attn").kv_cache = cache


class DecoderLayer(nn.Module):
    """Pre-norm residual block (attention, then MLP or MoE) with Hugging Face's parameter names.

    ``forward(positions, hidden, residual, ...) -> (mlp_out, residual)`` as vLLM's layers: the residual add
    after the MLP is left to the next layer's input norm (or the model's final norm), so each add runs fused
    with the norm after it (:meth:`RMSNorm.add_and_norm`; one Triton kernel under ``fused_tails``). The first
    layer gets ``residual=None``. The adds and norms are HF's, in HF's dtypes, in either case.
    """

    def __init__(self, layer_idx: int, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float,
                 dtype: torch.dtype | None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with trace.compute_span("residual", "N"):  # the previous layer's residual add, with this input norm
            normed, residual = self.input_layernorm.add_and_norm(hidden, residual)
        with trace.compute_span("attention", "A", layer=self.layer_idx):
            attn = self.self_attn(positions, normed, rope, cos, sin)
        with trace.compute_span("mlp_norm", "N"):
            normed, residual = self.post_attention_layernorm.add_and_norm(attn, residual)
        return self.mlp(normed), residual


def moe_or_dense_layer(config: Any, layer_idx: int, self_attn: nn.Module, make_moe: Callable[[], nn.Module],
                       dtype: torch.dtype | None, mlp_bias: bool = False,
                       layer_cls: Callable[..., DecoderLayer] = DecoderLayer) -> DecoderLayer:
    """A decoder layer whose MLP is the model's MoE block where the config says so, else a dense SwiGLU MLP."""
    mlp = make_moe() if config.is_moe_layer(layer_idx) else DenseMLP(
        config.hidden_size, config.intermediate_size, dtype, bias=mlp_bias)
    return layer_cls(layer_idx, self_attn, mlp, config.hidden_size, config.rms_norm_eps, dtype)


class DecoderModel(nn.Module):
    """``model.embed_tokens`` / ``model.layers.{i}`` / ``model.norm``: the HF layout both families share."""

    def __init__(self, config: Any, make_layer: Callable[[int], nn.Module], dtype: torch.dtype | None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(make_layer(i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def decoder_layers(self) -> list[DecoderLayer]:
        """``layers`` as the decoder layers they are (``nn.ModuleList`` iterates as plain modules)."""
        layers = []
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, DecoderLayer):
                raise TypeError(f"model.layers.{i} is a {type(layer).__name__}, not a DecoderLayer")
            layers.append(layer)
        return layers


class MoECausalLM(nn.Module):
    """``forward(input_ids [T], positions [T]) -> hidden [T, H]``; ``compute_logits(hidden) -> fp32 [T, V]``."""

    model: DecoderModel
    rotary_emb: Any
    #: DBO schedules this family can run (``runner.models.schedules``); "moe" needs nothing from the model
    supported_dbo_schedules: tuple[str, ...] = (DEFAULT_DBO_SCHEDULE,)

    def __init__(self, config: Any, parallel: MoEParallelConfig | None, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel or MoEParallelConfig()
        self.moe_runtime = MoERuntime(self.parallel)  # one per model: its MoE layers share backends and link
        self.dbo_schedule = DBOSchedule()  # one per model: the layers that follow it hold this object
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self._spec: WeightSpec | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        with trace.compute_span("embed", "N"):
            hidden = self.model.embed_tokens(input_ids)
            cos, sin = self.rotary_emb.cos_sin(positions, hidden.dtype)
        residual: torch.Tensor | None = None
        for layer in self.model.layers:
            hidden, residual = layer(positions, hidden, residual, self.rotary_emb, cos, sin)
        with trace.compute_span("final_norm", "N"):  # the last layer's residual add, with the final norm
            return self.model.norm.add_and_norm(hidden, residual)[0]

    @property
    def has_moe_layers(self) -> bool:
        """Whether any layer routes tokens to experts: without one, DBO has no all-to-all to overlap."""
        return bool(self.weight_spec().moe_layers)

    def set_fused_tails(self, enabled: bool) -> None:
        """Run every RMSNorm (with its residual add), the q/k norm with RoPE and the routers without groups or
        bias as fused Triton kernels (``True``) or as torch ops (``False``): the resolved ``fused_tails``
        setting (``ubatch.fused_tails.resolve_fused_tails``). DeepSeek's MLA RoPE and grouped or biased
        routing always run as torch ops."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, RotaryEmbedding)):
                module.fused = enabled
            elif isinstance(module, FusedMoE):
                module.fused_router = enabled

    def set_dbo_schedule(self, name: str) -> None:
        """Pick where the ubatches yield (``--dbo-schedule``); a schedule this family cannot run is an error."""
        self.dbo_schedule.name = check_schedule(name, self.supported_dbo_schedules, type(self).__name__)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """The LM head's logits ``[T, V]``, float32; ``upcast=False``: in the model's dtype, for a greedy pick, whose
        argmax is the same (the cast to float32 is exact) without writing and reading a float32 copy."""
        logits = F.linear(hidden, self.model.embed_tokens.weight) if self.lm_head is None else self.lm_head(hidden)
        return logits.float() if upcast else logits

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        raise NotImplementedError

    def _build_spec(self) -> WeightSpec:
        raise NotImplementedError

    def _common_shapes(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint tensors every family has: embeddings, final norm, and the LM head unless tied."""
        c = self.config
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
                                              "model.norm.weight": (c.hidden_size,)}
        if not c.tie_word_embeddings:
            shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
        return shapes

    def bind_kv_caches(self, caches: list[torch.Tensor]) -> None:
        check_and_bind(list(self.model.layers), caches, self.kv_cache_specs())

    def weight_spec(self) -> WeightSpec:
        if self._spec is None:
            self._spec = self._build_spec()
        return self._spec

    def wants_weight(self, name: str) -> bool:
        """Lets the loader skip reading tensors this EP rank does not keep."""
        return wants_weight(self.weight_spec(), name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_hf_weights(self, self.weight_spec(), weights)
