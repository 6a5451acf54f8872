"""Write a streamed response's body chunks to the connection itself when uvicorn's httptools protocol serves it.

uvicorn's ``send`` of a body chunk (``httptools_impl.RequestResponseCycle.send``) checks the ASGI message, frames
the chunk for chunked transfer encoding and writes it to the transport. A stream sends one chunk per token, and
those checks, the message dict and the coroutine cost more user-space CPU than the framing and the write call
themselves (docs/benchmarks.md, ``benchmarks/bench_chunk_write.py``). :func:`chunk_writer` gives a response whose
headers are out a writer that frames and writes the chunk as uvicorn does, and hands the chunk to uvicorn's ``send``
whenever that would do anything else: the client's socket is full (it waits for the drain), the client is gone (it
drops the chunk), the response is not chunked or is complete. Any other ``send`` (h11, a wrapped one) gets each
chunk as a body message, run through :func:`send_now`.
"""
from __future__ import annotations

import types
from collections.abc import Awaitable, Callable

from starlette.types import Send

from runner.entrypoints.openai.send_now import send_now

try:  # uvicorn[standard]'s parser, the one the server runs (limits.with_header_timeout)
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle
except ImportError:  # pragma: no cover - httptools is in the serve extra
    RequestResponseCycle = None  # type: ignore[assignment,misc]

# Write a chunk of body now: None when written, else what finishes the write (the client's socket is full).
ChunkWrite = Callable[[bytes], Awaitable[None] | None]


def chunk_writer(send: Send) -> ChunkWrite:
    """A writer of body chunks (never the body's end) for the response that ``send`` serves, once its headers
    went out through it."""
    through_send = _through(send)
    if (RequestResponseCycle is not None and isinstance(send, types.MethodType)
            and type(send.__self__) is RequestResponseCycle and send.__func__ is RequestResponseCycle.send):
        return _direct(send.__self__, through_send)
    return through_send


def _through(send: Send) -> ChunkWrite:
    """Each chunk as an ASGI body message to ``send``, run up to its first wait."""
    return lambda body: send_now(send({"type": "http.response.body", "body": body, "more_body": True}))


def _direct(cycle: RequestResponseCycle, through_send: ChunkWrite) -> ChunkWrite:
    write, flow = cycle.transport.write, cycle.flow

    def write_chunk(body: bytes) -> Awaitable[None] | None:
        if flow.write_paused or cycle.disconnected or not cycle.chunked_encoding or cycle.response_complete \
                or not body:
            return through_send(body)
        write(b"%x\r\n%b\r\n" % (len(body), body))
        return None

    return write_chunk
