"""FusedMoE: one MoE layer's expert weights (this EP rank's share), its routing and its modular kernel.

Layers of one model share one :class:`MoERuntime` (pass ``runtime=``): that is how they share the
all-to-all backend and, with ``emulate_link``, contend for the same modelled wire. A layer given only
``parallel`` builds a runtime of its own.

Padding rows (DP padding to the max across ranks, CUDA-graph padding to a capture size) are marked by the
forward context's ``real_token_mask``; their top-k ids become ``-1`` right after routing, so they are sent
to no expert, skew no expert's load and take no buffer capacity (vLLM's ``moe_padding_mask``). The mask is
a device tensor, so this costs no host sync and stays CUDA-graph capturable.

``expert_bias`` and ``activation`` (gpt-oss) add per-expert biases ``w13_bias [E_local, 2I]`` (gate entries,
then up entries) and ``w2_bias [E_local, H]`` and the clamped SwiGLU; the experts backend must implement them
(``MoEExperts.supports_extras``: torch and grouped_mm), which is checked when the kernel is built.

:meth:`FusedMoE.use_fp8_weights` makes the layer hold its experts as a checkpoint's FP8 (float8_e4m3fn values,
``w13_weight_scale_inv`` / ``w2_weight_scale_inv`` block scales, ``ubatch/fp8.py``); the kernel then gets
:class:`~ubatch.fp8.Fp8Tensor` weights, which a backend either consumes (DeepGEMM) or dequantises.
"""
from __future__ import annotations

from typing import cast

import torch
from torch import nn

from ubatch import trace
from ubatch.forward_context import maybe_get_forward_context
from ubatch.fp8 import FP8_DTYPE, Fp8Tensor, scale_shape
from ubatch.modular_moe.config import MoEParallelConfig
from ubatch.modular_moe.experts.auto import experts_for_layer
from ubatch.modular_moe.experts.base import MoEExperts
from ubatch.modular_moe.fused_router import fused_select_experts
from ubatch.modular_moe.kernel import FusedMoEModularKernel
from ubatch.modular_moe.router import ScoringFunc, select_experts
from ubatch.modular_moe.runtime import MoERuntime
from ubatch.modular_moe.types import ClampedSwiGLU, ExpertMLPExtras

