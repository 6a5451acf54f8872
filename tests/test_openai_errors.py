"""Every error the OpenAI server answers: its status, the OpenAI error body naming the field (``param``), and that
nothing reached the engine (the double records every request it was given)."""
from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from fake_engine_client import FakeEngineClient, make_tokenizer
from openai_harness import MODEL, ServerThread
from runner.engine.protocol import RequestError

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": MODEL, "prompt": "hello"}
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(FakeEngineClient(max_model_len=MAX_MODEL_LEN)) as srv:
        yield srv


def post(server: ServerThread, path: str, body: dict | bytes) -> tuple[int, dict]:
    with server.http() as http:
        if isinstance(body, bytes):
            r = http.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            r = http.post(path, json=body)
    return r.status_code, r.json()


def check_error(server: ServerThread, path: str, body: dict | bytes, status: int, param: str | None,
                *in_message: str) -> dict:
    before = len(server.engine.submitted)
    code, resp = post(server, path, body)
    assert code == status, resp
    err = resp["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["param"] == param, err
    for text in in_message:
        assert text in err["message"], err
    assert len(server.engine.submitted) == before  # nothing reached the engine
    return err


@pytest.mark.parametrize("body, param, text", [
    ({**COMPLETION, "temperature": -0.5}, "temperature", "temperature"),
    ({**COMPLETION, "temperature": "hot"}, "temperature", "'hot'"),
    ({**COMPLETION, "top_p": 0}, "top_p", "top_p"),
    ({**COMPLETION, "top_k": -5}, "top_k", "-5"),
    ({**COMPLETION, "n": 0}, "n", "n"),
    ({**COMPLETION, "n": 2, "temperature": 0}, "n", "greedy"),
    ({**COMPLETION, "max_tokens": 0}, "max_tokens", "max_tokens"),
    ({**COMPLETION, "max_tokens": "4"}, "max_tokens", "'4'"),
    ({**COMPLETION, "logprobs": 30}, "logprobs", "30"),
    ({**COMPLETION, "stop": [3]}, "stop", "stop"),
    ({**COMPLETION, "stop_token_ids": [100000]}, "stop_token_ids", "100000"),
    ({**COMPLETION, "logit_bias": {"99999": 1}}, "logit_bias", "99999"),
    ({**COMPLETION, "min_tokens": 20, "max_tokens": 4}, "min_tokens", "20"),
    ({**COMPLETION, "presence_penalty": -3}, "presence_penalty", "-3"),
    ({**COMPLETION, "suffix": "after"}, "suffix", "not supported"),
    ({**COMPLETION, "stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"model": MODEL}, "prompt", "required"),
    ({**COMPLETION, "prompt": []}, "prompt", "prompt"),
])
def test_completion_bad_values(server: ServerThread, body: dict, param: str, text: str) -> None:
    err = check_error(server, "/v1/completions", body, 400, param, text)
    assert err["type"] == "BadRequestError"


@pytest.mark.parametrize("body, param, text", [
    ({**CHAT, "messages": [{"role": "user"}], "temperature": -1}, "temperature", "temperature"),
    ({**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages[0].content", "5"),
    ({**CHAT, "messages": [{"content": "hi"}]}, "messages[0].role", "required"),
    ({"model": MODEL}, "messages", "required"),
    ({**CHAT, "top_logprobs": 3}, "top_logprobs", "logprobs"),
    ({**CHAT, "logprobs": True, "top_logprobs": 25}, "top_logprobs", "25"),
    ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "not supported"),
])
def test_chat_bad_values(server: ServerThread, body: dict, param: str, text: str) -> None:
    check_error(server, "/v1/chat/completions", body, 400, param, text)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_malformed_json(server: ServerThread, path: str) -> None:
    check_error(server, path, b'{"model": "fake-model", "prompt": ', 400, None, "not valid JSON")
    check_error(server, path, b'[1, 2]', 400, None, "JSON object")


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_unknown_model_is_404_naming_it(server: ServerThread, path: str, body: dict) -> None:
    err = check_error(server, path, {**body, "model": "gpt-9"}, 404, "model", "gpt-9", MODEL)
    assert err["type"] == "NotFoundError"
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="gpt-9", prompt="x")


def test_prompt_plus_max_tokens_over_the_context(server: ServerThread) -> None:
    prompt_len = len(make_tokenizer()("hello")["input_ids"])
    over = MAX_MODEL_LEN - prompt_len + 1
    check_error(server, "/v1/completions", {**COMPLETION, "max_tokens": over}, 400, "max_tokens",
                f"maximum context length is {MAX_MODEL_LEN} tokens", f"{MAX_MODEL_LEN + 1} tokens",
                f"{prompt_len} in the prompt", f"{over} in the completion")
    check_error(server, "/v1/completions", {**COMPLETION, "prompt": ["ok", "x" * MAX_MODEL_LEN], "max_tokens": 1},
                400, "prompt[1]", f"{MAX_MODEL_LEN} tokens")
    check_error(server, "/v1/chat/completions", {**CHAT, "max_completion_tokens": MAX_MODEL_LEN}, 400,
                "max_completion_tokens", f"maximum context length is {MAX_MODEL_LEN}")
    check_error(server, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "y" * 80}]}, 400,
                "messages", f"{MAX_MODEL_LEN} tokens")
    with pytest.raises(openai.BadRequestError) as info:  # the openai client sees the same
        server.client().completions.create(model=MODEL, prompt="hello", max_tokens=over)
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == "max_tokens"


