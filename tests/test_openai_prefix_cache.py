"""The server's prefix-cache surface over a caching test double of the engine: ``usage.prompt_tokens_details``
with ``--enable-prompt-tokens-details`` (and its absence without), in full and streamed responses of completions
and chat; the per-rank ``ubatch:prefix_cache_queries`` / ``_hits`` counters; ``POST /reset_prefix_cache`` and its
refusals. ``tests/test_serve_prefix_cache.py`` checks the same against the real engine."""
from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletionMessageParam

from fake_engine_client import FakeEngineClient, make_tokenizer
from openai_harness import MODEL, ServerThread, sse_events
from runner.engine.protocol import EngineDeadError, EngineStats
from runner.outputs import RequestOutput
from runner.sampling_params import SamplingParams
from test_openai_metrics import samples, value

BLOCK = 4  # the double caches whole blocks of this many prompt tokens, as the engine does
TOK = make_tokenizer()
PROMPT = "The same long prefix, then a question?"  # 38 tokens (one per byte): 9 whole blocks
CHAT: list[ChatCompletionMessageParam] = [{"role": "system", "content": "A shared system prompt."},
                                          {"role": "user", "content": "hi"}]


def cached_for(prompt_ids: list[int], seen: set[tuple[int, ...]]) -> int:
    """The tokens of ``prompt_ids``'s longest run of whole blocks already seen; the last token is always computed."""
    cached = 0
    while cached + BLOCK <= len(prompt_ids) - 1 and tuple(prompt_ids[:cached + BLOCK]) in seen:
        cached += BLOCK
    return cached


class CachingEngine(FakeEngineClient):
    """The double with a prefix cache of whole prompt blocks: each output carries its request's
    ``num_cached_tokens``, each rank counts the prompt tokens it looked up and found, and ``reset_prefix_cache``
    empties the cache unless a request runs (or ``refuse_reset`` is set)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen: set[tuple[int, ...]] = set()
        self.queries = [0] * self.num_ranks
        self.hits = [0] * self.num_ranks
        self.num_requests = 0
        self.refuse_reset = False

    def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]:
        ids = list(prompt_token_ids)
        cached = cached_for(ids, self.seen)
        rank = self.num_requests % self.num_ranks
        self.num_requests += 1
        self.queries[rank] += len(ids)
        self.hits[rank] += cached
        self.seen.update(tuple(ids[:end]) for end in range(BLOCK, len(ids) + 1, BLOCK))
        return self._with_cached(super().generate(request_id, prompt, ids, params), cached)

    @staticmethod
    async def _with_cached(outputs: AsyncIterator[RequestOutput], cached: int) -> AsyncIterator[RequestOutput]:
        async for output in outputs:
            output.num_cached_tokens = cached
            yield output

    def stats(self) -> EngineStats:
        stats = super().stats()
        for rank, r in enumerate(stats.ranks):
            r.prefix_cache_queries, r.prefix_cache_hits = self.queries[rank], self.hits[rank]
        return stats

    async def reset_prefix_cache(self) -> bool:
        if self.running or self.refuse_reset:
            return False
        self.seen.clear()
        return True


def prompt_ids(text: str) -> list[int]:
    return TOK(text)["input_ids"]


def chat_ids(messages: list[ChatCompletionMessageParam]) -> list[int]:
    return TOK.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]


@pytest.fixture
def server() -> Iterator[ServerThread]:
    with ServerThread(CachingEngine(), enable_prompt_tokens_details=True) as srv:
        yield srv


def reset(http: httpx.Client) -> httpx.Response:
    return http.post("/reset_prefix_cache")


def cached(usage: CompletionUsage | None) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` as the official client reads it (None: no details)."""
    assert usage is not None
    return None if usage.prompt_tokens_details is None else usage.prompt_tokens_details.cached_tokens


def test_cached_tokens_in_completions_full_and_streamed(server: ServerThread) -> None:
    c = server.client()
    want = cached_for(prompt_ids(PROMPT), {tuple(prompt_ids(PROMPT)[:e]) for e in range(BLOCK, 39, BLOCK)})
    assert want == 36
    first = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    second = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    assert cached(first.usage) == 0
    assert cached(second.usage) == want
    assert second.usage is not None and first.usage is not None
    assert second.usage.prompt_tokens == first.usage.prompt_tokens == 38
    assert second.choices[0].text == first.choices[0].text
    usage = [ch.usage for ch in c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, stream=True,
                                                     stream_options={"include_usage": True}) if ch.usage][0]
    assert cached(usage) == want
    # a prompt list: the cached tokens of all its prompts
    both = c.completions.create(model=MODEL, prompt=[PROMPT, PROMPT[:20] + "!"], max_tokens=2)
    assert cached(both.usage) == want + 20
    with server.http() as http:  # echo with max_tokens 0 answers its own way
        body = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 0,
                                                  "echo": True}).json()
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": want}


