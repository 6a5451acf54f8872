"""Stream chunks filled from templates are the bytes their pydantic models write (``chunk_templates.py``)."""
from __future__ import annotations

import json
from typing import Any

import pytest

from runner.entrypoints.openai.chunk_templates import ChunkTemplate
from runner.entrypoints.openai.protocol import (
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
)
from runner.entrypoints.openai.serving_chat import LAST_FIELDS as CHAT_LAST
from runner.entrypoints.openai.serving_chat import TEXT_FIELDS as CHAT_TEXT
from runner.entrypoints.openai.serving_completion import LAST_FIELDS, TEXT_FIELDS
from runner.entrypoints.openai.sse import TextChunks, chunk_event

TEXTS = ["", "plain", ' "quoted" \\ back', "new\nline\ttab", "é日本🙂", "\x00\x1f control", "\u2028\u2029"]
STOPS: list[int | str | None] = [None, 0, 151645, "stop", 'a "stop"\n']


def completion(include_usage: bool, model: str = "m/é") -> Any:
    def render(id: str, created: int, **choice: Any) -> str:
        return chunk_event(CompletionStreamResponse(id=id, created=created, model=model, choices=[
            CompletionResponseStreamChoice(**choice)]), include_usage)
    return render


def chat(include_usage: bool, model: str = "m/é") -> Any:
    def render(id: str, created: int, index: int, text: str = "", **choice: Any) -> str:
        return chunk_event(ChatCompletionStreamResponse(id=id, created=created, model=model, choices=[
            ChatCompletionResponseStreamChoice(index=index, delta=DeltaMessage(content=text), **choice)]),
            include_usage)
    return render


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("make", [completion, chat])
def test_filled_chunks_equal_the_model_path(make: Any, include_usage: bool) -> None:
    render = make(include_usage)
    text_fields, last_fields = (TEXT_FIELDS, LAST_FIELDS) if make is completion else (CHAT_TEXT, CHAT_LAST)
    plain = TextChunks(ChunkTemplate.render(render, text_fields).bind(id="cmpl-abc", created=1_700_000_000))
    last = ChunkTemplate.render(render, last_fields).bind(id="cmpl-abc", created=1_700_000_000)
    for index in (0, 3, 12):
        for text in TEXTS:
            assert plain.event(index, text) == render(id="cmpl-abc", created=1_700_000_000, index=index, text=text)
            for finish in ("stop", "length", "abort"):
                for stop in STOPS:
                    assert last.fill(index=index, text=text, finish_reason=finish, stop_reason=stop) == render(
                        id="cmpl-abc", created=1_700_000_000, index=index, text=text, finish_reason=finish,
                        stop_reason=stop)


def test_a_marker_missing_from_the_chunk_is_refused() -> None:
    with pytest.raises(RuntimeError, match="'text' field exactly once"):
        ChunkTemplate.render(lambda id, text: json.dumps({"id": id}), {"id": "str", "text": "str"})
    template = ChunkTemplate.render(completion(False), TEXT_FIELDS)
    with pytest.raises(ValueError, match="got \\['index'\\]"):
        template.fill(index=1)
