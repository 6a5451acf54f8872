"""Whether the server takes requests, the requests it is serving, and how it stops.

SIGTERM or SIGINT (``begin_drain``): new requests get 503 while connections are still accepted, so clients
are told; running requests may finish for up to ``shutdown_timeout_s``; then the rest are aborted (their
streams end with finish_reason "abort", non-streamed ones return what they have) and the server is told to
exit (``should_exit``), with status 0. A second signal aborts at once instead of waiting out the timeout.

The engine dying (``engine_died``: a rank died or stopped responding) fails the running requests with 500 (their
engine iterators raise ``EngineDeadError``), and the server exits with status 1. Every wait here is bounded.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from http import HTTPStatus
from typing import Any

from runner.engine.protocol import EngineClient
from runner.entrypoints.openai.engine_streams import EngineStreams, Receive
from runner.entrypoints.openai.errors import OpenAIError, redact

logger = logging.getLogger(__name__)


class ServerLifecycle:
    def __init__(self, engine: EngineClient, shutdown_timeout_s: float = 30.0, abort_grace_s: float = 10.0,
                 dead_grace_s: float = 10.0) -> None:
        self.engine = engine
        self.shutdown_timeout_s = shutdown_timeout_s
        self.abort_grace_s = abort_grace_s  # how long an aborted request's engine may take to end it
        self.dead_grace_s = dead_grace_s  # how long requests may take to answer 500 once the engine died
        self.draining = False
        self.dead_reason: str | None = None
        self.exit_code = 0
        self.should_exit = asyncio.Event()  # the HTTP server may stop now
        self._streams: set[EngineStreams] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._force = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- admission -------------------------------------------------------------------------------------------
    def dead_error(self) -> str | None:
        """Why the engine is dead, noticing it here if the engine client has not told the server yet."""
        if self.dead_reason is None and self.engine.dead_error is not None:
            self.engine_died(self.engine.dead_error)
        return self.dead_reason

    def check_admission(self) -> None:
        """Raise the error a new request gets now: 500 once the engine died, 503 while draining."""
        reason = self.dead_error()
        if reason is not None:
            raise OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"The engine is dead: {redact(reason)}")
        if self.draining:
            raise OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE,
                              "The server is shutting down and takes no new requests")

    def open_streams(self, request_ids: list[str], receive: Receive | None) -> EngineStreams:
        """The streams of one HTTP request's engine requests (opened with ``EngineStreams.open``), counted as
        running until closed."""
        streams = EngineStreams(self.engine, request_ids, receive, on_close=self._closed)
        self._streams.add(streams)
        self._idle.clear()
        return streams

    def _closed(self, streams: EngineStreams) -> None:
        self._streams.discard(streams)
        if not self._streams:
            self._idle.set()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- stopping --------------------------------------------------------------------------------------------
    def begin_drain(self, why: str) -> None:
        """Called on the event loop for SIGTERM/SIGINT; a second call aborts the running requests at once."""
        if self.draining:
            logger.warning("%s again: aborting the %d running request(s) now", why, self.num_in_flight)
            self._force.set()
            return
        self.draining = True
        logger.info("%s: taking no new requests; %d running request(s) may finish within %g s", why,
                    self.num_in_flight, self.shutdown_timeout_s)
        self._spawn(self._drain(), "drain")

    async def _drain(self) -> None:
        if not await self._wait_idle(self.shutdown_timeout_s, stop_early=self._force):
            streams = list(self._streams)
            logger.warning("Aborting %d request(s) still running: %s", len(streams),
                           ", ".join(rid for s in streams for rid in s.request_ids))
            for s in streams:
                s.abort(self.abort_grace_s)
            if not await self._wait_idle(self.abort_grace_s + 5.0):
                logger.error("Timed out waiting %g s for aborted requests to end: %s", self.abort_grace_s + 5.0,
                             ", ".join(rid for s in self._streams for rid in s.request_ids))
        self.should_exit.set()

    def engine_died(self, reason: str) -> None:
        """The engine client reports the engine dead (or the server noticed ``dead_error``): fail the running
        requests with 500 and stop with exit status 1."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        self.exit_code = 1
        logger.error("The engine is dead (%s): failing %d running request(s) and stopping the server", reason,
                     self.num_in_flight)
        self._spawn(self._die(), "engine died")

    async def _die(self) -> None:
        if not await self._wait_idle(self.dead_grace_s):
            logger.error("Requests still waiting on the dead engine after %g s; ending them", self.dead_grace_s)
            for s in list(self._streams):
                s.stop("dead")
            await self._wait_idle(5.0)
        self.should_exit.set()

    async def _wait_idle(self, timeout_s: float, stop_early: asyncio.Event | None = None) -> bool:
        """True once no request is running; False after ``timeout_s`` or when ``stop_early`` is set."""
        waits = [asyncio.ensure_future(self._idle.wait())]
        if stop_early is not None:
            waits.append(asyncio.ensure_future(stop_early.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return self._idle.is_set()

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
