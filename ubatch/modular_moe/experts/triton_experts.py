"""Triton fused-MoE experts: two grouped GEMMs over expert-sorted row blocks, in vLLM's kernel structure.

Kernel 1 multiplies each block of routed rows by its expert's gate *and* up tiles and applies SiLU-and-mul in
the epilogue, so the ``[M*K, 2I]`` gate/up product is never materialised. Kernel 2 multiplies by ``w2``,
scales by the routing weight and writes one row per (token, k); the sum over k is a torch reduce.

Numerics, chosen so that GPU, interpreter and the torch reference agree: every load is cast to fp32 before
any arithmetic (the interpreter computes garbage on bf16), ``tl.dot`` runs with ``input_precision="ieee"``
(no TF32), the intermediate activation is kept in fp32, and only the final result is rounded to the input
dtype. That costs tensor-core throughput; it is a correctness backend first.

``triton`` is imported, and the kernels decorated, only when a ``TritonExperts`` is constructed: decoration
reads ``TRITON_INTERPRET``, and the package must import without Triton installed.

The reduction length ``K`` is a ``tl.constexpr``: a loop ``range`` with a run-time bound fails in Triton
3.6's interpreter under NumPy >= 2.4 (its ``tensor.__index__`` calls ``int()`` on a one-element array,
which NumPy 2.4 turned from a deprecation into a TypeError; Triton 3.9 squeezes the array first). A compile-time
``K`` gives every Triton version a plain Python bound, and the compiler a static trip count; it costs one
compilation per (hidden size, intermediate size), both fixed per model.

FP8 weights with block scales (a checkpoint's, :class:`~ubatch.fp8.Fp8Tensor`) are dequantised tile by tile in
the kernels (``FP8_W``): each loaded weight element is multiplied by the scale of its block, looked up per
element, so partial blocks and gate/up grids that do not line up need nothing special. Activations stay in
their dtype (weight-only W8A16, fp32 arithmetic as above).

Tile sizes, the L2 grouping of row blocks (``GROUP_M``, over a 1-D grid), warps and stages come per launch from
a tuned table or vLLM's untuned rule (:mod:`~ubatch.modular_moe.experts.triton_configs`).
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import torch

from ubatch.fp8 import Fp8Tensor
from ubatch.modular_moe.experts.base import MoEExperts
from ubatch.modular_moe.experts.moe_align import moe_align_block_size
from ubatch.modular_moe.experts.torch_experts import check_expert_weights
from ubatch.modular_moe.experts.triton_configs import (
    MoEConfigTable,
    TritonMoEConfig,
    config_dtype,
    default_config,
    device_table_name,
    find_table,
)
from ubatch.modular_moe.types import ExpertMLPExtras, ExpertTokens
from ubatch.triton_runtime import import_triton, interpreter_enabled, kernels_per_mode, launch_guard

__all__ = ["TritonExperts"]

logger = logging.getLogger("ubatch.experts")

# Filled by _load_kernels(); module globals because the interpreter re-executes kernel source against the
# defining function's __globals__ (closure variables are invisible to it).
triton: Any = None
tl: Any = None


def _import_triton() -> None:
    """Import on every construction (cheap once cached) so a missing Triton always gets the install hint."""
    global triton, tl
    triton, tl = import_triton("The 'triton' experts backend")


@kernels_per_mode
def _load_kernels() -> tuple[Any, Any]:
    """Decorate the kernels (once per interpreter mode: ``kernels_per_mode``)."""

    @triton.jit
    def _fused_w13_silu_mul_kernel(
        a_ptr, w_ptr, out_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_pad_ptr,
        num_valid, N, top_k, num_m_blocks,
        stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on,
        s_ptr, stride_se, stride_sn, stride_sk, up_scale_offset,
        K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, FP8_W: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
    ):
        # out[id, n] = silu(a[id // top_k] . w[e, n]) * (a[id // top_k] . w[e, N + n]) for the block's ids.
        # 1-D program id -> (row block, column block), GROUP_M row blocks at a time so that the programs
        # running together share weight column tiles in L2 (the Triton matmul tutorial's ordering, as vLLM)
        pid = tl.program_id(0)
        num_pid_in_group = GROUP_M * tl.cdiv(N, BLOCK_N)
        first_pid_m = (pid // num_pid_in_group) * GROUP_M
        group_size_m = tl.minimum(num_m_blocks - first_pid_m, GROUP_M)
        pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
        pid_n = (pid % num_pid_in_group) // group_size_m
        if pid_m * BLOCK_M >= tl.load(num_post_pad_ptr):
            return
        if tl.load(sorted_ids_ptr + pid_m * BLOCK_M) >= num_valid:
            return  # an all-padding block (masked layout: beyond expert_num_tokens[e])
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        if expert < 0:
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        ids = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
        row_mask = ids < num_valid
        ids = tl.where(row_mask, ids, 0)  # keep masked-off pointers in bounds (the interpreter checks)
        a_rows = ids // top_k
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
        gate_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        up_ptrs = gate_ptrs + N * stride_wn
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k_mask = offs_k < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            w_mask = k_mask[:, None] & n_mask[None, :]
            gate_w = tl.load(gate_ptrs, mask=w_mask, other=0.0).to(tl.float32)
            up_w = tl.load(up_ptrs, mask=w_mask, other=0.0).to(tl.float32)
            if FP8_W:  # each element times its block's scale; the up rows' grid starts up_scale_offset later
                s_ptrs = (s_ptr + expert * stride_se + ((kb * BLOCK_K + offs_k)[:, None] // SCALE_BK) * stride_sk
                          + (offs_n[None, :] // SCALE_BN) * stride_sn)
                gate_w = gate_w * tl.load(s_ptrs, mask=w_mask, other=0.0)
                up_w = up_w * tl.load(s_ptrs + up_scale_offset, mask=w_mask, other=0.0)
            acc_gate = tl.dot(a, gate_w, acc_gate, input_precision="ieee")
            acc_up = tl.dot(a, up_w, acc_up, input_precision="ieee")
            a_ptrs += BLOCK_K * stride_ak
            gate_ptrs += BLOCK_K * stride_wk
            up_ptrs += BLOCK_K * stride_wk
        act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
        out_ptrs = out_ptr + ids[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])

    @triton.jit
    def _w2_kernel(
        a_ptr, w_ptr, out_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_pad_ptr,
        num_valid, N, num_m_blocks,
        stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on,
        s_ptr, stride_se, stride_sn, stride_sk,
        MUL_ROUTED_WEIGHT: tl.constexpr,
        K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, FP8_W: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
    ):
        # out[id, n] = (a[id] . w[e, n]) * weight[id]: rows are already per (token, k), so no // top_k.
        pid = tl.program_id(0)  # grouped as in the first kernel
        num_pid_in_group = GROUP_M * tl.cdiv(N, BLOCK_N)
        first_pid_m = (pid // num_pid_in_group) * GROUP_M
        group_size_m = tl.minimum(num_m_blocks - first_pid_m, GROUP_M)
        pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
        pid_n = (pid % num_pid_in_group) // group_size_m
        if pid_m * BLOCK_M >= tl.load(num_post_pad_ptr):
            return
        if tl.load(sorted_ids_ptr + pid_m * BLOCK_M) >= num_valid:
            return
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        if expert < 0:
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        ids = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
        row_mask = ids < num_valid
        ids = tl.where(row_mask, ids, 0)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + ids[:, None] * stride_am + offs_k[None, :] * stride_ak
        w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k_mask = offs_k < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
            if FP8_W:
                s_ptrs = (s_ptr + expert * stride_se + ((kb * BLOCK_K + offs_k)[:, None] // SCALE_BK) * stride_sk
                          + (offs_n[None, :] // SCALE_BN) * stride_sn)
                w = w * tl.load(s_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision="ieee")
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk
        if MUL_ROUTED_WEIGHT:
            route_w = tl.load(weights_ptr + ids, mask=row_mask, other=0.0).to(tl.float32)
            acc = acc * route_w[:, None]
        out_ptrs = out_ptr + ids[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])

    return (_fused_w13_silu_mul_kernel, _w2_kernel)


_NO_FP8: dict[str, Any] = {"FP8_W": False, "SCALE_BN": 1, "SCALE_BK": 1}


def _scale_args(w: Fp8Tensor) -> tuple[Any, ...]:
    """A weight's scale pointer and strides (expert, row block, column block)."""
    s = w.scale
    return s, s.stride(0), s.stride(1), s.stride(2)


