"""The OpenAI server end to end over a test double of the engine (``fake_engine_client``), through the official
``openai`` client and plain HTTP: texts, choice order, usage, streaming, logprobs, models, the API key.

Expected texts come from the double's formula (``expected_text``), not from the server."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypedDict

import pytest
from openai.types import CompletionUsage, completion_create_params
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionTokenLogprob
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.completion import Completion

from fake_engine_client import (
    FakeEngineClient,
    expected_logprob,
    expected_text,
    make_tokenizer,
    sampled_rank,
)
from openai_extra import extra_fields
from openai_harness import MODEL, ServerThread, sse_events
from runner.sampling_params import RequestOutputKind

TOK = make_tokenizer()
CHAT: list[ChatCompletionMessageParam] = [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "hello there"}]


def ids(text: str) -> list[int]:
    return TOK(text)["input_ids"]


def chat_ids(messages: list[ChatCompletionMessageParam]) -> list[int]:
    return TOK.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(FakeEngineClient(max_model_len=128)) as srv:
        yield srv


def test_completion_text_usage_and_engine_request(server: ServerThread) -> None:
    n_before = len(server.engine.submitted)
    r = server.client().completions.create(model=MODEL, prompt="Hello", max_tokens=5, seed=3, temperature=0.5)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert [(c.index, c.text, c.finish_reason) for c in r.choices] == [(0, expected_text(ids("Hello"), 0, 3, 5),
                                                                        "length")]
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 5, 10)
    rid, prompt, prompt_ids, params = server.engine.submitted[n_before]
    assert rid == f"{r.id}-0" and prompt == "Hello" and prompt_ids == ids("Hello")
    assert (params.max_tokens, params.seed, params.temperature, params.output_kind) == \
        (5, 3, 0.5, RequestOutputKind.FINAL_ONLY)


def test_prompt_list_and_n_give_choices_in_order(server: ServerThread) -> None:
    prompts = ["first prompt", "second", "3rd!"]
    r = server.client().completions.create(model=MODEL, prompt=prompts, max_tokens=4, n=2, seed=1)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [expected_text(ids(p), k, 1, 4) for p in prompts for k in range(2)]
    assert r.usage is not None
    assert r.usage.prompt_tokens == sum(len(ids(p)) for p in prompts)
    assert r.usage.completion_tokens == 6 * 4
    token_prompts = [[5, 6, 7], [100, 101]]
    r = server.client().completions.create(model=MODEL, prompt=token_prompts, max_tokens=3)
    assert [c.text for c in r.choices] == [expected_text(p, 0, None, 3) for p in token_prompts]
    assert r.usage is not None
    assert r.usage.prompt_tokens == 5


def test_request_ids_are_unique(server: ServerThread) -> None:
    c = server.client()
    got = {c.completions.create(model=MODEL, prompt="x", max_tokens=1).id for _ in range(5)}
    got |= {c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1).id for _ in range(5)}
    assert len(got) == 10 and sum(i.startswith("chatcmpl-") for i in got) == 5


def _join_completion_stream(chunks: list[Completion], num_choices: int
                            ) -> tuple[list[dict[str, Any]], CompletionUsage | None]:
    joined: list[dict[str, Any]] = [{"text": "", "finish_reason": None, "tokens": [], "token_logprobs": [],
                                     "top_logprobs": [], "text_offset": []} for _ in range(num_choices)]
    usage: CompletionUsage | None = None
    for chunk in chunks:
        if chunk.usage is not None:
            assert chunk.choices == [] and usage is None  # one usage chunk, after every choice chunk
            usage = chunk.usage
            continue
        assert len(chunk.choices) == 1 and usage is None
        c = chunk.choices[0]
        j = joined[c.index]
        assert j["finish_reason"] is None  # nothing after a choice's finish
        j["text"] += c.text
        j["finish_reason"] = c.finish_reason
        if c.logprobs is not None:
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                j[key] += getattr(c.logprobs, key)
    return joined, usage


@pytest.mark.parametrize("stop", [None, ["rz", "q"]])
def test_completion_stream_joins_to_the_response(server: ServerThread, stop: list[str] | None) -> None:
    kwargs: completion_create_params.CompletionCreateParamsBase = {
        "model": MODEL, "prompt": ["ab", "stream me"], "max_tokens": 12, "n": 2, "seed": 7, "logprobs": 2, "stop": stop}
    full = server.client().completions.create(**kwargs)
    streaming: completion_create_params.CompletionCreateParamsStreaming = {
        **kwargs, "stream": True, "stream_options": {"include_usage": True}}
    chunks = list(server.client().completions.create(**streaming))
    joined, usage = _join_completion_stream(chunks, 4)
    assert len({chunk.id for chunk in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    for j, c in zip(joined, full.choices, strict=True):
        assert (j["text"], j["finish_reason"]) == (c.text, c.finish_reason)
        assert c.logprobs is not None
        assert j["tokens"] == c.logprobs.tokens and j["token_logprobs"] == c.logprobs.token_logprobs
        assert j["top_logprobs"] == c.logprobs.top_logprobs and j["text_offset"] == c.logprobs.text_offset
    assert usage == full.usage
    if stop:  # the double's texts were chosen so that some choices stop on a string and some do not
        reasons = {(c.finish_reason, extra_fields(c)["stop_reason"]) for c in full.choices}
        assert ("stop", "q") in reasons and ("length", None) in reasons
        for c in full.choices:
            assert all(s not in c.text for s in stop)


def test_stream_framing_and_usage_only_when_asked(server: ServerThread) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}
    with server.http() as http:
        plain = sse_events(http.post("/v1/completions", json=body))
        with_usage = sse_events(http.post("/v1/completions", json={**body, "stream_options": {"include_usage": True}}))
    assert plain[-1] == "[DONE]" and "[DONE]" not in plain[:-1]
    assert all("usage" not in e for e in plain[:-1])
    assert all(e["usage"] is None for e in with_usage[:-2])
    assert with_usage[-2]["choices"] == [] and with_usage[-2]["usage"] == {
        "prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert [e["choices"][0]["text"] for e in plain[:-1]] == list(expected_text(ids("hi"), 0, None, 3))


def test_chat_completion(server: ServerThread) -> None:
    n_before = len(server.engine.submitted)
    r = server.client().chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=6, n=2, seed=2)
    prompt = chat_ids(CHAT)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert [(c.index, c.message.role, c.message.content, c.finish_reason) for c in r.choices] == \
        [(k, "assistant", expected_text(prompt, k, 2, 6), "length") for k in range(2)]
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), 12)
    _, text, prompt_ids, _ = server.engine.submitted[n_before]
    assert prompt_ids == prompt and text == TOK.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)


def test_chat_stream_joins_to_the_response(server: ServerThread) -> None:
    kwargs: chat_create_params.CompletionCreateParamsBase = {
        "model": MODEL, "messages": CHAT, "max_tokens": 9, "n": 2, "seed": 5, "logprobs": True, "top_logprobs": 3,
        "stop": ["x", "j"]}
    full = server.client().chat.completions.create(**kwargs)
    streaming: chat_create_params.CompletionCreateParamsStreaming = {
        **kwargs, "stream": True, "stream_options": {"include_usage": True}}
    chunks = list(server.client().chat.completions.create(**streaming))
    first = [c.choices[0] for c in chunks[:2]]
    assert [(c.index, c.delta.role, c.delta.content) for c in first] == [(0, "assistant", ""), (1, "assistant", "")]
    text: list[str] = ["", ""]
    reasons: list[str | None] = [None, None]
    logprobs: list[list[ChatCompletionTokenLogprob]] = [[], []]
    for chunk in chunks[2:-1]:
        (c,) = chunk.choices
        assert c.delta.role is None and reasons[c.index] is None
        assert c.delta.content is not None and c.logprobs is not None and c.logprobs.content is not None
        text[c.index] += c.delta.content
        reasons[c.index] = c.finish_reason
        logprobs[c.index] += c.logprobs.content
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert text == [c.message.content for c in full.choices]
    assert reasons == [c.finish_reason for c in full.choices]
    assert logprobs == [c.logprobs.content if c.logprobs is not None else None for c in full.choices]


def test_completion_logprobs_shape(server: ServerThread) -> None:
    r = server.client().completions.create(model=MODEL, prompt="lp", max_tokens=4, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None
    text = expected_text(ids("lp"), 0, None, 4)
    assert lp.tokens == list(text) and lp.text_offset == [0, 1, 2, 3]
    assert lp.token_logprobs == [expected_logprob(k, sampled_rank(k)) for k in range(4)]
    for k, top in enumerate(lp.top_logprobs):
        # the 2 most likely tokens, and the sampled one when it is not among them
        assert len(top) == (2 if sampled_rank(k) <= 2 else 3)
        assert top[text[k]] == expected_logprob(k, sampled_rank(k))
        assert sorted(top.values(), reverse=True)[:2] == [expected_logprob(k, 1), expected_logprob(k, 2)]


def test_chat_logprobs_shape(server: ServerThread) -> None:
    r = server.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, logprobs=True,
                                                top_logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content is not None
    content = lp.content
    text = expected_text(chat_ids(CHAT), 0, None, 4)
    assert [c.token for c in content] == list(text)
    assert [c.bytes for c in content] == [[ord(ch)] for ch in text]
    assert [c.logprob for c in content] == [expected_logprob(k, sampled_rank(k)) for k in range(4)]
    for k, c in enumerate(content):
        assert [t.logprob for t in c.top_logprobs] == [expected_logprob(k, 1), expected_logprob(k, 2)]
        assert (text[k] in [t.token for t in c.top_logprobs]) == (sampled_rank(k) <= 2)
    plain = server.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert plain.choices[0].logprobs is None
    only_sampled = server.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, logprobs=True)
    only_lp = only_sampled.choices[0].logprobs
    assert only_lp is not None and only_lp.content is not None
    assert [c.top_logprobs for c in only_lp.content] == [[], []]


def test_checkpoint_defaults_fill_unset_fields() -> None:
    engine = FakeEngineClient(defaults={"temperature": 0.7, "top_k": 5, "max_tokens": 7, "repetition_penalty": 1.1})
    with ServerThread(engine) as srv:
        r = srv.client().chat.completions.create(model=MODEL, messages=CHAT)
        srv.client().chat.completions.create(model=MODEL, messages=CHAT, temperature=0.2, max_tokens=3)
        srv.client().completions.create(model=MODEL, prompt="x")
    (_, _, _, p1), (_, _, _, p2), (_, _, _, p3) = engine.submitted
    assert (p1.temperature, p1.top_k, p1.max_tokens, p1.repetition_penalty, p1.top_p) == (0.7, 5, 7, 1.1, 1.0)
    content = r.choices[0].message.content
    assert content is not None and len(content) == 7
    assert (p2.temperature, p2.top_k, p2.max_tokens) == (0.2, 5, 3)
    assert p3.max_tokens == 16  # completions: OpenAI's default max_tokens


def test_models_version_health(server: ServerThread) -> None:
    models = server.client().models.list()
    assert [(m.id, m.object, m.owned_by, extra_fields(m)["max_model_len"]) for m in models.data] == \
        [(MODEL, "model", "ubatch", 128)]
    with server.http() as http:
        import ubatch

        assert http.get("/version").json() == {"version": ubatch.__version__}
        assert http.get("/health").status_code == 200


def test_several_served_names() -> None:
    with ServerThread(names=("a", "b")) as srv:
        assert [m.id for m in srv.client().models.list().data] == ["a", "b"]
        assert srv.client().completions.create(model="b", prompt="x", max_tokens=1).model == "b"
        with srv.http() as http:  # no model named: the first name (vLLM)
            assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).json()["model"] == "a"


def test_api_key() -> None:
    import openai

    with ServerThread(api_key="sekret") as srv:
        assert srv.client().completions.create(model=MODEL, prompt="x", max_tokens=1).choices[0].text
        for key in ("wrong", "sekret-but-longer"):
            with pytest.raises(openai.AuthenticationError) as info:
                srv.client(api_key=key).completions.create(model=MODEL, prompt="x", max_tokens=1)
            body = info.value.body
            assert isinstance(body, dict)
            assert info.value.status_code == 401 and body["type"] == "AuthenticationError"
        with srv.http() as http:
            for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                 ("GET", "/v1/models")):
                assert http.request(method, path, json={}).status_code == 401
                assert http.request(method, path, json={}, headers={"Authorization": "Basic sekret"}).status_code \
                    == 401
            assert http.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
            for path in ("/health", "/version", "/metrics"):
                assert http.get(path).status_code == 200
            assert http.get("/openapi.json").status_code == 401  # every other route needs the key too
            assert http.get("/openapi.json", headers={"Authorization": "Bearer sekret"}).status_code == 200
    assert srv.engine.submitted[1:] == []  # only the authorized request reached the engine


def test_inference_routes_methods_and_schema(server: ServerThread) -> None:
    """The inference routes (Starlette's, ahead of FastAPI's declarations) answer only POST, with a 405 in
    OpenAI's error shape, and the OpenAPI schema still lists them."""
    with server.http() as http:
        for path in ("/v1/completions", "/v1/chat/completions"):
            for method in ("GET", "PUT", "DELETE"):
                r = http.request(method, path)
                assert (r.status_code, r.headers["allow"], r.json()) == (405, "POST", {"error": {
                    "message": "Method Not Allowed", "type": "MethodNotAllowedError", "param": None, "code": 405}})
        paths = http.get("/openapi.json").json()["paths"]
        assert {"/v1/completions", "/v1/chat/completions"} <= set(paths)
        assert list(paths["/v1/completions"]) == ["post"] and list(paths["/v1/chat/completions"]) == ["post"]


