"""DeepGEMM fp8 experts for the masked (DeepEP low-latency) and the contiguous layouts.

DeepEP's low-latency dispatch hands over exactly what ``m_grouped_fp8_gemm_nt_masked`` consumes -- a
``[E_local, capacity, H]`` buffer plus per-expert counts -- so decode steps need no permute and no host sync.
The contiguous layout (prefill, the high-throughput and torch all-to-alls) is sorted by expert into groups padded
to DeepGEMM's M alignment for ``m_grouped_fp8_gemm_nt_contiguous``, in a buffer of fixed size (no host sync).
DeepGEMM is fp8-only on this path: activations use per-token 1x128 scales, weights per-block 128x128 scales.
The quantisation helpers are plain torch (``torch.float8_e4m3fn`` exists on CPU) so they are unit-tested
without a GPU; ``deep_gemm`` itself is imported only when a ``DeepGemmExperts`` is constructed without an
explicit ``deep_gemm_module`` (the tests pass their CPU stand-in, ``tests/standins/deep_gemm.py``, which
follows DeepGEMM's signatures, layouts and scaling rules); only the real package is checked for CUDA.

DeepEP's FP8 low-latency dispatch hands the masked buffer over already quantised, values and per-token 1 x 128
scales (``ExpertTokens.hidden_scales``); the first GEMM takes them as they are (:attr:`accepts_fp8_activations`).

A checkpoint's own FP8 experts (:meth:`DeepGemmExperts.apply_fp8`, 128 x 128 blocks) go to the GEMMs as they
are, values and scales; where DeepGEMM keeps only scale exponents (UE8M0, SM100) they are requantised once with
power-of-two scales and cached, since rounding the scales alone would change the weights.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ubatch.fp8 import Fp8Tensor
from ubatch.modular_moe.experts.base import MoEExperts
from ubatch.modular_moe.experts.torch_experts import check_expert_weights
from ubatch.modular_moe.types import ExpertMLPExtras, ExpertTokens, Layout

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
QUANT_BLOCK = 128  # DeepGEMM's scaling granularity along K (and N for weights)
# Current name first (DeepGEMM main 54e2261, 2026-06-23, and sgl-deep-gemm 0.2.5 define
# ``m_grouped_fp8_fp4_gemm_nt_masked(a, b, d, masked_m, expected_m, recipe=None, recipe_a=None, recipe_b=None,
# compiled_dims='nk', disable_ue8m0_cast=False)`` and keep ``m_grouped_fp8_gemm_nt_masked`` as an alias), then
# the older names, so one backend spans DeepGEMM releases. The call below passes the first five positionally.
_MASKED_GEMM_NAMES: tuple[str, ...] = (
    "m_grouped_fp8_fp4_gemm_nt_masked",
    "m_grouped_fp8_gemm_nt_masked",
    "fp8_m_grouped_gemm_nt_masked",
    "m_grouped_gemm_fp8_fp8_bf16_nt_masked",
)

_CONTIGUOUS_GEMM_NAMES: tuple[str, ...] = (
    "m_grouped_fp8_fp4_gemm_nt_contiguous",
    "m_grouped_fp8_gemm_nt_contiguous",
)

_Fp8Pair = tuple[torch.Tensor, torch.Tensor]  # (fp8 values, fp32 scales): DeepGEMM's operand format


def ceil_to_ue8m0(sf: torch.Tensor) -> torch.Tensor:
    """Round scales up to a power of two: SM100 stores them as bare 8-bit exponents (UE8M0)."""
    return torch.exp2(torch.ceil(torch.log2(sf.abs().float())))


def _pad_dim(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    size = x.shape[dim]
    extra = -size % multiple
    if extra == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra]
    return F.pad(x, pad)


def per_token_cast_to_fp8(
    x: torch.Tensor, use_ue8m0: bool = False, group: int = QUANT_BLOCK
) -> _Fp8Pair:
    """``x [..., K]`` -> ``(fp8 [..., K], fp32 scales [..., cdiv(K, group)])``, one scale per 1 x group slice.

    Same recipe as DeepGEMM's ``per_token_cast_to_fp8`` (amax clamped at 1e-4 so all-zero rows stay finite),
    batched over leading dims so a whole masked buffer is quantised in one call.
    """
    k = x.shape[-1]
    padded = _pad_dim(x, -1, group)
    view = padded.reshape(*x.shape[:-1], padded.shape[-1] // group, group)
    amax = view.abs().float().amax(dim=-1).clamp(min=1e-4)
    sf = amax / FP8_MAX
    if use_ue8m0:
        sf = ceil_to_ue8m0(sf)
    q = (view.float() * (1.0 / sf.unsqueeze(-1))).to(FP8_DTYPE)
    return q.reshape(padded.shape)[..., :k].contiguous(), sf


def per_block_cast_to_fp8(
    w: torch.Tensor, use_ue8m0: bool = False, block: int = QUANT_BLOCK
) -> _Fp8Pair:
    """``w [..., N, K]`` -> ``(fp8 [..., N, K], fp32 scales [..., cdiv(N, block), cdiv(K, block)])``.

    Weights get square blocks (DeepGEMM's ``per_block_cast_to_fp8``) so the scale of a weight tile does not
    depend on which token rows it meets; the leading expert dim is batched instead of looped.
    """
    n, k = w.shape[-2:]
    padded = _pad_dim(_pad_dim(w, -2, block), -1, block)
    lead = w.shape[:-2]
    nb, kb = padded.shape[-2] // block, padded.shape[-1] // block
    view = padded.reshape(*lead, nb, block, kb, block)
    amax = view.abs().float().amax(dim=(-3, -1), keepdim=True).clamp(min=1e-4)
    sf = amax / FP8_MAX
    if use_ue8m0:
        sf = ceil_to_ue8m0(sf)
    q = (view.float() * (1.0 / sf)).to(FP8_DTYPE)
    q = q.reshape(padded.shape)[..., :n, :k].contiguous()
    return q, sf.reshape(*lead, nb, kb)


def per_token_dequant(q: torch.Tensor, sf: torch.Tensor, group: int = QUANT_BLOCK) -> torch.Tensor:
    """Inverse of ``per_token_cast_to_fp8`` (fp32), for tests and debugging."""
    scale = sf.repeat_interleave(group, dim=-1)[..., : q.shape[-1]]
    return q.float() * scale


def per_block_dequant(q: torch.Tensor, sf: torch.Tensor, block: int = QUANT_BLOCK) -> torch.Tensor:
    """Inverse of ``per_block_cast_to_fp8`` (fp32), for tests and debugging."""
    n, k = q.shape[-2:]
    scale = sf.repeat_interleave(block, dim=-2)[..., :n, :].repeat_interleave(block, dim=-1)[..., :k]
    return q.float() * scale


def _import_deep_gemm() -> Any:
    try:
        import deep_gemm
    except ImportError as exc:
        raise ImportError(
            "The 'deep_gemm' experts backend needs DeepGEMM (an SM90/SM100 GPU) and it is not importable. "
            "Install the prebuilt SGLang build (pip install sgl-deep-gemm: CUDA 13, built against one torch "
            "version) or build github.com/deepseek-ai/DeepGEMM from source (./install.sh); or use "
            "make_experts('triton') / make_experts('torch')."
        ) from exc
    return deep_gemm


def deep_gemm_function(deep_gemm: Any, names: tuple[str, ...]) -> Callable[..., None]:
    """The first of ``names`` this ``deep_gemm`` build has (DeepGEMM renames its GEMMs between releases: the
    current name first, then the older aliases); ImportError naming them all when it has none."""
    for name in names:
        fn = getattr(deep_gemm, name, None)
        if fn is not None:
            return fn
    raise ImportError(f"this deep_gemm build ({getattr(deep_gemm, '__name__', deep_gemm)}) has none of {names}; "
                      "upgrade DeepGEMM")


def _resolve_masked_gemm(deep_gemm: Any) -> Callable[..., None]:
    return deep_gemm_function(deep_gemm, _MASKED_GEMM_NAMES)


class DeepGemmExperts(MoEExperts):
    """fp8 grouped GEMMs for both layouts; SiLU-and-mul and re-quantisation run in torch between them.

    ``expected_m`` is DeepGEMM's tuning hint for tokens per expert (defaults to the buffer capacity, as vLLM
    does). ``use_ue8m0`` defaults to True on SM100+, where DeepGEMM keeps only each scale's exponent (UE8M0)
    so the scales must be powers of two; off CUDA (a stand-in module) it must be given. bf16 weights are
    quantised on first use and cached per (storage, version): weights are static during inference.
    """

    name = "deep_gemm"
    supported_layouts: tuple[Layout, ...] = ("masked", "contiguous")
    supports_fp8_weights = True
    accepts_fp8_activations = True

    def wants_power_of_two_scales(self, device: torch.device) -> bool:
        return self._ue8m0(device)

    def __init__(self, expected_m: int | None = None, use_ue8m0: bool | None = None,
                 deep_gemm_module: Any = None) -> None:
        self._needs_cuda = deep_gemm_module is None
        self._deep_gemm = deep_gemm_module if deep_gemm_module is not None else _import_deep_gemm()
        self._masked_gemm = _resolve_masked_gemm(self._deep_gemm)
        self.expected_m = expected_m
        self.use_ue8m0 = use_ue8m0
        self._weight_cache: dict[tuple[Any, ...], tuple[weakref.ref[torch.Tensor], _Fp8Pair]] = {}

    def apply(self, tokens: ExpertTokens, w13: torch.Tensor, w2: torch.Tensor,
              extras: ExpertMLPExtras | None = None) -> torch.Tensor:
        self._check(tokens, w13, w2, extras)
        use_ue8m0 = self._ue8m0(tokens.hidden.device)
        return self._compute(tokens, self._quantized(w13, use_ue8m0), self._quantized(w2, use_ue8m0), use_ue8m0)

    def apply_fp8(self, tokens: ExpertTokens, w13: Fp8Tensor, w2: Fp8Tensor,
                  extras: ExpertMLPExtras | None = None) -> torch.Tensor:
        """The checkpoint's FP8 experts: 128 x 128 blocks on one grid (the intermediate size a multiple of 128)."""
        self._check(tokens, w13.data, w2.data, extras)
        for label, w in (("w13", w13), ("w2", w2)):
            if w.block != (QUANT_BLOCK, QUANT_BLOCK) or not w.uniform_grid():
                raise ValueError(f"DeepGEMM needs {QUANT_BLOCK} x {QUANT_BLOCK} weight blocks on one grid; {label} "
                                 f"has {w.block} blocks over {w.row_shards} row shard(s) of "
                                 f"{w.data.shape[-2] // w.row_shards} rows")
        use_ue8m0 = self._ue8m0(tokens.hidden.device)
        return self._compute(tokens, self._checkpoint_pair(w13, use_ue8m0), self._checkpoint_pair(w2, use_ue8m0),
                             use_ue8m0)

    def _check(self, tokens: ExpertTokens, w13: torch.Tensor, w2: torch.Tensor,
               extras: ExpertMLPExtras | None) -> None:
        self.check_extras(extras)
        _, hidden_size, inter = check_expert_weights(tokens, w13, w2)
        for label, dim in (("hidden size", hidden_size), ("intermediate size", inter)):
            if dim % QUANT_BLOCK:
                raise ValueError(f"DeepGEMM needs the {label} ({dim}) to be a multiple of {QUANT_BLOCK}")
        if self._needs_cuda and tokens.hidden.device.type != "cuda":
            raise RuntimeError(f"DeepGemmExperts needs CUDA tensors, got {tokens.hidden.device}")

    def _compute(self, tokens: ExpertTokens, w13_q: _Fp8Pair, w2_q: _Fp8Pair, use_ue8m0: bool) -> torch.Tensor:
        if tokens.layout == "masked":
            return self._masked(tokens, w13_q, w2_q, use_ue8m0)
        return self._contiguous(tokens, w13_q, w2_q, use_ue8m0)

    def _contiguous(self, tokens: ExpertTokens, w13_q: _Fp8Pair, w2_q: _Fp8Pair, use_ue8m0: bool) -> torch.Tensor:
        """Routes sorted by local expert into groups padded to DeepGEMM's M alignment (padding rows in group -1),
        both grouped GEMMs, then each route's row weighted and summed back onto its token.

        The buffer has a fixed size, every route plus a full alignment of padding per expert plus one row where
        routes to no local expert (id -1) land, so nothing is read back to size it: no host sync, capturable.
        """
        hidden = tokens.hidden
        assert tokens.topk_ids is not None and tokens.topk_weights is not None
        gemm = self._contiguous_gemm()
        num_experts, two_i, hidden_size = w13_q[0].shape
        inter = two_i // 2
        num_tokens, top_k = tokens.topk_ids.shape
        device = hidden.device
        align = int(self._deep_gemm.get_mk_alignment_for_contiguous_layout())
        total = num_tokens * top_k + num_experts * align + 1
        flat = tokens.topk_ids.reshape(-1).to(torch.int64)
        key = torch.where(flat >= 0, flat, num_experts)  # routes to other ranks sort last, as group E
        order = torch.argsort(key, stable=True)
        group = key[order]
        counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device).scatter_add_(
            0, key, torch.ones_like(key))
        padded = (counts[:num_experts] + align - 1) // align * align
        first_row = torch.cumsum(padded, 0) - padded  # each group's first row in the buffer
        rank = torch.arange(order.numel(), device=device) - (torch.cumsum(counts, 0) - counts)[group]
        local = group < num_experts
        rows = torch.where(local, first_row[group.clamp(max=num_experts - 1)] + rank, total - 1)
        layout = torch.full((total,), -1, dtype=torch.int32, device=device)
        layout[rows] = torch.where(local, group, -1).to(torch.int32)
        layout[total - 1] = -1  # the row of the routes to no local expert is never computed
        a = torch.zeros((total, hidden_size), dtype=hidden.dtype, device=device)
        a[rows] = hidden[order // top_k]
        gate_up = torch.zeros((total, 2 * inter), dtype=torch.bfloat16, device=device)
        gemm(per_token_cast_to_fp8(a, use_ue8m0), w13_q, gate_up, layout)
        gate_up_f = gate_up.float()
        act = F.silu(gate_up_f[:, :inter]) * gate_up_f[:, inter:]
        down = torch.zeros((total, hidden_size), dtype=torch.bfloat16, device=device)
        gemm(per_token_cast_to_fp8(act, use_ue8m0), w2_q, down, layout)
        weights = (tokens.topk_weights.reshape(-1)[order].float() * local).unsqueeze(1)
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=device)
        out.index_add_(0, order // top_k, down[rows].float() * weights)
        return out.to(hidden.dtype)

    def _contiguous_gemm(self) -> Callable[..., None]:
        return deep_gemm_function(self._deep_gemm, _CONTIGUOUS_GEMM_NAMES)

    def _masked(self, tokens: ExpertTokens, w13_q: _Fp8Pair, w2_q: _Fp8Pair, use_ue8m0: bool) -> torch.Tensor:
        """Both grouped GEMMs over the masked buffer, SiLU-and-mul between them, padding rows zeroed."""
        hidden = tokens.hidden
        assert tokens.expert_num_tokens is not None
        num_experts, two_i, hidden_size = w13_q[0].shape
        inter = two_i // 2
        capacity = hidden.shape[1]
        # Grouped masked GEMMs want the per-group row count to be a whole number of M blocks.
        a_q = self._masked_operand(tokens, use_ue8m0)
        max_m = a_q[0].shape[1]
        masked_m = tokens.expert_num_tokens.to(device=hidden.device, dtype=torch.int32)
        expected_m = self.expected_m if self.expected_m is not None else capacity

        gate_up = torch.empty((num_experts, max_m, 2 * inter), dtype=torch.bfloat16, device=hidden.device)
        self._masked_gemm(a_q, w13_q, gate_up, masked_m, expected_m)
        gate_up_f = gate_up.float()
        act = F.silu(gate_up_f[..., :inter]) * gate_up_f[..., inter:]
        out = torch.empty((num_experts, max_m, hidden_size), dtype=torch.bfloat16, device=hidden.device)
        self._masked_gemm(per_token_cast_to_fp8(act, use_ue8m0), w2_q, out, masked_m, expected_m)

        # Rows past expert_num_tokens are never written by the kernel; the contract says they are zeros.
        valid = torch.arange(max_m, device=hidden.device).unsqueeze(0) < masked_m.unsqueeze(1)
        out = out.masked_fill(~valid.unsqueeze(-1), 0)
        # Contiguous, even when the capacity was padded: DeepEP's low-latency combine asserts it of its input.
        return out[:, :capacity].to(tokens.output_dtype).contiguous()

    @staticmethod
    def _masked_operand(tokens: ExpertTokens, use_ue8m0: bool) -> _Fp8Pair:
        """The first GEMM's A: the dispatched FP8 values and scales as they are, or the activations quantised
        per token per 128 columns; rows padded to a whole number of M blocks either way."""
        capacity = tokens.hidden.shape[1]
        extra = -capacity % QUANT_BLOCK
        if tokens.hidden_scales is None:
            return per_token_cast_to_fp8(_pad_dim(tokens.hidden, 1, QUANT_BLOCK) if extra else tokens.hidden,
                                         use_ue8m0)
        # On SM100 (use_ue8m0) the dispatch rounded the scales to powers of two: the kernel asked it to, from
        # wants_power_of_two_scales. Checking it here would cost a host sync per call.
        q, sf = tokens.hidden, tokens.hidden_scales
        if extra:  # F.pad has no float8 kernel: copy into a zeroed buffer of the padded size
            padded = torch.zeros((q.shape[0], capacity + extra, q.shape[2]), dtype=q.dtype, device=q.device)
            padded[:, :capacity] = q
            q, sf = padded, _pad_dim(sf, 1, QUANT_BLOCK)
        return q, sf

    def _checkpoint_pair(self, w: Fp8Tensor, use_ue8m0: bool) -> _Fp8Pair:
        """A checkpoint's FP8 weight as DeepGEMM's operand: as is, or requantised once to UE8M0 scales."""
        if not use_ue8m0:
            return w.data, w.scale.float()
        key = (w.data.data_ptr(), tuple(w.data.shape), w.data.dtype, w.data.device, w.data._version, "ue8m0")
        entry = self._weight_cache.get(key)
        if entry is None or entry[0]() is not w.data:
            entry = (weakref.ref(w.data), per_block_cast_to_fp8(w.dequantize(torch.float32), use_ue8m0=True))
            self._weight_cache[key] = entry
        return entry[1]

    def _ue8m0(self, device: torch.device) -> bool:
        if self.use_ue8m0 is not None:
            return self.use_ue8m0
        if device.type != "cuda":
            raise ValueError(f"DeepGemmExperts on {device} tensors (a stand-in deep_gemm module) cannot read the GPU "
                             "generation: pass use_ue8m0 (True for SM100 / Blackwell, False for SM90 / Hopper)")
        return torch.cuda.get_device_capability(device)[0] >= 10

    def _quantized(self, w: torch.Tensor, use_ue8m0: bool) -> _Fp8Pair:
        key = (w.data_ptr(), tuple(w.shape), w.dtype, w.device, w._version, use_ue8m0)
        entry = self._weight_cache.get(key)
        # The weakref guards against a freed weight whose address (and version 0) got reused.
        if entry is None or entry[0]() is not w:
            entry = (weakref.ref(w), per_block_cast_to_fp8(w, use_ue8m0))
            self._weight_cache[key] = entry
        return entry[1]
