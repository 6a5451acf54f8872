"""Server-sent events as OpenAI streams them: a ``data:`` line per JSON chunk, ``data: [DONE]`` at the end.

``EventStreamResponse`` always closes the generator and ends the engine requests, also when the client is gone;
the disconnect itself is noticed by ``EngineStreams`` on the ASGI receive channel.
"""
from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from json.encoder import encode_basestring  # C-accelerated; ensure_ascii=False
from typing import Any

from pydantic import BaseModel
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from runner.entrypoints.openai.chunk_templates import ChunkTemplate
from runner.entrypoints.openai.chunk_writer import chunk_writer

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
    """The events of a stream's plain text chunks (no logprobs, no token ids, not the last) of one request:
    ``template`` (``chunk_templates.py``) has the request's id and time filled, the choice's index and the text
    left; each choice's head and tail are made once, and a token's event is head, its text as JSON, tail."""

    def __init__(self, template: ChunkTemplate) -> None:
        self._template = template
        self._parts: dict[int, tuple[str, str]] = {}

    def event(self, index: int, text: str) -> str:
        parts = self._parts.get(index)
        if parts is None:
            parts = self._parts[index] = self._template.bind(index=index).around("text")
        return parts[0] + encode_basestring(text) + parts[1]


class RawSend:
    """The outermost ASGI layer of the served app: keeps the server's own ``send`` in the scope (``RAW_SEND``),
    so that a stream's body chunks go straight to it. Starlette's and FastAPI's middlewares wrap ``send`` only to
    see the response start (and the error handler to know a response began), which still goes through them;
    passing each of thousands of chunks a second through their four wrappers cost a tenth of the server's CPU."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[RAW_SEND] = send
        await self.app(scope, receive, send)


RAW_SEND = "ubatch.raw_send"


class EventStreamResponse(Response):
    """``events`` as server-sent events, in one write per item; the item that ends with ``[DONE]`` is the last
    and goes out with the body's end (one write). An exception the events raise after the 200 goes into the
    stream as ``on_error(exc)`` (an error event), then ``[DONE]``, as vLLM does; ``close`` runs at the end
    whatever happened (it ends the engine requests). ``direct_write``, when given, receives (once the headers
    are out) a function that writes event text at once from any task (``chunk_writer``): the engine's output reader
    writes a step's chunk with it (``EngineStreams.set_direct_write``)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[str, None], on_error: Callable[[Exception], str],
                 close: Callable[[], Awaitable[None]],
                 direct_write: Callable[[Callable[[str], Awaitable[None] | None]], None] | None = None) -> None:
        self.events = events
        self.on_error = on_error
        self.close = close
        self.direct_write = direct_write
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # body chunks go to the server's own send (RawSend); an app served without it (a test's) has the middlewares'
        write_chunk = chunk_writer(scope.get(RAW_SEND, send))
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if self.direct_write is not None and RAW_SEND in scope:  # the server's own send: safe from any task
                self.direct_write(lambda text: write_chunk(text.encode()))
            end = ""  # the event that ends with [DONE] is the last: it goes out with the body's end, one write
            try:
                async for event in self.events:
                    if event.endswith(DONE):
                        end = event
                    elif (unfinished := write_chunk(event.encode())) is not None:
                        await unfinished
            except OSError:
                raise
            except Exception as exc:
                if end:  # after [DONE] the stream is whole: the error is the server's own
                    raise
                end = self.on_error(exc) + DONE
            await send({"type": "http.response.body", "body": end.encode(), "more_body": False})
        except OSError:  # the client went away while we wrote; ``close`` ends its requests
            pass
        finally:
            try:
                await self.events.aclose()
            finally:
                await self.close()
