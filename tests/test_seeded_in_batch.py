"""A seeded request samples the same tokens alone and in a batch of 256, through the public ``LLM.generate``
with the engine core in its own process (the default), in float32 on the CPU.

The other 255 requests mix greedy rows, unseeded and other-seeded random rows, penalties and top-k/top-p/min-p,
and the batch runs on the emulated device, whose default loop is the pipelined one: neither the batch's
composition, the row the request lands on, nor the steps launched ahead may reach its draws. The draws come
from a generator keyed by (seed, position), so a different seed must give different tokens (the comparison
would mean nothing if the model's distribution left no choice).
"""
from __future__ import annotations

import random

import pytest

from runner.entrypoints.llm import LLM
from runner.sampling_params import SamplingParams
from test_mp_default import multiprocessing

MAX_TOKENS = 12
BATCH = 256
POSITION = 137  # where the seeded request sits in the batch


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True)


def others(rng: random.Random) -> list[SamplingParams]:
    """255 requests of every kind, some finishing early so that the batch changes shape under the seeded row."""
    kinds = [
        lambda: SamplingParams(temperature=0.0, max_tokens=rng.randint(1, MAX_TOKENS), ignore_eos=True),
        lambda: SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, ignore_eos=True),
        lambda: SamplingParams(temperature=1.0, top_k=5, seed=rng.randrange(1 << 30), max_tokens=MAX_TOKENS,
                               ignore_eos=True),
        lambda: SamplingParams(temperature=0.7, min_p=0.1, repetition_penalty=1.3, presence_penalty=0.4,
                               max_tokens=rng.randint(2, MAX_TOKENS), ignore_eos=True),
    ]
    return [rng.choice(kinds)() for _ in range(BATCH - 1)]


@pytest.mark.slow
def test_a_seeded_request_draws_the_same_tokens_alone_and_in_a_batch_of_256() -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 500) for _ in range(rng.randint(1, 6))] for _ in range(BATCH)]
    batch_params = others(rng)
    batch_params.insert(POSITION, seeded(1234))
    with multiprocessing(True):
        llm = LLM(model="tiny-qwen3-moe", device="cpu", dtype="float32", max_num_seqs=BATCH,
                  max_num_batched_tokens=2048, emulate_device="step_us=100", dist_timeout_s=60.0)
    try:
        alone = llm.generate([prompts[POSITION]], seeded(1234), use_tqdm=False)[0].outputs[0].token_ids
        other_seed = llm.generate([prompts[POSITION]], seeded(4321), use_tqdm=False)[0].outputs[0].token_ids
        batch = llm.generate(prompts, batch_params, use_tqdm=False)
    finally:
        llm.close()
    assert len(alone) == MAX_TOKENS and len(set(alone)) > 3, f"the draws must vary to mean anything: {alone}"
    assert other_seed != alone
    assert batch[POSITION].outputs[0].token_ids == alone
