"""The engine outputs of one HTTP request, read as one stream, that a client disconnect or a server-side abort ends.

A completion request with several prompts runs one engine request per prompt (:meth:`EngineStreams.open`), each
streamed with ``EngineClient.stream`` into a sink of this object: the engine hands each output straight to the
request's buffer and wakes its handler, once per engine step however many outputs the step brought (no task
or queue in between). A streamed response goes further (:meth:`EngineStreams.set_direct_format`): while its
handler waits, the engine's output reader formats and writes each step's chunk itself, and wakes the handler only
for a last output, an error, or a write that has to wait for the client; whatever comes after such an item, from
any of the request's prompts and samples, queues behind it, so the order on the wire is the engine's.

A second task reads the ASGI receive channel: ``http.disconnect`` stops the stream at once, whether the response
is streamed or the handler is still waiting for a final output (uvicorn reports the disconnect there as soon as
the socket closes). ``close()`` ends every engine stream (which aborts its request
if the engine did not finish it) and also calls ``EngineClient.abort`` for every request the engine did not
finish, so an engine whose streams do not abort frees the KV blocks too.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from types import GeneratorType
from typing import Any

from runner.engine.protocol import CloseStream, EngineClient
from runner.outputs import RequestOutput
from runner.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_END = object()  # a stream ended

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]  # starlette's
# The text of one output's stream chunk(s), updating the response's state as the handler would ("" for none).
DirectFormat = Callable[[int, RequestOutput], str]
# Write a chunk's text to the client now: None when written, else what finishes the write (``send_now``).
DirectWrite = Callable[[str], Awaitable[None] | None]


class _Sink:
    """``EngineClient.stream``'s sink for prompt ``index`` of an :class:`EngineStreams`."""

    __slots__ = ("streams", "index")

    def __init__(self, streams: EngineStreams, index: int) -> None:
        self.streams, self.index = streams, index

    def put(self, output: RequestOutput) -> None:
        streams = self.streams
        if streams._direct_open and not output.finished and output.error is None:
            streams._write_directly(self.index, output)
        else:
            streams._push(self.index, output)

    def fail(self, exc: BaseException) -> None:
        self.streams._push(self.index, exc)

    def end(self) -> None:
        self.streams._push(self.index, _END)


