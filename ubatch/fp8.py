"""FP8 weights as checkpoints ship them: float8_e4m3fn values with one fp32 scale per block.

DeepSeek-V3 and the Qwen3 ``-FP8`` models store every quantised matrix ``W [N, K]`` as ``q`` (float8_e4m3fn) and
``weight_scale_inv [cdiv(N, 128), cdiv(K, 128)]`` with ``W = q * scale`` block by block; the last row and column
of blocks may be partial (DeepSeek-V3's ``kv_a_proj_with_mqa`` has 576 rows, 4.5 blocks). A per-tensor scale
(``weight_scale``, one scalar) is the same thing with one block covering the whole matrix. Experts fuse gate
and up rows into one ``w13``; each keeps its own block grid (``row_shards=2``), which is the plain grid whenever
the intermediate size is a multiple of the block height, as the GPU kernels require.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
DEFAULT_BLOCK = (128, 128)  # DeepSeek-V3's and Qwen3-FP8's weight_block_size
_MIN_SCALE = 1e-12  # an all-zero block gets this scale instead of 0, so quantising it divides by no zero


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scale_shape(rows: int, cols: int, block: tuple[int, int], row_shards: int = 1) -> tuple[int, int]:
    """The scale grid of a ``[rows, cols]`` matrix split into ``row_shards`` equal row shards, each blocked alone."""
    if rows % row_shards:
        raise ValueError(f"{rows} rows do not split into {row_shards} equal shards")
    return row_shards * cdiv(rows // row_shards, block[0]), cdiv(cols, block[1])


def _expand(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """``[..., nb_rows, nb_cols]`` -> ``[..., rows, cols]``: each block's scale over its (possibly partial) block."""
    full = scale.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    return full.repeat_interleave(block[1], dim=-1)[..., :cols]


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q [..., N, K]`` fp8 times its per-block ``scale`` in fp32, rounded once to ``dtype``."""
    n, k = q.shape[-2:]
    return (q.float() * _expand(scale, n, k, block)).to(dtype)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` -> ``(fp8 [..., N, K], fp32 scales [..., cdiv(N, bn), cdiv(K, bk)])``.

    Each block's scale is its absolute maximum over 448 (the largest e4m3 value), as DeepSeek's and vLLM's
    block quantisers do, so the block's largest entry maps to +-448.
    """
    n, k = w.shape[-2:]
    bn, bk = block
    nb, kb = cdiv(n, bn), cdiv(k, bk)
    padded = torch.nn.functional.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n))
    view = padded.reshape(*w.shape[:-2], nb, bn, kb, bk)
    amax = view.abs().amax(dim=(-3, -1))
    scale = (amax / FP8_MAX).clamp(min=_MIN_SCALE)
    q = (w.float() / _expand(scale, n, k, block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


@dataclass(frozen=True)
class Fp8Tensor:
    """An FP8 matrix (or a stack of them, e.g. one per expert) with its block scales.

    ``data [..., N, K]`` float8_e4m3fn; ``scale [..., row_shards * cdiv(N / row_shards, bn), cdiv(K, bk)]`` fp32,
    multiplied in to dequantise (DeepSeek names it ``weight_scale_inv``); ``block = (bn, bk)``.
    """

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]
    row_shards: int = 1

    def __post_init__(self) -> None:
        if self.data.dtype != FP8_DTYPE:
            raise ValueError(f"Fp8Tensor data must be {FP8_DTYPE}, got {self.data.dtype}")
        want = scale_shape(self.data.shape[-2], self.data.shape[-1], self.block, self.row_shards)
        if tuple(self.scale.shape[-2:]) != want or self.scale.shape[:-2] != self.data.shape[:-2]:
            raise ValueError(f"Fp8Tensor scale has shape {tuple(self.scale.shape)}, expected "
                             f"{(*self.data.shape[:-2], *want)} for data {tuple(self.data.shape)} in "
                             f"{self.block} blocks")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The matrix in ``dtype``: fp32 products rounded once (W8A16 compute, and the tests' reference)."""
        if self.row_shards == 1:
            return dequantize_blocks(self.data, self.scale, self.block, dtype)
        data = self.data.chunk(self.row_shards, dim=-2)
        scale = self.scale.chunk(self.row_shards, dim=-2)
        return torch.cat([dequantize_blocks(d, s, self.block, dtype) for d, s in zip(data, scale, strict=True)], dim=-2)

    def uniform_grid(self) -> bool:
        """Whether ``scale`` is one plain block grid over all rows (each row shard a whole number of blocks),
        the layout DeepGEMM and the Triton kernel read."""
        return self.row_shards == 1 or (self.data.shape[-2] // self.row_shards) % self.block[0] == 0
