"""``--load-format dummy`` (vLLM's): random weights for a model described by its ``config.json`` alone.

For benchmarks of checkpoints that are not on the machine (a Qwen3-30B-A3B-shaped model is 61 GB in bf16): every
tensor the checkpoint would hold is drawn on the model's device, in its dtype, uniform in [-1e-3, 1e-3] (vLLM's
``initialize_dummy_weights``: small enough that no layer overflows), and loaded through the same path as a
checkpoint's (names, shapes, fused experts, online FP8 quantisation). Each tensor has its own generator, seeded
from the engine's seed and the tensor's name, so its values do not depend on the order of loading or on which
rank loads it: an expert drawn on an expert-parallel rank equals the same expert of a single-rank run.
"""
from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch

from runner.models.base import MoECausalLM

LOW, HIGH = -1e-3, 1e-3


def dummy_weights(model: MoECausalLM, dtype: torch.dtype, device: torch.device | str,
                  seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, random tensor) for every tensor of the model's checkpoint that this rank keeps."""
    gen = torch.Generator(device=device)
    for name, shape in model.weight_spec().all_names():
        if not model.wants_weight(name):
            continue
        gen.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))  # 32 bits: all the CPU's generator keeps
        yield name, torch.empty(shape, dtype=dtype, device=device).uniform_(LOW, HIGH, generator=gen)
