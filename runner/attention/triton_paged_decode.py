"""Split-KV ("flash-decoding") paged attention for decode steps: one query token per request, in Triton.

Stage 1 attends each GQA group against a slice of a request's keys read straight from the paged cache (K/V
read once per group, online softmax in fp32); stage 2 merges the slices by log-sum-exp (vLLM's
``triton_decode_attention.py``, SGLang's ``decode_attention.py``). The split count comes from shapes only, so the
grid is fixed and the launch capturable; slots at or past ``seq_len`` are never loaded. The key loop is a
pipelined ``tl.range`` when compiled and a ``while`` under the interpreter. Windows move a request's first key;
sinks seed split 0's softmax. Triton is imported on first call.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ubatch.sbo import DeviceProps
from ubatch.triton_runtime import import_triton, interpreter_enabled, kernels_per_mode, launch_guard

__all__ = ["DecodeLaunchPlan", "choose_num_splits", "paged_decode_attention", "plan_decode_launch"]

# Filled by _load_kernels(); module globals because the interpreter re-executes kernel source against the
# defining function's __globals__ (closure variables are invisible to it).
triton: Any = None
tl: Any = None
# The stage-1 loop body, a @triton.jit helper; bound here by _load_kernels in interpreter mode only, since the
# interpreter resolves kernel names in this module's globals. Compiled kernels find it in their closure (the
# compiler reads closure variables before globals), so a process's compiled kernels never see this binding.
_attend_keys: Any = None

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_SPLITS = 64
# Stage-1 programs aimed at per SM: a few resident programs per SM, each with KEY_LOOP_STAGES iterations of
# loads in flight, to hide memory latency.
TARGET_PROGRAMS_PER_SM = 4
# A split shorter than this spends more on its own set-up and on the merge than it saves.
MIN_TOKENS_PER_SPLIT = 256
LOG2E = 1.4426950408889634
# Pipeline stages of the compiled key loop: the K/V loads of this many iterations are in flight at once.
KEY_LOOP_STAGES = 3


@dataclass(frozen=True)
class DecodeShape:
    """The sizes a launch depends on, read from tensor shapes only."""

    num_requests: int
    num_q_heads: int
    num_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    block_size: int
    max_blocks: int

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


@dataclass(frozen=True)
class DecodeLaunchPlan:
    """Tile sizes and grid of one launch; a function of the shapes (and SM count) alone."""

    num_splits: int
    block_h: int        # query heads of one GQA group per stage-1 program (padded rows are masked)
    head_blocks: int    # stage-1 programs per KV head: cdiv(group, block_h)
    block_n: int        # tokens per loop iteration
    block_dk1: int      # key dims in the first dot: the largest power of two <= Dk (at least 16)
    block_dk2: int      # the rest of Dk, padded to a power of two (0 when Dk is a power of two)
    block_dv: int       # value dims, padded to a power of two
    block_s: int        # splits, padded to a power of two (stage 2)
    num_warps: int
    num_stages: int     # software-pipeline stages of the compiled key loop (tl.range); unused when interpreted
    dot_precision: str  # "tf32" when q, K and V are all 16-bit, else "ieee"

    def workspace_bytes(self, shape: DecodeShape) -> int:
        """fp32 partial outputs ``[R, Hq, splits, Dv]`` plus log-sum-exps ``[R, Hq, splits]``; 0 for one split."""
        if self.num_splits == 1:
            return 0
        return 4 * shape.num_requests * shape.num_q_heads * self.num_splits * (shape.head_dim_v + 1)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def choose_num_splits(num_requests: int, programs_per_request: int, max_tokens: int, num_sms: int) -> int:
    """Splits per request so that stage 1 fills the GPU, from host-side sizes only.

    ``programs_per_request`` is the stage-1 programs per request and split (KV heads x head blocks),
    ``max_tokens`` the longest sequence the block table can describe (``max_blocks * block_size``). Enough
    splits to give ``TARGET_PROGRAMS_PER_SM * num_sms`` programs, but none shorter than
    ``MIN_TOKENS_PER_SPLIT`` tokens of a full-length request, and at most ``MAX_SPLITS``.
    """
    for label, value in (("num_requests", num_requests), ("programs_per_request", programs_per_request),
                         ("max_tokens", max_tokens), ("num_sms", num_sms)):
        if value < 1:
            raise ValueError(f"{label}={value} must be >= 1")
    wanted = _cdiv(TARGET_PROGRAMS_PER_SM * num_sms, num_requests * programs_per_request)
    by_length = _cdiv(max_tokens, MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_SPLITS))


def plan_decode_launch(shape: DecodeShape, dtypes: tuple[torch.dtype, ...], num_sms: int,
                       num_splits: int | None = None, interpret: bool = False,
                       sliding_window: int | None = None) -> DecodeLaunchPlan:
    """Tile sizes for ``shape``; ``num_splits`` overrides the automatic choice (1..MAX_SPLITS). A sliding window
    bounds the keys a request reads, so the automatic split count is sized for the window.

    Tile sizes are reasoned defaults, not tuned per GPU. Under the interpreter every loop iteration is
    expensive, so ``block_n`` stays at the minimum tile.
    """
    block_dk1 = max(16, 1 << (shape.head_dim_k.bit_length() - 1))
    rest = max(0, shape.head_dim_k - block_dk1)
    block_dk2 = max(16, _next_pow2(rest)) if rest else 0
    block_dv = max(16, _next_pow2(shape.head_dim_v))
    wide = block_dk1 + block_dk2 > 256 or block_dv > 256
    block_h = min(max(16, _next_pow2(shape.group)), 16 if wide else 64)
    head_blocks = _cdiv(shape.group, block_h)
    if num_splits is None:
        max_tokens = shape.max_blocks * shape.block_size
        if sliding_window is not None:
            max_tokens = min(max_tokens, sliding_window)
        num_splits = choose_num_splits(shape.num_requests, shape.num_kv_heads * head_blocks, max_tokens, num_sms)
    elif isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits={num_splits!r} must be an int in [1, {MAX_SPLITS}]")
    sixteen_bit = all(d in (torch.bfloat16, torch.float16) for d in dtypes)
    return DecodeLaunchPlan(
        num_splits=num_splits,
        block_h=block_h,
        head_blocks=head_blocks,
        block_n=16 if interpret or wide else 32,
        block_dk1=block_dk1,
        block_dk2=block_dk2,
        block_dv=block_dv,
        block_s=max(2, _next_pow2(num_splits)),
        num_warps=8 if wide else 4,
        num_stages=KEY_LOOP_STAGES,
        dot_precision="tf32" if sixteen_bit else "ieee",
    )


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None) -> DecodeShape:
    """Every check reads shapes, strides, dtypes and devices only: no device data, no sync."""
    for label, t, dims in (("q", q, "[R, Hq, Dk]"), ("k_cache", k_cache, "[num_blocks, block_size, Hkv, Dk]"),
                           ("v_cache", v_cache, "[num_blocks, block_size, Hkv, Dv]"),
                           ("block_table", block_table, "[R, max_blocks]"), ("seq_lens", seq_lens, "[R]")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{label} must be a torch.Tensor {dims}, got {type(t).__name__}")
        if t.dim() != dims.count(",") + 1:
            raise ValueError(f"{label} must be {dims}, got shape {tuple(t.shape)}")
    for label, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{label} dtype {t.dtype} is not supported (bfloat16, float16 or float32)")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{label} needs a unit-stride last dim, got strides {t.stride()}")
    for label, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        if t.dtype != torch.int32:
            raise TypeError(f"{label} must be int32, got {t.dtype}")
    num_requests, num_q_heads, head_dim_k = q.shape
    num_blocks, block_size, num_kv_heads, k_dim = k_cache.shape
    if k_dim != head_dim_k:
        raise ValueError(f"k_cache head dim {k_dim} != q head dim {head_dim_k}")
    if tuple(v_cache.shape[:3]) != (num_blocks, block_size, num_kv_heads):
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} does not match k_cache {tuple(k_cache.shape)} "
                         "in [num_blocks, block_size, Hkv]")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if min(num_blocks, block_size, head_dim_k, v_cache.shape[3]) < 1:
        raise ValueError(f"empty cache or head dim: k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    if block_table.shape[0] != num_requests or block_table.shape[1] < 1:
        raise ValueError(f"block_table shape {tuple(block_table.shape)} must be [{num_requests}, max_blocks >= 1]")
    if seq_lens.shape[0] != num_requests:
        raise ValueError(f"seq_lens shape {tuple(seq_lens.shape)} must be [{num_requests}]")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise ValueError(f"scale={scale!r} must be a finite float")
    devices = {t.device for t in (q, k_cache, v_cache, block_table, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(str(d) for d in devices)}")
    shape = DecodeShape(num_requests, num_q_heads, num_kv_heads, head_dim_k, v_cache.shape[3], block_size,
                        block_table.shape[1])
    if out is not None:
        want = (num_requests, num_q_heads, shape.head_dim_v)
        if tuple(out.shape) != want or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(f"out must be {list(want)} {q.dtype} on {q.device}, got {list(out.shape)} "
                             f"{out.dtype} on {out.device}")
        if want[2] > 1 and out.stride(-1) != 1:
            raise ValueError(f"out needs a unit-stride last dim, got strides {out.stride()}")
    return shape


def _check_options(shape: DecodeShape, device: torch.device, sliding_window: int | None,
                   sinks: torch.Tensor | None) -> None:
    """Shapes, dtypes and devices only, like :func:`_check_inputs`."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window={sliding_window!r} must be a positive int or None")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (shape.num_q_heads,):
            got = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
            raise ValueError(f"sinks must be a [{shape.num_q_heads}] tensor (one per query head), got {got}")
        if sinks.dtype not in _FLOAT_DTYPES or sinks.device != device:
            raise ValueError(f"sinks must be a float tensor on {device}, got {sinks.dtype} on {sinks.device}")


