"""The random-token workloads of ``vllm bench serve``: ``--dataset-name random``, prompts of ``prefix_len`` shared
token ids then ``input_len`` random ones (varied by ``range_ratio``), and ``--dataset-name prefix_repetition``,
``num_prefixes`` random prefixes each followed by random suffixes (a prefix cache's workload); each request asks
for ``output_len`` tokens (with EOS honoured unless the run asks the server to ignore it, as vLLM's
``--ignore-eos``); and when each request is sent."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def random_requests(num_prompts: int, input_len: int, output_len: int, vocab_size: int, *, range_ratio: float = 0.0,
                    seed: int = 0, prefix_len: int = 0) -> list[BenchRequest]:
    """Token ids drawn uniformly from ``[0, vocab_size)``; lengths uniform in ``[len*(1-r), len*(1+r)]``; the
    same ``prefix_len`` ids first in every prompt (vLLM's ``--random-prefix-len``)."""
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    for name, value in (("num_prompts", num_prompts), ("input_len", input_len), ("output_len", output_len),
                        ("vocab_size", vocab_size)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must lie in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(prefix_len)]

    def length(n: int) -> int:
        return rng.randint(max(1, round(n * (1 - range_ratio))), max(1, round(n * (1 + range_ratio))))

    return [BenchRequest(prefix + [rng.randrange(vocab_size) for _ in range(length(input_len))], length(output_len))
            for _ in range(num_prompts)]


def prefix_repetition_requests(num_prompts: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                               output_len: int, vocab_size: int, *, seed: int = 0) -> list[BenchRequest]:
    """vLLM's ``prefix_repetition`` dataset over token ids: ``num_prefixes`` prefixes of ``prefix_len`` random ids,
    each followed by ``num_prompts / num_prefixes`` suffixes of ``suffix_len`` random ids, in shuffled order (the
    prompts of one prefix do not arrive together). ``num_prompts`` must be a multiple of ``num_prefixes`` (vLLM
    drops the remainder; here it is refused, so a run sends the requests it was asked for)."""
    for name, value, least in (("num_prompts", num_prompts, 1), ("prefix_len", prefix_len, 0),
                               ("suffix_len", suffix_len, 0), ("num_prefixes", num_prefixes, 1),
                               ("output_len", output_len, 1), ("vocab_size", vocab_size, 1)):
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    if prefix_len + suffix_len < 1:
        raise ValueError("prefix_len + suffix_len must be >= 1 (a prompt of no tokens), got 0")
    if num_prompts % num_prefixes:
        raise ValueError(f"num_prompts ({num_prompts}) must be a multiple of num_prefixes ({num_prefixes}), so that "
                         "every prefix has as many prompts")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_prefixes):
        prefix = [rng.randrange(vocab_size) for _ in range(prefix_len)]
        requests += [BenchRequest(prefix + [rng.randrange(vocab_size) for _ in range(suffix_len)], output_len)
                     for _ in range(num_prompts // num_prefixes)]
    rng.shuffle(requests)
    return requests


def arrival_offsets(num: int, request_rate: float, *, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds after the start at which each request is sent: all at 0 for an infinite rate, else a gamma process
    with mean gap ``1 / request_rate`` (``burstiness`` 1: Poisson arrivals, as vLLM's benchmark)."""
    if request_rate <= 0 or math.isnan(request_rate):
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    rng = random.Random(seed + 1)
    theta = 1.0 / (request_rate * burstiness)
    t, out = 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.gammavariate(burstiness, theta)
    return out
