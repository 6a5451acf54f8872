"""Per-head q/k RMSNorm followed by RoPE, for q and k in one Triton kernel (Qwen3's attention prologue).

``qk_norm_rope(q [T, Hq, D], k [T, Hk, D], cos, sin, rot_dim, ...)`` normalises each head over its ``D``
features (when weights are given: the no-norm case is RoPE alone), then rotates its first ``rot_dim`` features
with the half-width tables of :meth:`~runner.models.layers.RotaryEmbedding.cos_sin` and passes the rest through
(partial rotary). Both layouts of :meth:`~runner.models.layers.RotaryEmbedding.rotate` are covered: neox
(rotate-half) and interleaved pairs, whose output is ``cat(rotated_evens, rotated_odds)``.

Rounding follows the torch ops it replaces: the norm runs in fp32 and is rounded to the activation dtype before
the weight multiply, whose product is rounded again; each RoPE product and the sum or difference of two are
rounded to the activation dtype, as ``x1 * cos - x2 * sin`` is in torch. Only the order of the fp32 sum of
squares differs.

One program per (token, block of heads); q's heads and k's heads form one range, each program loading from q or
from k by masks (no branch), so one launch serves both. Outputs are new contiguous tensors, the grid comes from
shapes alone, so the call is capturable in a CUDA graph. Triton is imported on first call.
"""
from __future__ import annotations

from typing import Any

import torch

from ubatch.triton_runtime import import_triton, kernels_per_mode, launch_guard, launch_mode

__all__ = ["qk_norm_rope"]

triton: Any = None
tl: Any = None
# Elements of one program's tile of heads (a power of two); BLOCK_H is this over the padded rotary half-width.
TILE_ELEMENTS = 2048