class EngineStreams:
    """The engine streams of one HTTP request (``request_ids[i]`` for prompt i, opened with :meth:`open`)."""

    def __init__(self, engine: EngineClient, request_ids: list[str], receive: Receive | None,
                 on_close: Callable[[EngineStreams], None] | None = None) -> None:
        self.engine = engine
        self.request_ids = request_ids
        self.finished = [False] * len(request_ids)  # the engine reported the request finished
        self.stop_reason: str | None = None  # why the server stopped reading: "disconnect", "abort" or "dead"
        self.aborted_by_server = False  # abort() was called (shutdown timeout)
        self._ended = [False] * len(request_ids)  # the stream ended or failed
        self._num_ended = 0
        self._items: deque[tuple[int, Any]] = deque()  # (prompt index, output / exception / _END), in order
        self._waiter: asyncio.Future[None] | None = None  # the reader waits on it while nothing is ready
        self._closers: list[CloseStream] = []  # of the streams opened, in prompt order
        self._on_close = on_close
        self._closed = False
        self._abort_tasks: set[asyncio.Task[None]] = set()
        self._abort_timer: asyncio.TimerHandle | None = None
        self._direct_format: DirectFormat | None = None
        self._direct_write: DirectWrite | None = None
        self._direct_open = False  # the handler waits in next_batch with nothing queued: the reader may write
        self._unfinished_write: Awaitable[None] | None = None  # a direct write that waits for the client
        self._direct_error: BaseException | None = None  # what a direct format or write raised
        self._watcher = asyncio.create_task(self._watch(receive), name=f"disconnect watch {request_ids[0]}") \
            if receive is not None else None

    # ---- feeding ---------------------------------------------------------------------------------------------
    def open(self, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Start the engine request of the next prompt; raises what the engine raises when it refuses it."""
        i = len(self._closers)
        if i >= len(self.request_ids):
            raise ValueError(f"all {len(self.request_ids)} engine requests of {self.request_ids[0]} are open")
        self._closers.append(self.engine.stream(self.request_ids[i], prompt, prompt_token_ids, params,
                                                _Sink(self, i)))

    def set_direct_format(self, format: DirectFormat) -> None:
        """With :meth:`set_direct_write`: the engine's output reader answers this stream's outputs itself while
        the handler waits in :meth:`next_batch`; ``format`` turns an output into chunk text exactly as the handler
        would (the handler sets it: it knows the response's shape). The last output, errors and ends still go to
        the handler, in order."""
        self._direct_format = format

    def set_direct_write(self, write: DirectWrite) -> None:
        """With :meth:`set_direct_format`: ``write`` sends chunk text to the client (the response sets it once
        its headers are out)."""
        self._direct_write = write

    def _push(self, i: int, item: Any) -> None:
        """Queue an item for the handler; what any prompt's stream brings after it queues behind it (no direct
        write overtakes it) until the handler has read the queue and waits again."""
        self._direct_open = False
        self._items.append((i, item))
        self._wake()

    def _write_directly(self, i: int, output: RequestOutput) -> None:
        """Answer a running request's output at once (the handler waits with nothing queued: ``_direct_open``)."""
        format, write = self._direct_format, self._direct_write
        try:
            text = format(i, output)  # type: ignore[misc]  # both set where _direct_open is
            unfinished = write(text) if text else None  # type: ignore[misc]
        except BaseException as exc:  # noqa: BLE001 - raised to the handler, as its own formatting would
            self._direct_error = exc
            unfinished = None
        if unfinished is not None or self._direct_error is not None:
            self._unfinished_write = unfinished
            self._direct_open = False  # what follows queues behind it, for the handler
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def _wait(self) -> None:
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        await waiter

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.stop("disconnect")
                return

    # ---- reading ---------------------------------------------------------------------------------------------
    def _end(self, i: int) -> None:
        if not self._ended[i]:
            self._ended[i] = True
            self._num_ended += 1

    async def next(self) -> tuple[int, RequestOutput] | None:
        """(prompt index, output) in arrival order; None when all requests ended or the stream was stopped;
        raises what a stream failed with."""
        items = self._items
        while self.stop_reason is None and self._num_ended < len(self._closers):
            if not items:
                await self._wait()
                continue
            i, item = items.popleft()
            if item is _END:
                self._end(i)
                continue
            if isinstance(item, BaseException):
                self._end(i)
                raise item
            if item.finished:
                self.finished[i] = True
            return i, item
        return None

    async def next_batch(self) -> list[tuple[int, RequestOutput]] | None:
        """Every output ready now, in arrival order (waiting for one if none is): a handler answers all of them
        in one write. None when all requests ended or the stream was stopped. A failed stream raises, and an
        output with an ``error`` comes in a batch of its own, after the outputs before it."""
        items = self._items
        while self.stop_reason is None and self._num_ended < len(self._closers):
            if self._unfinished_write is not None:
                unfinished, self._unfinished_write = self._unfinished_write, None
                await unfinished
            if self._direct_error is not None:
                exc, self._direct_error = self._direct_error, None
                raise exc
            if not items:
                self._direct_open = self._direct_write is not None and self._direct_format is not None
                try:
                    await self._wait()
                finally:
                    self._direct_open = False
                continue
            batch: list[tuple[int, RequestOutput]] = []
            while items:
                i, item = items[0]
                if item is _END:
                    items.popleft()
                    self._end(i)
                    continue
                if isinstance(item, BaseException) or item.error is not None:
                    if batch:
                        break
                    items.popleft()
                    if isinstance(item, BaseException):
                        self._end(i)
                        raise item
                    batch.append((i, item))
                    break
                items.popleft()
                if item.finished:
                    self.finished[i] = True
                batch.append((i, item))
            if batch:
                return batch
        return None

    async def prime(self) -> None:
        """Wait until every engine request produced its first output (or the stream stopped), so that an error
        the engine raises before queueing a request (overloaded, shutting down, dead) is answered with its
        status instead of inside a stream that already said 200."""
        while self.stop_reason is None:
            started = set()
            for i, item in self._items:
                if isinstance(item, BaseException):
                    self._items.remove((i, item))
                    self._end(i)
                    raise item
                started.add(i)
            if len(started) == len(self._closers):
                return
            await self._wait()

    @property
    def disconnected(self) -> bool:
        return self.stop_reason == "disconnect"

    @property
    def all_finished(self) -> bool:
        """The engine finished every request of the stream: no output follows the last one read."""
        return len(self._closers) == len(self.request_ids) and all(self.finished)

    # ---- ending ----------------------------------------------------------------------------------------------
    def stop(self, reason: str) -> None:
        """Stop reading now (the client left, or an aborted request's engine did not end it in time)."""
        if self.stop_reason is None:
            self.stop_reason = reason
            self._direct_open = False
            self._wake()

    def abort(self, grace_s: float) -> None:
        """End the requests from the server's side (shutdown timeout): the engine aborts them, and its final
        outputs (finish_reason "abort") are still read; whatever it has not ended after ``grace_s`` is stopped."""
        if self.aborted_by_server or self._closed:
            return
        self.aborted_by_server = True
        # strict=False: only the requests opened so far (``finished`` has a flag for every request)
        for rid, finished in zip(self.request_ids[:len(self._closers)], self.finished, strict=False):
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
        """End every engine stream and abort what the engine did not finish. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._abort_timer is not None:
            self._abort_timer.cancel()
        if self._watcher is not None:  # it ends at the loop's next turn; nothing here waits for that
            self._watcher.cancel()
        self._direct_open = False
        if isinstance(self._unfinished_write, (Coroutine, GeneratorType)):  # the client left while it waited
            self._unfinished_write.close()
        self._unfinished_write = None
        try:
            for close in self._closers:
                try:
                    await close()
                except Exception:  # the engine may be gone; the request is ended on this side either way
                    logger.exception("Closing the engine stream of %s failed", self.request_ids[0])
            # strict=False: only the requests opened so far (``finished`` has a flag for every request)
            for rid, finished in zip(self.request_ids[:len(self._closers)], self.finished, strict=False):
                if not finished:
                    await self._abort(rid)
        finally:
            if self._on_close is not None:
                self._on_close(self)
