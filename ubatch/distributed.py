"""Process groups for expert parallelism: one group per ubatch, under torchrun (threads: ``ubatch.testing``).

Each ubatch gets its own group because two ubatches interleave their collectives differently on
different ranks; sharing one group would let rank 0's ubatch-1 dispatch pair with rank 1's ubatch-0 one.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist


def new_ep_groups(num_groups: int, backend: str | None = None, timeout_s: float | None = None) -> list[Any]:
    """Under an initialised default group (torchrun / init_process_group): ``num_groups`` groups of all ranks."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call init_process_group first (or use torchrun)")
    kwargs: dict[str, Any] = {}
    if timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=timeout_s)
    return [dist.new_group(backend=backend, **kwargs) for _ in range(num_groups)]
