"""The engine outputs of one HTTP request, read as one stream, that a client disconnect or a server-side abort ends.

A completion request with several prompts runs one engine request per prompt; their iterators are pumped by
one task each into a queue, so the handler reads outputs in the order they arrive. A second task reads the ASGI
receive channel: ``http.disconnect`` stops the stream at once, whether the response is streamed or the
handler is still waiting for a final output (uvicorn reports the disconnect there as soon as the socket
closes). ``close()`` cancels the pumps, which leaves the engine iterators (aborting their requests, per
``EngineClient.generate``), and also calls ``EngineClient.abort`` for every request the engine did not finish,
so an engine whose iterators are not async generators frees the KV blocks too.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any, AsyncIterator, Awaitable, Callable, MutableMapping

from runner.engine.protocol import EngineClient
from runner.outputs import RequestOutput

logger = logging.getLogger(__name__)

_END = object()  # an iterator ended
_WAKE = object()  # stop() was called: wake a reader blocked on the queue

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]  # starlette's


class EngineStreams:
    """The engine iterators of one HTTP request (one per prompt, ``request_ids[i]`` for prompt i)."""

    def __init__(self, engine: EngineClient, request_ids: list[str], iterators: list[AsyncIterator[RequestOutput]],
                 receive: Receive | None, on_close: Callable[["EngineStreams"], None] | None = None) -> None:
        self.engine = engine
        self.request_ids = request_ids
        self.finished = [False] * len(request_ids)  # the engine reported the request finished
        self.stop_reason: str | None = None  # why the server stopped reading: "disconnect" or "abort"
        self.aborted_by_server = False  # abort() was called (shutdown timeout)
        self._ended = [False] * len(request_ids)  # the iterator is exhausted or raised
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._buffer: deque[tuple[int, Any]] = deque()
        self._on_close = on_close
        self._closed = False
        self._abort_tasks: set[asyncio.Task[None]] = set()
        self._abort_timer: asyncio.TimerHandle | None = None
        self._pumps = [asyncio.create_task(self._pump(i, it), name=f"pump {rid}")
                       for i, (rid, it) in enumerate(zip(request_ids, iterators))]
        self._watcher = asyncio.create_task(self._watch(receive), name=f"disconnect watch {request_ids[0]}") \
            if receive is not None else None

    # ---- feeding ---------------------------------------------------------------------------------------------
    async def _pump(self, i: int, iterator: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in iterator:
                self._queue.put_nowait((i, output))
            self._queue.put_nowait((i, _END))
        except Exception as exc:  # handed to the reader, which answers it (500 for EngineDeadError, 503 ...)
            self._queue.put_nowait((i, exc))
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.stop("disconnect")
                return

    # ---- reading ---------------------------------------------------------------------------------------------
    async def _take(self) -> tuple[int, Any] | None:
        """The next item, or None once stopped or every iterator ended; raises what an iterator raised."""
        while self.stop_reason is None and not all(self._ended):
            i, item = self._buffer.popleft() if self._buffer else await self._queue.get()
            if item is _WAKE:
                continue
            if item is _END:
                self._ended[i] = True
                continue
            if isinstance(item, BaseException):
                self._ended[i] = True
                raise item
            if item.finished:
                self.finished[i] = True
            return i, item
        return None

    async def prime(self) -> None:
        """Wait until every engine request produced its first output (or the stream stopped), so that an error
        the engine raises before queueing a request (overloaded, shutting down, dead) is answered with its
        status instead of inside a stream that already said 200."""
        started = [False] * len(self.request_ids)
        while self.stop_reason is None and not all(started):
            i, item = await self._queue.get()
            if item is _WAKE:
                continue
            if isinstance(item, BaseException):
                self._ended[i] = True
                raise item
            started[i] = True
            self._buffer.append((i, item))

    async def next(self) -> tuple[int, RequestOutput] | None:
        """(prompt index, output) in arrival order; None when all requests ended or the stream was stopped."""
        return await self._take()

    def has_ready(self) -> bool:
        """Whether :meth:`next` would return without waiting (outputs queued, or the stream ended)."""
        return bool(self._buffer) or not self._queue.empty() or self.stop_reason is not None

    @property
    def disconnected(self) -> bool:
        return self.stop_reason == "disconnect"

    # ---- ending ----------------------------------------------------------------------------------------------
    def stop(self, reason: str) -> None:
        """Stop reading now (the client left, or an aborted request's engine did not end it in time)."""
        if self.stop_reason is None:
            self.stop_reason = reason
            self._queue.put_nowait((-1, _WAKE))

    def abort(self, grace_s: float) -> None:
        """End the requests from the server's side (shutdown timeout): the engine aborts them, and its final
        outputs (finish_reason "abort") are still read; whatever it has not ended after ``grace_s`` is stopped."""
        if self.aborted_by_server or self._closed:
            return
        self.aborted_by_server = True
        for rid, finished in zip(self.request_ids, self.finished):
            if not finished:
                task = asyncio.create_task(self._abort(rid), name=f"abort {rid}")
                self._abort_tasks.add(task)
                task.add_done_callback(self._abort_tasks.discard)
        self._abort_timer = asyncio.get_running_loop().call_later(grace_s, self.stop, "abort")

    async def _abort(self, request_id: str) -> None:
        try:
            await self.engine.abort(request_id)
        except Exception:  # the engine may be gone; the request is ended on this side either way
            logger.exception("Aborting request %s failed", request_id)

    async def close(self) -> None:
        """Leave every engine iterator and abort what the engine did not finish. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._abort_timer is not None:
            self._abort_timer.cancel()
        tasks = [*self._pumps, *([self._watcher] if self._watcher is not None else [])]
        for task in tasks:
            task.cancel()
        try:
            await asyncio.gather(*tasks, return_exceptions=True)
            for rid, finished in zip(self.request_ids, self.finished):
                if not finished:
                    await self._abort(rid)
        finally:
            if self._on_close is not None:
                self._on_close(self)
