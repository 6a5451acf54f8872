"""The counter-based noise: SplitMix64 as published, per-draw uniforms that are uniform and independent across
output indices and seeds, and the inverse-CDF draw (exact on a known distribution, never a removed token)."""
from __future__ import annotations

import math

import numpy as np
import torch

from runner.worker.sampling_noise import (
    INVALID_TOKEN,
    MASK64,
    draw_by_inverse_cdf_,
    row_uniform,
    row_uniforms,
    seed_hash,
    splitmix64,
)


def test_splitmix64_matches_its_published_outputs() -> None:
    """SplitMix64 seeded with 0 (java.util.SplittableRandom's algorithm, Vigna's splitmix64.c): its first three
    outputs, each the finaliser of the state advanced once more."""
    assert [splitmix64(k * 0x9E3779B97F4A7C15) for k in range(3)] == [
        0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_vectorised_uniforms_equal_the_python_definition() -> None:
    """The engine's numpy uint64 path (seed hashed once, a step's draws at once) gives bit for bit the uniforms
    of exact Python integers, for seeds of any sign and size and output indices up to 2**40."""
    rng = np.random.default_rng(0)
    seeds = [0, 1, -1, MASK64, 2**64 + 5, -(2**70) + 3, 12345678901234567890] + \
        [int(x) for x in rng.integers(-2**62, 2**62, size=40)] + [int(x) << 40 for x in rng.integers(0, 2**40, 20)]
    indices = [0, 1, 2, 1023, 2**31, 2**40] + [int(x) for x in rng.integers(0, 100_000, size=30)]
    pairs = [(s, i) for s in seeds for i in indices]
    hashes = np.array([seed_hash(s) for s, _ in pairs], dtype=np.uint64)
    got = row_uniforms(hashes, np.array([i for _, i in pairs], dtype=np.int64))
    assert got.dtype == np.float64 and got.tolist() == [row_uniform(s, i) for s, i in pairs]


def uniforms_grid(seeds: range, indices: range) -> torch.Tensor:
    return torch.tensor([[row_uniform(s, i) for i in indices] for s in seeds], dtype=torch.float64)


def test_uniforms_are_exact_float32_inside_zero_one() -> None:
    u = uniforms_grid(range(50), range(200))
    assert torch.equal(u.to(torch.float32).double(), u)  # 24 bits: exact in float32
    assert float(u.min()) >= 0.0 and float(u.max()) <= 1 - 2.0 ** -24
    assert row_uniform(-1, 3) == row_uniform(MASK64, 3)  # seeds are taken modulo 2**64


def test_uniforms_pass_chi_square_and_bit_balance() -> None:
    """200 seeds x 500 output indices. For 255 degrees of freedom chi-square has mean 255 and standard deviation
    22.6; each of the 24 bits is set half the time within 6 sigma."""
    u = uniforms_grid(range(200), range(500))
    n = u.numel()
    counts = torch.bincount((u * 256).long().flatten(), minlength=256).double()
    chi2 = float(((counts - n / 256) ** 2 / (n / 256)).sum())
    assert abs(chi2 - 255) < 6 * 22.6, chi2
    bits = (u * 2**24).long()
    for b in range(24):
        ones = int(((bits >> b) & 1).sum())
        assert abs(ones - n / 2) < 6 * math.sqrt(n / 4), f"bit {b}"


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.flatten() - 0.5, b.flatten() - 0.5
    return float((a * b).mean() / (a.square().mean() * b.square().mean()).sqrt())


def test_uniforms_are_uncorrelated_across_output_indices_and_seeds() -> None:
    """Neighbours in each coordinate (output i vs i+1 of one seed, seed s vs s+1 at one output, and two seeds'
    sequences) have correlation within 5/sqrt(n) of zero."""
    u = uniforms_grid(range(300), range(300))
    bound = 5 / math.sqrt(300 * 299)
    assert abs(_corr(u[:, :-1], u[:, 1:])) < bound
    assert abs(_corr(u[:-1], u[1:])) < bound
    assert abs(_corr(u[:, :-2], u[:, 2:])) < bound


def test_inverse_cdf_draws_the_token_whose_interval_holds_u() -> None:
    probs = torch.tensor([0.1, 0.0, 0.2, 0.3, 0.4, 0.0])
    logits = probs.log()  # the zero-probability tokens are -inf: removed
    u = torch.tensor([0.0, 0.05, 0.15, 0.29, 0.31, 0.59, 0.61, 0.99, 1 - 2.0 ** -24])
    got = draw_by_inverse_cdf_(logits.expand(len(u), 6).contiguous(), u)
    assert got.tolist() == [0, 0, 2, 2, 3, 3, 4, 4, 4]  # never 1 or 5, also at u = 0 and at the largest u


def test_inverse_cdf_never_lands_past_the_last_kept_token() -> None:
    """Rows whose last tokens are removed, u at its largest: the target stays below the total, so the draw is
    the last kept token and not the end of the row (or a removed token after it)."""
    logits = torch.full((3, 8), float("-inf"))
    logits[0, :3] = torch.tensor([0.0, 1.0, 2.0])
    logits[1, 2] = 5.0
    logits[2, [0, 7]] = torch.tensor([3.0, 20.0])
    got = draw_by_inverse_cdf_(logits, torch.full((3,), 1 - 2.0 ** -24))
    assert got.tolist() == [2, 2, 7]


def test_a_row_without_a_distribution_draws_the_invalid_token() -> None:
    """NaN, +inf, or every token removed: no distribution, so ``INVALID_TOKEN``; the other rows draw as usual."""
    logits = torch.zeros(4, 8)
    logits[1, 3] = float("nan")
    logits[2, 5] = float("inf")
    logits[3] = float("-inf")
    got = draw_by_inverse_cdf_(logits, torch.full((4,), 0.5))
    assert got.dtype == torch.int64 and got.tolist() == [4, INVALID_TOKEN, INVALID_TOKEN, INVALID_TOKEN]
