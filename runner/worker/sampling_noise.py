"""Counter-based sampling noise: each draw's uniform is a pure function of (seed, output index).

A request's draws must not depend on its batch, DP rank or DBO, and a step is sampled in one pass with no
per-request generator, so the uniform is computed: SplitMix64's finaliser over the seed, XORed with the output
index and applied again, top 24 bits (exact in float32); the token is picked by inverse CDF, one uniform per row
rather than one per vocabulary entry (Gumbel-max). :func:`row_uniform` is the definition in exact integers,
:func:`row_uniforms` the same in numpy ``uint64`` for a whole step.
"""
from __future__ import annotations

import numpy as np
import torch

from runner.worker.sampling_ops import finite

MASK64 = 0xFFFF_FFFF_FFFF_FFFF


# What a row with no valid distribution samples (non-finite logits): never a token id, so the scheduler ends that
# request with finish_reason "error" instead of emitting a token.
INVALID_TOKEN = -1

def splitmix64(x: int) -> int:
    """SplitMix64's step and finaliser: the generator's next output from state ``x`` (any Python int, mod 2**64)."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def row_uniform(seed: int, output_index: int) -> float:
    """The uniform in ``[0, 1 - 2**-24]`` of the draw for the ``output_index``-th output (0 = the first generated
    token) of a request seeded with ``seed`` (any Python int; taken modulo 2**64)."""
    h = splitmix64(splitmix64(seed & MASK64) ^ (output_index & MASK64))
    return (h >> 40) * 2.0 ** -24


def seed_hash(seed: int) -> int:
    """The first half of :func:`row_uniform`, fixed for a request's life: ``splitmix64(seed mod 2**64)``."""
    return splitmix64(seed & MASK64)


_U = np.uint64


def splitmix64_array(x: np.ndarray) -> np.ndarray:
    """:func:`splitmix64` of every element of a ``uint64`` array (numpy's unsigned arithmetic wraps modulo 2**64)."""
    x = x + _U(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U(30))) * _U(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U(27))) * _U(0x94D049BB133111EB)
    return x ^ (x >> _U(31))


def row_uniforms(seed_hashes: np.ndarray, output_index: np.ndarray) -> np.ndarray:
    """``row_uniform(seed_i, output_index[i])`` for every row at once, from the rows' :func:`seed_hash` es
    (``uint64``) and output indices (any integer dtype; taken modulo 2**64), as float64 (exact in float32)."""
    h = splitmix64_array(seed_hashes ^ output_index.astype(np.uint64))
    return (h >> _U(40)).astype(np.float64) * 2.0 ** -24


def draw_by_inverse_cdf_(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Row ``r`` draws token ``t`` with probability ``softmax(logits[r])[t]``, the ``t`` whose CDF interval holds
    ``uniforms[r]`` (vocabulary order: the draw is exact in any order, so nothing is sorted). ``logits`` (float32,
    ``-inf`` for removed tokens) is overwritten with the unnormalised CDF.

    The target ``u * total`` is kept strictly below the row's total, so the first CDF entry above it is a step of
    the CDF, i.e. a token of positive probability, never a removed one (nor past the end).

    A row whose largest logit is not finite (NaN, +inf, or every token removed) has no distribution: it draws
    ``INVALID_TOKEN``, which the engine turns into an error for that request alone."""
    peak = logits.amax(dim=-1, keepdim=True)
    cdf = logits.sub_(peak).exp_().cumsum_(dim=-1)
    total = cdf[:, -1]
    target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    drawn = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    return torch.where(finite(peak.squeeze(1)), drawn, INVALID_TOKEN)
