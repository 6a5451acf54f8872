"""A row's draw by inverse CDF in three small Triton kernels: temperature, a drop threshold and the draw.

``fused_draw(logits, uniforms, temperature, threshold)`` returns, for each row whose uniform is non-negative, a
token drawn from ``softmax(y)`` where ``y = logits / temperature`` with every ``y < threshold`` removed (top-k's
threshold; ``None``: nothing removed), ``INVALID_TOKEN`` where the row has no distribution (a NaN, a ``+inf``,
or nothing left). Rows with a negative uniform (greedy rows) are not read and get ``INVALID_TOKEN``.

Why: the torch ops it replaces (``sampling_noise.draw_by_inverse_cdf_`` after the temperature and top-k's mask)
make nine passes over ``[rows, vocab]`` float32 logits and write four of them; these kernels read a row about
twice and write one id. A row is cut into chunks of ``CHUNK_BLOCKS`` blocks, one program per (row, chunk), so a
few rows still fill the GPU:

1. ``peak``: each chunk's largest ``y`` (NaN if it holds one);
2. ``total``: each chunk's sum of ``exp(y - peak)`` (the row's peak), as the walk will add it up: a block at a time,
   by the largest value of the block's ``tl.cumsum`` over tokens of positive probability;
3. ``walk``: every program adds the chunks' sums in chunk order, the row's total and the sum before its own chunk
   ``P``; the one chunk with ``P <= u * total < P + its sum`` walks its blocks again and writes the first token of
   positive probability whose CDF (``P`` plus its running sum) passes the target.

Steps 2 and 3 make the same additions, so exactly one chunk owns the target and holds a token past it, and only a
token of positive probability is chosen: a removed or underflowed token is never drawn, whatever the rounding of
the parallel scan. The chunks depend on the vocabulary alone, so a row gives the same token in any batch. The
rounding is not the torch ops', so the sampler draws with these kernels on every step where they are on
(``Sampler(fused_draw=True)``: CUDA with the fused tails), eagerly and in the graph heads alike. The temperature
division is IEEE's (``div_rn``), as torch's, so dividing here or beforehand gives the same ``y``.
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
#: blocks per chunk: Qwen3's 151,936 tokens are 10 chunks, so 32 rows are 320 programs
CHUNK_BLOCKS = 4

# Filled on first use; module globals because the interpreter re-executes kernel source against the defining
# function's __globals__ (closure variables are invisible to it).
triton: Any = None
tl: Any = None
# @triton.jit helpers of the kernels; bound here by _load_kernels in interpreter mode only, since the interpreter
# resolves kernel names in this module's globals (compiled kernels find them in their closure).
_load_y: Any = None
_chunk_of: Any = None
_row_peak: Any = None
_walk_block: Any = None


@kernels_per_mode
def _load_kernels() -> tuple[Any, Any, Any]:
    """Decorate the kernels (once per interpreter mode: ``kernels_per_mode``): peak, total, walk."""

    @triton.jit
    def _load_y(row_ptr, idx, end, t, thr, HAS_TEMP: tl.constexpr, HAS_THR: tl.constexpr):
        """``y`` of the tokens ``idx`` of a row: divided by its temperature, below its threshold removed; -inf
        from ``end`` on (the chunk's end, or its start for a row not read)."""
        y = tl.load(row_ptr + idx, mask=idx < end, other=float("-inf")).to(tl.float32)
        if HAS_TEMP:
            y = tl.math.div_rn(y, t)
        if HAS_THR:
            y = tl.where(y < thr, float("-inf"), y)
        return y

    @triton.jit
    def _chunk_of(temp_ptr, thr_ptr, row, chunk, n_cols, read, HAS_TEMP: tl.constexpr, HAS_THR: tl.constexpr,
                  BLOCK_V: tl.constexpr, CHUNK_BLOCKS: tl.constexpr):
        """A (row, chunk) program's first token and end (its start where ``read`` is false: nothing is loaded),
        and the row's temperature and threshold."""
        start = chunk * (BLOCK_V * CHUNK_BLOCKS)
        end = tl.where(read, tl.minimum(start + BLOCK_V * CHUNK_BLOCKS, n_cols), start)
        t = tl.load(temp_ptr + row) if HAS_TEMP else 1.0
        thr = tl.load(thr_ptr + row) if HAS_THR else float("-inf")
        return start, end, t, thr

    @triton.jit
    def _row_peak(peaks_ptr, row, n_peaks, u, NCH: tl.constexpr):
        """The row's peak (0 where it has none) from its ``n_peaks`` partial ones (its chunks', or one given), and
        whether it has a distribution and draws: no peak is NaN, the largest is finite, the uniform is not
        negative."""
        c = tl.arange(0, NCH)
        m = tl.load(peaks_ptr + row * n_peaks + c, mask=c < n_peaks, other=float("-inf"))
        nans = tl.sum((m != m).to(tl.int32), 0)
        peak = tl.max(tl.where(m != m, float("-inf"), m), 0)
        valid = (u >= 0) & (nans == 0) & (peak > float("-inf")) & (peak < float("inf"))
        return tl.where(valid, peak, 0.0), valid

    @triton.jit
    def _walk_block(row_ptr, idx, end, t, thr, peak, HAS_TEMP: tl.constexpr, HAS_THR: tl.constexpr):
        """A block's unnormalised probabilities, its CDF from the block's start, and the CDF's largest value over
        tokens of positive probability (what the running sum adds for the block)."""
        p = tl.exp(_load_y(row_ptr, idx, end, t, thr, HAS_TEMP, HAS_THR) - peak)
        c = tl.cumsum(p, 0)
        return p, c, tl.max(tl.where(p > 0, c, 0.0), 0)

    if interpreter_enabled():
        globals().update(_load_y=_load_y, _chunk_of=_chunk_of, _row_peak=_row_peak, _walk_block=_walk_block)

    @triton.jit
    def _peak_kernel(logits_ptr, stride, n_cols, temp_ptr, thr_ptr, u_ptr, peaks_ptr, n_chunks,
                     HAS_TEMP: tl.constexpr, HAS_THR: tl.constexpr, BLOCK_V: tl.constexpr,
                     CHUNK_BLOCKS: tl.constexpr):
        row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
        row_ptr = logits_ptr + row * stride
        start, end, t, thr = _chunk_of(temp_ptr, thr_ptr, row, chunk, n_cols, tl.load(u_ptr + row) >= 0, HAS_TEMP,
                                       HAS_THR, BLOCK_V, CHUNK_BLOCKS)
        offs = tl.arange(0, BLOCK_V)
        m = float("-inf")
        nans = 0
        for b in range(CHUNK_BLOCKS):
            y = _load_y(row_ptr, start + b * BLOCK_V + offs, end, t, thr, HAS_TEMP, HAS_THR)
            nans += tl.sum((y != y).to(tl.int32), 0)
            m = tl.maximum(m, tl.max(tl.where(y != y, float("-inf"), y), 0))
        tl.store(peaks_ptr + row * n_chunks + chunk, tl.where(nans > 0, float("nan"), m))

    @triton.jit
    def _total_kernel(logits_ptr, stride, n_cols, temp_ptr, thr_ptr, u_ptr, peaks_ptr, n_peaks, sums_ptr, n_chunks,
                      HAS_TEMP: tl.constexpr, HAS_THR: tl.constexpr, BLOCK_V: tl.constexpr,
                      CHUNK_BLOCKS: tl.constexpr, NCH: tl.constexpr):
        row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
        row_ptr = logits_ptr + row * stride
        peak, valid = _row_peak(peaks_ptr, row, n_peaks, tl.load(u_ptr + row), NCH)
        start, end, t, thr = _chunk_of(temp_ptr, thr_ptr, row, chunk, n_cols, valid, HAS_TEMP, HAS_THR, BLOCK_V,
                                       CHUNK_BLOCKS)
        offs = tl.arange(0, BLOCK_V)
        acc = 0.0
        for b in range(CHUNK_BLOCKS):
            _, _, step = _walk_block(row_ptr, start + b * BLOCK_V + offs, end, t, thr, peak, HAS_TEMP, HAS_THR)
            acc += step
        tl.store(sums_ptr + row * n_chunks + chunk, acc)

    @triton.jit
    def _walk_kernel(logits_ptr, stride, n_cols, temp_ptr, thr_ptr, u_ptr, peaks_ptr, n_peaks, sums_ptr, out_ptr,
                     n_chunks,
                     HAS_TEMP: tl.constexpr, HAS_THR: tl.constexpr, BLOCK_V: tl.constexpr,
                     CHUNK_BLOCKS: tl.constexpr, NCH: tl.constexpr):
        row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
        row_ptr = logits_ptr + row * stride
        u = tl.load(u_ptr + row)
        peak, valid = _row_peak(peaks_ptr, row, n_peaks, u, NCH)
        # the chunks' sums added in chunk order: the row's total, and the sums before and through this chunk
        before = 0.0
        through = 0.0
        total = 0.0
        for k in tl.static_range(NCH):  # the sums past the last chunk are 0: adding them changes nothing
            total += tl.load(sums_ptr + row * n_chunks + k, mask=k < n_chunks, other=0.0)
            before = tl.where(k < chunk, total, before)
            through = tl.where(k == chunk, total, through)
        target = u * total  # u <= 1 - 2**-24 and total >= 1 (the peak's own term): strictly below total
        owner = valid & (before <= target) & (target < through)
        start, end, t, thr = _chunk_of(temp_ptr, thr_ptr, row, chunk, n_cols, owner, HAS_TEMP, HAS_THR, BLOCK_V,
                                       CHUNK_BLOCKS)
        offs = tl.arange(0, BLOCK_V)
        acc = 0.0
        token = n_cols
        for b in range(CHUNK_BLOCKS):
            idx = start + b * BLOCK_V + offs
            p, c, step = _walk_block(row_ptr, idx, end, t, thr, peak, HAS_TEMP, HAS_THR)
            token = tl.minimum(token, tl.min(tl.where((p > 0) & (before + (acc + c) > target), idx, n_cols), 0))
            acc += step
        tl.store(out_ptr + row, token.to(tl.int64), mask=owner & (token < n_cols))

    return _peak_kernel, _total_kernel, _walk_kernel


def fused_draw(logits: torch.Tensor, uniforms: torch.Tensor, temperature: torch.Tensor | None = None,
               threshold: torch.Tensor | None = None, peak: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's drawn token ``[rows]`` int64 (module docstring); ``logits`` ``[rows, vocab]`` (any float dtype,
    unit stride along the vocabulary), ``uniforms``, ``temperature`` (> 0) and ``threshold`` ``[rows]`` float32.
    ``peak``: each row's largest ``y`` where the caller has it (a graph head's ``max(logits) / temperature``, which
    is the largest ``logits / temperature``: division keeps the order; NaN where the row holds one), so the first
    launch is not needed. Nothing is written but the result and ``[rows, chunks]`` scratch tensors; shapes alone
    fix the grids, so the call is capturable in a CUDA graph.

    CUDA tensors run the compiled kernels; CPU tensors need ``TRITON_INTERPRET=1`` (Triton's interpreter)."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError(f"fused_draw: logits need a unit stride along the vocabulary, got strides {logits.stride()}")
    for name, given in (("uniforms", uniforms), ("temperature", temperature), ("threshold", threshold),
                        ("peak", peak)):
        if given is not None and (given.shape != (rows,) or given.dtype != torch.float32):
            raise ValueError(f"fused_draw: {name} must be [{rows}] float32, got {tuple(given.shape)} {given.dtype}")
    interpret = launch_mode("fused_draw", logits.device)
    global triton, tl
    triton, tl = import_triton("fused_draw")
    out = torch.full((rows,), INVALID_TOKEN, dtype=torch.int64, device=logits.device)  # rows no chunk owns
    if rows == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(vocab))
    n_chunks = triton.cdiv(vocab, block * CHUNK_BLOCKS)
    sums = torch.empty(rows, n_chunks, dtype=torch.float32, device=logits.device)
    u = uniforms.contiguous()
    # an unread placeholder where a setting is absent
    row_args = (logits, logits.stride(0), vocab, u if temperature is None else temperature.contiguous(),
                u if threshold is None else threshold.contiguous(), u)
    sizes = dict(HAS_TEMP=temperature is not None, HAS_THR=threshold is not None, BLOCK_V=block,
                 CHUNK_BLOCKS=CHUNK_BLOCKS, **({} if interpret else {"num_warps": NUM_WARPS}))
    peak_kernel, total_kernel, walk_kernel = _load_kernels()
    grid = (rows, n_chunks)
    with launch_guard(interpret):
        if peak is None:
            peaks = torch.empty_like(sums)
            peak_kernel[grid](*row_args, peaks, n_chunks, **sizes)
        else:
            peaks = peak.contiguous().view(rows, 1)
        nch = triton.next_power_of_2(max(n_chunks, peaks.shape[1]))  # a row's peaks, and its chunks' sums
        total_kernel[grid](*row_args, peaks, peaks.shape[1], sums, n_chunks, NCH=nch, **sizes)
        walk_kernel[grid](*row_args, peaks, peaks.shape[1], sums, out, n_chunks, NCH=nch, **sizes)
    return out
