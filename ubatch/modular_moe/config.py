"""How one MoE layer is spread over expert-parallel ranks, and which backends move and compute its tokens."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ubatch.sbo import SBO_OFF, DeviceProps, SboFlags, select_sbo_modes


@dataclass
class MoEParallelConfig:
    """Per-rank expert-parallel settings shared by every FusedMoE layer of a model: settings only.

    ``ep_groups`` holds one process group per ubatch slot (index = ``dbo_current_ubatch_id()``): the two
    ubatches issue collectives in different interleavings, so each needs its own group to keep collective
    order identical on every rank. Slot 0 is also used outside DBO. The groups are the caller's (they name
    the EP world); what is *built* from these settings at run time -- backend instances, the emulated
    link -- lives in :class:`ubatch.modular_moe.runtime.MoERuntime`, never here.

    ``sbo``: the single-batch-overlap modes every layer's kernel uses (``ubatch.sbo.enable_sbo`` picks them
    for ``--enable-single-batch-overlap``).
    """

    ep_rank: int = 0
    ep_size: int = 1
    all2all_backend: str = "none"
    experts_backend: str = "torch"
    ep_groups: Sequence[Any] | None = None
    max_dispatch_tokens_per_rank: int = 256
    emulate_link: str | None = None
    sbo: SboFlags = SBO_OFF

    def __post_init__(self) -> None:
        if self.ep_size < 1 or not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"bad expert-parallel rank {self.ep_rank} for ep_size {self.ep_size}")
        if self.max_dispatch_tokens_per_rank < 1:
            raise ValueError(f"max_dispatch_tokens_per_rank must be >= 1, got {self.max_dispatch_tokens_per_rank}")
        if not isinstance(self.sbo, SboFlags):
            raise TypeError(f"MoEParallelConfig.sbo must be an SboFlags, got {type(self.sbo).__name__}")

    def local_expert_range(self, num_experts: int) -> range:
        """Experts are assigned in contiguous blocks: rank r owns ``[r*E/R, (r+1)*E/R)``."""
        if num_experts % self.ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={self.ep_size}")
        per_rank = num_experts // self.ep_size
        return range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)


def enable_sbo(parallel: MoEParallelConfig, flags: SboFlags | None = None,
               device: torch.device | str | None = None) -> SboFlags:
    """Turn SBO on for every layer built from ``parallel`` (sets ``parallel.sbo``); returns the flags.

    ``flags=None`` is ``--enable-single-batch-overlap``: the modes are chosen by
    :func:`ubatch.sbo.select_sbo_modes` for ``parallel``'s backends on ``device`` (default: the accelerator,
    else CPU). Pass ``SboFlags(...)`` to force modes (e.g. the two-stream ones on CPU, where their streams
    are CPU stand-ins).
    """
    if flags is None:
        flags = select_sbo_modes(True, all2all_backend=parallel.all2all_backend,
                                 experts_backend=parallel.experts_backend, device=DeviceProps.of(device),
                                 emulate_link=parallel.emulate_link is not None)
    if not isinstance(flags, SboFlags):
        raise TypeError(f"SBO flags must be an SboFlags, got {type(flags).__name__}")
    parallel.sbo = flags
    return flags
