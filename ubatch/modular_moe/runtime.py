"""MoERuntime: what every MoE layer of one rank shares while it runs -- the all-to-all backends and the link.

A backend instance is expensive (DeepEP buffers are registered memory) and meant to be shared by the
layers, and the emulated link models one wire per rank that every layer and ubatch contends for. Both
are built lazily, on first use, because the backends need the EP process groups, which exist only once
the ranks are up. They are kept here, in an object the model owns and hands to each of its layers,
rather than cached inside the settings object (``MoEParallelConfig``), so a config stays plain data that
can be copied, compared and pickled.
"""
from __future__ import annotations

from typing import Any

import torch

from ubatch.modular_moe.config import MoEParallelConfig
from ubatch.modular_moe.prepare_finalize import EmulatedLink, PrepareFinalize, make_prepare_finalize, parse_link


class MoERuntime:
    """One rank's shared MoE run-time objects, built from ``parallel`` on first use."""

    def __init__(self, parallel: MoEParallelConfig | None = None) -> None:
        self.parallel = parallel if parallel is not None else MoEParallelConfig()
        self._link: EmulatedLink | None = None
        self._backends: dict[tuple[int, int], PrepareFinalize] = {}

    def link(self, device: torch.device | str | None = None) -> EmulatedLink | None:
        """The rank's one link model (``None`` without ``emulate_link``), shared by every layer and ubatch."""
        spec = parse_link(self.parallel.emulate_link)
        if spec is None:
            return None
        if self._link is None:
            self._link = EmulatedLink(spec, device)
        return self._link

    def prepare_finalize(self, num_experts: int, hidden_size: int, device: Any = None) -> PrepareFinalize:
        """The backend for layers of this shape (one instance per shape, shared)."""
        key = (num_experts, hidden_size)
        if key not in self._backends:
            p = self.parallel
            self._backends[key] = make_prepare_finalize(
                p.all2all_backend, num_experts=num_experts, hidden_size=hidden_size, ep_rank=p.ep_rank,
                ep_size=p.ep_size, groups=p.ep_groups, max_dispatch_tokens_per_rank=p.max_dispatch_tokens_per_rank,
                link=self.link(device))
        return self._backends[key]