def _num_sms(device: torch.device) -> int:
    """The GPU's SM count; the interpreter runs one program at a time, so it counts as one."""
    return DeviceProps.of(device).sm_count if device.type == "cuda" else 1  # cached per device index


@kernels_per_mode
def _load_kernels() -> tuple[Any, Any]:
    """Decorate the kernels (once per interpreter mode: ``kernels_per_mode``)."""

    @triton.jit
    def _attend_keys(
        n0, end, q1, q2, acc, l_i, m_i, k_head, v_head, bt_row, qk_scale_log2,
        block_size, head_dim_k, head_dim_v, stride_kb, stride_ks, stride_vb, stride_vs, stride_btc,
        DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_DK1: tl.constexpr, BLOCK_DK2: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):
        # One step of the key loop: keys [n0, min(n0 + BLOCK_N, end)) folded into the online softmax.
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        # Positions past the split's end are never loaded: neither their block ids nor their K/V.
        page = tl.load(bt_row + (offs_n // block_size) * stride_btc, mask=n_mask, other=0).to(tl.int64)
        slot = (offs_n % block_size).to(tl.int64)
        k_tok = k_head + page * stride_kb + slot * stride_ks
        offs_d1 = tl.arange(0, BLOCK_DK1)
        d1_mask = offs_d1 < head_dim_k
        k1 = tl.load(k_tok[None, :] + offs_d1[:, None], mask=d1_mask[:, None] & n_mask[None, :],
                     other=0.0).to(tl.float32)
        qk = tl.dot(q1, k1, input_precision=DOT_PRECISION)
        if BLOCK_DK2 > 0:
            offs_d2 = BLOCK_DK1 + tl.arange(0, BLOCK_DK2)
            d2_mask = offs_d2 < head_dim_k
            k2 = tl.load(k_tok[None, :] + offs_d2[:, None], mask=d2_mask[:, None] & n_mask[None, :],
                         other=0.0).to(tl.float32)
            qk = tl.dot(q2, k2, qk, input_precision=DOT_PRECISION)
        qk = tl.where(n_mask[None, :], qk * qk_scale_log2, float("-inf"))
        # Every step has at least one valid key, so m_new is finite and no exp2 sees -inf - -inf.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        offs_dv = tl.arange(0, BLOCK_DV)
        dv_mask = offs_dv < head_dim_v
        v_tok = v_head + page * stride_vb + slot * stride_vs
        v = tl.load(v_tok[:, None] + offs_dv[None, :], mask=n_mask[:, None] & dv_mask[None, :],
                    other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        return acc, l_i, m_new

    if interpreter_enabled():
        globals()["_attend_keys"] = _attend_keys

    # ``num_splits`` is a runtime argument, not a constexpr, and never specialised (``do_not_specialize``): the
    # split count follows the batch size, so as a constexpr every new batch size compiled a new kernel (about
    # 0.5 s each, in the middle of serving, seen on an H100); only WRITE_LSE (one split or several) and the
    # tile sizes select a compiled variant.
    @triton.jit(do_not_specialize=["num_splits"])
    def _split_kv_kernel(
        q_ptr, k_ptr, v_ptr, block_table_ptr, seq_lens_ptr, part_ptr, lse_ptr, sinks_ptr,
        qk_scale_log2, group, head_blocks, block_size, head_dim_k, head_dim_v, window,
        stride_qr, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_btr, stride_btc, stride_sl, stride_pr, stride_ph, stride_ps, stride_lr, stride_lh, num_splits,
        WRITE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_WINDOW: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_DK1: tl.constexpr, BLOCK_DK2: tl.constexpr, BLOCK_DV: tl.constexpr,
        INTERPRET: tl.constexpr, NUM_STAGES: tl.constexpr,
    ):
        # One program: query heads [hb * BLOCK_H, (hb + 1) * BLOCK_H) of KV head kv_head's group, keys of one split.
        req = tl.program_id(0).to(tl.int64)
        pid_h = tl.program_id(1)
        split = tl.program_id(2)
        kv_head = pid_h // head_blocks
        offs_g = (pid_h % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_mask = offs_g < group
        q_heads = (kv_head * group + offs_g).to(tl.int64)

        seq_len = tl.load(seq_lens_ptr + req * stride_sl)
        first = seq_len * 0  # the request's first visible key: 0, or seq_len - window under a sliding window
        if HAS_WINDOW:
            first = tl.maximum(seq_len - window, 0)
        split_len = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
        start = first + split * split_len
        end = tl.minimum(start + split_len, seq_len)

        q_rows = q_ptr + req * stride_qr + q_heads[:, None] * stride_qh
        offs_d1 = tl.arange(0, BLOCK_DK1)
        d1_mask = offs_d1 < head_dim_k
        q1 = tl.load(q_rows + offs_d1[None, :], mask=h_mask[:, None] & d1_mask[None, :], other=0.0).to(tl.float32)
        if BLOCK_DK2 > 0:
            offs_d2 = BLOCK_DK1 + tl.arange(0, BLOCK_DK2)
            d2_mask = offs_d2 < head_dim_k
            q2 = tl.load(q_rows + offs_d2[None, :], mask=h_mask[:, None] & d2_mask[None, :], other=0.0).to(tl.float32)
        else:
            q2 = q1  # a placeholder: _attend_keys reads q2 only when BLOCK_DK2 > 0
        offs_dv = tl.arange(0, BLOCK_DV)
        dv_mask = offs_dv < head_dim_v
        k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
        v_head = v_ptr + kv_head.to(tl.int64) * stride_vh
        bt_row = block_table_ptr + req * stride_btr

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
        if HAS_SINKS:
            # Split 0 starts from the sink: a key of score `sink` (natural log, so times log2 e) and no value.
            sink = tl.load(sinks_ptr + q_heads, mask=h_mask, other=0.0).to(tl.float32) * 1.4426950408889634
            m_i = tl.where(split == 0, sink, m_i)
            l_i = tl.where(split == 0, l_i + 1.0, l_i)
        # Two forms of one loop (see the module docstring); INTERPRET is a constexpr, so the compiler sees only
        # the `for`, and the interpreter only the `while`.
        if INTERPRET:
            n0 = start
            while n0 < end:
                acc, l_i, m_i = _attend_keys(
                    n0, end, q1, q2, acc, l_i, m_i, k_head, v_head, bt_row, qk_scale_log2,
                    block_size, head_dim_k, head_dim_v, stride_kb, stride_ks, stride_vb, stride_vs, stride_btc,
                    DOT_PRECISION, BLOCK_N, BLOCK_DK1, BLOCK_DK2, BLOCK_DV)
                n0 += BLOCK_N
        else:
            for n0 in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES):
                acc, l_i, m_i = _attend_keys(
                    n0, end, q1, q2, acc, l_i, m_i, k_head, v_head, bt_row, qk_scale_log2,
                    block_size, head_dim_k, head_dim_v, stride_kb, stride_ks, stride_vb, stride_vs, stride_btc,
                    DOT_PRECISION, BLOCK_N, BLOCK_DK1, BLOCK_DK2, BLOCK_DV)

        # An empty split (or seq_len 0) has l_i == 0 and acc == 0: it writes zeros and log-sum-exp -inf.
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        part = acc / l_safe[:, None]
        part_ptrs = part_ptr + req * stride_pr + q_heads[:, None] * stride_ph + split * stride_ps + offs_dv[None, :]
        tl.store(part_ptrs, part.to(part_ptr.dtype.element_ty), mask=h_mask[:, None] & dv_mask[None, :])
        if WRITE_LSE:
            lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
            tl.store(lse_ptr + req * stride_lr + q_heads * stride_lh + split, lse, mask=h_mask)

    @triton.jit(do_not_specialize=["num_splits"])
    def _merge_kernel(
        part_ptr, lse_ptr, out_ptr, head_dim_v,
        stride_pr, stride_ph, stride_ps, stride_lr, stride_lh, stride_or, stride_oh, num_splits,
        BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):
        # out[req, head] = sum_s 2^(lse_s - max) * part_s / sum_s 2^(lse_s - max); all splits empty -> zeros.
        req = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        offs_s = tl.arange(0, BLOCK_S)
        s_mask = offs_s < num_splits
        offs_dv = tl.arange(0, BLOCK_DV)
        dv_mask = offs_dv < head_dim_v
        lse = tl.load(lse_ptr + req * stride_lr + head * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)  # every weight below is then 0, never NaN
        w = tl.exp2(lse - m)
        parts = tl.load(part_ptr + req * stride_pr + head * stride_ph + offs_s[:, None] * stride_ps + offs_dv[None, :],
                        mask=s_mask[:, None] & dv_mask[None, :], other=0.0)
        num = tl.sum(parts * w[:, None], 0)
        den = tl.sum(w, 0)
        o = num / tl.where(den > 0, den, 1.0)
        tl.store(out_ptr + req * stride_or + head * stride_oh + offs_dv, o.to(out_ptr.dtype.element_ty), mask=dv_mask)

    return (_split_kv_kernel, _merge_kernel)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, *, out: torch.Tensor | None = None,
                           num_splits: int | None = None, sliding_window: int | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention over a paged cache: ``q [R, Hq, Dk]`` -> ``[R, Hq, Dv]`` in ``q.dtype``.

    ``k_cache [num_blocks, block_size, Hkv, Dk]`` and ``v_cache [num_blocks, block_size, Hkv, Dv]`` may have
    any strides with a unit-stride last dim, and may alias (MLA: ``v_cache = k_cache[..., :Dv]``; MHA cache
    ``[NB, BS, 2, Hkv, D]``: ``cache[:, :, 0]`` and ``cache[:, :, 1]``). Query head ``h`` reads KV head
    ``h // (Hq // Hkv)``. ``block_table`` (int32 ``[R, max_blocks]``) maps request ``r``'s position ``p`` to
    slot ``p % block_size`` of block ``block_table[r, p // block_size]``; ``seq_lens`` (int32 ``[R]``) gives
    each request's length: its query sits at ``seq_len - 1`` and sees keys ``[0, seq_len)``, and 0 (a padding
    request) gives zeros. The caller guarantees ``seq_len <= max_blocks * block_size`` (not checked: that
    would read device data).

    Memory: with more than one split (see ``choose_num_splits``; ``num_splits`` overrides it), each call
    allocates fp32 partial outputs ``[R, Hq, splits, Dv]`` and log-sum-exps ``[R, Hq, splits]``, i.e.
    ``4 * R * Hq * splits * (Dv + 1)`` bytes (``DecodeLaunchPlan.workspace_bytes``); one split allocates
    nothing beyond ``out``. Shapes fix the grid, so the call can be captured in a CUDA graph.

    ``sliding_window`` (a positive int): each request sees only its last ``W`` keys. ``sinks`` (``[Hq]``, any
    float dtype, read as fp32): one logit per query head joining the softmax with no value (module docstring).

    CUDA tensors run the compiled kernels; CPU tensors need ``TRITON_INTERPRET=1`` (Triton's interpreter).
    """
    shape = _check_inputs(q, k_cache, v_cache, block_table, seq_lens, scale, out)
    _check_options(shape, q.device, sliding_window, sinks)
    interpret = interpreter_enabled()
    if q.device.type == "cuda" and interpret:
        raise RuntimeError("paged_decode_attention got CUDA tensors, but TRITON_INTERPRET=1 selects Triton's CPU "
                           "interpreter; unset it to run the compiled kernels")
    if q.device.type != "cuda" and not interpret:
        raise RuntimeError(f"paged_decode_attention got tensors on {q.device}; without TRITON_INTERPRET=1 "
                           "they need CUDA tensors")
    global triton, tl
    triton, tl = import_triton("paged_decode_attention")
    if out is None:
        out = torch.empty((shape.num_requests, shape.num_q_heads, shape.head_dim_v), dtype=q.dtype, device=q.device)
    if shape.num_requests == 0:
        return out
    plan = plan_decode_launch(shape, (q.dtype, k_cache.dtype, v_cache.dtype), _num_sms(q.device), num_splits,
                              interpret, sliding_window)
    sinks_arg = q if sinks is None else sinks.to(torch.float32).contiguous()  # q: an unread placeholder
    split_kernel, merge_kernel = _load_kernels()
    splits = plan.num_splits
    if splits == 1:
        part, lse = out, out  # stage 1 writes the final output; lse is not written (WRITE_LSE=False)
        part_strides = (out.stride(0), out.stride(1), 0)
        lse_strides = (0, 0)
    else:
        part = torch.empty((shape.num_requests, shape.num_q_heads, splits, shape.head_dim_v),
                           dtype=torch.float32, device=q.device)
        lse = torch.empty((shape.num_requests, shape.num_q_heads, splits), dtype=torch.float32, device=q.device)
        part_strides = (part.stride(0), part.stride(1), part.stride(2))
        lse_strides = (lse.stride(0), lse.stride(1))
    compiled = {} if interpret else {"num_warps": plan.num_warps}
    with launch_guard(interpret):
        split_kernel[(shape.num_requests, shape.num_kv_heads * plan.head_blocks, splits)](
            q, k_cache, v_cache, block_table, seq_lens, part, lse, sinks_arg,
            float(scale) * LOG2E, shape.group, plan.head_blocks, shape.block_size, shape.head_dim_k, shape.head_dim_v,
            sliding_window or 0,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_table.stride(0), block_table.stride(1), seq_lens.stride(0), *part_strides, *lse_strides, splits,
            WRITE_LSE=splits > 1, DOT_PRECISION=plan.dot_precision,
            HAS_SINKS=sinks is not None, HAS_WINDOW=sliding_window is not None,
            BLOCK_H=plan.block_h, BLOCK_N=plan.block_n,
            BLOCK_DK1=plan.block_dk1, BLOCK_DK2=plan.block_dk2, BLOCK_DV=plan.block_dv,
            INTERPRET=interpret, NUM_STAGES=plan.num_stages, **compiled,
        )
        if splits > 1:
            merge_kernel[(shape.num_requests, shape.num_q_heads)](
                part, lse, out, shape.head_dim_v,
                *part_strides, *lse_strides, out.stride(0), out.stride(1), splits,
                BLOCK_S=plan.block_s, BLOCK_DV=plan.block_dv,
                **({} if interpret else {"num_warps": 8 if plan.block_s * plan.block_dv > 8192 else 4}),
            )
    return out
