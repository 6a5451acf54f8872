"""Decode attention of every engine backend as zero-argument callables, for ``bench_gpu.py``.

Each callable runs the same decode a layer runs (``AttentionBackend.decode``) over an MHA cache
``[NB, BS, 2, Hkv, D]``, so the benchmark times what the engine calls, eagerly or captured in a graph:

- ``torch``: the plain-torch eager decode (gathers every request's keys up to the longest request);
- ``torch (graph shapes)``: the same with the block table's width as the bound, the fixed-shape form a CUDA
  graph of the torch backend captures (memory grows with requests x max_model_len);
- ``triton``: the split-KV paged decode kernel (what ``auto`` picks on CUDA, eager and in graphs).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from runner.attention.cache_layout import mha_cache_views
from runner.attention.torch_backend import TorchAttentionBackend
from runner.attention.triton_backend import TritonAttentionBackend


def decode_attention_backends(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                              seq_lens: torch.Tensor, scale: float) -> dict[str, Callable[[], torch.Tensor]]:
    """``q [R, Hq, D]``, ``block_table`` int32 ``[R, max_blocks]``, ``seq_lens`` int32 ``[R]``."""
    k_cache, v_cache = mha_cache_views(kv_cache)
    longest = int(seq_lens.max())  # read once here, as the step metadata holds it on the host
    torch_backend = TorchAttentionBackend()
    triton_backend = TritonAttentionBackend()
    return {
        "torch": lambda: torch_backend.decode(q, k_cache, v_cache, block_table, seq_lens, longest, scale),
        "torch (graph shapes)": lambda: torch_backend.decode(q, k_cache, v_cache, block_table, seq_lens, None,
                                                             scale),
        "triton": lambda: triton_backend.decode(q, k_cache, v_cache, block_table, seq_lens, longest, scale),
    }
