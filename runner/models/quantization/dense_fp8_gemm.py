"""Which GEMM the dense FP8 linears (attention projections, shared experts, dense MLPs) run; chosen once per load.

- ``deep_gemm``: DeepGEMM's ``fp8_gemm_nt`` on Hopper (sm_90). Each call quantises the activations per token
  per 128 columns (fp32 scales ``[M, K / 128]``, DeepGEMM's 1 x 128 recipe; the library lays them out MN-major
  and TMA-aligned itself) and hands the checkpoint's FP8 weight and ``weight_scale_inv`` (the 128 x 128 recipe)
  over as they are; the output is bf16. Layers it takes: 128 x 128 blocks, ``K`` a multiple of 128 and ``N`` of
  64 (the shapes DeepGEMM's own tests run, e.g. DeepSeek-V3's 576-row ``kv_a_proj_with_mqa``).
- ``dequantize``: the weight dequantised to the activations' dtype, then a plain GEMM (W8A16): the CPU, GPUs
  other than Hopper (Blackwell's DeepGEMM keeps only each scale's exponent, so the checkpoint's scales would
  need requantising), Hopper without ``deep_gemm``, and layers of other shapes or per-tensor scales.

:func:`select_dense_fp8_gemm` makes the choice and says why; the loader logs it with the layer counts.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from ubatch.fp8 import Fp8Tensor
from ubatch.modular_moe.experts.deep_gemm_experts import deep_gemm_function, per_token_cast_to_fp8

DEEP_GEMM, DEQUANTIZE = "deep_gemm", "dequantize"
DEEP_GEMM_BLOCK = (128, 128)
_GEMM_NAMES = ("fp8_fp4_gemm_nt", "fp8_gemm_nt")  # DeepGEMM main's name first, then its alias (older releases)


@dataclass(frozen=True)
class DenseFp8Gemm:
    """``kernel`` (``deep_gemm`` or ``dequantize``), ``reason`` it was chosen, and DeepGEMM's ``fp8_gemm_nt``
    when it is the kernel."""

    kernel: str
    reason: str
    fp8_gemm_nt: Callable[..., None] | None = None

    def takes(self, block: tuple[int, int], in_features: int, out_features: int) -> bool:
        """Whether a layer of this shape runs the FP8 GEMM (else it dequantises)."""
        return (self.kernel == DEEP_GEMM and block == DEEP_GEMM_BLOCK and in_features % 128 == 0
                and out_features % 64 == 0)

    def linear(self, x: torch.Tensor, w: Fp8Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ w.T + bias`` in ``x``'s dtype: the FP8 GEMM when :meth:`takes` the weight, else dequantised."""
        n, k = w.shape
        if self.fp8_gemm_nt is None or not self.takes(w.block, k, n):
            return F.linear(x, w.dequantize(x.dtype), bias)
        rows = x.reshape(-1, k)
        out = torch.empty((rows.shape[0], n), dtype=torch.bfloat16, device=x.device)
        self.fp8_gemm_nt(per_token_cast_to_fp8(rows), (w.data, w.scale), out)
        y = out.to(x.dtype).reshape(*x.shape[:-1], n)
        return y if bias is None else y + bias


DEQUANTIZED = DenseFp8Gemm(DEQUANTIZE, "the default: each weight dequantised to the activations' dtype")


def select_dense_fp8_gemm(device: torch.device, deep_gemm_module: ModuleType | None = None) -> DenseFp8Gemm:
    """DeepGEMM on a Hopper GPU where ``deep_gemm`` imports (or through ``deep_gemm_module``, the tests' CPU
    stand-in, which behaves as SM90), else dequantise; the result names its reason."""
    if deep_gemm_module is not None:
        return DenseFp8Gemm(DEEP_GEMM, f"the deep_gemm module given ({deep_gemm_module.__name__})",
                            deep_gemm_function(deep_gemm_module, _GEMM_NAMES))
    if device.type != "cuda":
        return DenseFp8Gemm(DEQUANTIZE, f"no FP8 GEMM on {device}: weights dequantised per call (W8A16)")
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return DenseFp8Gemm(DEQUANTIZE, f"sm_{major}{minor}: the block-FP8 GEMM used is DeepGEMM's Hopper (sm_90) "
                                        "one; weights dequantised per call (W8A16)")
    try:
        import deep_gemm
    except ImportError:
        return DenseFp8Gemm(DEQUANTIZE, "sm_90 without deep_gemm (pip install sgl-deep-gemm for the FP8 GEMM): "
                                        "weights dequantised per call (W8A16)")
    return DenseFp8Gemm(DEEP_GEMM, "sm_90 with deep_gemm importable", deep_gemm_function(deep_gemm, _GEMM_NAMES))
