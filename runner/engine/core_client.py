"""The engine client of the server: one engine-core process per DP rank behind ZeroMQ, driven from the
server's asyncio loop (vLLM V1's ``AsyncLLM`` over ``DPAsyncMPClient``).

- **Processes.** :meth:`MPEngineClient.start` spawns the ranks with ``runner.distributed.launch.RankGroup``
  (private rendezvous, loopback only, heartbeats, ranks die with this process) running
  ``runner.core.engine_core_proc.run_engine_core``, and supervises them from a thread. Sockets are IPC files
  in a private (0700) directory: nothing listens on the network but the HTTP server.
- **Several clients.** With ``--api-server-count N`` each API-server process has a client of its own
  (``client_index`` c of N, over :class:`EngineSockets` made by the parent, which also starts and supervises
  the ranks: ``runner/entrypoints/api_servers.py``). Client c sends its requests with its index, gets their
  outputs and every rank's ``Ready``/wave/failure messages on its own socket, and numbers its engine requests
  c, c + N, c + 2N, ... so that no two clients' ids meet on a rank. Every rank reports its load (running +
  waiting, all clients' requests) to every client with each step's outputs, and at least every
  ``STATS_INTERVAL_S`` without them: what exceeds a client's own requests there is the other clients' load,
  which its choice of rank and ``--max-queued-requests`` count too (vLLM's DP coordinator publishes the same
  counts to its front ends).
- **Requests.** Each request is validated here (prompt ids in the vocabulary, prompt + max_tokens within
  max_model_len), split into ``n`` engine requests (int ids, one per sample), and each is sent to the DP rank
  with the least outstanding work (this client's requests and, as last reported, the other clients'). The
  ranks step while any has work (waves: see ``runner/core/engine_core_proc.py``); this client relays each
  rank's ``WaveStarted`` to every rank.
- **Outputs.** One task reads every rank's outputs, turns each step's into ``RequestOutput`` s in one pass
  (detokenization, stop strings, ``n``: the output processor) and hands each to its request's sink
  (:meth:`stream`: the request handler's buffer, no task in between; :meth:`generate`: a queue); a stop
  string found here aborts the engine request. Leaving :meth:`generate` early or closing a :meth:`stream`
  (a client that disconnected) aborts the request: its rank frees the KV blocks at its next step.
- **Failure.** A rank that dies or stops answering heartbeats is named by the launcher; every request in
  flight then fails with :class:`EngineDeadError` carrying that name, and ``dead_error`` tells the server to
  answer 503 on /health and exit non-zero.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import pickle
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from runner.config import RunnerConfig
from runner.core.messages import (
    ENCODER,
    OUTPUT_DECODER,
    AbortRequests,
    AddRequest,
    AddRequests,
    CoreFailed,
    CoreInfo,
    CoreStats,
    InputMessage,
    Outputs,
    Profile,
    Ready,
    Shutdown,
    StartProfile,
    StopProfile,
    Wake,
    WaveDone,
    WaveStarted,
    WireOutput,
)
from runner.core.requests import EngineCoreRequest
from runner.engine.protocol import (
    CloseStream,
    EngineClient,
    EngineDeadError,
    EngineOverloadedError,
    EngineShuttingDownError,
    EngineStats,
    MetricsSink,
    OutputSink,
    RankStats,
    RequestError,
)
from runner.engine.simple_output import RequestTracker
from runner.outputs import RequestOutput
from runner.sampling_params import SamplingParams

if TYPE_CHECKING:  # imported where the ranks start: the launcher pulls in multiprocessing and torch
    from runner.distributed.launch import RankGroup

logger = logging.getLogger("ubatch.engine")

# Loading a checkpoint and capturing graphs happen before a rank says Ready; on top of the collective timeout.
STARTUP_GRACE_S = 600.0
# A rank that reports a failure is named by that report only if the launcher has not named a cause by then.
CORE_FAILED_GRACE_S = 3.0
# The most engine requests a rank is sent in one message (the requests of one event-loop turn go together): a burst
# of arrivals is handled in one long turn, and a rank that waited for its end would sit idle meanwhile.
ADD_BATCH = 16


@dataclass(frozen=True)
class EngineSockets:
    """The IPC addresses between the ranks and the clients, in a private (0700) directory: ``inputs[r]`` is
    bound by rank r (every client sends to it), ``outputs[c]`` by client c (every rank sends to it)."""

    directory: str
    inputs: list[str]
    outputs: list[str]

    @staticmethod
    def create(num_ranks: int, num_clients: int) -> EngineSockets:
        directory = tempfile.mkdtemp(prefix="ubatch-engine-")  # mode 0700
        return EngineSockets(directory, [f"ipc://{os.path.join(directory, f'in-{r}')}" for r in range(num_ranks)],
                             [f"ipc://{os.path.join(directory, f'out-{c}')}" for c in range(num_clients)])

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


@dataclass
class _Rank:
    socket: Any
    info: CoreInfo | None = None
    outstanding: int = 0  # this client's engine requests sent and not finished
    # other clients' requests on this rank (--api-server-count): the rank's reported load beyond this client's
    others: int = 0
    # as last reported, kept as it came: turned into RankStats only when asked (stats(), the /metrics route)
    core_stats: CoreStats = field(default_factory=CoreStats)
    running: bool = False  # as last reported (WaveStarted / WaveDone)
    # engine requests taken in this event-loop turn, sent together at its end (MPEngineClient._send_added)
    added: list[EngineCoreRequest] = field(default_factory=list)


def rank_threads(dp: int) -> int:
    """Torch threads of each rank process: ``OMP_NUM_THREADS`` when the server's environment sets it (as for any
    torch program), else the machine's cores shared among the ranks (the offline LLM with one rank uses them
    all too); the launcher's default for ranks sharing a machine would be one thread."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not value:
        return max(1, (os.cpu_count() or 1) // dp)
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"OMP_NUM_THREADS={value!r} must be a positive integer (the rank processes' torch threads)")
    return int(value)