def test_cached_tokens_in_chat_full_and_streamed(server: ServerThread) -> None:
    c = server.client()
    want = cached_for(chat_ids(CHAT), {tuple(chat_ids(CHAT)[:e]) for e in range(BLOCK, 100, BLOCK)})
    assert want > 0
    first = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3)
    assert cached(first.usage) == 0
    usage = [ch.usage for ch in c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, stream=True,
                                                         stream_options={"include_usage": True}) if ch.usage][0]
    assert cached(usage) == want
    second = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3)
    assert cached(second.usage) == want
    assert second.choices[0].message.content == first.choices[0].message.content


def test_no_details_without_the_flag() -> None:
    engine = CachingEngine()
    with ServerThread(engine) as srv, srv.http() as http:
        for _ in range(2):  # the second one hits the cache: still no field
            full = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2}).json()
            chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2}).json()
            streamed = sse_events(http.post("/v1/completions", json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": 2, "stream": True,
                "stream_options": {"include_usage": True}}))
            for usage in (full["usage"], chat["usage"], streamed[-2]["usage"]):
                assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens"}
        assert engine.hits != [0, 0]  # the engine did serve cached tokens


def test_counters_per_rank(server: ServerThread) -> None:
    c = server.client()
    for _ in range(3):  # ranks 0, 1, 0
        c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    with server.http() as http:
        got = samples(http.get("/metrics").text)
    assert value(got, "ubatch:prefix_cache_queries_total", engine="0") == 2 * 38
    assert value(got, "ubatch:prefix_cache_queries_total", engine="1") == 38
    assert value(got, "ubatch:prefix_cache_hits_total", engine="0") == 36
    assert value(got, "ubatch:prefix_cache_hits_total", engine="1") == 36


def test_reset_empties_the_cache(server: ServerThread) -> None:
    c = server.client()
    c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    with server.http() as http:
        r = reset(http)
    assert r.status_code == 200 and r.content == b""
    again = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    assert cached(again.usage) == 0


def test_reset_refused_and_behind_the_key() -> None:
    engine = CachingEngine()
    with ServerThread(engine, api_key="sekret") as srv, srv.http() as http:
        assert reset(http).status_code == 401
        key = {"Authorization": "Bearer sekret"}
        engine.refuse_reset = True
        r = http.post("/reset_prefix_cache", headers=key)
        assert r.status_code == 409
        message = r.json()["error"]["message"]
        assert "not reset" in message and "retry" in message
        engine.refuse_reset = False
        assert http.post("/reset_prefix_cache", headers=key).status_code == 200


def test_reset_on_a_dead_engine() -> None:
    engine = CachingEngine()
    with ServerThread(engine, with_dead_event=False) as srv:  # the server learns it from dead_error alone
        with srv.http() as http:
            engine._dead = "DP rank 1 stopped responding for 30 s"
            r = reset(http)
        assert r.status_code == 500 and "DP rank 1" in r.json()["error"]["message"]
        assert srv.wait_stopped() == 1


def test_a_prompt_of_several_samples_counts_the_tokens_no_sample_computed() -> None:
    from runner.entrypoints.openai.serving_engine import Choices, EnginePrompt

    choices = Choices([EnginePrompt("x", list(range(40))), EnginePrompt("y", list(range(20)))], 2,
                      cached_tokens_details=True)
    for prompt, cached in ((0, None), (0, 32), (0, 16), (0, 32), (1, 0)):  # sample 2 of prompt 0 found 32, sample 1 16
        choices.saw(prompt, RequestOutput(f"r{prompt}", None, [], [], False, num_cached_tokens=cached))
    usage = choices.usage()
    assert usage.prompt_tokens == 60 and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 16
    assert Choices(choices.prompts, 2).usage().prompt_tokens_details is None  # not asked for


class DyingEngine(CachingEngine):
    """A rank dies while the reset waits for it."""

    async def reset_prefix_cache(self) -> bool:
        raise EngineDeadError("DP rank 0 exited with status -9")


def test_reset_when_the_engine_dies_meanwhile() -> None:
    with ServerThread(DyingEngine(), with_dead_event=False) as srv:
        with srv.http() as http:
            r = reset(http)
        assert r.status_code == 500 and "DP rank 0 exited" in r.json()["error"]["message"]
        assert srv.wait_stopped() == 1  # the server learnt the engine is dead, and stops
