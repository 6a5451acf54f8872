"""What one client may cost the server: the request body's size and shape, how long a connection may take to send
its headers or sit idle, and how many connections and requests may be open at once.

- **Body**: a request larger than ``max_request_bytes`` gets 413, by its ``Content-Length`` before anything is
  read, or as soon as a streamed body passes the limit (``read_body``). (Malformed bodies are 400s:
  ``errors.parse_request``.)
- **Connections**: uvicorn times out an idle keep-alive connection but waits forever for a request's headers;
  ``HeaderTimeout`` closes a connection whose headers have not all arrived within ``header_timeout_s``
  of its opening (or of its previous response), so half-sent headers do not hold a file descriptor each.
  ``limit_concurrency`` (uvicorn's) answers 503 beyond that many open connections and tasks.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi import Request
from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # uvicorn's faster HTTP parser (uvicorn[standard]), which it picks itself when installed
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _FastestProtocol
except ImportError:  # pragma: no cover - httptools is in the serve extra
    _FastestProtocol = H11Protocol  # type: ignore[assignment,misc]

from runner.entrypoints.openai.errors import OpenAIError


@dataclass(frozen=True)
class ServerLimits:
    """The server's limits per client (flags of ``cli_args.add_server_args``)."""

    max_request_bytes: int = 8 << 20
    header_timeout_s: float = 10.0
    timeout_keep_alive_s: float = 5.0
    limit_concurrency: int | None = 4096


def too_large(limit: int) -> OpenAIError:
    return OpenAIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                       f"The request body is larger than this server's limit of {limit} bytes (--max-request-bytes)")


async def read_body(raw: Request, limit: int) -> bytes:
    """The body of ``raw``, refused with 413 once it passes ``limit`` bytes (a chunked body has no length)."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in raw.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def declared_too_large(content_length: str | None, limit: int) -> bool:
    """Whether a request's ``Content-Length`` header already says its body is over ``limit`` (a malformed one is
    left to the HTTP parser)."""
    return content_length is not None and content_length.strip().isdigit() and int(content_length) > limit


class HeaderTimeout:
    """Mixed into one of uvicorn's HTTP protocols (httptools, else h11): closes a connection that has not sent a
    whole request head within ``HEADER_TIMEOUT_S`` of connecting or of its previous response."""

    HEADER_TIMEOUT_S = 10.0
    _head_timer: asyncio.TimerHandle | None = None
    cycle: Any
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]  # a mixin: uvicorn's protocol defines it
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]  # a mixin: uvicorn's protocol defines it
        if self._in_request():
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]  # a mixin: uvicorn's protocol defines it
        if not self.transport.is_closing():
            self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)  # type: ignore[misc]  # a mixin: uvicorn's protocol defines it

    def _in_request(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.HEADER_TIMEOUT_S, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_request() and not self.transport.is_closing():
            self.transport.close()


def with_header_timeout(seconds: float) -> type[asyncio.Protocol]:
    """The protocol class uvicorn runs (``Config(http=...)``): its fastest parser, with a header timeout of
    ``seconds``."""
    return type("HeaderTimeoutProtocol", (HeaderTimeout, _FastestProtocol), {"HEADER_TIMEOUT_S": seconds})