class _QueueSink:
    """:meth:`MPEngineClient.generate`'s sink: the outputs on a queue its iterator reads."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, output: RequestOutput) -> None:
        self.queue.put_nowait(output)

    def fail(self, exc: BaseException) -> None:
        self.queue.put_nowait(exc)

    def end(self) -> None:
        pass  # the finished output ends the iterator


class MPEngineClient(EngineClient):
    """``await MPEngineClient(cfg, ...).start()``; then :meth:`generate` from request handlers;
    ``await shutdown()`` at the end (or :meth:`close` to stop the ranks at once).

    ``sockets``: attach as client ``client_index`` to ranks that another process started over these sockets
    (``--api-server-count``); that process supervises and stops them, and reports their failure here
    (:meth:`engine_failed`). Without it, this client starts, supervises and stops the ranks itself."""

    def __init__(self, cfg: Any, *, tokenizer: Any = None, default_params: dict[str, Any] | None = None,
                 max_queued_requests: int | None = None, metrics: MetricsSink | None = None,
                 on_dead: Callable[[str], None] | None = None, generation_config: Any = None,
                 sockets: EngineSockets | None = None, client_index: int = 0) -> None:
        num_clients = 1 if sockets is None else len(sockets.outputs)
        if not 0 <= client_index < num_clients:
            raise ValueError(f"client_index {client_index} is outside [0, {num_clients}) (the clients of the sockets)")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self._default_params = dict(default_params or {})
        self.max_queued_requests = max_queued_requests
        self.metrics = metrics
        self.on_dead = on_dead
        self._ranks: list[_Rank] = []
        self._group: RankGroup | None = None
        self._ctx: Any = None
        self._out_socket: Any = None
        self._sockets = sockets
        self._owns_ranks = sockets is None
        self._num_clients = num_clients
        self.client_index = client_index
        self._reader: asyncio.Task | None = None
        self._supervisor: threading.Thread | None = None
        self._stop_supervising = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead_error: str | None = None
        self._accepting = False
        self._stopping = False  # shutdown() told the ranks to leave: their exit is expected
        self._engine_ids = itertools.count(client_index, num_clients)
        self._seeds = itertools.count(client_index, num_clients)
        self.tracker = RequestTracker(tokenizer, generation_config)  # the checkpoint's EOS ids on every request
        self._where: dict[int, int] = {}  # engine request id -> rank
        self._send_scheduled = False  # _send_added runs at the end of this event-loop turn
        self._ready = asyncio.Event()
        self._profiles: dict[int, Any] = {}
        self._profiles_done = asyncio.Event()

    # ------------------------------------------------------------------ EngineClient
    @property
    def max_model_len(self) -> int:
        return self._info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._info.vocab_size

    @property
    def _info(self) -> CoreInfo:
        if not self._ranks or self._ranks[0].info is None:
            raise RuntimeError("the engine has not started yet (call start())")
        return self._ranks[0].info

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def default_sampling_params(self) -> dict[str, Any]:
        return dict(self._default_params)

    @property
    def dead_error(self) -> str | None:
        return self._dead_error

    def stats(self) -> EngineStats:
        return EngineStats([_rank_stats(r.core_stats) for r in self._ranks])

    @property
    def num_unfinished_requests(self) -> int:
        return self.tracker.num_requests

    # ------------------------------------------------------------------ start / stop
    async def start(self) -> None:
        """Spawn the ranks (unless attached) and wait until each has loaded the model (or one failed: the error
        names it)."""
        import zmq
        import zmq.asyncio

        cfg = self.cfg
        dp = cfg.data_parallel_size
        self._loop = asyncio.get_running_loop()
        if self._sockets is None:
            self._sockets = EngineSockets.create(dp, 1)
        sockets = self._sockets
        if len(sockets.inputs) != dp:
            raise ValueError(f"the sockets serve {len(sockets.inputs)} ranks but --data-parallel-size is {dp}")
        self._ctx = zmq.asyncio.Context()
        self._out_socket = self._ctx.socket(zmq.PULL)
        self._out_socket.bind(sockets.outputs[self.client_index])
        for addr in sockets.inputs:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(addr)
            self._ranks.append(_Rank(sock))
        if self._owns_ranks:
            self._group = start_ranks(cfg, sockets)
            self._supervisor = threading.Thread(target=self._supervise, args=(self._group,),
                                                name="ubatch-rank-supervisor", daemon=True)
            self._supervisor.start()
        self._reader = asyncio.create_task(self._read_outputs(), name="ubatch-engine-outputs")
        deadline = STARTUP_GRACE_S + cfg.dist_timeout_s
        try:
            await asyncio.wait_for(self._ready.wait(), deadline)
        except TimeoutError:
            missing = [r for r, rank in enumerate(self._ranks) if rank.info is None]
            self._die(f"rank {', '.join(map(str, missing))} did not load the model within {deadline:.0f} s")
        if self._dead_error is not None:
            await self.close()
            raise EngineDeadError(self._dead_error)
        self._accepting = True

    def engine_failed(self, message: str) -> None:
        """The process supervising the ranks reports one failed (attached clients): every request in flight
        fails with ``message``."""
        self._die(message)

    def _supervise(self, group: RankGroup) -> None:
        """Thread: wait on the rank processes; a failure (or an unexpected exit) kills the engine."""
        failure = group.watch(self._stop_supervising, lambda: self._stopping, "the server")
        message = None if failure is None else str(failure)
        if message is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._die, message)

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort what is left, let the ranks finish their wave and leave their loops, then stop them. Attached:
        abort what is left and wait until the ranks ended it; the ranks are left to their owner."""
        self._accepting = False
        for request_id in list(self.tracker.request_ids()):
            self._abort(request_id, "abort")
        if self._dead_error is None and not self._owns_ranks:
            deadline = time.monotonic() + timeout_s
            while any(r.outstanding for r in self._ranks) and time.monotonic() < deadline \
                    and self._dead_error is None:
                await asyncio.sleep(0.02)
        elif self._dead_error is None:
            deadline = time.monotonic() + timeout_s
            while any(r.running or r.outstanding for r in self._ranks) and time.monotonic() < deadline \
                    and self._dead_error is None:
                await asyncio.sleep(0.02)
            self._stopping = True
            for rank in self._ranks:
                await self._send(rank, Shutdown())
            while time.monotonic() < deadline and self._group is not None \
                    and any(p.is_alive() for p in self._group.procs):
                await asyncio.sleep(0.05)
        await self.close()

    async def close(self) -> None:
        """Stop every rank now (SIGTERM, then SIGKILL) and release the sockets. Idempotent."""
        self._accepting = False
        self._stop_supervising.set()
        if self._group is not None:
            group, self._group = self._group, None
            await asyncio.get_running_loop().run_in_executor(None, group.close)
        if self._supervisor is not None:
            self._supervisor.join(timeout=10)
            self._supervisor = None
        if self._reader is not None:
            self._reader.cancel()
            # closing: the reader's error, if any, was already reported
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
            self._reader = None
        if self._ctx is not None:
            for rank in self._ranks:
                rank.added = []  # requests taken in this last turn: the ranks are gone
                rank.socket.close(linger=0)
            self._out_socket.close(linger=0)
            self._ctx.term()
            self._ctx = None
        if self._owns_ranks and self._sockets is not None:  # attached: the sockets are their owner's to remove
            self._sockets.remove()
            self._sockets = None

    # ------------------------------------------------------------------ requests
    def _check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        info = self._info
        if not prompt_token_ids:
            raise RequestError("prompt", "the prompt is empty: at least one token is needed")
        vocab = info.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:  # in C; the first bad id named below
            bad = next(t for t in prompt_token_ids if not 0 <= t < vocab)
            raise RequestError("prompt", f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        params.check_vocab(info.vocab_size)
        room = info.max_model_len - len(prompt_token_ids)
        if room < 1:
            raise RequestError("prompt", f"the prompt has {len(prompt_token_ids)} tokens but max_model_len is "
                                         f"{info.max_model_len}: no room for a generated token")
        if params.max_tokens is None:
            params = params.clone()
            params.max_tokens = room
        elif params.max_tokens > room:
            raise RequestError("max_tokens", f"prompt ({len(prompt_token_ids)} tokens) + max_tokens "
                                             f"({params.max_tokens}) = {len(prompt_token_ids) + params.max_tokens} "
                                             f"exceeds max_model_len {info.max_model_len}")
        return params

    def _check_accepting(self, n: int) -> None:
        if self._dead_error is not None:
            raise EngineDeadError(self._dead_error)
        if not self._accepting:
            raise EngineShuttingDownError("the server is shutting down and takes no new requests")
        if self.max_queued_requests is not None:  # requests beyond what the ranks can run at once wait
            capacity = self.cfg.max_num_seqs * len(self._ranks)
            load = sum(r.outstanding + r.others for r in self._ranks)
            waiting = max(0, load - capacity)
            if max(0, load + n - capacity) > self.max_queued_requests:
                raise EngineOverloadedError(f"the waiting queue is full ({waiting} requests waiting, "
                                            f"--max-queued-requests {self.max_queued_requests})")

    def _pick_rank(self) -> int:
        if len(self._ranks) == 1:
            return 0
        return min(range(len(self._ranks)), key=lambda r: (self._ranks[r].outstanding + self._ranks[r].others, r))

    def _submit(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                sink: OutputSink) -> None:
        """Check the request, register its sink and send its engine requests to the ranks."""
        self._check_accepting(params.n)
        prompt_token_ids = list(prompt_token_ids)  # the caller's list stays the caller's
        params = self._check_request(prompt_token_ids, params)
        if self.tracker.has(request_id):
            raise RequestError("request_id", f"request id {request_id!r} is already running")
        children = self.tracker.add(request_id, prompt, prompt_token_ids, params, sink,
                                    lambda: next(self._engine_ids))
        if self.metrics is not None:
            self.metrics.on_prompt_tokens(len(prompt_token_ids))
        for child in children:
            child.default_seed = self.cfg.seed * 1_000_003 + next(self._seeds)
            rank = self._pick_rank()
            self._where[child.request_id] = rank
            target = self._ranks[rank]
            target.outstanding += 1
            target.added.append(child)
            if len(target.added) >= ADD_BATCH:  # a long turn: the rank starts on these meanwhile
                self._send_rank_added(target)
        if not self._send_scheduled:
            self._send_scheduled = True
            asyncio.get_running_loop().call_soon(self._send_added)

    def _send_added(self) -> None:
        """Send each rank the engine requests taken since the last call, in one message: a burst of requests
        wakes ZeroMQ's I/O thread and the rank once per ``ADD_BATCH`` requests, not once per request. Runs at the
        end of the event-loop turn that took them (a handler's ``stream`` only queues them), so they wait for no
        step."""
        self._send_scheduled = False
        for rank in self._ranks:
            self._send_rank_added(rank)

    def _send_rank_added(self, rank: _Rank) -> None:
        added = rank.added
        if added:
            rank.added = []
            message = AddRequest(added[0], self.client_index) if len(added) == 1 else \
                AddRequests(added, self.client_index)
            rank.socket.send(ENCODER.encode(message))

    def _send(self, rank: _Rank, message: InputMessage) -> Any:
        """Send ``message`` to ``rank`` after the engine requests queued for it (an abort never overtakes the
        request it aborts); returns the socket's send (an awaitable)."""
        self._send_rank_added(rank)
        return rank.socket.send(ENCODER.encode(message))

    def stream(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
               sink: OutputSink) -> CloseStream:
        """The output reader hands this request's outputs to ``sink`` itself (no task per request); refusals
        raise here."""
        self._submit(request_id, prompt, prompt_token_ids, params, sink)

        async def close() -> None:
            self._abort(request_id, "abort")  # a no-op once the request finished

        return close

    async def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        sink = _QueueSink()
        self._submit(request_id, prompt, prompt_token_ids, params, sink)
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._abort(request_id, "abort")

    async def abort(self, request_id: str) -> None:
        self._abort(request_id, "abort")

    def _abort(self, request_id: str, reason: str) -> None:
        engine_ids = self.tracker.abort(request_id, reason, self.metrics)
        self._abort_engine_requests(engine_ids)

    def _abort_engine_requests(self, engine_ids: list[int]) -> None:
        by_rank: dict[int, list[int]] = {}
        for eid in engine_ids:
            rank = self._where.pop(eid, None)
            if rank is not None:
                by_rank.setdefault(rank, []).append(eid)
                self._ranks[rank].outstanding -= 1
        if self._ctx is None:
            return
        for rank, ids in by_rank.items():
            self._send(self._ranks[rank], AbortRequests(ids))

    # ------------------------------------------------------------------ profiling
    async def start_profile(self) -> None:
        """Every rank records its timeline from its next step on (vLLM's ``/start_profile``)."""
        for rank in self._ranks:
            await self._send(rank, StartProfile())

    async def stop_profile(self, path: str, timeout_s: float = 60.0) -> Any:
        """Stop recording; write one Chrome trace (a process per rank) to ``path`` and return its
        ``runner.tracing.TraceResult`` (per-rank overlap metrics), or None if nothing was recording."""
        from runner import tracing

        self._profiles, self._profiles_done = {}, asyncio.Event()
        for rank in self._ranks:
            await self._send(rank, StopProfile(self.client_index))
        await asyncio.wait_for(self._profiles_done.wait(), timeout_s)
        per_rank = [self._profiles.get(r) for r in range(len(self._ranks))]
        if all(p is None for p in per_rank):
            return None
        return tracing.export(path, per_rank, 0, exclusive=True)

    # ------------------------------------------------------------------ outputs
    async def _read_outputs(self) -> None:
        try:
            while True:
                msg = OUTPUT_DECODER.decode(await self._out_socket.recv())
                if isinstance(msg, Outputs):
                    self._on_outputs(msg)
                elif isinstance(msg, WaveStarted):
                    self._ranks[msg.rank].running = True
                    for rank in self._ranks:
                        await self._send(rank, Wake(msg.wave))
                elif isinstance(msg, WaveDone):
                    self._ranks[msg.rank].running = False
                elif isinstance(msg, Ready):
                    self._ranks[msg.info.rank].info = msg.info
                    if all(r.info is not None for r in self._ranks):
                        self._ready.set()
                elif isinstance(msg, Profile):
                    self._profiles[msg.rank] = pickle.loads(msg.payload)
                    if len(self._profiles) == len(self._ranks):
                        self._profiles_done.set()
                elif isinstance(msg, CoreFailed):
                    # The rank exits next and the launcher names the likely cause among all failed ranks (a peer
                    # that died first, not the rank whose collective broke on it): give it a moment to say so.
                    text = f"rank {msg.rank} failed: {msg.message}"
                    asyncio.get_running_loop().call_later(CORE_FAILED_GRACE_S, self._die, text)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - a broken output pipe kills the engine, never silently
            self._die(f"reading the ranks' outputs failed: {type(exc).__name__}: {exc}")

    def _on_outputs(self, msg: Outputs) -> None:
        """A rank's step: its stats are kept as they came (the metrics read them when scraped: the /metrics
        route hands ``stats()`` to the sink first), its outputs processed."""
        rank = self._ranks[msg.rank]
        rank.core_stats = msg.stats
        if msg.outputs:
            self._process(msg.outputs)
        if self._num_clients > 1:  # the rank counts every client's requests; its outputs to us are processed
            rank.others = max(0, msg.stats.num_running + msg.stats.num_waiting - rank.outstanding)

    def _process(self, outputs: list[WireOutput]) -> None:
        where, ranks = self._where, self._ranks
        for out in outputs:
            if out.finish_reason is not None:
                rank = where.pop(out.request_id, None)
                if rank is not None:
                    ranks[rank].outstanding -= 1
        to_abort = self.tracker.process(outputs, self.metrics)
        if to_abort:
            self._abort_engine_requests(to_abort)

    def _die(self, message: str) -> None:
        if self._dead_error is not None:
            return
        self._dead_error = message
        self._accepting = False
        logger.error("engine dead: %s", message)
        self.tracker.fail_all(EngineDeadError(message))
        self._ready.set()  # a start() still waiting learns of it
        if self.on_dead is not None:
            self.on_dead(message)


def _rank_stats(s: CoreStats) -> RankStats:
    return RankStats(s.num_running, s.num_waiting, s.kv_cache_usage, s.num_steps, s.num_ubatched_steps, s.comm_s,
                     s.comm_exposed_s, {b.bucket: (b.dbo_on, b.speedup) for b in s.dbo_buckets})


def start_ranks(cfg: RunnerConfig, sockets: EngineSockets, *, child_tracebacks: bool = True) -> RankGroup:
    """Spawn one engine-core process per DP rank over ``sockets`` (a started ``RankGroup``; the ranks ignore
    SIGINT/SIGTERM/SIGHUP: the caller drains and stops them) and log their pids. ``child_tracebacks``: a rank
    that fails prints its traceback to stderr."""
    from runner.core.engine_core_proc import run_engine_core
    from runner.distributed.launch import RankGroup

    dp = cfg.data_parallel_size
    group = RankGroup(run_engine_core, dp, args=(cfg, sockets.inputs, sockets.outputs), timeout_s=cfg.dist_timeout_s,
                      device=cfg.device, num_threads=rank_threads(dp), child_tracebacks=child_tracebacks,
                      parent_handles_signals=True)
    group.start()
    logger.info("engine: %d rank process(es): %s", dp, ", ".join(f"rank {r} pid {pid}"
                                                               for r, pid in enumerate(group.pids)))
    return group
