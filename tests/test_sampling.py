"""Sampler: greedy, top-p support, seeded reproducibility independent of the batch, parameter validation."""
from __future__ import annotations

import math

import pytest
import torch

from runner.sampling_params import SamplingParams
from runner.worker.sampler import make_generator, sample


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax_first_on_ties() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 1.0, 2.0, 0.0]])
    assert sample(logits, [SamplingParams(temperature=0.0)] * 2, [None, None]) == [1, 0]
    assert sample(logits[:1], [SamplingParams(temperature=1e-7)], [gen(0)]) == [1]  # below eps: greedy
    assert sample(torch.zeros(0, 4), [], []) == []


def seeded_draws(position: int, batch_size: int, num_draws: int = 60) -> list[int]:
    """``num_draws`` successive tokens of one seeded request (seed 7, top-p 0.9) sitting at ``position`` of a
    batch of ``batch_size`` rows; the other rows mix greedy rows and random rows with their own seeds, and
    every row's logits change at every draw, so any leak between rows or from the batch shape shows."""
    target = SamplingParams(temperature=1.5, top_p=0.9, seed=7)
    others = [SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=100 + i) for i in range(batch_size)]
    params = others[:position] + [target] + others[position + 1:]
    gens = [make_generator(p, 0) for p in params]
    table = torch.randn(num_draws, 40, generator=gen(0))  # the target's logits per draw, whatever the batch
    noise = gen(1000 + batch_size * 10 + position)  # the other rows' logits: different for every layout
    out = []
    for d in range(num_draws):
        logits = torch.randn(batch_size, 40, generator=noise) * 3
        logits[position] = table[d]
        out.append(sample(logits, params, gens)[position])
    return out


def test_seeded_row_does_not_depend_on_batch() -> None:
    """60 draws of one seeded request: alone, and at the first, a middle and the last position of larger,
    differently composed batches. A sampler that let the batch shape, the row index or another row's
    generator reach the target row would change some of the 60 draws, where a single draw can match by
    chance."""
    alone = seeded_draws(0, 1)
    assert len(set(alone)) >= 10, f"the draws must vary for the comparison to mean anything: {alone}"
    for position, batch_size in [(0, 4), (2, 5), (4, 5), (7, 8)]:
        assert seeded_draws(position, batch_size) == alone, f"position {position} of {batch_size}"


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None]
    g = gen(0)
    drawn = {sample(logits, [SamplingParams(temperature=1.0, top_p=0.8)], [g])[0] for _ in range(300)}
    assert drawn == {0, 1}
    drawn = {sample(logits, [SamplingParams(temperature=1.0, top_p=1e-6)], [g])[0] for _ in range(50)}
    assert drawn == {0}


def test_temperature_one_matches_softmax() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log()[None]
    g, n = gen(1), 4000
    counts = [0] * 4
    for _ in range(n):
        counts[sample(logits, [SamplingParams(temperature=1.0)], [g])[0]] += 1
    for c, p in zip(counts, probs.tolist()):
        assert abs(c / n - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-3


def test_make_generator() -> None:
    assert make_generator(SamplingParams(temperature=0.0), 5) is None  # greedy needs no RNG
    a = make_generator(SamplingParams(temperature=1.0, seed=11), 5)
    b = make_generator(SamplingParams(temperature=1.0), 11)
    assert torch.rand(3, generator=a).tolist() == torch.rand(3, generator=b).tolist()


@pytest.mark.parametrize("kwargs,msg", [
    ({"max_tokens": 0}, r"max_tokens must be an integer >= 1 \(or None\), got 0"),
    ({"temperature": -1}, r"temperature must be a number in \[0, 2\], got -1"),
    ({"temperature": float("nan")}, "temperature must be"),
    ({"top_p": 0.0}, r"top_p must be a number in \(0, 1\], got 0.0"),
    ({"top_p": 1.5}, "top_p must be a number in"),
    ({"seed": "x"}, "seed must be an integer or None"),
    ({"stop_token_ids": [1, -2]}, "stop_token_ids must be non-negative integers, got -2"),
    ({"ignore_eos": 1}, "ignore_eos must be True or False"),
])
def test_sampling_params_validation(kwargs: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kwargs)


def test_sample_shape_errors() -> None:
    with pytest.raises(ValueError, match="got 2 logit rows but 1 sampling params"):
        sample(torch.zeros(2, 3), [SamplingParams()], [None])
    with pytest.raises(ValueError, match=r"logits must be \[num_rows, vocab\]"):
        sample(torch.zeros(3), [SamplingParams()], [None])
