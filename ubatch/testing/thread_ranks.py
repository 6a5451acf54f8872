"""Expert-parallel ranks as threads of one process, each with its own gloo groups, for tests and examples.

The threads share a ``HashStore``, so a world of ranks runs on one CPU machine without torchrun; the product
builds its groups under torchrun instead (:func:`ubatch.distributed.new_ep_groups`).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def thread_gloo_groups(store: Any, rank: int, world_size: int, num_groups: int,
                       timeout_s: float = 60.0) -> list[Any]:
    """Gloo groups for one rank that runs as a thread; ``store`` is a HashStore shared by the rank threads."""
    groups = []
    for g in range(num_groups):
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, absent from torch's stubs
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        opts._timeout = timedelta(seconds=timeout_s)
        groups.append(dist.ProcessGroupGloo(dist.PrefixStore(f"ep{g}/", store), rank, world_size, opts))
    return groups


def run_thread_ranks(world_size: int, fn: Callable[[int, list[Any]], Any], num_groups: int = 2,
                     timeout_s: float = 120.0, num_threads: int = 1) -> list[Any]:
    """Run ``fn(rank, groups)`` on ``world_size`` threads, each a rank with ``num_groups`` gloo groups.

    Returns results in rank order; the first exception of any rank is re-raised in the caller, and a rank
    that does not finish within ``timeout_s`` is reported by number.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    store = dist.HashStore()
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def body(rank: int) -> None:
        torch.set_num_threads(num_threads)
        try:
            results[rank] = fn(rank, thread_gloo_groups(store, rank, world_size, num_groups, timeout_s))
        except BaseException as exc:  # noqa: BLE001 - surfaced in the caller below
            errors[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), name=f"rank-{r}", daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    for err in errors:
        if err is not None:
            raise err
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    if stuck:
        raise TimeoutError(f"ranks {stuck} did not finish within {timeout_s:.0f}s")
    return results
