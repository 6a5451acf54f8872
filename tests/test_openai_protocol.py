"""The OpenAI server's request parsing, sampling-parameter building and logprob formats, without a server."""
from __future__ import annotations

import json
import logging
from typing import TypeVar

import pytest
from pydantic import BaseModel

from runner.entrypoints.openai.cli_args import add_server_args, served_model_names
from runner.entrypoints.openai.errors import OpenAIError, param_path, parse_request
from runner.entrypoints.openai.logprobs import (
    chat_logprobs,
    completion_logprobs,
    token_text_fn,
)
from runner.entrypoints.openai.metrics import build_1_2_5_buckets
from runner.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from runner.entrypoints.openai.sampling import build_sampling_params, resolve_max_tokens
from runner.outputs import Logprob
from runner.sampling_params import RequestOutputKind

_M = TypeVar("_M", bound=BaseModel)


def parse(model: type[_M], body: object) -> _M:
    return parse_request(json.dumps(body).encode(), model)


def refused(model: type[BaseModel], body: object) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse_request(body if isinstance(body, bytes) else json.dumps(body).encode(), model)
    assert info.value.status == 400
    return info.value


def test_param_path_drops_union_tags_and_dict_keys() -> None:
    assert param_path(("messages", 0, "content")) == "messages[0].content"
    assert param_path(("prompt", "list[int]", 1)) == "prompt[1]"
    assert param_path(("logit_bias", "50256")) == "logit_bias"
    assert param_path(("stop", "str")) == "stop"


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "n": True}, "n"),
    ({"prompt": "x", "n": 1.5}, "n"),
    ({"prompt": "x", "temperature": "0.5"}, "temperature"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logit_bias": {"1": "high"}}, "logit_bias"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": ["a", [1]]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "suffix": "after"}, "suffix"),
    ({"prompt": "x", "suffix": "tail"}, "suffix"),
    ({"prompt": "x", "use_beam_search": True}, "use_beam_search"),
])
def test_completion_request_errors_name_the_field(body: dict, param: str) -> None:
    assert refused(CompletionRequest, body).param == param


@pytest.mark.parametrize("body, param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
])
def test_chat_request_errors_name_the_field(body: dict, param: str) -> None:
    assert refused(ChatCompletionRequest, body).param == param


def test_body_must_be_a_json_object() -> None:
    err = refused(CompletionRequest, b'{"prompt": "x",')
    assert err.param is None and "not valid JSON" in err.message
    assert "JSON object" in refused(CompletionRequest, b'["x"]').message


def test_unknown_fields_are_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        req = parse(CompletionRequest, {"prompt": "x", "frobnicate": 1, "echo": False})
    assert req.prompts() == ["x"]
    assert "frobnicate" in caplog.text and "echo" not in caplog.text


def test_prompt_shapes() -> None:
    assert parse(CompletionRequest, {"prompt": "a"}).prompts() == ["a"]
    assert parse(CompletionRequest, {"prompt": ["a", "b"]}).prompts() == ["a", "b"]
    assert parse(CompletionRequest, {"prompt": [1, 2]}).prompts() == [[1, 2]]
    assert parse(CompletionRequest, {"prompt": [[1], [2, 3]]}).prompts() == [[1], [2, 3]]
    assert parse(CompletionRequest, {"prompt": "a", "max_tokens": None}).max_tokens == 16  # vLLM: null = default


def test_chat_messages_join_text_parts_and_keep_extra_keys() -> None:
    req = parse(ChatCompletionRequest, {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "bob"}]})
    assert req.messages[0].template_dict() == {"role": "user", "content": "a\nb", "name": "bob"}


def test_sampling_precedence_request_then_checkpoint_then_vllm() -> None:
    defaults = {"temperature": 0.6, "top_k": 20, "top_p": 0.9, "stop_token_ids": [7]}
    req = parse(CompletionRequest, {"prompt": "x", "top_p": 0.5, "stop_token_ids": [3], "seed": 4, "n": 2,
                                    "stream": True})
    sp = build_sampling_params(req, 9, defaults, vocab_size=100)
    assert (sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.repetition_penalty) == (0.6, 20, 0.5, 0.0, 1.0)
    assert sp.stop_token_ids == [3, 7] and sp.seed == 4 and sp.n == 2 and sp.max_tokens == 9
    assert sp.output_kind == RequestOutputKind.DELTA
    assert build_sampling_params(parse(CompletionRequest, {"prompt": "x"}), 9, {}, 100).output_kind \
        == RequestOutputKind.FINAL_ONLY