_SHARDS = ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *,
                 renormalize: bool = True, scoring_func: str = "softmax", num_expert_group: int | None = None,
                 topk_group: int | None = None, use_correction_bias: bool = False,
                 routed_scaling_factor: float = 1.0, group_scoring: str = "top2_sum",
                 shared_experts: nn.Module | None = None,
                 parallel: MoEParallelConfig | None = None, params_dtype: torch.dtype | None = None,
                 runtime: MoERuntime | None = None, expert_bias: bool = False,
                 activation: ClampedSwiGLU | None = None) -> None:
        super().__init__()
        if top_k < 1 or top_k > num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if runtime is not None and parallel is not None and runtime.parallel is not parallel:
            raise ValueError("FusedMoE got both parallel= and runtime= with a different config; pass the runtime "
                             "alone (it carries its config)")
        self.runtime = runtime if runtime is not None else MoERuntime(parallel)
        self.parallel = self.runtime.parallel
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.scoring_func = cast(ScoringFunc, scoring_func)  # select_experts refuses any other name
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.group_scoring = group_scoring
        self.local_expert_range = self.parallel.local_expert_range(num_experts)
        dtype = params_dtype or torch.get_default_dtype()
        n_local = len(self.local_expert_range)
        self.w13_weight = nn.Parameter(torch.zeros(n_local, 2 * intermediate_size, hidden_size, dtype=dtype),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.zeros(n_local, hidden_size, intermediate_size, dtype=dtype),
                                      requires_grad=False)
        self.activation = activation
        if expert_bias:
            self.w13_bias: nn.Parameter | None = nn.Parameter(
                torch.zeros(n_local, 2 * intermediate_size, dtype=dtype), requires_grad=False)
            self.w2_bias: nn.Parameter | None = nn.Parameter(torch.zeros(n_local, hidden_size, dtype=dtype),
                                                             requires_grad=False)
        else:
            self.w13_bias = self.w2_bias = None
        self.e_score_correction_bias: nn.Parameter | None
        if use_correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                        requires_grad=False)
        else:
            self.e_score_correction_bias = None
        self.shared_experts = shared_experts
        #: route with the fused Triton kernel (``fused_tails``) where this layer's routing has no groups and no
        #: correction bias; grouped or biased routing always runs ``select_experts``
        self.fused_router = False
        self._kernels: dict[str, FusedMoEModularKernel] = {}
        #: (w13 block, w2 block) once the experts are FP8 (:meth:`use_fp8_weights`), else None
        self.fp8_blocks: tuple[tuple[int, int], tuple[int, int]] | None = None
        self.w13_weight_scale_inv: nn.Parameter | None = None
        self.w2_weight_scale_inv: nn.Parameter | None = None

    def use_fp8_weights(self, block: tuple[int, int] | None) -> None:
        """Hold the experts as float8_e4m3fn with fp32 scales, one per ``block`` (``None``: one per matrix, the
        per-tensor scheme), on the device the weights are on (the meta device while a model is built).

        ``w13``'s gate rows and up rows are blocked separately (each expert's checkpoint has one tensor and one
        scale grid per projection), so ``w13_weight_scale_inv [E_local, 2 * cdiv(I, bn), cdiv(H, bk)]``.
        """
        if self.w13_bias is not None or self.activation is not None:
            raise ValueError("FP8 experts with biases or the clamped SwiGLU (gpt-oss) are not supported")
        e, i, h = self.w13_weight.shape[0], self.intermediate_size, self.hidden_size
        b13, b2 = (block, block) if block is not None else ((i, h), (h, i))
        device = self.w13_weight.device
        self.fp8_blocks = (b13, b2)
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, h, dtype=FP8_DTYPE, device=device), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(e, h, i, dtype=FP8_DTYPE, device=device), requires_grad=False)
        self.w13_weight_scale_inv = nn.Parameter(torch.empty(e, *scale_shape(2 * i, h, b13, 2), device=device),
                                                 requires_grad=False)
        self.w2_weight_scale_inv = nn.Parameter(torch.empty(e, *scale_shape(h, i, b2), device=device),
                                                requires_grad=False)

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor] | tuple[Fp8Tensor, Fp8Tensor]:
        """``(w13, w2)`` as the kernel takes them: plain tensors, or FP8 ones with their scales."""
        if self.fp8_blocks is None:
            return self.w13_weight, self.w2_weight
        assert self.w13_weight_scale_inv is not None and self.w2_weight_scale_inv is not None
        b13, b2 = self.fp8_blocks
        return (Fp8Tensor(self.w13_weight, self.w13_weight_scale_inv, b13, row_shards=2),
                Fp8Tensor(self.w2_weight, self.w2_weight_scale_inv, b2))

    @property
    def kernel(self) -> FusedMoEModularKernel:
        """The kernel over the configured backend (a phase-aware backend: its decode one)."""
        return self.kernel_for(self.runtime.default_backend)

    def kernel_for(self, backend: str) -> FusedMoEModularKernel:
        """Built on first use: the backend needs the process groups, which exist only once ranks are up.

        An ``experts_backend`` of ``auto`` is resolved here, by the device the weights are on by then and this
        layer's shape (:func:`~ubatch.modular_moe.experts.auto.experts_for_layer`: a backend per token-count
        bucket where a backend-choice table exists for it).
        """
        kernel = self._kernels.get(backend)
        if kernel is None:
            device = self.w13_weight.device
            pf = self.runtime.prepare_finalize(self.num_experts, self.hidden_size, device, backend)
            experts = self._make_experts(device)
            experts.check_extras(self.extras())
            kernel = FusedMoEModularKernel(pf, experts, self.shared_experts, sbo=self.parallel.sbo)
            self._kernels[backend] = kernel
        return kernel

    def _make_experts(self, device: torch.device) -> MoEExperts:
        """The experts backend for this layer's shape, keyed as the Triton tables are: local experts, intermediate
        and hidden size, the weights' dtype (FP8 ones by their ``w13`` block shape)."""
        fp8_block = self.fp8_blocks[0] if self.fp8_blocks is not None else None
        return experts_for_layer(self.parallel.experts_backend, device, self.w13_weight.shape[0],
                                 self.intermediate_size, self.hidden_size, self.w13_weight.dtype, fp8_block)

    def extras(self) -> ExpertMLPExtras | None:
        """The experts' biases and activation, ``None`` for plain SiLU-and-mul without biases."""
        if self.w13_bias is None and self.activation is None:
            return None
        return ExpertMLPExtras(self.w13_bias, self.w2_bias, self.activation)

    def load_expert_weight(self, global_expert_id: int, shard: str, weight: torch.Tensor) -> bool:
        if shard not in _SHARDS:
            raise ValueError(f"unknown expert weight shard {shard!r}; expected one of {_SHARDS}")
        if not 0 <= global_expert_id < self.num_experts:
            raise ValueError(f"expert id {global_expert_id} out of range [0, {self.num_experts})")
        if global_expert_id not in self.local_expert_range:
            return False
        local = global_expert_id - self.local_expert_range.start
        i = self.intermediate_size
        if shard.endswith("_bias"):
            if self.w13_bias is None or self.w2_bias is None:
                raise ValueError(f"expert {global_expert_id} {shard}: this MoE layer has no expert biases")
            target = {"gate_bias": self.w13_bias[local, :i], "up_bias": self.w13_bias[local, i:],
                      "down_bias": self.w2_bias[local]}[shard]
        else:
            target = {"gate": self.w13_weight[local, :i], "up": self.w13_weight[local, i:],
                      "down": self.w2_weight[local]}[shard]
        if tuple(weight.shape) != tuple(target.shape):
            raise ValueError(f"expert {global_expert_id} {shard} weight has shape {tuple(weight.shape)}, "
                             f"expected {tuple(target.shape)}")
        if (target.dtype == FP8_DTYPE) != (weight.dtype == FP8_DTYPE):  # a cast would drop or miss the scales
            raise ValueError(f"expert {global_expert_id} {shard} weight is {weight.dtype}, but this layer holds "
                             f"{target.dtype} experts")
        with torch.no_grad():
            target.copy_(weight)
        return True

    def load_expert_scale(self, global_expert_id: int, shard: str, scale: torch.Tensor) -> bool:
        """One expert projection's FP8 scales (``gate``/``up``/``down``: its ``weight_scale_inv`` grid, or its
        per-tensor ``weight_scale`` as a 1 x 1 grid); False for another rank's expert."""
        if self.w13_weight_scale_inv is None or self.w2_weight_scale_inv is None:
            raise ValueError(f"expert {global_expert_id} {shard}: got an FP8 scale, but this MoE layer's experts "
                             "are not FP8")
        if shard not in ("gate", "up", "down"):
            raise ValueError(f"unknown expert scale shard {shard!r}; expected gate, up or down")
        if not 0 <= global_expert_id < self.num_experts:
            raise ValueError(f"expert id {global_expert_id} out of range [0, {self.num_experts})")
        if global_expert_id not in self.local_expert_range:
            return False
        local = global_expert_id - self.local_expert_range.start
        half = self.w13_weight_scale_inv.shape[1] // 2
        target = {"gate": self.w13_weight_scale_inv[local, :half], "up": self.w13_weight_scale_inv[local, half:],
                  "down": self.w2_weight_scale_inv[local]}[shard]
        if tuple(scale.shape) != tuple(target.shape):
            raise ValueError(f"expert {global_expert_id} {shard} scale has shape {tuple(scale.shape)}, "
                             f"expected {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(scale)
        return True

    def load_fused_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Load every expert from full fused tensors ``w13 [E, 2I, H]``, ``w2 [E, H, I]``; keeps the local ones."""
        if w13.shape[0] != self.num_experts or w2.shape[0] != self.num_experts:
            raise ValueError(f"expected weights for {self.num_experts} experts, got w13 {tuple(w13.shape)} and "
                             f"w2 {tuple(w2.shape)}")
        i = self.intermediate_size
        for e in self.local_expert_range:
            self.load_expert_weight(e, "gate", w13[e, :i])
            self.load_expert_weight(e, "up", w13[e, i:])
            self.load_expert_weight(e, "down", w2[e])

    @property
    def routes_fused(self) -> bool:
        """Whether this layer's routing runs the fused kernel: ``fused_router`` set, no groups, no bias."""
        return self.fused_router and self.num_expert_group is None and self.e_score_correction_bias is None

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        with trace.compute_span("route", "R"):
            if self.routes_fused:
                topk_weights, topk_ids = fused_select_experts(router_logits, self.top_k, self.renormalize,
                                                              self.scoring_func, self.routed_scaling_factor)
            else:
                topk_weights, topk_ids = select_experts(
                    router_logits, self.top_k, self.renormalize, scoring_func=self.scoring_func,
                    num_expert_group=self.num_expert_group, topk_group=self.topk_group,
                    e_score_correction_bias=self.e_score_correction_bias,
                    routed_scaling_factor=self.routed_scaling_factor, group_scoring=self.group_scoring)
            topk_ids = route_padding_nowhere(topk_ids)
        kernel = self.kernel_for(self.runtime.backend_for_step())
        w13, w2 = self.expert_weights()
        return kernel(hidden_states, w13, w2, topk_weights, topk_ids, self.extras())

    def extra_repr(self) -> str:
        r = self.local_expert_range
        return (f"experts={self.num_experts} (local {r.start}..{r.stop - 1}), top_k={self.top_k}, "
                f"hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"all2all={self.parallel.all2all_backend}, experts_backend={self.parallel.experts_backend}"
                + (f", fp8_blocks={self.fp8_blocks}" if self.fp8_blocks is not None else ""))


def route_padding_nowhere(topk_ids: torch.Tensor) -> torch.Tensor:
    """``topk_ids`` with every padding row's ids set to ``-1`` (the forward context's ``real_token_mask``)."""
    fc = maybe_get_forward_context()
    mask = fc.real_token_mask if fc is not None else None
    if mask is None:
        return topk_ids
    if mask.shape != topk_ids.shape[:1]:
        raise ValueError(f"real_token_mask has shape {tuple(mask.shape)} but this MoE call routes "
                         f"{topk_ids.shape[0]} rows; the mask must have one entry per row")
    return topk_ids.masked_fill(~mask.unsqueeze(1), -1)
