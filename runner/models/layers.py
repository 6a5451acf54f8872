"""Building blocks shared by the model files: RMSNorm, the SwiGLU MLP and rotary embeddings.

Numerics follow Hugging Face's eager implementations op for op (norm in fp32 then cast back before the
weight multiply; cos/sin computed in fp32 and cast to the activation dtype), so parity tests can hold
tight tolerances and greedy decoding matches token for token.

``fused`` on :class:`RMSNorm` and :class:`RotaryEmbedding` (set for a whole model by
``MoECausalLM.set_fused_tails``, the ``fused_tails`` setting) runs the residual add with its norm, and q/k
norm with RoPE, as the Triton kernels of ``runner/models/kernels/``, which round at the same points.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from runner.models.configs import RopeConfig
from runner.models.kernels.add_rms_norm import add_rms_norm
from runner.models.kernels.qk_norm_rope import qk_norm_rope


class RMSNorm(nn.Module):
    """HF ``*RMSNorm``: normalise in fp32, cast back, then scale (the order matters for bf16 parity)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.variance_epsilon = eps
        self.fused = False  # the add_rms_norm Triton kernel instead of the torch ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return add_rms_norm(x, None, self.weight, self.variance_epsilon)[0]
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``, the add in ``x``'s dtype as HF's residual add;
        ``residual=None`` (a model's first layer): ``(norm(x), x)``."""
        if self.fused:
            return add_rms_norm(x, residual, self.weight, self.variance_epsilon)
        if residual is not None:
            x = residual + x
        return self(x), x


class DenseMLP(nn.Module):
    """SwiGLU MLP with HF names (``gate_proj``/``up_proj``/``down_proj``): dense layers and shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype | None = None,
                 bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def checkpoint_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """HF tensor name -> shape for this MLP's projections (and biases), ``prefix`` ending in ``.``."""
        shapes: dict[str, tuple[int, ...]] = {}
        for name in ("gate_proj", "up_proj", "down_proj"):
            proj: nn.Linear = getattr(self, name)
            shapes[f"{prefix}{name}.weight"] = (proj.out_features, proj.in_features)
            if proj.bias is not None:
                shapes[f"{prefix}{name}.bias"] = (proj.out_features,)
        return shapes


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """HF ``_compute_yarn_parameters`` (transformers 5.23), line for line."""
    base = rope.rope_theta
    orig_max = rope.original_max_position_embeddings
    assert orig_max is not None  # parsing a yarn rope config always sets it
    factor = rope.factor
    if factor is None:
        raise ValueError("yarn RoPE needs 'factor'")

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = float(get_mscale(factor, rope.mscale) / get_mscale(factor, rope.mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rope.beta_fast or 32
    beta_slow = rope.beta_slow or 1

    def correction_dim(num_rot: float) -> float:
        return (dim * math.log(orig_max / (num_rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extra_factor = 1 - ramp
    return inter * (1 - extra_factor) + extra * extra_factor, float(attention_factor)


def _llama3_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """HF ``_compute_llama3_parameters``: long wavelengths divided by ``factor``, short ones kept, the band
    between smoothly interpolated."""
    assert rope.factor is not None and rope.low_freq_factor is not None and rope.high_freq_factor is not None
    assert rope.original_max_position_embeddings is not None
    inv_freq = 1.0 / (rope.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
    factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old_context_len = rope.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low) / (high - low)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def yarn_softmax_mscale(rope: RopeConfig) -> float:
    """DeepSeek's extra softmax-scale factor under yarn (HF ``yarn_apply_mscale``).

    ``mscale(factor, mscale_all_dim) ** 2``; 1 without yarn.
    """
    if rope.rope_type == "default" or not rope.mscale_all_dim or rope.factor is None or rope.factor <= 1:
        return 1.0
    m = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
    return m * m


class RotaryEmbedding(nn.Module):
    """RoPE over the first ``dim`` features of q/k, either neox (rotate-half) or interleaved pairs.

    ``interleaved=True`` rotates pairs ``(x0, x1), (x2, x3), ...`` (DeepSeek); the output is laid out as
    ``cat(rotated_evens, rotated_odds)`` like HF's ``apply_rotary_pos_emb_interleave``. The layout differs
    from V2's complex-number form but q.k dot products are identical, and q and k always share a layout
    (the cache stores rotated keys), so attention is unchanged.
    ``inv_freq`` is a plain attribute, not a buffer, so it never appears in state dicts or meta-device init.
    """

    def __init__(self, dim: int, rope: RopeConfig, interleaved: bool = False) -> None:
        super().__init__()
        self.dim = dim
        self.interleaved = interleaved
        if rope.rope_type == "yarn":
            inv_freq, self.attention_scaling = _yarn_inv_freq(rope, dim)
        elif rope.rope_type == "llama3":
            inv_freq, self.attention_scaling = _llama3_inv_freq(rope, dim), 1.0
        else:
            inv_freq = 1.0 / (rope.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
            self.attention_scaling = 1.0
        self._inv_freq_cpu = inv_freq
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        self.fused = False  # norm_and_rotate runs the qk_norm_rope Triton kernel instead of the torch ops

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T] -> ([T, dim/2], [T, dim/2])`` half-width tables (the two halves of HF's are equal)."""
        inv = self._inv_freq.get(positions.device)
        if inv is None:
            inv = self._inv_freq.setdefault(positions.device, self._inv_freq_cpu.to(positions.device))
        freqs = positions.to(torch.float32)[:, None] * inv[None, :]
        return (freqs.cos() * self.attention_scaling).to(dtype), (freqs.sin() * self.attention_scaling).to(dtype)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, H, dim]`` (or ``[T, dim]``) with tables from :meth:`cos_sin`."""
        if x.dim() == 3:
            cos, sin = cos[:, None, :], sin[:, None, :]
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def rotate_prefix(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the first ``dim`` features of each head of ``x``, the rest passed through (HF's partial
        rotary)."""
        if self.dim == x.shape[-1]:
            return self.rotate(x, cos, sin)
        return torch.cat((self.rotate(x[..., :self.dim], cos, sin), x[..., self.dim:]), dim=-1)

    def norm_and_rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        q_norm: RMSNorm | None = None,
                        k_norm: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[T, Hq, D]`` and k ``[T, Hk, D]`` normalised per head (both norms over ``D``, or none), then
        rotated on their first ``dim`` features (:meth:`rotate_prefix`); one Triton kernel when ``fused``."""
        if (q_norm is None) != (k_norm is None):
            raise ValueError("norm_and_rotate takes both q_norm and k_norm, or neither")
        if self.fused:
            return qk_norm_rope(q, k, cos, sin, self.dim, interleaved=self.interleaved,
                                q_weight=None if q_norm is None else q_norm.weight,
                                k_weight=None if k_norm is None else k_norm.weight,
                                eps_q=1e-6 if q_norm is None else q_norm.variance_epsilon,
                                eps_k=1e-6 if k_norm is None else k_norm.variance_epsilon)
        if q_norm is not None and k_norm is not None:
            q, k = q_norm(q), k_norm(k)
        return self.rotate_prefix(q, cos, sin), self.rotate_prefix(k, cos, sin)
