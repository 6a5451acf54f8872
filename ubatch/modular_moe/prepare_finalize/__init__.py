"""All-to-all backends by ``--all2all-backend`` name.

Phase-aware names (SGLang's ``--deepep-mode auto``) pick a backend per step: the high-throughput layout for
steps where any DP rank runs a prefill or mixed batch, the low-latency one for pure decode steps.
``auto_torch`` and ``auto_deepep_v1`` name their pair outright. ``auto`` (the DP+EP default) is DeepEP V2
(``deepep_v2`` for both phases: V2 has one class for both) where ``deep_ep`` with ``ElasticBuffer`` imports
and CUDA is available, and the torch pair otherwise; the choice and its reason are logged once per process.
It never falls back to DeepEP V1: ask for ``auto_deepep_v1`` or a ``deepep_*`` name, which are errors when
DeepEP is missing, as ``deepep_v2`` is. Every rank must resolve ``auto`` alike (the same install on every
node), or their all-to-alls would not pair up.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ubatch.log_once import log_once
from ubatch.modular_moe.prepare_finalize.base import PrepareFinalize
from ubatch.modular_moe.prepare_finalize.emulated_link import EmulatedLink, LinkSpec, parse_link

ALL2ALL_BACKENDS = ("none", "torch_ll", "torch_ht", "deepep_low_latency", "deepep_high_throughput", "deepep_v2")
AUTO_BACKEND = "auto"
PHASE_AWARE_BACKENDS = {  # name -> (prefill backend, decode backend); ``auto`` is resolved by phase_backends
    "auto_torch": ("torch_ht", "torch_ll"),
    "auto_deepep_v1": ("deepep_high_throughput", "deepep_low_latency"),
}
AUTO_DEEPEP_V2 = ("deepep_v2", "deepep_v2")
ALL2ALL_CHOICES = (*ALL2ALL_BACKENDS, AUTO_BACKEND, *PHASE_AWARE_BACKENDS)
_logger = logging.getLogger(__name__)


def phase_backends(name: str, deep_ep_module: Any = None) -> tuple[str, str] | None:
    """``(prefill, decode)`` backends for a phase-aware ``name``; ``None`` for a single backend.

    ``auto``: DeepEP V2 when ``deep_ep_module`` (the tests' stand-in) has ``ElasticBuffer``, or, without one,
    when the real ``deep_ep`` V2 imports and CUDA is available; the torch pair otherwise.
    """
    if name != AUTO_BACKEND:
        return PHASE_AWARE_BACKENDS.get(name)
    if deep_ep_module is not None:
        has_v2 = hasattr(deep_ep_module, "ElasticBuffer")
        why = f"the deep_ep module given ({getattr(deep_ep_module, '__name__', '?')}) " + \
            ("has ElasticBuffer" if has_v2 else "has no ElasticBuffer")
    else:
        from ubatch.modular_moe.prepare_finalize.deepep_v2 import deep_ep_v2_status
        has_v2, why = deep_ep_v2_status()
    pair = AUTO_DEEPEP_V2 if has_v2 else PHASE_AWARE_BACKENDS["auto_torch"]
    log_once(_logger, logging.INFO, f"--all2all-backend auto: prefill {pair[0]}, decode {pair[1]} ({why})"
             + ("" if has_v2 else "; ask for deepep_v2 to make a missing DeepEP V2 an error"))
    return pair


def make_prepare_finalize(name: str, *, num_experts: int, hidden_size: int, ep_rank: int = 0, ep_size: int = 1,
                          groups: Sequence[Any] | None = None, max_dispatch_tokens_per_rank: int = 256,
                          link: EmulatedLink | None = None, deep_ep_module: Any = None) -> PrepareFinalize:
    """``deep_ep_module``: a module with DeepEP's API to use instead of importing ``deep_ep`` (the tests'
    CPU stand-in); only the DeepEP backends take it."""
    if name not in ALL2ALL_BACKENDS:
        raise ValueError(f"unknown all2all backend {name!r}; choose one of {', '.join(ALL2ALL_BACKENDS)}")
    if name == "none":
        from ubatch.modular_moe.prepare_finalize.none import NoAllToAll
        return NoAllToAll(num_experts, ep_rank, ep_size, link)
    if not groups:
        raise ValueError(f"all2all backend {name!r} needs expert-parallel process groups (one per ubatch)")
    if name == "torch_ll":
        from ubatch.modular_moe.prepare_finalize.torch_ll import TorchLowLatency
        return TorchLowLatency(num_experts, ep_rank, ep_size, groups, max_dispatch_tokens_per_rank, link)
    if name == "torch_ht":
        from ubatch.modular_moe.prepare_finalize.torch_ht import TorchHighThroughput
        return TorchHighThroughput(num_experts, ep_rank, ep_size, groups, link)
    if name == "deepep_v2":
        from ubatch.modular_moe.prepare_finalize.deepep_v2 import DeepEPV2
        return DeepEPV2(num_experts, ep_rank, ep_size, groups, hidden_size, max_dispatch_tokens_per_rank, link,
                        deep_ep_module=deep_ep_module)
    from ubatch.modular_moe.prepare_finalize import deepep
    if name == "deepep_low_latency":
        return deepep.DeepEPLowLatency(num_experts, ep_rank, ep_size, groups, hidden_size,
                                       max_dispatch_tokens_per_rank, link, deep_ep_module=deep_ep_module)
    return deepep.DeepEPHighThroughput(num_experts, ep_rank, ep_size, groups, hidden_size, link,
                                       deep_ep_module=deep_ep_module)


__all__ = ["ALL2ALL_BACKENDS", "ALL2ALL_CHOICES", "AUTO_BACKEND", "PHASE_AWARE_BACKENDS", "phase_backends",
           "EmulatedLink", "LinkSpec", "PrepareFinalize", "make_prepare_finalize", "parse_link"]
