"""The GPU backend: Triton split-KV paged decode, SDPA prefill over padded groups.

Decode reads each request's blocks through the block table (``triton_paged_decode.py``), capturable in a CUDA
graph. Prefill asks SDPA for ``is_causal`` when a group is fresh prompts of one length, and otherwise passes the
mask as an additive bias with GQA folded into the query length, in the kernel order of
:data:`PREFILL_SDPA_ORDER` (no cuDNN); attention sinks are extra zero-value keys. The decode function is a
constructor argument so tests can run the plumbing against a stand-in. Design: docs/design_notes.md,
"Attention backends".
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from runner.attention.backend import AttentionBackend
from runner.attention.options import AttentionOptions, sinks_of, window_of
from runner.attention.prefill_batch import PrefillGroup

PagedDecodeFn = Callable[..., torch.Tensor]  # paged_decode_attention's signature

# Shape-generic kernels first; cuDNN, which plans per shape, is left out (module docstring).
PREFILL_SDPA_ORDER = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def load_paged_decode_kernel() -> PagedDecodeFn:
    """The Triton kernel (imported here so ``runner.attention`` imports without Triton)."""
    from runner.attention.triton_paged_decode import paged_decode_attention

    return paged_decode_attention


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, decode_fn: PagedDecodeFn | None = None) -> None:
        self.decode_fn = load_paged_decode_kernel() if decode_fn is None else decode_fn

    def __repr__(self) -> str:
        return f"TritonAttentionBackend(decode_fn={getattr(self.decode_fn, '__module__', '?')}." \
               f"{getattr(self.decode_fn, '__name__', '?')})"

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, max_seq_len: int | None, scale: float,
               out: torch.Tensor | None = None, options: AttentionOptions | None = None) -> torch.Tensor:
        if options is None:
            return self.decode_fn(q, k_cache, v_cache, block_table, seq_lens, scale, out=out)
        return self.decode_fn(q, k_cache, v_cache, block_table, seq_lens, scale, out=out,
                              sliding_window=options.sliding_window, sinks=options.sinks)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: PrefillGroup,
                scale: float, options: AttentionOptions | None = None) -> torch.Tensor:
        r, lq, hq, dk = q.shape
        hkv, dv = k.shape[2], v.shape[-1]
        kh, vh = k.transpose(1, 2), v.transpose(1, 2)  # [R, Hkv, S, D]
        window, sinks = window_of(options), sinks_of(options)
        if sinks is not None:
            return _prefill_with_sinks(q, kh, vh, group, scale, window, sinks)
        if group.plain_causal(window):
            with sdpa_kernel(PREFILL_SDPA_ORDER, set_priority=True):
                out = F.scaled_dot_product_attention(q.transpose(1, 2), kh, vh, is_causal=True, scale=scale,
                                                     enable_gqa=True)
            return out.transpose(1, 2)
        g = hq // hkv
        qf = q.view(r, lq, hkv, g, dk).permute(0, 2, 3, 1, 4).reshape(r, hkv, g * lq, dk)
        bias = group.memo(("folded_bias", g, q.dtype, window),
                          lambda: _folded_bias(group.visible(window), g, q.dtype))
        with sdpa_kernel(PREFILL_SDPA_ORDER, set_priority=True):
            out = F.scaled_dot_product_attention(qf, kh, vh, attn_mask=bias, scale=scale)  # [R, Hkv, G * L, Dv]
        return out.view(r, hkv, g, lq, dv).permute(0, 3, 1, 2, 4).reshape(r, lq, hq, dv)


def _folded_bias(mask: torch.Tensor, g: int, dtype: torch.dtype) -> torch.Tensor:
    """``mask [R, L, S]`` (True = attend) -> additive bias ``[R, 1, G * L, S]`` in ``dtype`` (0 or -inf), the
    mask repeated for each of the ``G`` query heads of a KV head. What SDPA would make of a boolean mask,
    made here once per step and group rather than in every layer (``PrefillGroup.memo``). Its rows are
    allocated 16 elements aligned, as CUDA's memory-efficient kernel wants them (else SDPA pads the bias again
    in every call)."""
    r, lq, s = mask.shape
    rep = mask[:, None].expand(r, g, lq, s).reshape(r, 1, g * lq, s)
    bias = torch.zeros(r, 1, g * lq, -(-s // 16) * 16, dtype=dtype, device=mask.device)[..., :s]
    return bias.masked_fill_(~rep, float("-inf"))


def _prefill_with_sinks(q: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, group: PrefillGroup, scale: float,
                        window: int | None, sinks: torch.Tensor) -> torch.Tensor:
    """The folded form plus ``G`` sink keys per KV head (module docstring). Sink key ``j`` of KV head ``h`` is
    zero but for feature ``D + j``, which holds ``sink[h * G + j] / scale``; every query gets ``G`` more features,
    one-hot at its own ``g``; so query ``g`` scores exactly its sink on key ``g``, and the bias hides the other
    sink keys from it. The values of the sink keys are zero. The bias stays ``[R, 1, G * L, S + G]`` (shared by
    the KV heads and made once per step), not one per head; the extra features are padded to a multiple of 8."""
    r, lq, hq, dk = q.shape
    hkv, s, dv = kh.shape[1], kh.shape[2], vh.shape[-1]
    g = hq // hkv
    extra = -(-g // 8) * 8
    qf = q.view(r, lq, hkv, g, dk).permute(0, 2, 3, 1, 4).reshape(r, hkv, g * lq, dk)
    onehot = torch.eye(g, extra, dtype=q.dtype, device=q.device).repeat_interleave(lq, dim=0)  # [G * L, extra]
    q_ext = torch.cat((qf, onehot.expand(r, hkv, g * lq, extra)), dim=-1)
    sink_keys = torch.zeros(hkv, g, dk + extra, dtype=kh.dtype, device=kh.device)
    sink_keys[:, :, dk:dk + g] = torch.diag_embed(sinks.view(hkv, g).to(kh.dtype) / scale)
    k_ext = torch.cat((torch.cat((kh, kh.new_zeros(r, hkv, s, extra)), dim=-1),
                       sink_keys.expand(r, hkv, g, dk + extra)), dim=2)
    v_ext = torch.cat((vh, vh.new_zeros(r, hkv, g, dv)), dim=2)
    bias = group.memo(("sink_bias", g, q.dtype, window), lambda: _sink_bias(group.visible(window), g, q.dtype))
    with sdpa_kernel(PREFILL_SDPA_ORDER, set_priority=True):
        out = F.scaled_dot_product_attention(q_ext, k_ext, v_ext, attn_mask=bias, scale=scale)
    return out.view(r, hkv, g, lq, dv).permute(0, 3, 1, 2, 4).reshape(r, lq, hq, dv)


def _sink_bias(mask: torch.Tensor, g: int, dtype: torch.dtype) -> torch.Tensor:
    """:func:`_folded_bias` with ``G`` more columns, the sink keys: row ``g * L + l`` sees column ``S + g`` only."""
    r, lq, s = mask.shape
    rep = mask[:, None].expand(r, g, lq, s).reshape(r, 1, g * lq, s)
    own = torch.eye(g, dtype=torch.bool, device=mask.device).repeat_interleave(lq, dim=0)  # [G * L, G]
    visible = torch.cat((rep, own.expand(r, 1, g * lq, g)), dim=-1)
    bias = torch.zeros(r, 1, g * lq, -(-(s + g) // 16) * 16, dtype=dtype, device=mask.device)[..., :s + g]
    return bias.masked_fill_(~visible, float("-inf"))
