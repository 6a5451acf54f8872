"""A row's draw by inverse CDF in one Triton kernel: temperature, a drop threshold and the draw, three reads.

``fused_draw(logits, uniforms, temperature, threshold)`` returns, for each row whose uniform is non-negative, a
token drawn from ``softmax(y)`` where ``y = logits / temperature`` with every ``y < threshold`` removed (top-k's
threshold; ``None``: nothing removed), ``INVALID_TOKEN`` where the row has no distribution (a NaN, a ``+inf``,
or nothing left). Rows with a negative uniform (greedy rows) are not read and get ``INVALID_TOKEN``.

Why: the torch ops it replaces (``sampling_noise.draw_by_inverse_cdf_`` after the temperature and top-k's mask)
make nine passes over ``[rows, vocab]`` float32 logits and write four of them; this kernel reads a row three times
and writes one id. One program per row: the peak (and NaN check), the total, then the first token whose CDF
passes ``u * total``. The CDF is walked in vocabulary order, a block at a time: within a block by ``tl.cumsum``,
across blocks by a running sum of each block's largest CDF value over tokens of positive probability. Passes
two and three run the same additions, so the target stays below the last step of the CDF, and a token is
chosen only where its probability is positive: a removed or underflowed token is never drawn, whatever the
rounding of the parallel scan.

The same row gives the same token in any batch (a row is one program). Its rounding is not the torch ops',
so the sampler draws with this kernel on every step where it is on (``Sampler(fused_draw=True)``: CUDA with
the fused tails), eagerly and in the graph heads alike. The temperature division is IEEE's (``div_rn``), as
torch's, so dividing here or beforehand gives the same ``y``.
"""
from __future__ import annotations

from typing import Any

import torch

from runner.worker.sampling_noise import INVALID_TOKEN
from ubatch.triton_runtime import import_triton, interpreter_enabled, kernels_per_mode, launch_guard, launch_mode

__all__ = ["fused_draw"]

#: vocabulary entries a program holds per step of its loops, and its warps (16 entries a lane)
BLOCK = 4096
NUM_WARPS = 8

# Filled on first use; module globals because the interpreter re-executes kernel source against the defining
# function's __globals__ (closure variables are invisible to it).
triton: Any = None
tl: Any = None
# A @triton.jit helper of the kernel; bound here by _load_kernel in interpreter mode only, since the interpreter
# resolves kernel names in this module's globals (compiled kernels find it in their closure).
_load_y: Any = None


@kernels_per_mode
def _load_kernel() -> Any:
    """Decorate the kernel (once per interpreter mode: ``kernels_per_mode``)."""

    @triton.jit
    def _load_y(row_ptr, idx, n_read, t, thr, HAS_TEMP: tl.constexpr, HAS_THR: tl.constexpr):
        """``y`` of the tokens ``idx`` of a row: divided by its temperature, below its threshold removed; -inf
        from ``n_read`` on (the vocabulary's end, or 0 for a row not read)."""
        y = tl.load(row_ptr + idx, mask=idx < n_read, other=float("-inf")).to(tl.float32)
        if HAS_TEMP:
            y = tl.math.div_rn(y, t)
        if HAS_THR:
            y = tl.where(y < thr, float("-inf"), y)
        return y

    if interpreter_enabled():
        globals()["_load_y"] = _load_y

    @triton.jit
    def _draw_kernel(logits_ptr, stride, n_cols, temp_ptr, thr_ptr, u_ptr, out_ptr,
                     HAS_TEMP: tl.constexpr, HAS_THR: tl.constexpr, INVALID: tl.constexpr, BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * stride
        offs = tl.arange(0, BLOCK_V)
        u = tl.load(u_ptr + row)
        active = u >= 0
        n_read = tl.where(active, n_cols, 0)
        t = 1.0
        if HAS_TEMP:
            t = tl.load(temp_ptr + row)
        thr = float("-inf")
        if HAS_THR:
            thr = tl.load(thr_ptr + row)
        # 1: the peak, and whether any y is NaN (which tl.max would not carry)
        peak = float("-inf")
        nans = 0
        for start in range(0, n_cols, BLOCK_V):
            y = _load_y(row_ptr, start + offs, n_read, t, thr, HAS_TEMP, HAS_THR)
            nans += tl.sum((y != y).to(tl.int32), 0)
            peak = tl.maximum(peak, tl.max(tl.where(y != y, float("-inf"), y), 0))
        valid = active & (nans == 0) & (peak > float("-inf")) & (peak < float("inf"))
        peak = tl.where(valid, peak, 0.0)
        n_read = tl.where(valid, n_cols, 0)
        # 2: the total, accumulated as pass 3 accumulates it
        total = 0.0
        for start in range(0, n_cols, BLOCK_V):
            p = tl.exp(_load_y(row_ptr, start + offs, n_read, t, thr, HAS_TEMP, HAS_THR) - peak)
            total += tl.max(tl.where(p > 0, tl.cumsum(p, 0), 0.0), 0)
        target = u * total  # u <= 1 - 2**-24 and total >= 1 (the peak's own term): strictly below total
        # 3: the first token of positive probability whose CDF passes the target
        acc = 0.0
        token = n_cols
        for start in range(0, n_cols, BLOCK_V):
            idx = start + offs
            p = tl.exp(_load_y(row_ptr, idx, n_read, t, thr, HAS_TEMP, HAS_THR) - peak)
            c = tl.cumsum(p, 0)
            token = tl.minimum(token, tl.min(tl.where((p > 0) & (acc + c > target), idx, n_cols), 0))
            acc += tl.max(tl.where(p > 0, c, 0.0), 0)
        tl.store(out_ptr + row, tl.where(valid & (token < n_cols), token, INVALID).to(tl.int64))

    return _draw_kernel


def fused_draw(logits: torch.Tensor, uniforms: torch.Tensor, temperature: torch.Tensor | None = None,
               threshold: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's drawn token ``[rows]`` int64 (module docstring); ``logits`` ``[rows, vocab]`` (any float dtype,
    unit stride along the vocabulary), ``uniforms``, ``temperature`` (> 0) and ``threshold`` ``[rows]`` float32.
    Nothing is written but the result; shapes alone fix the grid, so the call is capturable in a CUDA graph.

    CUDA tensors run the compiled kernel; CPU tensors need ``TRITON_INTERPRET=1`` (Triton's interpreter)."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError(f"fused_draw: logits need a unit stride along the vocabulary, got strides {logits.stride()}")
    for name, t in (("uniforms", uniforms), ("temperature", temperature), ("threshold", threshold)):
        if t is not None and (t.shape != (rows,) or t.dtype != torch.float32):
            raise ValueError(f"fused_draw: {name} must be [{rows}] float32, got {tuple(t.shape)} {t.dtype}")
    interpret = launch_mode("fused_draw", logits.device)
    global triton, tl
    triton, tl = import_triton("fused_draw")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    kernel = _load_kernel()
    with launch_guard(interpret):
        kernel[(rows,)](
            logits, logits.stride(0), vocab,
            uniforms if temperature is None else temperature.contiguous(),  # an unread placeholder when absent
            uniforms if threshold is None else threshold.contiguous(),
            uniforms.contiguous(), out,
            HAS_TEMP=temperature is not None, HAS_THR=threshold is not None, INVALID=INVALID_TOKEN,
            BLOCK_V=min(BLOCK, triton.next_power_of_2(vocab)),
            **({} if interpret else {"num_warps": NUM_WARPS}),
        )
    return out