def test_request_log_only_when_enabled(caplog: pytest.LogCaptureFixture) -> None:
    """Off by default, as in vLLM (``--enable-log-requests`` turns it on): one INFO line per engine request.
    uvicorn's access log is on unless ``--disable-uvicorn-access-log`` (or ``--disable-log-requests``), and only
    at a log level that shows INFO."""
    import argparse
    import logging

    from fastapi.testclient import TestClient

    from runner.entrypoints.openai.api_server import build_app
    from runner.entrypoints.openai.cli_args import add_server_args, request_logging, uvicorn_access_log

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    assert [request_logging(parser.parse_args(flags)) for flags in (
        [], ["--enable-log-requests"], ["--enable-log-requests", "--disable-log-requests"],
        ["--no-enable-log-requests"])] == [False, True, False, False]
    assert [uvicorn_access_log(parser.parse_args(flags)) for flags in (
        [], ["--disable-uvicorn-access-log"], ["--disable-log-requests"], ["--uvicorn-log-level", "warning"],
        ["--uvicorn-log-level", "debug"])] == [True, False, False, False, True]
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2}
    class LogFlag(TypedDict, total=False):
        log_requests: bool

    cases: tuple[tuple[LogFlag, bool], ...] = (({}, False), ({"log_requests": True}, True))
    for kwargs, logged in cases:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="runner.entrypoints.openai"):
            r = TestClient(build_app(FakeEngineClient(), [MODEL], **kwargs)).post("/v1/completions", json=body)
        assert r.status_code == 200
        lines = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("Request ")]
        assert len(lines) == int(logged)
        if logged:
            assert lines[0].startswith(f"Request {r.json()['id']}-0: 3 prompt tokens, SamplingParams(n=1")