def test_sampling_errors_name_the_request_field() -> None:
    def field_of(model: type[CompletionRequest | ChatCompletionRequest], body: dict[str, object],
                 vocab: int = 100) -> str | None:
        with pytest.raises(OpenAIError) as info:
            build_sampling_params(parse(model, body), 8, {}, vocab)
        assert info.value.status == 400
        return info.value.param

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert field_of(CompletionRequest, {"prompt": "x", "temperature": -1}) == "temperature"
    assert field_of(CompletionRequest, {"prompt": "x", "top_p": 0}) == "top_p"
    assert field_of(CompletionRequest, {"prompt": "x", "n": 0}) == "n"
    assert field_of(CompletionRequest, {"prompt": "x", "n": 2, "temperature": 0}) == "n"
    assert field_of(CompletionRequest, {"prompt": "x", "stop_token_ids": [100]}) == "stop_token_ids"
    assert field_of(CompletionRequest, {"prompt": "x", "logit_bias": {"100": 1}}) == "logit_bias"
    assert field_of(CompletionRequest, {"prompt": "x", "min_tokens": 9}) == "min_tokens"
    assert field_of(ChatCompletionRequest, {**chat, "presence_penalty": 2.5}) == "presence_penalty"


def test_max_tokens_against_the_context() -> None:
    req = parse(CompletionRequest, {"prompt": "x", "max_tokens": 10})
    assert resolve_max_tokens(req, 90, 100, {}, "prompt") == 10
    with pytest.raises(OpenAIError) as info:
        resolve_max_tokens(req, 91, 100, {}, "prompt")
    assert info.value.param == "max_tokens"
    assert "100 tokens" in info.value.message and "101 tokens (91 in the prompt, 10 in the completion)" \
        in info.value.message
    with pytest.raises(OpenAIError) as info:
        resolve_max_tokens(req, 100, 100, {}, "prompt")
    assert info.value.param == "prompt" and "100 tokens" in info.value.message
    chat = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]})
    assert resolve_max_tokens(chat, 30, 100, {}, "messages") == 70  # unset: what the context leaves
    assert resolve_max_tokens(chat, 30, 100, {"max_tokens": 8}, "messages") == 8  # generation_config's cap
    chat2 = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 80,
                                          "max_tokens": 5})
    with pytest.raises(OpenAIError) as info:
        resolve_max_tokens(chat2, 30, 100, {}, "messages")
    assert info.value.param == "max_completion_tokens"


def _steps() -> list[dict[int, Logprob]]:
    # token 10 sampled at rank 2 of step 0, token 11 at rank 1 of step 1
    return [{10: Logprob(-1.0, 2, "ab"), 12: Logprob(-0.5, 1, "x"), 13: Logprob(-2.0, 3, "y")},
            {11: Logprob(float("-inf"), 1, "c"), 14: Logprob(-3.0, 2, None)}]


def test_completion_logprobs_format() -> None:
    text = token_text_fn(None)
    lp = completion_logprobs([10, 11], _steps(), 1, text, initial_offset=5)  # a stream continues the offsets
    assert lp.tokens == ["ab", "c"]
    assert lp.token_logprobs == [-1.0, -9999.0]
    assert lp.top_logprobs == [{"x": -0.5, "ab": -1.0}, {"c": -9999.0}]  # top 1, and the sampled token
    assert lp.text_offset == [5, 7]
    assert completion_logprobs([10], _steps(), 0, text).top_logprobs == [{"ab": -1.0}]


def test_chat_logprobs_format() -> None:
    content = chat_logprobs([10, 11], _steps(), 2, token_text_fn(None)).model_dump()["content"]
    assert content[0] == {"token": "ab", "logprob": -1.0, "bytes": [97, 98], "top_logprobs": [
        {"token": "x", "logprob": -0.5, "bytes": [120]}, {"token": "ab", "logprob": -1.0, "bytes": [97, 98]}]}
    assert content[1]["top_logprobs"][1] == {"token": "token_id:14", "logprob": -3.0, "bytes": list(b"token_id:14")}
    with pytest.raises(RuntimeError, match="lack the sampled token 99"):
        chat_logprobs([99], _steps(), 1, token_text_fn(None))


def test_metric_buckets() -> None:
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(4) == [1, 2]


def test_cli_args() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    add_server_args(parser)
    args = parser.parse_args(["--model", "m"])
    assert (args.host, args.port, args.shutdown_timeout, args.max_queued_requests) == ("127.0.0.1", 8000, 30.0, None)
    assert served_model_names(args) == ["m"]
    args = parser.parse_args(["--model", "m", "--served-model-name", "a", "b", "--port", "0"])
    assert served_model_names(args) == ["a", "b"] and args.port == 0
    for bad in (["--port", "70000"], ["--shutdown-timeout", "-1"], ["--max-queued-requests", "0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["--model", "m", *bad])
