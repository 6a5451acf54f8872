"""What one client may cost the server: the request body's size, shape and pace, how long a connection may take to
send its headers or sit idle, and how many generation requests may run at once.

- **Body**: a request larger than ``max_request_bytes`` gets 413, by its ``Content-Length`` before anything is
  read, or as soon as a streamed body passes the limit (``read_body``). A body whose next piece takes longer than
  ``body_timeout_s``, or whose whole takes longer than ``body_total_timeout_s``, gets 408 and its connection is
  closed (nginx's ``client_body_timeout``). A client that leaves mid-body is counted, not logged with a
  traceback (``ClientLeft``). (Malformed bodies are 400s: ``errors.parse_request``.)
- **Connections**: uvicorn times out an idle keep-alive connection but waits forever for a request's headers;
  ``HeaderTimeout`` closes a connection whose headers have not all arrived within ``header_timeout_s``
  of its opening (or of its previous response), so half-sent headers do not hold a file descriptor each. A
  response sent before its request's body was read (an early 413) is followed by a lingering close: the rest of
  the body is read and dropped (for at most ``LINGER_S``), so the client reads the response instead of a reset.
- **Concurrency**: ``limit_concurrency`` generation requests (``/v1/...``, ``/tokenize``, ``/detokenize``)
  whose body has arrived may run at once; more get 503 with Retry-After (``RequestSlots``). A connection still
  sending its headers or body holds no slot, and ``/health``, ``/metrics`` and ``/version`` never wait for one.
"""
from __future__ import annotations

import asyncio
import time
from http import HTTPStatus
from typing import Any

from starlette.types import Message, Receive
from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # uvicorn's faster HTTP parser (uvicorn[standard]), which it picks itself when installed
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _FastestProtocol
except ImportError:  # pragma: no cover - httptools is in the serve extra
    _FastestProtocol = H11Protocol  # type: ignore[assignment,misc]

from runner.entrypoints.openai.errors import OpenAIError
from runner.entrypoints.openai.server_limits import ServerLimits

# After an early response, how long the rest of a request's body is read and dropped before the connection closes.
LINGER_S = 30.0


def too_large(limit: int) -> OpenAIError:
    return OpenAIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                       f"The request body is larger than this server's limit of {limit} bytes (--max-request-bytes)")


class ClientLeft(Exception):
    """The client closed its connection before its request's body arrived: no one to answer."""


class BodyTimeout(OpenAIError):
    """408: the body came too slowly; the connection is closed after the answer."""

    def __init__(self, message: str) -> None:
        super().__init__(HTTPStatus.REQUEST_TIMEOUT, message, headers={"Connection": "close"})


async def read_body(receive: Receive, limit: int, limits: ServerLimits = ServerLimits()) -> bytes:
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


class HeaderTimeout:
    """Mixed into one of uvicorn's HTTP protocols (httptools, else h11): closes a connection that has not sent a
    whole request head within ``HEADER_TIMEOUT_S`` of connecting or of its previous response. A response sent
    before its request's body was read is followed by a lingering close: the rest of the body is read (and
    dropped by uvicorn) while it keeps coming, a piece at least every ``BODY_TIMEOUT_S``, for ``LINGER_S`` at
    most; then the connection serves its next request, or is closed."""

    HEADER_TIMEOUT_S = 10.0
    BODY_TIMEOUT_S = 5.0
    _head_timer: asyncio.TimerHandle | None = None
    _linger_until: float | None = None
    cycle: Any
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]  # a mixin: uvicorn's protocol defines it
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]  # a mixin: uvicorn's protocol defines it
        if self._linger_until is not None:
            self._arm_timer(min(self.BODY_TIMEOUT_S, self._linger_until - self.loop.time()))
        elif self._in_request():
            self._cancel_head_timer()

    def on_message_complete(self) -> None:
        super().on_message_complete()  # type: ignore[misc]  # a mixin: uvicorn's protocol defines it
        if self._linger_until is not None:  # the rest of an answered request's body has been read
            self._linger_until = None
            self._arm_head_timer()

    def on_response_complete(self) -> None:
        unread_body = self.cycle is not None and self.cycle.more_body and not self.cycle.disconnected
        super().on_response_complete()  # type: ignore[misc]  # a mixin: uvicorn's protocol defines it
        if self.transport.is_closing():
            return
        if unread_body:
            self._linger_until = self.loop.time() + LINGER_S
            self._arm_timer(self.BODY_TIMEOUT_S)
        else:
            self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)  # type: ignore[misc]  # a mixin: uvicorn's protocol defines it

    def _in_request(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm_head_timer(self) -> None:
        self._arm_timer(self.HEADER_TIMEOUT_S)

    def _arm_timer(self, seconds: float) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(max(seconds, 0.0), self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if (self._linger_until is not None or not self._in_request()) and not self.transport.is_closing():
            self.transport.close()


def with_header_timeout(seconds: float, body_timeout_s: float = ServerLimits.body_timeout_s) -> type[asyncio.Protocol]:
    """The protocol class uvicorn runs (``Config(http=...)``): its fastest parser, with a header timeout of
    ``seconds`` and lingering closes that wait ``body_timeout_s`` between pieces of the body."""
    return type("HeaderTimeoutProtocol", (HeaderTimeout, _FastestProtocol),
                {"HEADER_TIMEOUT_S": seconds, "BODY_TIMEOUT_S": body_timeout_s})
