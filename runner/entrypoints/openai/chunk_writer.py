"""Write a streamed response's body chunks through uvicorn's public ``send``, from any task, without waiting.

:func:`chunk_writer` gives a response whose headers are out a writer that hands each chunk to ``send`` as an ASGI
body message, run through :func:`send_now`: the write happens at once unless the client's socket is full, and
then the writer returns what finishes it. The handler's task and the engine's output reader
(``EngineStreams.set_direct_write``) both write with it. Writing to uvicorn's transport directly, past ``send``,
saved 6 % of the API server's CPU per streamed token (docs/benchmarks.md, "The API server's CPU per streamed
token"), less than the 10 % that reaching into uvicorn's private internals on the hot path would have to earn.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.types import Send

from runner.entrypoints.openai.send_now import send_now

# Write a chunk of body now: None when written, else what finishes the write (the client's socket is full).
ChunkWrite = Callable[[bytes], Awaitable[None] | None]


def chunk_writer(send: Send) -> ChunkWrite:
    """A writer of body chunks (never the body's end) for the response that ``send`` serves, once its headers
    went out through it: each chunk as an ASGI body message to ``send``, run up to its first wait."""
    return lambda body: send_now(send({"type": "http.response.body", "body": body, "more_body": True}))
