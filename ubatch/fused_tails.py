"""The ``fused_tails`` setting: whether a decoder step's pointwise tails run as fused Triton kernels.

The tails are the residual add with its RMSNorm, q/k RMSNorm with RoPE (``runner/models/kernels/``), the
router's scoring with top-k (:mod:`ubatch.modular_moe.fused_router`) and the sampler's draw
(``runner/worker/fused_draw.py``). ``auto`` fuses them where the model runs on
CUDA and Triton imports, ``on`` insists (an error elsewhere), ``off`` keeps the torch ops, which match Hugging
Face op for op. The choice is made once per rank, from the device, never per call.
"""
from __future__ import annotations

import torch

FUSED_TAILS_CHOICES: tuple[str, ...] = ("auto", "on", "off")


def triton_importable() -> bool:
    """Whether the ``triton`` package imports here (it is an optional extra)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_fused_tails(setting: str, device: torch.device | str) -> bool:
    """``True`` where the fused kernels run for ``setting`` on ``device``; a bad value or ``on`` where they
    cannot run is a ``ValueError`` naming the setting."""
    if setting not in FUSED_TAILS_CHOICES:
        raise ValueError(f"fused_tails must be one of {', '.join(FUSED_TAILS_CHOICES)}; got {setting!r}")
    if setting == "off":
        return False
    runnable = torch.device(device).type == "cuda" and triton_importable()
    if setting == "on" and not runnable:
        why = "Triton does not import" if torch.device(device).type == "cuda" else f"the model runs on {device}"
        raise ValueError(f"fused_tails='on' needs a CUDA device and the Triton package, but {why}; "
                         "use fused_tails='auto' or 'off'")
    return runnable
