"""FULL CUDA graphs for uniform-decode steps, with and without DBO.

A decode step is captured once per batch size (vLLM's FULL cudagraph mode); a DBO step is captured by
running its ubatches inside the capture, so a replay needs no threads. :class:`GraphRunner` captures and
replays; the engine builds one through ``runner.worker.cuda_graphs``. This package depends on ``ubatch`` only,
never on the engine. GPU-free, table-tested pieces: :mod:`cudagraph.sizes` (ladder, ``--cuda-graph-sizes``
parsing, padding) and :mod:`cudagraph.dispatch` (batch descriptors and the replay rules). Only ``sizes`` is
imported eagerly, so a CLI can parse ``--cuda-graph-sizes`` without importing torch.
"""
from __future__ import annotations

from typing import Any

from cudagraph.sizes import default_capture_sizes, pad_to_capture_size, parse_cuda_graph_sizes, resolve_capture_sizes

_LAZY = {
    "cudagraph.dispatch": ("BatchKind", "CaptureRuleError", "Dispatch", "GraphKey", "Why", "capture_blocker",
                           "check_deepep_ll_rules", "check_replay", "classify_batch", "plan_captures",
                           "select_graph", "token_split"),
    "cudagraph.manager": ("GraphRunner", "MetadataBuffers"),
    "cudagraph.backends": ("CudaGraphBackend", "EagerReplayBackend"),
}

__all__ = ["default_capture_sizes", "pad_to_capture_size", "parse_cuda_graph_sizes", "resolve_capture_sizes",
           *(name for names in _LAZY.values() for name in names)]


def __getattr__(name: str) -> Any:
    import importlib

    for module, names in _LAZY.items():
        if name in names:
            return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'cudagraph' has no attribute {name!r}")
