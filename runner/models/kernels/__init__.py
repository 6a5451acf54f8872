"""Triton kernels of the model layers (the ``fused_tails`` setting): residual add + RMSNorm, q/k RMSNorm + RoPE.

Each module imports Triton only on first use, so the package imports without it.
"""