@kernels_per_mode
def _load_kernel() -> Any:
    """Decorate the kernel (once per interpreter mode: ``kernels_per_mode``)."""

    @triton.jit
    def _qk_norm_rope_kernel(
        q_ptr, k_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_out_ptr, k_out_ptr,
        num_q_heads, num_k_heads, head_dim, half, eps_q, eps_k,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
        stride_qot, stride_qoh, stride_kot, stride_koh,
        HAS_NORM: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_TAIL: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        is_q = heads < num_q_heads
        is_k = (heads >= num_q_heads) & (heads < num_q_heads + num_k_heads)
        qh = tl.where(is_q, heads, 0).to(tl.int64)  # in-bounds rows for the masked-off side
        kh = tl.where(is_k, heads - num_q_heads, 0).to(tl.int64)
        i = tl.arange(0, BLOCK_HALF)
        i_mask = i < half
        if INTERLEAVED:
            off1, off2 = 2 * i, 2 * i + 1
        else:
            off1, off2 = i, i + half
        q_row = q_ptr + t * stride_qt + qh[:, None] * stride_qh
        k_row = k_ptr + t * stride_kt + kh[:, None] * stride_kh
        mq = is_q[:, None] & i_mask[None, :]
        mk = is_k[:, None] & i_mask[None, :]
        x1 = tl.where(is_q[:, None], tl.load(q_row + off1[None, :], mask=mq, other=0.0).to(tl.float32),
                      tl.load(k_row + off1[None, :], mask=mk, other=0.0).to(tl.float32))
        x2 = tl.where(is_q[:, None], tl.load(q_row + off2[None, :], mask=mq, other=0.0).to(tl.float32),
                      tl.load(k_row + off2[None, :], mask=mk, other=0.0).to(tl.float32))
        if HAS_TAIL:
            j = tl.arange(0, BLOCK_TAIL)
            off3 = 2 * half + j
            j_mask = off3 < head_dim
            mq3 = is_q[:, None] & j_mask[None, :]
            mk3 = is_k[:, None] & j_mask[None, :]
            x3 = tl.where(is_q[:, None], tl.load(q_row + off3[None, :], mask=mq3, other=0.0).to(tl.float32),
                          tl.load(k_row + off3[None, :], mask=mk3, other=0.0).to(tl.float32))
        if HAS_NORM:
            sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
            if HAS_TAIL:
                sq += tl.sum(x3 * x3, axis=1)
            eps = tl.where(is_q, eps_q, eps_k)
            rs = tl.rsqrt(sq / head_dim + eps)[:, None]
            w1 = tl.where(is_q[:, None], tl.load(qw_ptr + off1, mask=i_mask, other=0.0).to(tl.float32)[None, :],
                          tl.load(kw_ptr + off1, mask=i_mask, other=0.0).to(tl.float32)[None, :])
            w2 = tl.where(is_q[:, None], tl.load(qw_ptr + off2, mask=i_mask, other=0.0).to(tl.float32)[None, :],
                          tl.load(kw_ptr + off2, mask=i_mask, other=0.0).to(tl.float32)[None, :])
            # cast back to the activation dtype, then scale and round again (HF's RMSNorm)
            x1 = ((x1 * rs).to(q_ptr.dtype.element_ty).to(tl.float32) * w1).to(q_ptr.dtype.element_ty).to(tl.float32)
            x2 = ((x2 * rs).to(q_ptr.dtype.element_ty).to(tl.float32) * w2).to(q_ptr.dtype.element_ty).to(tl.float32)
            if HAS_TAIL:
                w3 = tl.where(is_q[:, None], tl.load(qw_ptr + off3, mask=j_mask, other=0.0).to(tl.float32)[None, :],
                              tl.load(kw_ptr + off3, mask=j_mask, other=0.0).to(tl.float32)[None, :])
                x3 = ((x3 * rs).to(q_ptr.dtype.element_ty).to(tl.float32) * w3).to(q_ptr.dtype.element_ty)
        c = tl.load(cos_ptr + t * stride_ct + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + t * stride_st + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
        # each product, then their difference / sum, rounded to the activation dtype as torch's ops round
        a1 = (x1 * c).to(q_ptr.dtype.element_ty).to(tl.float32)
        b1 = (x2 * s).to(q_ptr.dtype.element_ty).to(tl.float32)
        a2 = (x2 * c).to(q_ptr.dtype.element_ty).to(tl.float32)
        b2 = (x1 * s).to(q_ptr.dtype.element_ty).to(tl.float32)
        o1 = (a1 - b1).to(q_out_ptr.dtype.element_ty)
        o2 = (a2 + b2).to(q_out_ptr.dtype.element_ty)
        qo_row = q_out_ptr + t * stride_qot + qh[:, None] * stride_qoh
        ko_row = k_out_ptr + t * stride_kot + kh[:, None] * stride_koh
        tl.store(qo_row + i[None, :], o1, mask=mq)
        tl.store(qo_row + half + i[None, :], o2, mask=mq)
        tl.store(ko_row + i[None, :], o1, mask=mk)
        tl.store(ko_row + half + i[None, :], o2, mask=mk)
        if HAS_TAIL:
            x3 = x3.to(q_out_ptr.dtype.element_ty)
            tl.store(qo_row + off3[None, :], x3, mask=mq3)
            tl.store(ko_row + off3[None, :], x3, mask=mk3)

    return _qk_norm_rope_kernel


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int, *,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                 eps_q: float = 1e-6, eps_k: float = 1e-6,
                 interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q', k')``: q ``[T, Hq, D]`` and k ``[T, Hk, D]`` normalised per head (``q_weight``/``k_weight``
    ``[D]``, both or neither) and rotated on their first ``rot_dim`` features by ``cos``/``sin``
    ``[T, rot_dim / 2]``; every tensor of q's dtype, each head's last dim of unit stride.

    CUDA tensors run the compiled kernel; CPU tensors need ``TRITON_INTERPRET=1`` (Triton's interpreter).
    """
    _check(q, k, cos, sin, rot_dim, q_weight, k_weight)
    interpret = launch_mode("qk_norm_rope", q.device)
    global triton, tl
    triton, tl = import_triton("qk_norm_rope")
    t, hq, d = q.shape
    hk = k.shape[1]
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hk, d), dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    half = rot_dim // 2
    block_half = triton.next_power_of_2(half)
    tail = d - rot_dim
    block_h = max(1, min(triton.next_power_of_2(hq + hk), TILE_ELEMENTS // (2 * block_half)))
    has_norm = q_weight is not None
    qw = q_weight.contiguous() if q_weight is not None else q  # q: an unread placeholder
    kw = k_weight.contiguous() if k_weight is not None else q
    cos, sin = cos.contiguous(), sin.contiguous()
    kernel = _load_kernel()
    with launch_guard(interpret):
        kernel[(t, triton.cdiv(hq + hk, block_h))](
            q, k, cos, sin, qw, kw, q_out, k_out, hq, hk, d, half, float(eps_q), float(eps_k),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            HAS_NORM=has_norm, INTERLEAVED=interleaved, HAS_TAIL=tail > 0,
            BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_TAIL=triton.next_power_of_2(max(tail, 1)),
            **({} if interpret else {"num_warps": 4}),
        )
    return q_out, k_out


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int,
           q_weight: torch.Tensor | None, k_weight: torch.Tensor | None) -> None:
    """Shapes, dtypes and layouts the kernel assumes; each mismatch is a ValueError naming the tensor."""
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"qk_norm_rope: q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, H, D] with one T "
                         "and one D")
    t, _, d = q.shape
    if rot_dim % 2 or not 2 <= rot_dim <= d:
        raise ValueError(f"qk_norm_rope: rot_dim={rot_dim} must be even and in [2, head_dim={d}]")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (t, rot_dim // 2) or table.dtype != q.dtype:
            raise ValueError(f"qk_norm_rope: {name} is {tuple(table.shape)} {table.dtype}, expected "
                             f"({t}, {rot_dim // 2}) {q.dtype}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("qk_norm_rope: give both q_weight and k_weight, or neither")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and (w.shape != (d,) or w.dtype != q.dtype):
            raise ValueError(f"qk_norm_rope: {name} is {tuple(w.shape)} {w.dtype}, expected ({d},) {q.dtype}")
    if k.dtype != q.dtype:
        raise ValueError(f"qk_norm_rope: k is {k.dtype}, q is {q.dtype}")
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError(f"qk_norm_rope: q and k need unit stride along head_dim, got strides {q.stride()} and "
                         f"{k.stride()}")