def test_token_ids_outside_the_vocabulary(server: ServerThread) -> None:
    vocab = len(make_tokenizer())
    check_error(server, "/v1/completions", {**COMPLETION, "prompt": [1, vocab]}, 400, "prompt", str(vocab))
    check_error(server, "/v1/completions", {**COMPLETION, "prompt": [[1], [2, vocab + 5]]}, 400, "prompt[1]",
                str(vocab + 5))


def test_chat_without_a_chat_template() -> None:
    with ServerThread(FakeEngineClient(chat_template=False)) as srv:
        check_error(srv, "/v1/chat/completions", CHAT, 400, "model", f"`{MODEL}` has no chat template")
        assert srv.client().completions.create(model=MODEL, prompt="x", max_tokens=1).choices[0].text


def test_text_prompt_without_a_tokenizer() -> None:
    with ServerThread(FakeEngineClient(with_tokenizer=False)) as srv:
        check_error(srv, "/v1/completions", COMPLETION, 400, "prompt", "token ids")
        check_error(srv, "/v1/chat/completions", CHAT, 400, "model", "no chat template")
        r = srv.client().completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2, logprobs=1)
        lp = r.choices[0].logprobs
        assert lp is not None and lp.tokens is not None
        assert lp.tokens[0].startswith("token_id:")


def test_overloaded_and_shutting_down_engine_is_503() -> None:
    engine = FakeEngineClient(max_running=0)
    with ServerThread(engine) as srv:
        for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT),
                           ("/v1/completions", {**COMPLETION, "stream": True})):
            code, resp = post(srv, path, body)
            assert code == 503 and resp["error"]["type"] == "ServiceUnavailableError"
            assert "limit is 0" in resp["error"]["message"]
        engine.max_running, engine.shutting_down = None, True
        code, resp = post(srv, "/v1/completions", COMPLETION)
        assert code == 503 and "shutting down" in resp["error"]["message"]
        with pytest.raises(openai.InternalServerError) as info:  # openai's class for every 5xx
            srv.client().completions.create(model=MODEL, prompt="x")
        assert info.value.status_code == 503
    assert engine.submitted == []


def test_a_prompt_list_refused_midway_leaves_no_request_behind() -> None:
    engine = FakeEngineClient(max_running=1, token_delay_s=0.01)
    with ServerThread(engine) as srv:
        code, resp = post(srv, "/v1/completions", {**COMPLETION, "prompt": ["a", "b"], "max_tokens": 50})
        assert code == 503 and "limit is 1" in resp["error"]["message"]
    assert len(engine.submitted) == 1 and engine.aborted == [engine.submitted[0][0]] and engine.running == {}


def test_the_engine_refusing_a_request_is_400_naming_its_field() -> None:
    engine = FakeEngineClient()
    engine.request_error = RequestError("max_tokens", "prompt + max_tokens exceeds max_model_len 7")
    with ServerThread(engine) as srv:
        for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", {**CHAT, "stream": True})):
            code, resp = post(srv, path, body)
            assert code == 400 and resp["error"]["param"] == "max_tokens"
            assert "max_model_len 7" in resp["error"]["message"]
