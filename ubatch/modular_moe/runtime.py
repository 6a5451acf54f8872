"""MoERuntime: what every MoE layer of one rank shares while it runs -- the all-to-all backends and the link.

A backend instance is expensive (DeepEP buffers are registered memory) and meant to be shared by the
layers, and the emulated link models one wire per rank that every layer and ubatch contends for. Both
are built lazily, on first use, because the backends need the EP process groups, which exist only once
the ranks are up. They are kept here, in an object the model owns and hands to each of its layers,
rather than cached inside the settings object (``MoEParallelConfig``), so a config stays plain data that
can be copied, compared and pickled.

With the phase-aware backend (``all2all_backend="auto"``) the runtime holds both layouts and
:meth:`MoERuntime.backend_for_step` picks one per step from what the DP vote agreed
(``DPMetadata.any_prefill``), so every rank uses the same one and the collectives pair up.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from ubatch.forward_context import maybe_get_forward_context
from ubatch.modular_moe.config import MoEParallelConfig
from ubatch.modular_moe.prepare_finalize import (
    EmulatedLink,
    LinkSpec,
    PrepareFinalize,
    make_prepare_finalize,
    parse_link,
    phase_backends,
)


class MoERuntime:
    """One rank's shared MoE run-time objects, built from ``parallel`` on first use."""

    def __init__(self, parallel: MoEParallelConfig | None = None, deep_ep_module: Any = None) -> None:
        """``deep_ep_module``: a module with DeepEP's API for the DeepEP backends instead of the real package
        (the tests' CPU stand-in); kept here, not in the config, because a module is not settings data."""
        self.parallel = parallel if parallel is not None else MoEParallelConfig()
        self.deep_ep_module = deep_ep_module
        self._link: EmulatedLink | None = None
        self._backends: dict[tuple[str, int, int], PrepareFinalize] = {}

    @functools.cached_property
    def _phase_pair(self) -> tuple[str, str] | None:
        """``(prefill, decode)`` for a phase-aware backend (``auto`` resolved once: neither the setting nor
        ``deep_ep_module`` changes after construction), else ``None``."""
        return phase_backends(self.parallel.all2all_backend, self.deep_ep_module)

    @property
    def default_backend(self) -> str:
        """The configured backend; for a phase-aware one, its decode (low-latency) backend."""
        pair = self._phase_pair
        return pair[1] if pair is not None else self.parallel.all2all_backend

    def backend_for_step(self) -> str:
        """This step's backend: the configured one, or for ``auto`` the layout the DP vote's phase asks for.

        Without DP metadata (a CUDA-graph capture, which only captures decode steps, or a caller outside
        the engine) ``auto`` means the low-latency layout.
        """
        pair = self._phase_pair
        if pair is None:
            return self.parallel.all2all_backend
        fc = maybe_get_forward_context()
        prefill = fc is not None and fc.dp_metadata is not None and fc.dp_metadata.any_prefill
        return pair[0] if prefill else pair[1]

    def link(self, device: torch.device | str | None = None) -> EmulatedLink | None:
        """The rank's one link model (``None`` without ``emulate_link``), shared by every layer and ubatch."""
        spec = parse_link(self.parallel.emulate_link)
        if spec is None:
            return None
        if self._link is None:
            self._link = EmulatedLink(spec, device)
        return self._link

    def link_times(self) -> tuple[float, float] | None:
        """(modelled all-to-all seconds in flight, seconds of it a ubatch waited for) so far, from the emulated
        link on the CPU; None without one or on a GPU (its waits happen on the device)."""
        link = self._link
        if link is None or link._side_stream is not None:
            return None
        return link.in_flight_s, link.exposed_s

    def wire_bytes(self) -> int:
        """Bytes every backend of this rank has handed to its real collectives so far (both directions)."""
        return sum(pf.wire.total() for pf in self._backends.values())

    def set_link(self, spec: LinkSpec | str) -> None:
        """Retune the modelled wire between runs (a benchmark calibrating comm/compute); the model must have
        been built with ``emulate_link`` so that its backends carry the link."""
        link = self.link()
        if link is None:
            raise ValueError("this model has no emulated link to retune: build it with emulate_link set")
        new = parse_link(spec)
        assert new is not None
        link.spec = new

    def prepare_finalize(self, num_experts: int, hidden_size: int, device: Any = None,
                         backend: str | None = None) -> PrepareFinalize:
        """The ``backend`` (default: :attr:`default_backend`) for layers of this shape: one instance per
        (backend, shape), shared by the layers."""
        name = backend or self.default_backend
        key = (name, num_experts, hidden_size)
        if key not in self._backends:
            p = self.parallel
            self._backends[key] = make_prepare_finalize(
                name, num_experts=num_experts, hidden_size=hidden_size, ep_rank=p.ep_rank,
                ep_size=p.ep_size, groups=p.ep_groups, max_dispatch_tokens_per_rank=p.max_dispatch_tokens_per_rank,
                link=self.link(device), deep_ep_module=self.deep_ep_module)
        return self._backends[key]
