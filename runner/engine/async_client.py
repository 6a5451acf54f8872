"""The multi-process engine client driven from an asyncio loop (vLLM V1's ``AsyncMPClient``): the server's I/O
over :class:`~runner.engine.mp_client.MPClient`.

One task reads every rank's messages and hands each to :meth:`MPClient._handle`; requests taken in one
event-loop turn are sent at its end, one message per rank (at most ``ADD_BATCH`` requests: a rank starts on a
long turn's first requests meanwhile). :meth:`AsyncMPClient.start` waits until every rank has loaded the model;
:meth:`AsyncMPClient.shutdown` lets the ranks finish their wave and leave, :meth:`AsyncMPClient.close` stops them
at once. The rank supervisor's verdict and a rank's own failure report reach the loop as :meth:`MPClient._die`.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, cast

from runner.config import RunnerConfig
from runner.core.messages import OUTPUT_DECODER, StartProfile, StopProfile
from runner.core.requests import EngineCoreRequest
from runner.engine.mp_client import ADD_BATCH, RESET_PREFIX_CACHE_WAIT_S, STARTUP_GRACE_S, EngineSockets, MPClient
from runner.engine.protocol import EngineDeadError

if TYPE_CHECKING:
    import zmq.asyncio

    from runner.tracing import TraceResult


class AsyncMPClient(MPClient):
    """``await client.start()``; requests with :meth:`_submit_engine_request`; ``await shutdown()`` at the end
    (or :meth:`close`)."""

    def __init__(self, cfg: RunnerConfig, *, sockets: EngineSockets | None = None, client_index: int = 0) -> None:
        super().__init__(cfg, sockets=sockets, client_index=client_index)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: asyncio.Task[None] | None = None
        self._send_scheduled = False  # _send_all_added runs at the end of this event-loop turn
        self._ready = asyncio.Event()
        self._profiles_done = asyncio.Event()
        self._prefix_cache_answered = asyncio.Event()
        self._prefix_cache_lock = asyncio.Lock()  # one reset at a time: the ranks' answers are not numbered

    async def start(self) -> None:
        """Spawn the ranks (unless attached) and wait until each has loaded the model (or one failed: the error
        names it)."""
        import zmq.asyncio

        self._loop = asyncio.get_running_loop()
        self._open(zmq.asyncio.Context(), what="the server")
        self._reader = asyncio.create_task(self._read_outputs(), name="ubatch-engine-outputs")
        timeout_s = STARTUP_GRACE_S + self.cfg.dist_timeout_s
        try:
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        except TimeoutError:
            self._die(self._missing_ranks(timeout_s))
        if self._dead_error is not None:
            await self.close()
            raise EngineDeadError(self._dead_error)
        self._started()

    def _started(self) -> None:
        """Every rank is ready: the subclass starts taking requests."""

    def _on_ready(self) -> None:
        self._ready.set()

    def _on_profiles(self) -> None:
        self._profiles_done.set()

    def _on_prefix_cache_reset(self) -> None:
        self._prefix_cache_answered.set()

    def _rank_failed(self, message: str) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(super()._rank_failed, message)

    def _failure_reported(self, grace_s: float) -> None:
        asyncio.get_running_loop().call_later(grace_s, self._check_failed)

    def _on_dead(self, message: str) -> None:
        self._ready.set()  # a start() still waiting learns of it
        self._prefix_cache_answered.set()  # so does a reset_prefix_cache()

    # ------------------------------------------------------------------ requests
    def _submit_engine_request(self, request: EngineCoreRequest) -> None:
        """Queue ``request`` for its rank; it is sent at the end of this event-loop turn (or at once, with the
        rank's other queued requests, when ``ADD_BATCH`` are waiting)."""
        rank = self._queue(request)
        if len(rank.added) >= ADD_BATCH:  # a long turn: the rank starts on these meanwhile
            self._send_added(rank)
        if not self._send_scheduled:
            self._send_scheduled = True
            asyncio.get_running_loop().call_soon(self._send_all_added)

    def _send_all_added(self) -> None:
        """Send each rank the engine requests taken since the last call, in one message: a burst of requests
        wakes ZeroMQ's I/O thread and the rank once per ``ADD_BATCH`` requests, not once per request. Runs at the
        end of the event-loop turn that took them (a handler's ``stream`` only queues them), so they wait for no
        step."""
        self._send_scheduled = False
        for rank in self._ranks:
            self._send_added(rank)

    async def _read_outputs(self) -> None:
        assert self._procs is not None
        out = cast("zmq.asyncio.Socket", self._procs.out)  # bound on start()'s asyncio context
        try:
            while True:
                self._handle(OUTPUT_DECODER.decode(await out.recv()))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - a broken output pipe kills the engine, never silently
            self._die(f"reading the ranks' outputs failed: {type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ prefix cache
    async def reset_prefix_cache(self, timeout_s: float = RESET_PREFIX_CACHE_WAIT_S) -> bool:
        """Drop every rank's cached prefix blocks; True only if every rank did (a rank whose requests held KV
        blocks answers False and drops nothing). :class:`EngineDeadError` if the engine is or dies meanwhile,
        TimeoutError naming the ranks that did not answer within ``timeout_s``."""
        async with self._prefix_cache_lock:
            if self._dead_error is not None:
                raise EngineDeadError(self._dead_error)
            self._prefix_cache_answered = asyncio.Event()
            for send in self._ask_prefix_cache_reset():
                await send
            try:
                await asyncio.wait_for(self._prefix_cache_answered.wait(), timeout_s)
            except TimeoutError:
                missing = [r for r, rank in enumerate(self._ranks) if rank.prefix_cache_reset is None]
                raise TimeoutError(f"rank {', '.join(map(str, missing))} did not answer a prefix-cache reset "
                                   f"within {timeout_s:.0f} s") from None
            if self._dead_error is not None:
                raise EngineDeadError(self._dead_error)
            return self._prefix_cache_reset()

    # ------------------------------------------------------------------ profiling
    async def start_profile(self) -> None:
        """Every rank records its timeline from its next step on (vLLM's ``/start_profile``)."""
        for rank in self._ranks:
            await self._send(rank, StartProfile())

    async def stop_profile(self, path: str, timeout_s: float = 60.0) -> TraceResult | None:
        """Stop recording; write one Chrome trace (a process per rank) to ``path`` and return its
        ``runner.tracing.TraceResult`` (per-rank overlap metrics), or None if nothing was recording."""
        from runner import tracing

        self._profiles_done = asyncio.Event()
        for rank in self._ranks:
            rank.trace, rank.traced = None, False
            await self._send(rank, StopProfile(self.client_index))
        await asyncio.wait_for(self._profiles_done.wait(), timeout_s)
        per_rank = [rank.trace for rank in self._ranks]
        if all(p is None for p in per_rank):
            return None
        return tracing.export(path, per_rank, 0, exclusive=True)

    # ------------------------------------------------------------------ stop
    def _outstanding(self, include_running: bool) -> bool:
        return any(r.outstanding or (include_running and r.running) for r in self._ranks)

    async def _drain(self, timeout_s: float) -> None:
        """Wait until the ranks ended this client's requests (and, owning them, their wave) or ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self._outstanding(self._owns_ranks) and time.monotonic() < deadline and self._dead_error is None:
            await asyncio.sleep(0.02)
        if self._owns_ranks and self._dead_error is None and self._procs is not None:
            self._procs.send_shutdown()
            while time.monotonic() < deadline and self._procs.alive():
                await asyncio.sleep(0.05)

    async def close(self) -> None:
        """Stop every rank now (SIGTERM, then SIGKILL) and release the sockets. Idempotent."""
        procs = self._procs
        if procs is not None:
            await asyncio.get_running_loop().run_in_executor(None, procs.stop_ranks, 5.0)
        if self._reader is not None:
            self._reader.cancel()
            # closing: the reader's error, if any, was already reported
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
            self._reader = None
        for rank in self._ranks:
            rank.added = []  # requests taken in this last turn: the ranks are gone
        if procs is not None:
            procs.release()

