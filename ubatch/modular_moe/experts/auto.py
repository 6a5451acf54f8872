"""``--experts-backend auto`` where a layer's shape is known: a per-bucket choice from a table, else the device rule.

On a CUDA device with a backend-choice table for the layer's (local experts ``E``, intermediate ``N``, hidden
``K``, GPU, dtype[, FP8 block]) the layer gets a :class:`~.bucketed_experts.BucketedExperts` over the table's
backends; without one, :func:`~ubatch.modular_moe.experts.resolve_experts_backend`'s answer. Never a table on
the CPU (``auto`` stays ``torch`` there). Which happened is logged once per shape on ``ubatch.experts``.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from ubatch.log_once import log_once
from ubatch.modular_moe.experts import AUTO, make_experts, resolve_experts_backend
from ubatch.modular_moe.experts.backend_choice import find_choice_table
from ubatch.modular_moe.experts.base import MoEExperts
from ubatch.modular_moe.experts.bucketed_experts import BucketedExperts
from ubatch.modular_moe.experts.triton_configs import config_dtype, device_table_name

__all__ = ["experts_for_layer"]

logger = logging.getLogger("ubatch.experts")


def experts_for_layer(name: str, device: torch.device, num_experts: int, inter: int, hidden: int,
                      dtype: torch.dtype, fp8_block: tuple[int, int] | None,
                      config_dir: Path | None = None) -> MoEExperts:
    """The experts backend ``name`` builds for a layer of this shape on ``device``: ``dtype`` is the weights'
    (FP8 ones are keyed by ``fp8_block``, their ``w13`` block shape, as the Triton tables are)."""
    if name != AUTO or device.type != "cuda":
        return make_experts(resolve_experts_backend(name, device))
    device_name = device_table_name(device)
    table_dtype = config_dtype(str(dtype).removeprefix("torch."), fp8_block)
    table, how = find_choice_table(config_dir, num_experts, inter, hidden, device_name, table_dtype, fp8_block)
    shape = (f"experts backend auto (E={num_experts}, N={inter}, K={hidden}, "
             f"{table_dtype or str(dtype).removeprefix('torch.')}, {device_name})")
    if table is None:
        fallback = resolve_experts_backend(name, device)
        log_once(logger, logging.INFO, f"{shape}: {how}; using {fallback} (the device rule)")
        return make_experts(fallback)
    picks = ", ".join(f"{b} at {table.buckets_of(b)} tokens" for b in table.backends)
    log_once(logger, logging.INFO, f"{shape}: {how}; per token-count bucket: {picks}")
    return BucketedExperts.from_table(table)
