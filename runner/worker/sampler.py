"""Sampling parameters and the sampler: greedy, or temperature + top-p with a per-request generator.

Reproducibility is the design constraint: DBO on vs off, DP layouts and batch composition must not change a
request's tokens. So each random request draws from its *own* CPU ``torch.Generator`` (one uniform per
sampled token) and picks its token by inverse-CDF over its own stable-sorted probabilities; nothing depends
on other rows, on the device's RNG, or on how many requests share the batch. Greedy is a plain argmax.
"""
from __future__ import annotations

from typing import Sequence

import torch

from runner.sampling_params import SamplingParams

def make_generator(params: SamplingParams, default_seed: int) -> torch.Generator | None:
    """The request's private RNG: ``params.seed`` if set, else ``default_seed`` (the engine derives it from the
    run seed and the request's input index, so unseeded runs are reproducible too). Greedy needs none."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else default_seed
    return torch.Generator(device="cpu").manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)


def _sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    if params.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass *before* it is < top_p
        # (so the first token always stays).
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
    cdf = torch.cumsum(sorted_probs, dim=-1)
    u = torch.rand((), generator=generator).item() if generator is not None else torch.rand(()).item()
    target = torch.tensor([u], dtype=cdf.dtype, device=cdf.device) * cdf[-1]
    idx = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[0] - 1)
    # A zero-probability token past the kept prefix can only be hit through rounding: step back onto the prefix.
    kept = int((sorted_probs > 0).sum().item())
    return int(order[min(int(idx.item()), max(kept - 1, 0))].item())


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits`` ``[num_rows, vocab]``; row ``i`` uses ``params[i]`` and ``generators[i]``.

    Greedy rows are argmaxed together; each random row samples on its own so its result depends only on its
    logits and its generator.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [num_rows, vocab], got shape {tuple(logits.shape)}")
    n = logits.shape[0]
    if len(params) != n or len(generators) != n:
        raise ValueError(f"got {n} logit rows but {len(params)} sampling params and {len(generators)} generators")
    if n == 0:
        return []
    out: list[int] = [0] * n
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        ids = torch.argmax(logits[greedy], dim=-1).tolist()
        for i, t in zip(greedy, ids):
            out[i] = int(t)
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = _sample_row(logits[i], p, generators[i])
    return out
