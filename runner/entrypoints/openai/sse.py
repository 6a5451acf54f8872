"""Server-sent events as OpenAI streams them: a ``data:`` line per JSON chunk, ``data: [DONE]`` at the end.

``EventStreamResponse`` always closes the generator (its ``finally`` ends the engine requests), also when the
client is gone; the disconnect itself is noticed by ``EngineStreams`` on the ASGI receive channel.
"""
from __future__ import annotations

import json
from json.encoder import encode_basestring  # type: ignore[attr-defined]  # C-accelerated; ensure_ascii=False
from typing import Any, AsyncGenerator, Callable

from pydantic import BaseModel
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"


def sse_event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


def chunk_event(chunk: BaseModel, include_usage: bool) -> str:
    """A stream chunk. As OpenAI: with ``stream_options.include_usage`` every chunk has a ``usage`` field (null
    but on the last), without it none has."""
    body = chunk.model_dump(mode="json")
    if not include_usage and body.get("usage") is None:
        body.pop("usage", None)
    return sse_event(body)


class TextChunks:
    """The events of a stream's plain text chunks (no logprobs, no token ids, not the last) without building a
    pydantic model per token: the chunk of choice ``index`` is rendered once through ``render(index, text)``
    (the model path, with a marker text), split around the marker, and each token's event is that head, the
    text as a JSON string, and that tail: the same bytes the model path writes."""

    _MARK = "\x00ubatch-text\x00"

    def __init__(self, render: Callable[[int, str], str]) -> None:
        self._render = render
        self._parts: dict[int, tuple[str, str]] = {}

    def event(self, index: int, text: str) -> str:
        parts = self._parts.get(index)
        if parts is None:
            head, mark, tail = self._render(index, self._MARK).partition(encode_basestring(self._MARK))
            if not mark or self._MARK in tail:
                raise RuntimeError(f"the stream chunk template of choice {index} does not hold its text once")
            parts = self._parts[index] = (head, tail)
        return parts[0] + encode_basestring(text) + parts[1]


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away while we wrote; the events' finally ends its requests
            pass
        finally:
            await self.events.aclose()
