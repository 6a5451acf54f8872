"""Prefix caching through ``python -m runner serve`` end to end: real server processes on loopback, a real
engine-core rank, the official ``openai`` client and plain HTTP, the transformers-written checkpoint of
``tests/tiny_checkpoint.py`` (caching is on by default).

What must hold: a request whose long prefix an earlier one computed reports ``cached_tokens`` > 0 (whole KV
blocks, the last prompt token always computed) and generates exactly the tokens of the first request and of an
engine without caching, in completions and chat, full and streamed; the per-rank counters
``ubatch:prefix_cache_queries`` / ``_hits`` move by the request's prompt and cached tokens; after ``POST
/reset_prefix_cache`` the same request computes its whole prompt again; without ``--enable-prompt-tokens-details``
the field is absent.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletionMessageParam

from runner import LLM, SamplingParams
from runner.entrypoints.benchserve.server_proc import ServerProcess, scrape
from server_set import started_servers
from tiny_checkpoint import TinyCheckpoint

pytestmark = pytest.mark.slow
ENGINE = "--device cpu --max-num-seqs 8 --dist-timeout-s 30"
BLOCK_SIZE = 16  # the engine's default KV block
# a long shared beginning, then a different end for each request
PREFIX = " ".join(["The quick brown fox jumps over the lazy dog."] * 6)
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "system", "content": PREFIX},
                                              {"role": "user", "content": "Hello world! How are you today?"}]
GREEDY: dict[str, Any] = {"max_tokens": 12, "temperature": 0.0}
EXTRA = {"ignore_eos": True, "return_token_ids": True}
COUNTERS = ("ubatch:prefix_cache_queries_total", "ubatch:prefix_cache_hits_total")


@pytest.fixture(scope="module")
def servers(tiny_chat_checkpoint: TinyCheckpoint) -> Iterator[dict[str, ServerProcess]]:
    variants = (("details", "--enable-prompt-tokens-details"), ("plain", ""))
    with started_servers(str(tiny_chat_checkpoint.path), ENGINE, variants) as started:
        yield started


@pytest.fixture(scope="module")
def uncached(tiny_chat_checkpoint: TinyCheckpoint) -> Iterator[LLM]:
    llm = LLM(model=str(tiny_chat_checkpoint.path), device="cpu", max_num_seqs=8, enable_prefix_caching=False)
    yield llm
    llm.close()


def client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def cached(usage: CompletionUsage | None) -> int | None:
    assert usage is not None
    return None if usage.prompt_tokens_details is None else usage.prompt_tokens_details.cached_tokens


def whole_blocks(num_prompt_tokens: int) -> int:
    """What a repeated prompt finds cached: its whole blocks, short of its last token (always computed)."""
    return (num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def reset(srv: ServerProcess) -> None:
    r = httpx.post(f"{srv.base_url}/reset_prefix_cache", timeout=60)
    assert r.status_code == 200, r.text


def test_completion_repeated_prefix_is_cached_with_the_same_tokens(servers: dict[str, ServerProcess],
                                                                  uncached: LLM, tiny_chat_checkpoint: TinyCheckpoint
                                                                  ) -> None:
    srv, c, model = servers["details"], client(servers["details"]), str(tiny_chat_checkpoint.path)
    reset(srv)
    prompts = [PREFIX + " One, two, three: stop here.", PREFIX + " Hello world! How are you"]
    want = uncached.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                             use_tqdm=False)
    first = c.completions.create(model=model, prompt=prompts[0], extra_body=EXTRA, **GREEDY)
    assert first.usage is not None and cached(first.usage) == 0
    # the second prompt shares the first's beginning: its whole blocks of that come from the cache
    shared = len(want[0].prompt_token_ids)
    while want[0].prompt_token_ids[:shared] != want[1].prompt_token_ids[:shared]:
        shared -= 1
    second = c.completions.create(model=model, prompt=prompts[1], extra_body=EXTRA, **GREEDY)
    assert cached(second.usage) == shared // BLOCK_SIZE * BLOCK_SIZE > 0
    again = c.completions.create(model=model, prompt=prompts[0], extra_body=EXTRA, **GREEDY)
    assert cached(again.usage) == whole_blocks(first.usage.prompt_tokens)
    for response, reference in ((first, want[0]), (second, want[1]), (again, want[0])):
        assert response.choices[0].model_extra is not None
        assert response.choices[0].model_extra["token_ids"] == list(reference.outputs[0].token_ids)
        assert response.choices[0].text == reference.outputs[0].text
    usage = [chunk.usage for chunk in c.completions.create(
        model=model, prompt=prompts[0], stream=True, stream_options={"include_usage": True}, extra_body=EXTRA,
        **GREEDY) if chunk.usage is not None]
    assert len(usage) == 1 and cached(usage[0]) == whole_blocks(first.usage.prompt_tokens)


def test_chat_repeated_system_prompt_is_cached_with_the_same_text(servers: dict[str, ServerProcess],
                                                                 uncached: LLM,
                                                                 tiny_chat_checkpoint: TinyCheckpoint) -> None:
    srv, c, model = servers["details"], client(servers["details"]), str(tiny_chat_checkpoint.path)
    reset(srv)
    want = uncached.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)[0]
    first = c.chat.completions.create(model=model, messages=MESSAGES, extra_body=EXTRA, **GREEDY)
    second = c.chat.completions.create(model=model, messages=MESSAGES, extra_body=EXTRA, **GREEDY)
    assert first.usage is not None and first.usage.prompt_tokens == len(want.prompt_token_ids)
    assert cached(first.usage) == 0 and cached(second.usage) == whole_blocks(first.usage.prompt_tokens)
    for response in (first, second):
        assert response.choices[0].message.content == want.outputs[0].text
    streamed = list(c.chat.completions.create(model=model, messages=MESSAGES, stream=True,
                                              stream_options={"include_usage": True}, extra_body=EXTRA, **GREEDY))
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == want.outputs[0].text
    assert cached(streamed[-1].usage) == whole_blocks(first.usage.prompt_tokens)


def test_counters_move_by_the_prompt_and_cached_tokens(servers: dict[str, ServerProcess],
                                                       tiny_chat_checkpoint: TinyCheckpoint) -> None:
    srv, c, model = servers["details"], client(servers["details"]), str(tiny_chat_checkpoint.path)
    reset(srv)
    prompt = PREFIX + " Dual batch overlap hides the expert all-to-all."
    counts = []
    for _ in range(2):
        before = scrape(srv.base_url, COUNTERS)
        response = c.completions.create(model=model, prompt=prompt, extra_body=EXTRA, **GREEDY)
        after = scrape(srv.base_url, COUNTERS)
        assert response.usage is not None
        counts.append((response.usage.prompt_tokens, cached(response.usage),
                       after[COUNTERS[0]] - before[COUNTERS[0]], after[COUNTERS[1]] - before[COUNTERS[1]]))
    (n, hit0, queries0, hits0), (_, hit1, queries1, hits1) = counts
    assert (hit0, queries0, hits0) == (0, n, 0)
    assert hit1 == whole_blocks(n) and (queries1, hits1) == (n, hit1)


def test_reset_makes_the_same_request_compute_its_whole_prompt(servers: dict[str, ServerProcess],
                                                               tiny_chat_checkpoint: TinyCheckpoint) -> None:
    srv, c, model = servers["details"], client(servers["details"]), str(tiny_chat_checkpoint.path)
    prompt = PREFIX + " END of the line."
    c.completions.create(model=model, prompt=prompt, extra_body=EXTRA, **GREEDY)
    warm = c.completions.create(model=model, prompt=prompt, extra_body=EXTRA, **GREEDY)
    assert warm.usage is not None and cached(warm.usage) == whole_blocks(warm.usage.prompt_tokens) > 0
    reset(srv)
    cold = c.completions.create(model=model, prompt=prompt, extra_body=EXTRA, **GREEDY)
    assert cached(cold.usage) == 0
    assert cold.choices[0].model_extra == warm.choices[0].model_extra  # the same token ids


def test_no_details_without_the_flag(servers: dict[str, ServerProcess],
                                     tiny_chat_checkpoint: TinyCheckpoint) -> None:
    srv, model = servers["plain"], str(tiny_chat_checkpoint.path)
    body = {"model": model, "prompt": PREFIX, **GREEDY, **EXTRA}
    with httpx.Client(base_url=srv.base_url, timeout=120) as http:
        for _ in range(2):  # the second one is served from the cache: still no field
            usage = http.post("/v1/completions", json=body).json()["usage"]
            assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens"}
        hits = scrape(srv.base_url, COUNTERS)[COUNTERS[1]]
    assert hits > 0
    assert cached(client(srv).completions.create(model=model, prompt=PREFIX, extra_body=EXTRA, **GREEDY).usage) \
        is None
