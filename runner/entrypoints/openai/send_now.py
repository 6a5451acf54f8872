"""Run an ASGI ``send`` from the caller's own frame, without a task switch, when it need not wait.

uvicorn's ``send`` of a body chunk writes to the transport and returns without suspending unless the client's
socket is full (flow control). :func:`send_now` runs the coroutine up to its first suspension: usually it has
finished by then and nothing else happens; otherwise it returns an awaitable that finishes the send, which the
request's own task awaits. This is how the engine's output reader writes a stream's chunk for a step itself
instead of waking the request's handler for it (``EngineStreams.set_direct_write``).
"""
from __future__ import annotations

import types
from collections.abc import Awaitable, Coroutine, Generator
from typing import Any


def send_now(sending: Awaitable[None]) -> Awaitable[None] | None:
    """Run ``sending`` (an ASGI ``send(message)`` call) until it finishes or first waits: None when it finished
    (what it raised propagates), else the awaitable that runs the rest of it (``sending`` itself where it is not
    a coroutine)."""
    if type(sending) is not types.CoroutineType and not isinstance(sending, Coroutine):  # the ABC check is slower
        return sending
    try:
        waiting_on = sending.send(None)
    except StopIteration:
        return None
    return _rest(sending, waiting_on)


@types.coroutine
def _rest(coroutine: Coroutine[Any, Any, None], waiting_on: Any) -> Generator[Any, Any, None]:
    """The rest of a started coroutine: hand what it waits on to the awaiting task (as its own ``await`` would
    have), resume it when that is done, and pass a cancellation of the task into it."""
    while True:
        try:
            yield waiting_on
        except BaseException as exc:  # noqa: BLE001  (the awaiting task was cancelled, or a future it waited on failed)
            try:
                waiting_on = coroutine.throw(exc)
            except StopIteration:
                return
            continue
        try:
            waiting_on = coroutine.send(None)
        except StopIteration:
            return
