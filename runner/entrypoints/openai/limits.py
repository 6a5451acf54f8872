"""What one client may cost the server: the request body's size, shape and pace, how long a connection may take to
send its headers or sit idle, and how many generation requests may run at once.

- **Body**: a request larger than ``max_request_bytes`` gets 413, by its ``Content-Length`` before anything is
  read, or as soon as a streamed body passes the limit (``read_body``). A body whose next piece takes longer than
  ``body_timeout_s``, or whose whole takes longer than ``body_total_timeout_s``, gets 408 and its connection is
  closed (nginx's ``client_body_timeout``). A client that leaves mid-body is counted, not logged with a
  traceback (``ClientLeft``). (Malformed bodies are 400s: ``errors.parse_request``.)
- **Connections**: uvicorn times out an idle keep-alive connection but waits forever for a request's headers;
  ``uvicorn_internals.HeaderTimeoutProtocol`` closes a connection whose headers have not all arrived within
  ``header_timeout_s`` of its opening (or of its previous response), so half-sent headers do not hold a file
  descriptor each. A response sent before its request's body was read (an early 413) is followed by a lingering
  close: the rest of the body is read and dropped (for at most ``uvicorn_internals.LINGER_S``), so the client
  reads the response instead of a reset.
- **Concurrency**: ``limit_concurrency`` generation requests (``/v1/...``, ``/tokenize``, ``/detokenize``)
  whose body has arrived may run at once; more get 503 with Retry-After (``RequestSlots``). A connection still
  sending its headers or body holds no slot, and ``/health``, ``/metrics`` and ``/version`` never wait for one.
"""
from __future__ import annotations

import asyncio
import time
from http import HTTPStatus

from starlette.types import Message, Receive

from runner.entrypoints.openai.errors import OpenAIError
from runner.entrypoints.openai.server_limits import DEFAULT_LIMITS, ServerLimits


def too_large(limit: int) -> OpenAIError:
    return OpenAIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                       f"The request body is larger than this server's limit of {limit} bytes (--max-request-bytes)")


class ClientLeft(Exception):
    """The client closed its connection before its request's body arrived: no one to answer."""


class BodyTimeout(OpenAIError):
    """408: the body came too slowly; the connection is closed after the answer."""

    def __init__(self, message: str) -> None:
        super().__init__(HTTPStatus.REQUEST_TIMEOUT, message, headers={"Connection": "close"})


async def read_body(receive: Receive, limit: int, limits: ServerLimits = DEFAULT_LIMITS) -> bytes:
    """The request body from ``receive``: 413 once it passes ``limit`` bytes (a chunked body has no length), 408
    when a piece takes longer than ``limits.body_timeout_s`` or the whole longer than
    ``limits.body_total_timeout_s``; ``ClientLeft`` when the client disconnects first."""
    chunks: list[bytes] = []
    size = 0
    deadline = time.monotonic() + limits.body_total_timeout_s
    while True:
        wait = min(limits.body_timeout_s, deadline - time.monotonic())
        try:
            message: Message = await asyncio.wait_for(receive(), max(wait, 0.0))
        except TimeoutError:
            whole = wait < limits.body_timeout_s
            raise BodyTimeout(f"The request body took longer than {limits.body_total_timeout_s:g} s to arrive "
                              "(--body-total-timeout)" if whole else
                              f"The request body stalled: no data for {limits.body_timeout_s:g} s "
                              "(--body-timeout)") from None
        if message["type"] == "http.disconnect":
            raise ClientLeft()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def declared_too_large(content_length: str | None, limit: int) -> bool:
    """Whether a request's ``Content-Length`` header already says its body is over ``limit`` (a malformed one is
    left to the HTTP parser)."""
    return content_length is not None and content_length.strip().isdigit() and int(content_length) > limit


class RequestSlots:
    """At most ``limit`` generation requests at once (None: no limit), counted from the moment their whole body
    has arrived to the end of their response."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.taken = 0

    def take(self) -> None:
        if self.limit is not None and self.taken >= self.limit:
            raise OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE,
                              f"The server is serving its limit of {self.limit} requests at once "
                              "(--limit-concurrency): try again shortly", retry_after_s=1)
        self.taken += 1

    def give_back(self) -> None:
        self.taken -= 1
