"""Requests with random settings give the same outputs in every engine layout, through ``LLM.generate``.

Each request draws its settings at random (temperature, top-k/top-p/min-p, the three penalties, a logit bias,
``min_tokens``, stop strings, logprobs and prompt logprobs, ``n``, ``ignore_eos``, a seed), and some share a long
prefix. The synchronous loop in this process is the reference; the pipelined loop on the emulated device, the
engine core in its own process, chunked prefill under a 16-token budget, preemption in a small KV cache, DBO on
every step, and no prefix cache must give the same token ids, text, finish reasons, logprobs (to 3 decimals) and
prompt logprobs, on a first call and on a second (prefix-cache hits). That the small cache did preempt, that some
prompt is longer than the budget and that the second call did hit the cache are checked, so each layout exercises
what it is there for.
"""
from __future__ import annotations

import random
from typing import Any

import pytest

from runner.entrypoints.llm import LLM
from runner.sampling_params import SamplingParams
from test_mp_default import multiprocessing
from tiny_checkpoint import TinyCheckpoint

pytestmark = pytest.mark.slow
WORDS = ["The quick brown fox", " jumps over", " the lazy dog.", " Hello world!", " Caf\u00e9 cr\u00e8me",
         " \u6771\u4eac", " One, two, three:", " stop here.", " END of the line."]
NUM_REQUESTS, MAX_TOKENS, BLOCK_SIZE = 16, 20, 16


def random_params(rng: random.Random) -> SamplingParams:
    temperature = rng.choice([0.0, 0.0, 0.5, 1.0, 1.5])
    kw: dict[str, Any] = dict(temperature=temperature, seed=rng.randrange(1000), max_tokens=rng.randint(1, MAX_TOKENS))
    options: list[tuple[bool, str, list[Any]]] = [
        (temperature > 0, "top_k", [1, 5, 20, 64, 65, 100]), (temperature > 0, "top_p", [0.5, 0.9, 0.99]),
        (temperature > 0, "min_p", [0.05, 0.2]), (temperature > 0, "n", [2]),
        (True, "repetition_penalty", [1.2, 0.8]), (True, "frequency_penalty", [0.5, -0.5]),
        (True, "presence_penalty", [0.5, 1.0]), (True, "ignore_eos", [True]), (True, "logprobs", [0, 2]),
        (True, "prompt_logprobs", [0, 1]), (True, "stop", [["e"], ["o"], [" the"], ["!"]]),
        (True, "logit_bias", [{7: -100.0}, {42: 5.0}])]
    for on, name, values in options:
        if on and rng.random() < 0.25:
            kw[name] = rng.choice(values)
    if rng.random() < 0.15:
        kw["min_tokens"] = rng.randint(1, kw["max_tokens"])
    return SamplingParams(**kw)


def workload(seed: int) -> tuple[list[str], list[SamplingParams]]:
    rng = random.Random(seed)
    shared = "".join(rng.choice(WORDS) for _ in range(6))  # over two blocks of tokens: prefix-cache hits
    prompts = [(shared if rng.random() < 0.5 else "") + "".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))
               for _ in range(NUM_REQUESTS)]
    return prompts, [random_params(rng) for _ in prompts]


def _lp(entries: Any) -> Any:
    return None if entries is None else [None if e is None else sorted((t, round(x.logprob, 3)) for t, x in e.items())
                                         for e in entries]


def outputs(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[Any]:
    return [(o.prompt_token_ids, _lp(o.prompt_logprobs),
             sorted((c.index, list(c.token_ids), c.text, c.finish_reason, c.stop_reason, _lp(c.logprobs))
                    for c in o.outputs))
            for o in llm.generate(prompts, params, use_tqdm=False)]


LAYOUTS: dict[str, dict[str, Any]] = {
    "pipelined": dict(emulate_device="step_us=300"),
    "engine-process": dict(emulate_device="step_us=200"),
    "chunked": dict(max_num_seqs=5, max_num_batched_tokens=16, emulate_device="step_us=100"),
    "preempted": dict(max_num_seqs=8, emulate_device="step_us=100"),  # and a small cache, from the workload
    "dbo": dict(enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=4, dbo_cost_model="off",
                emulate_device="step_us=200"),
    "no-prefix-cache": dict(enable_prefix_caching=False),
}


@pytest.mark.parametrize("seed", [0, 1])
def test_random_settings_give_the_same_outputs_in_every_layout(tiny_chat_checkpoint: TinyCheckpoint,
                                                               seed: int) -> None:
    prompts, params = workload(seed)
    model = str(tiny_chat_checkpoint.path)

    def run(layout: str, **kw: Any) -> tuple[list[Any], list[Any], Any, Any]:
        with multiprocessing(layout == "engine-process"):
            llm = LLM(model=model, device="cpu", dist_timeout_s=120.0, **kw)
        try:
            first = outputs(llm, prompts, params)
            stats = llm.last_stats
            return first, outputs(llm, prompts, params), stats, llm.last_stats
        finally:
            llm.close()

    want, again, _, reference_second = run("sync", disable_overlap_schedule=True)
    assert again == want and reference_second is not None and reference_second.prefix_cache_hits > 0
    assert max(len(o[0]) for o in want) > 16  # some prompt is chunked under the 16-token budget
    # the small cache holds the largest request alone, not all of them together
    small_cache = -(-max(len(o[0]) + MAX_TOKENS for o in want) // BLOCK_SIZE) + 1
    for layout, kw in LAYOUTS.items():
        first, second, stats, _ = run(layout, **kw, **({"num_kv_blocks": small_cache} if layout == "preempted" else {}))
        assert first == want, layout
        assert second == want, layout
        if layout == "preempted":
            assert stats is not None and stats.num_preemptions > 0
