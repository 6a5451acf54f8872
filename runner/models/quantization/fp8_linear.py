"""A linear layer holding FP8 weights with their scales (attention projections, dense MLPs, shared experts).

Parameter names are the checkpoint's: ``weight`` (float8_e4m3fn, ``[out, in]``) and ``weight_scale_inv`` (fp32,
one per block; a per-tensor checkpoint's ``weight_scale`` is loaded into it as a 1 x 1 grid). Memory holds the
FP8 bytes. The forward runs the layer's :class:`~runner.models.quantization.dense_fp8_gemm.DenseFp8Gemm`: an
FP8 GEMM on FP8-quantised activations (DeepGEMM on Hopper), or by default the weight dequantised to the
activations' dtype and a plain GEMM (W8A16, the CPU path: a transient full-precision copy of one weight at a time).
"""
from __future__ import annotations

import torch
from torch import nn

from runner.models.quantization.dense_fp8_gemm import DEQUANTIZED, DenseFp8Gemm
from ubatch.fp8 import FP8_DTYPE, Fp8Tensor, scale_shape


class Fp8Linear(nn.Module):
    """``y = x @ dequant(weight).T + bias``; built in place of an ``nn.Linear`` of the same sizes."""

    def __init__(self, in_features: int, out_features: int, bias: bool, block: tuple[int, int] | None,
                 bias_dtype: torch.dtype | None = None, device: torch.device | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block = block if block is not None else (out_features, in_features)  # per-tensor: one block
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            torch.empty(scale_shape(out_features, in_features, self.block), dtype=torch.float32, device=device),
            requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=bias_dtype, device=device),
                                 requires_grad=False) if bias else None
        self.gemm: DenseFp8Gemm = DEQUANTIZED  # set by the loader (convert.apply_fp8)

    @classmethod
    def replacing(cls, linear: nn.Linear, block: tuple[int, int] | None) -> Fp8Linear:
        """An FP8 layer shaped like ``linear``, on its device (the meta device while a model is built)."""
        bias = linear.bias
        return cls(linear.in_features, linear.out_features, bias is not None, block,
                   bias.dtype if bias is not None else None, linear.weight.device)

    def fp8(self) -> Fp8Tensor:
        return Fp8Tensor(self.weight, self.weight_scale_inv, self.block)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return self.fp8().dequantize(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm.linear(x, self.fp8(), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"block={self.block}, gemm={self.gemm.kernel if self.uses_fp8_gemm() else 'dequantize'}")

    def uses_fp8_gemm(self) -> bool:
        """Whether the forward runs an FP8 GEMM (its kernel takes this layer's shape and blocks)."""
        return self.gemm.takes(self.block, self.in_features, self.out_features)


def linear_weight(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A linear layer's ``[out, in]`` weight in ``dtype`` for code that reads it directly (MLA's absorbed
    ``kv_b_proj``): an FP8 one dequantised, a plain one as it is."""
    if isinstance(linear, Fp8Linear):
        return linear.dequantized_weight(dtype)
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"expected a linear layer, got {type(linear).__name__}")
    return linear.weight
