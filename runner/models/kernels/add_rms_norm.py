"""RMSNorm with the residual add before it, one Triton kernel: each row is read once and written once.

``out, residual = add_rms_norm(x, residual, weight, eps)`` computes ``residual = x + residual`` and
``out = weight * rmsnorm(residual)`` (vLLM's ``fused_add_rms_norm``); with ``residual=None`` it is the plain
RMSNorm and returns ``x`` as the residual. It rounds where Hugging Face's eager ops round, so a 16-bit model
sees the same values as :class:`~runner.models.layers.RMSNorm` after the add: the sum is rounded to the
activation dtype (and that rounded sum is what is normalised), the norm runs in fp32 and is rounded to the
activation dtype, then multiplied by the weight and rounded to ``promote(weight, x)``. Only the order of the
fp32 sum of squares differs from torch's.

One program per row, the whole row in one block; shapes alone fix the grid, outputs are allocated by shape, so
the call is capturable in a CUDA graph. Triton is imported on first call.
"""
from __future__ import annotations

from typing import Any

import torch

from ubatch.triton_runtime import import_triton, kernels_per_mode, launch_guard, launch_mode

__all__ = ["add_rms_norm"]

# Filled on first use; module globals because the interpreter re-executes kernel source against the defining
# function's __globals__ (closure variables are invisible to it).
triton: Any = None
tl: Any = None


@kernels_per_mode
def _load_kernel() -> Any:
    """Decorate the kernel (once per interpreter mode: ``kernels_per_mode``)."""

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
        stride_x, stride_r, stride_o, stride_ro,
        HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_N)
        mask = offs < n_cols
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
            summed = (x + r).to(res_out_ptr.dtype.element_ty)  # HF adds in the activation dtype
            tl.store(res_out_ptr + row * stride_ro + offs, summed, mask=mask)
            x = summed.to(tl.float32)
        var = tl.sum(x * x, axis=0) / n_cols
        normed = (x * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)  # cast back, then scale
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)

    return _add_rms_norm_kernel


def num_warps_for(block_n: int) -> int:
    """Warps per row program: enough lanes that each holds at most 16 of the row's elements."""
    return max(1, min(16, block_n // 512))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight * rmsnorm(x + residual), x + residual)`` over the last dim, ``x`` and ``residual`` of one
    shape and dtype, ``weight [N]``; ``residual=None``: ``(weight * rmsnorm(x), x)``.

    CUDA tensors run the compiled kernel; CPU tensors need ``TRITON_INTERPRET=1`` (Triton's interpreter).
    """
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"add_rms_norm: weight has shape {tuple(weight.shape)}, expected ({n},)")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} differs from x "
                         f"{tuple(x.shape)} {x.dtype}")
    interpret = launch_mode("add_rms_norm", x.device)
    global triton, tl
    triton, tl = import_triton("add_rms_norm")
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else x
    if x2.shape[0] == 0:
        return out, res_out
    r2 = _rows(residual) if residual is not None else x2  # x2: an unread placeholder
    out2, ro2 = out.view(-1, n), res_out.view(-1, n) if residual is not None else x2
    kernel = _load_kernel()
    block_n = triton.next_power_of_2(n)
    with launch_guard(interpret):
        kernel[(x2.shape[0],)](
            x2, r2, weight.contiguous(), out2, ro2, n, float(eps),
            x2.stride(0), r2.stride(0), out2.stride(0), ro2.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK_N=block_n,
            **({} if interpret else {"num_warps": num_warps_for(block_n)}),
        )
    return out, res_out


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, N]`` with unit stride along ``N`` (a view where the layout allows)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()
