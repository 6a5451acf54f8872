"""CPU stand-in for the DeepGEMM functions the deep_gemm experts call (tests only; pass as ``deep_gemm_module``).

Follows DeepGEMM's API and host-side rules (``csrc/apis/gemm.hpp`` of DeepGEMM main 54e2261:
``m_grouped_fp8_fp4_gemm_nt_masked``, bound also as ``m_grouped_fp8_gemm_nt_masked`` and aliased
``fp8_m_grouped_gemm_nt_masked``, the same names and parameters in sgl-deep-gemm 0.2.5; ``csrc/apis/layout.hpp``
and ``csrc/utils/layout.hpp`` for scale-factor recipes and layouts; ``csrc/jit_kernels/impls/smxx_layout.hpp``
for the UE8M0 packing):

- ``a = (fp8 [G, M, K], sfa)``, ``b = (fp8 [G, N, K], sfb)``, both K-major; ``d`` bf16 ``[G, M, N]`` row-major;
  ``masked_m`` int32 ``[G]``; ``expected_m > 0``. Only rows ``< masked_m[g]`` of ``d[g]`` are written.
- Default recipe by architecture: SM90 takes fp32 scales only, per-token ``1 x 128`` for A and per-block
  ``128 x 128`` for B; SM100 takes fp32 scales and converts them to UE8M0 (``sf.view(int32) >> 23``: the
  exponent alone, i.e. each scale rounded *down* to a power of two) unless they are already packed ints.
  So scales that are not powers of two give wrong results on SM100, as on hardware.
- ``fp8_fp4_gemm_nt`` (alias ``fp8_gemm_nt``), the dense GEMM: ``a = (fp8 [M, K], sfa)``, ``b = (fp8 [N, K],
  sfb)``, ``d [M, N]`` row-major, optional ``c`` to accumulate. On SM90 with fp32 ``128 x 128`` B scales
  (the 1D2D kernel, ``sm90_fp8_gemm_1d2d``) ``c`` must be absent and ``d`` bf16; SFB contiguous (or its
  transpose); SFA any fp32 ``[M, cdiv(K, 128)]`` (the library makes it MN-major and TMA-aligned itself).
- Products are formed from the dequantised operands and accumulated in fp32, then rounded to bf16.

The architecture the real library reads from the device is a module setting here (:func:`set_arch_major`).
"""
from __future__ import annotations

import torch

__version__ = "2.x (CPU stand-in)"
FP8 = torch.float8_e4m3fn
_state = {"arch_major": 9, "num_sms": 132}


def _require(cond: bool, what: str) -> None:
    """DeepGEMM's ``DG_HOST_ASSERT``: a ``RuntimeError`` naming the failed condition."""
    if not cond:
        raise RuntimeError(f"DeepGEMM assertion failed: {what}")


def set_arch_major(arch_major: int) -> None:
    """Stand-in only: which GPU generation to behave as (9 = Hopper, 10 = Blackwell)."""
    if arch_major not in (9, 10):
        raise ValueError(f"DeepGEMM supports SM90 and SM100, got arch {arch_major}")
    _state["arch_major"] = arch_major


def get_arch_major() -> int:
    return _state["arch_major"]


def set_num_sms(new_num_sms: int) -> None:
    _require(new_num_sms > 0, "num_sms > 0")
    _state["num_sms"] = new_num_sms