def _scale_consts(w: Fp8Tensor) -> dict[str, Any]:
    return {"FP8_W": True, "SCALE_BN": w.block[0], "SCALE_BK": w.block[1]}


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


class TritonExperts(MoEExperts):
    """Fused-MoE Triton backend for both layouts.

    Launch configurations come from a tuned table (:mod:`~ubatch.modular_moe.experts.triton_configs`: by GPU,
    shape, dtype and the nearest token count; ``config_dir`` or ``$UBATCH_MOE_CONFIG_DIR``), else from vLLM's
    untuned rule; which one is logged once per shape. Passing ``config`` or any block size fixes one
    configuration for every launch instead (tests, and ``benchmarks/tune_moe.py`` sweeping candidates).
    """

    name = "triton"
    supports_fp8_weights = True

    def __init__(
        self,
        block_m: int | None = None,
        block_n: int | None = None,
        block_k: int | None = None,
        num_warps: int | None = None,
        num_stages: int | None = None,
        group_m: int | None = None,
        *,
        config: TritonMoEConfig | None = None,
        config_dir: Path | None = None,
    ) -> None:
        _import_triton()
        self.interpret = interpreter_enabled()
        if not self.interpret and not torch.cuda.is_available():
            raise RuntimeError(
                "The Triton experts backend needs a CUDA GPU, or TRITON_INTERPRET=1 in the environment "
                "(set before construction) to run the kernels in Triton's CPU interpreter"
            )
        explicit = {name: value for name, value in (
            ("block_m", block_m), ("block_n", block_n), ("block_k", block_k), ("num_warps", num_warps),
            ("num_stages", num_stages), ("group_m", group_m)) if value is not None}
        if explicit and config is not None:
            raise ValueError(f"pass either config or block sizes, not both (got config and {sorted(explicit)})")
        if (explicit or config is not None) and config_dir is not None:
            raise ValueError("config_dir has no effect with a fixed configuration; pass one or the other")
        self.fixed_config = TritonMoEConfig(**explicit) if explicit else config
        self.config_dir = config_dir
        self._tables: dict[tuple[Any, ...], MoEConfigTable | None] = {}
        self._tables_lock = threading.Lock()
        self._w13_kernel, self._w2_kernel = _load_kernels()

    def config_for(self, device: torch.device, num_experts: int, inter: int, hidden: int, dtype: torch.dtype,
                   fp8_block: tuple[int, int] | None, num_tokens: int) -> TritonMoEConfig:
        """The configuration a launch with ``num_tokens`` tokens (rows per expert in the masked layout) uses."""
        if self.fixed_config is not None:
            return self.fixed_config
        device_name = device_table_name(device)
        table_dtype = config_dtype(str(dtype).removeprefix("torch."), fp8_block)
        key = (device_name, num_experts, inter, hidden, table_dtype, fp8_block)
        with self._tables_lock:
            if key not in self._tables:
                table, how = find_table(self.config_dir, num_experts, inter, hidden, device_name, table_dtype,
                                        fp8_block)
                logger.info("Triton experts (E=%d, N=%d, K=%d, %s, %s): %s", num_experts, inter, hidden,
                            table_dtype or str(dtype).removeprefix("torch."), device_name, how)
                self._tables[key] = table
            table = self._tables[key]
        return table.lookup(num_tokens) if table is not None else default_config(num_tokens, num_experts)

    def apply(self, tokens: ExpertTokens, w13: torch.Tensor, w2: torch.Tensor,
              extras: ExpertMLPExtras | None = None) -> torch.Tensor:
        return self._apply(tokens, w13, w2, extras, None)

    def apply_fp8(self, tokens: ExpertTokens, w13: Fp8Tensor, w2: Fp8Tensor,
                  extras: ExpertMLPExtras | None = None) -> torch.Tensor:
        """FP8 weights dequantised per block inside the kernels (any block size, partial blocks included)."""
        return self._apply(tokens, w13.data, w2.data, extras, (w13, w2))

    def _apply(self, tokens: ExpertTokens, w13: torch.Tensor, w2: torch.Tensor, extras: ExpertMLPExtras | None,
               fp8: tuple[Fp8Tensor, Fp8Tensor] | None) -> torch.Tensor:
        self.check_extras(extras)
        _, hidden_size, inter = check_expert_weights(tokens, w13, w2)
        if tokens.hidden.device.type != "cuda" and not self.interpret:
            raise RuntimeError(
                f"Triton kernels got tensors on {tokens.hidden.device}; "
                "without TRITON_INTERPRET=1 they need CUDA tensors"
            )
        # vLLM's M: the token count (contiguous), the rows per expert (masked: the batched experts' capacity)
        num_tokens = tokens.hidden.shape[1] if tokens.layout == "masked" else tokens.hidden.shape[0]
        config = self.config_for(tokens.hidden.device, w13.shape[0], inter, hidden_size, tokens.hidden.dtype,
                                 fp8[0].block if fp8 is not None else None, num_tokens)
        if tokens.layout == "masked":
            return self._apply_masked(tokens, w13, w2, hidden_size, inter, fp8, config)
        return self._apply_contiguous(tokens, w13, w2, hidden_size, inter, fp8, config)

    def _apply_contiguous(
        self, tokens: ExpertTokens, w13: torch.Tensor, w2: torch.Tensor, hidden_size: int, inter: int,
        fp8: tuple[Fp8Tensor, Fp8Tensor] | None, config: TritonMoEConfig,
    ) -> torch.Tensor:
        hidden = tokens.hidden
        assert tokens.topk_ids is not None and tokens.topk_weights is not None
        num_rows, top_k = tokens.topk_ids.shape
        num_routes = num_rows * top_k
        if num_routes == 0:
            return torch.zeros_like(hidden)
        sorted_ids, expert_ids, num_post_pad = moe_align_block_size(tokens.topk_ids, config.block_m, w13.shape[0])
        weights = tokens.topk_weights.reshape(-1).contiguous()
        per_route = torch.zeros((num_routes, hidden_size), dtype=torch.float32, device=hidden.device)
        self._run(hidden, top_k, w13, w2, weights, per_route, sorted_ids, expert_ids, num_post_pad, num_routes, inter,
                  fp8, config)
        return per_route.view(num_rows, top_k, hidden_size).sum(dim=1).to(hidden.dtype)

    def _apply_masked(
        self, tokens: ExpertTokens, w13: torch.Tensor, w2: torch.Tensor, hidden_size: int, inter: int,
        fp8: tuple[Fp8Tensor, Fp8Tensor] | None, config: TritonMoEConfig,
    ) -> torch.Tensor:
        """Each (expert, slot < expert_num_tokens[e]) is a route with weight 1; no align or host sync needed.

        Every expert gets ``cdiv(capacity, block_m)`` blocks of consecutive slots; blocks past its token count
        start with a pad id and exit at once, so the launch shape is static (CUDA-graph friendly).
        """
        hidden = tokens.hidden
        assert tokens.expert_num_tokens is not None
        num_experts, capacity, _ = hidden.shape
        num_slots = num_experts * capacity
        if num_slots == 0:
            return torch.zeros_like(hidden)
        device = hidden.device
        blocks_per_expert = _cdiv(capacity, config.block_m)
        slot = torch.arange(blocks_per_expert * config.block_m, device=device)
        counts = tokens.expert_num_tokens.to(device=device, dtype=torch.int64).clamp(max=capacity)
        flat_ids = torch.arange(num_experts, device=device).unsqueeze(1) * capacity + slot.unsqueeze(0)
        in_use = slot.unsqueeze(0) < counts.unsqueeze(1)
        sorted_ids = torch.where(in_use, flat_ids, num_slots).to(torch.int32).reshape(-1)
        expert_ids = torch.arange(num_experts, device=device, dtype=torch.int32).repeat_interleave(blocks_per_expert)
        num_post_pad = torch.full((1,), sorted_ids.numel(), dtype=torch.int32, device=device)  # no H2D copy
        out = torch.zeros((num_slots, hidden_size), dtype=hidden.dtype, device=device)
        self._run(hidden.reshape(num_slots, hidden_size), 1, w13, w2, None, out,
                  sorted_ids, expert_ids, num_post_pad, num_slots, inter, fp8, config)
        return out.view(num_experts, capacity, hidden_size)

    def _run(
        self,
        a: torch.Tensor,
        top_k: int,
        w13: torch.Tensor,
        w2: torch.Tensor,
        weights: torch.Tensor | None,
        out: torch.Tensor,
        sorted_ids: torch.Tensor,
        expert_ids: torch.Tensor,
        num_post_pad: torch.Tensor,
        num_routes: int,
        inter: int,
        fp8: tuple[Fp8Tensor, Fp8Tensor] | None,
        config: TritonMoEConfig,
    ) -> None:
        """Launch both GEMMs; ``out`` must be zero-initialised (rows of non-local routes are never written)."""
        intermediate = torch.empty((num_routes, inter), dtype=torch.float32, device=a.device)
        launch: dict[str, Any] = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                                      GROUP_M=config.group_m)
        # without FP8 weights the scale arguments are placeholders the kernels never read (FP8_W is False)
        s13, s2 = (_scale_args(fp8[0]), _scale_args(fp8[1])) if fp8 is not None else ((w13, 0, 0, 0), (w2, 0, 0, 0))
        f13, f2 = (_scale_consts(fp8[0]), _scale_consts(fp8[1])) if fp8 is not None else (_NO_FP8, _NO_FP8)
        up_offset = (fp8[0].scale.shape[1] // 2) * fp8[0].scale.stride(1) if fp8 is not None else 0
        if not self.interpret:
            launch.update(num_warps=config.num_warps, num_stages=config.num_stages)
        hidden_size = a.shape[1]
        num_m_blocks = expert_ids.numel()
        with launch_guard(self.interpret):
            self._w13_kernel[(num_m_blocks * _cdiv(inter, config.block_n),)](
                a, w13, intermediate, sorted_ids, expert_ids, num_post_pad,
                num_routes, inter, top_k, num_m_blocks,
                a.stride(0), a.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
                intermediate.stride(0), intermediate.stride(1),
                *s13, up_offset,
                K=hidden_size, **launch, **f13,
            )
            self._w2_kernel[(num_m_blocks * _cdiv(hidden_size, config.block_n),)](
                intermediate, w2, out, weights if weights is not None else intermediate,
                sorted_ids, expert_ids, num_post_pad,
                num_routes, hidden_size, num_m_blocks,
                intermediate.stride(0), intermediate.stride(1), w2.stride(0), w2.stride(1), w2.stride(2),
                out.stride(0), out.stride(1),
                *s2,
                MUL_ROUTED_WEIGHT=weights is not None,
                K=inter, **launch, **f2,
            )
