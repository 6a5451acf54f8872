"""Everything the server takes from uvicorn beyond its public API, in one place: the header-timeout protocol.

uvicorn times out an idle keep-alive connection but waits forever for a request's headers. The protocol that
:func:`header_timeout_protocol` makes is uvicorn's httptools protocol (the one ``uvicorn[standard]`` picks) with
a timer around the request head and a lingering close after an early response (``limits``). It overrides five of
the protocol's methods and reads three of its attributes and three of its request cycle's, all private.
:func:`check_uvicorn` checks each of them on the installed uvicorn and raises, naming uvicorn's version and what
is missing, before the server starts (``setup.cfg``'s ``serve`` extra bounds uvicorn to the versions checked).
No other module imports uvicorn's private modules (``tests/test_uvicorn_internals.py`` enforces it).
"""
from __future__ import annotations

import asyncio

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from runner.entrypoints.openai.server_limits import ServerLimits

# After an early response, how long the rest of a request's body is read and dropped before the connection closes.
LINGER_S = 30.0

# What the protocol below relies on: (class, method it overrides or attribute it reads, the method that sets it;
# None for a method). Attributes are checked in the code of the method that assigns them.
CONTRACT: tuple[tuple[type, str, str | None], ...] = (
    (HttpToolsProtocol, "connection_made", None),
    (HttpToolsProtocol, "data_received", None),
    (HttpToolsProtocol, "on_message_complete", None),
    (HttpToolsProtocol, "on_response_complete", None),
    (HttpToolsProtocol, "connection_lost", None),
    (HttpToolsProtocol, "loop", "__init__"),
    (HttpToolsProtocol, "cycle", "__init__"),
    (HttpToolsProtocol, "transport", "connection_made"),
    (RequestResponseCycle, "more_body", "__init__"),
    (RequestResponseCycle, "disconnected", "__init__"),
    (RequestResponseCycle, "response_complete", "__init__"),
)


class UvicornMismatch(RuntimeError):
    """The installed uvicorn lacks a private method or attribute the server relies on."""


def check_uvicorn() -> None:
    """Raise :class:`UvicornMismatch` naming uvicorn's version and every method or attribute of
    :data:`CONTRACT` it lacks."""
    missing = [f"{cls.__name__}.{name}" for cls, name, setter in CONTRACT if not _has(cls, name, setter)]
    if missing:
        raise UvicornMismatch(f"uvicorn {uvicorn.__version__} lacks {', '.join(missing)}, which the server's "
                              "header timeout relies on (runner/entrypoints/openai/uvicorn_internals.py); install "
                              "a uvicorn that the serve extra allows (setup.cfg)")


def _has(cls: type, name: str, setter: str | None) -> bool:
    method = cls.__dict__.get(name if setter is None else setter)
    if not callable(method):
        return False
    return setter is None or name in method.__code__.co_names


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol that closes a connection that has not sent a whole request head within
    ``HEADER_TIMEOUT_S`` of connecting or of its previous response. A response sent before its request's body
    was read is followed by a lingering close: the rest of the body is read (and dropped by uvicorn) while it keeps
    coming, a piece at least every ``BODY_TIMEOUT_S``, for ``LINGER_S`` at most; then the connection serves its
    next request, or is closed."""

    HEADER_TIMEOUT_S = ServerLimits.header_timeout_s
    BODY_TIMEOUT_S = ServerLimits.body_timeout_s
    _head_timer: asyncio.TimerHandle | None = None
    _linger_until: float | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # as uvicorn's
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._linger_until is not None:
            self._arm_timer(min(self.BODY_TIMEOUT_S, self._linger_until - self.loop.time()))
        elif self._in_request():
            self._cancel_head_timer()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self._linger_until is not None:  # the rest of an answered request's body has been read
            self._linger_until = None
            self._arm_head_timer()

    def on_response_complete(self) -> None:
        cycle: RequestResponseCycle | None = self.cycle
        unread_body = cycle is not None and cycle.more_body and not cycle.disconnected
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if unread_body:
            self._linger_until = self.loop.time() + LINGER_S
            self._arm_timer(self.BODY_TIMEOUT_S)
        else:
            self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _in_request(self) -> bool:
        cycle: RequestResponseCycle | None = self.cycle
        return cycle is not None and not cycle.response_complete

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


def header_timeout_protocol(seconds: float, body_timeout_s: float = ServerLimits.body_timeout_s
                            ) -> type[HeaderTimeoutProtocol]:
    """The protocol class uvicorn runs (``Config(http=...)``), with a header timeout of ``seconds`` and lingering
    closes that wait ``body_timeout_s`` between pieces of the body; raises :class:`UvicornMismatch` first when the
    installed uvicorn lacks what it relies on."""
    check_uvicorn()
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,),
                {"HEADER_TIMEOUT_S": seconds, "BODY_TIMEOUT_S": body_timeout_s})