def get_num_sms() -> int:
    return _state["num_sms"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def get_tma_aligned_size(x: int, element_size: int) -> int:
    _require(16 % element_size == 0, "kNumTMAAlignmentBytes % element_size == 0")
    return _ceil_div(x, 16 // element_size) * (16 // element_size)


def get_mn_major_tma_aligned_tensor(sf: torch.Tensor) -> torch.Tensor:
    """The same values, laid out MN-major with the MN stride padded for TMA (``smxx_layout.hpp``)."""
    batched = sf.unsqueeze(0) if sf.dim() == 2 else sf
    g, mn, k = batched.shape
    aligned = get_tma_aligned_size(mn, sf.element_size())
    out = torch.empty_strided((g, mn, k), (aligned * k, 1, aligned), dtype=sf.dtype)
    out.copy_(batched)
    return out.squeeze(0) if sf.dim() == 2 else out


def _ue8m0(sf: torch.Tensor) -> torch.Tensor:
    """What the SM100 kernels see of fp32 scales: the 8 exponent bits (``view(int32) >> 23``)."""
    exponent = (sf.float().contiguous().view(torch.int32) >> 23) & 0xFF
    return torch.exp2(exponent.float() - 127.0)


def _default_recipe(sfa: torch.Tensor, sfb: torch.Tensor) -> tuple[int, int, int]:
    if _state["arch_major"] == 9:
        _require(sfa.dtype == torch.float32 and sfb.dtype == torch.float32, "SM90: sfa and sfb are torch::kFloat")
        return 1, 128, 128
    _require(sfb.dtype in (torch.float32, torch.int32), "SM100: sfb is torch::kFloat or torch::kInt")
    return (1, 128, 128) if sfb.dtype == torch.float32 else (1, 1, 128)


def _check_sf(sf: torch.Tensor, mn: int, k: int, gran_mn: int, gran_k: int, groups: int, name: str) -> None:
    _require(sf.dtype in (torch.float32, torch.int32), f"{name}: scale dtype is torch::kFloat or torch::kInt")
    _require(sf.dim() == 3 and sf.shape[0] == groups, f"{name}: scales are [num_groups, ...], got {tuple(sf.shape)}")
    _require(sf.shape[-2] == _ceil_div(mn, gran_mn),
             f"{name}: sf.size(-2) == ceil_div({mn}, {gran_mn}), got {sf.shape[-2]}")
    per = gran_k * (1 if sf.dtype == torch.float32 else 4)
    _require(sf.shape[-1] == _ceil_div(k, per), f"{name}: sf.size(-1) == ceil_div({k}, {per}), got {sf.shape[-1]}")


def _effective_scales(sf: torch.Tensor, mn: int, k: int, gran_mn: int, gran_k: int, disable_ue8m0_cast: bool,
                      is_sfb: bool) -> torch.Tensor:
    """fp32 ``[G, mn, k]`` scale of every element, as the kernel of this architecture applies it."""
    arch = _state["arch_major"]
    if sf.dtype == torch.int32:
        _require(arch == 10 and gran_mn == 1, "packed UE8M0 scales need SM100 and a 1 x gran_k recipe")
        exps = sf.contiguous().view(torch.uint8).view(*sf.shape[:-1], sf.shape[-1] * 4).float()
        scale = torch.exp2(exps - 127.0)
    elif arch == 10:
        _require(not disable_ue8m0_cast, "not disable_ue8m0_cast (SM100 converts fp32 scales to UE8M0)")
        scale = _ue8m0(sf)
    else:
        if is_sfb:  # SM90 SFB must be contiguous, or contiguous after transposing the last two dims
            _require((sf.stride(-1) == 1 and sf.stride(-2) == sf.shape[-1])
                     or (sf.stride(-1) == sf.shape[-2] and sf.stride(-2) == 1), "SM90 sfb layout")
        scale = sf.float()
    scale = scale.repeat_interleave(gran_mn, dim=-2)[..., :mn, :]
    return scale.repeat_interleave(gran_k, dim=-1)[..., :k]


def _granularities(sfa: torch.Tensor, sfb: torch.Tensor, recipe: tuple[int, int, int] | None,
                   recipe_a: tuple[int, int] | None, recipe_b: tuple[int, int] | None
                   ) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((gran_mn_a, gran_k_a), (gran_mn_b, gran_k_b))`` from ``recipe`` (the scales' default when neither it
    nor the ``recipe_a`` / ``recipe_b`` pair is given) or that pair, with upstream's checks that exactly one of
    the two forms is given."""
    if recipe_a is None and recipe is None:
        recipe = _default_recipe(sfa, sfb)
    _require((recipe_a is None) == (recipe_b is None), "recipe_a.has_value() == recipe_b.has_value()")
    _require((recipe_a is None) != (recipe is None), "recipe_a.has_value() != recipe.has_value()")
    if recipe is not None:
        return (recipe[0], recipe[2]), (recipe[1], recipe[2])
    assert recipe_a is not None and recipe_b is not None
    return recipe_a, recipe_b


def m_grouped_fp8_gemm_nt_masked(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                                 d: torch.Tensor, masked_m: torch.Tensor, expected_m: int,
                                 recipe: tuple[int, int, int] | None = None,
                                 recipe_a: tuple[int, int] | None = None, recipe_b: tuple[int, int] | None = None,
                                 compiled_dims: str = "nk", disable_ue8m0_cast: bool = False) -> None:
    """``d[g, :masked_m[g]] = a[g, :masked_m[g]] @ b[g].T`` with fp8 operands and their scales."""
    (qa, sfa), (qb, sfb) = a, b
    _require(qa.stride(-1) == 1 and qb.stride(-1) == 1, "major_a == Major::K and major_b == Major::K")
    _require(masked_m.is_contiguous(), "masked_m.is_contiguous()")
    _require(qa.dtype == FP8 and qb.dtype == FP8, f"a and b are torch::kFloat8_e4m3fn, got {qa.dtype}, {qb.dtype}")
    _require(qa.dim() == 3 and qb.dim() == 3 and d.dim() == 3, "a, b and d are 3-D")
    g, m, k = qa.shape
    g_, n, k_ = qb.shape
    _require(g == g_ == d.shape[0] == masked_m.numel(), "num_groups agree across a, b, d and masked_m")
    _require(m == d.shape[1] and n == d.shape[2] and k == k_, "m == m_ and n == n_ and k == k_")
    _require(expected_m > 0 and m > 0 and n > 0 and k > 0 and g > 0, "expected_m > 0 and m, n, k, num_groups > 0")
    _require(d.dtype == torch.bfloat16, f"d.scalar_type() == torch::kBFloat16, got {d.dtype}")
    _require(masked_m.dtype == torch.int32, f"masked_m.scalar_type() == torch::kInt, got {masked_m.dtype}")
    _require(d.stride(-1) == 1, "d is row-major (stride(-1) == 1)")
    (mn_a, k_a), (mn_b, k_b) = _granularities(sfa, sfb, recipe, recipe_a, recipe_b)
    _check_sf(sfa, m, k, mn_a, k_a, g, "sfa")
    _check_sf(sfb, n, k, mn_b, k_b, g, "sfb")
    counts = masked_m.tolist()
    _require(all(0 <= c <= m for c in counts), f"0 <= masked_m <= m ({m}), got {counts}")
    scale_a = _effective_scales(sfa, m, k, mn_a, k_a, disable_ue8m0_cast, False)
    scale_b = _effective_scales(sfb, n, k, mn_b, k_b, disable_ue8m0_cast, True)
    for grp, rows in enumerate(counts):
        if rows:
            lhs = qa[grp, :rows].float() * scale_a[grp, :rows]
            rhs = qb[grp].float() * scale_b[grp]
            d[grp, :rows] = (lhs @ rhs.t()).to(torch.bfloat16)


m_grouped_fp8_fp4_gemm_nt_masked = m_grouped_fp8_gemm_nt_masked
fp8_m_grouped_gemm_nt_masked = m_grouped_fp8_gemm_nt_masked


def get_mk_alignment_for_contiguous_layout() -> int:
    """Rows per group in the contiguous layout are padded to a multiple of this (DeepGEMM's M block)."""
    return 128


def m_grouped_fp8_gemm_nt_contiguous(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                                     d: torch.Tensor, grouped_layout: torch.Tensor,
                                     recipe: tuple[int, int, int] | None = None,
                                     recipe_a: tuple[int, int] | None = None, recipe_b: tuple[int, int] | None = None,
                                     compiled_dims: str = "nk", disable_ue8m0_cast: bool = False,
                                     use_psum_layout: bool = False, ensure_zero_padding: bool = True,
                                     expected_m_for_psum_layout: int | None = None) -> None:
    """``d[r] = a[r] @ b[grouped_layout[r]].T`` for each row whose group is ``>= 0``; rows of group ``-1`` (the
    padding that aligns each group to :func:`get_mk_alignment_for_contiguous_layout`) are not computed."""
    (qa, sfa), (qb, sfb) = a, b
    _require(not use_psum_layout, "stand-in: the per-row grouped layout only (use_psum_layout=False)")
    _require(expected_m_for_psum_layout is None, "not expected_m_for_psum_layout.has_value()")
    _require(qa.stride(-1) == 1 and qb.stride(-1) == 1, "major_a == Major::K and major_b == Major::K")
    _require(grouped_layout.is_contiguous(), "grouped_layout.is_contiguous()")
    _require(qa.dtype == FP8 and qb.dtype == FP8, f"a and b are torch::kFloat8_e4m3fn, got {qa.dtype}, {qb.dtype}")
    _require(qa.dim() == 2 and qb.dim() == 3 and d.dim() == 2, "a and d are 2-D, b is 3-D")
    m, k = qa.shape
    g, n, k_ = qb.shape
    _require(m == d.shape[0] and n == d.shape[1] and k == k_, "m == m_ and n == n_ and k == k_")
    _require(n > 0 and k > 0 and g > 0, "n > 0 and k > 0 and num_groups > 0")
    _require(d.dtype == torch.bfloat16, f"d.scalar_type() == torch::kBFloat16, got {d.dtype}")
    _require(grouped_layout.dtype == torch.int32, f"grouped_layout.scalar_type() == torch::kInt, got "
                                                  f"{grouped_layout.dtype}")
    _require(grouped_layout.shape == (m,), f"m == grouped_layout.size(0), got {tuple(grouped_layout.shape)}")
    _require(d.stride(-1) == 1, "d is row-major (stride(-1) == 1)")
    if m == 0:
        return
    (mn_a, k_a), (mn_b, k_b) = _granularities(sfa, sfb, recipe, recipe_a, recipe_b)
    _check_sf(sfa.unsqueeze(0), m, k, mn_a, k_a, 1, "sfa")
    _check_sf(sfb, n, k, mn_b, k_b, g, "sfb")
    groups = grouped_layout.tolist()
    _require(all(-1 <= x < g for x in groups), f"-1 <= grouped_layout < num_groups ({g})")
    scale_a = _effective_scales(sfa.unsqueeze(0), m, k, mn_a, k_a, disable_ue8m0_cast, False)[0]
    scale_b = _effective_scales(sfb, n, k, mn_b, k_b, disable_ue8m0_cast, True)
    lhs = qa.float() * scale_a
    for grp in range(g):
        rows = torch.nonzero(grouped_layout == grp).flatten()
        if rows.numel():
            d[rows] = (lhs[rows] @ (qb[grp].float() * scale_b[grp]).t()).to(torch.bfloat16)


m_grouped_fp8_fp4_gemm_nt_contiguous = m_grouped_fp8_gemm_nt_contiguous


def fp8_fp4_gemm_nt(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor], d: torch.Tensor,
                    c: torch.Tensor | None = None, recipe: tuple[int, int, int] | None = None,
                    recipe_a: tuple[int, int] | None = None, recipe_b: tuple[int, int] | None = None,
                    compiled_dims: str = "nk", disable_ue8m0_cast: bool = False) -> None:
    """``d = a @ b.T`` (``+ c``) with fp8 operands and their scales (``csrc/apis/gemm.hpp``: ``fp8_fp4_gemm_nt``)."""
    (qa, sfa), (qb, sfb) = a, b
    for t, name in ((qa, "a"), (qb, "b"), (d, "d")):
        _require(t.dim() == 2, f"{name} is 2-D [mn, k] (get_shape<2>), got {tuple(t.shape)}")
        _require(t.stride(-2) == 1 or t.stride(-1) == 1, f"{name}: t.stride(-2) == 1 or t.stride(-1) == 1")
    if _state["arch_major"] == 9:  # fp8_requires_k_major
        _require(qa.stride(-1) == 1 and qb.stride(-1) == 1, "major_a == Major::K and major_b == Major::K")
    _require(d.stride(-1) == 1, "d is row-major (stride(-1) == 1)")
    _require(qa.dtype == FP8 and qb.dtype == FP8, f"a and b are torch::kFloat8_e4m3fn, got {qa.dtype}, {qb.dtype}")
    m, k = qa.shape
    n, k_ = qb.shape
    _require(m == d.shape[0] and n == d.shape[1] and k == k_, "m == m_ and n == n_ and k == k_")
    _require(d.dtype in (torch.bfloat16, torch.float32), f"d is torch::kBFloat16 or torch::kFloat, got {d.dtype}")
    if c is not None:
        _require(c.dtype == d.dtype and c.stride(-1) == 1, "c is row-major with d's dtype")
    if m == 0 or n == 0:  # early_return
        return
    (mn_a, k_a), (mn_b, k_b) = _granularities(sfa, sfb, recipe, recipe_a, recipe_b)
    _check_sf(sfa.unsqueeze(0), m, k, mn_a, k_a, 1, "sfa")
    _check_sf(sfb.unsqueeze(0), n, k, mn_b, k_b, 1, "sfb")
    if _state["arch_major"] == 9 and sfa.dtype == torch.float32 and mn_b != 1:  # sm90_fp8_gemm_1d2d
        _require(c is None and d.dtype == torch.bfloat16, "not c.has_value() and d.scalar_type() == torch::kBFloat16")
    scale_a = _effective_scales(sfa.unsqueeze(0), m, k, mn_a, k_a, disable_ue8m0_cast, False)[0]
    scale_b = _effective_scales(sfb.unsqueeze(0), n, k, mn_b, k_b, disable_ue8m0_cast, True)[0]
    acc = (qa.float() * scale_a) @ (qb.float() * scale_b).t()
    if c is not None:
        acc = acc + c.float()
    d.copy_(acc.to(d.dtype))


fp8_gemm_nt = fp8_fp4_gemm_nt
