"""What every multi-process engine client shares (vLLM V1's ``MPClient``): the engine-core processes, one per DP
rank, behind ZeroMQ, and the driving logic that does not depend on how the client waits.

- **Processes.** Unless attached to ranks another process owns (``--api-server-count``), the client spawns them
  with ``runner.distributed.launch.RankGroup`` running ``runner.core.engine_core_proc.run_engine_core`` (private
  rendezvous, loopback only, heartbeats, ranks die with this process) and watches them with one
  :class:`~runner.distributed.launch.RankSupervisor`. Sockets are IPC files in a private (0700) directory.
- **Ranks.** One record per rank (:class:`_Rank`): its socket, what it reported (``Ready``, stats, waves,
  timelines) and this client's requests on it. A request goes to the rank with the least outstanding work (this
  client's requests and, as last reported, the other clients'); an abort goes to the rank that has the request.
  Requests queued for a rank go out in one message (``AddRequests``), before anything else sent to that rank.
- **Messages.** :meth:`MPClient._handle` reads every message a rank sends: outputs (those of requests this client
  still tracks go to the subclass's :meth:`MPClient._process`), wave starts (relayed to every rank as ``Wake``:
  the DP collectives pair up only if every rank steps in every wave), wave ends, ``Ready``, timelines, and
  failure reports (acted on after a grace period, so that the launcher can name the likely cause first).
- **Subclasses differ in I/O only**: :class:`~runner.engine.sync_client.SyncMPClient` waits in the calling thread
  (the offline ``LLM``), :class:`~runner.engine.async_client.AsyncMPClient` in an asyncio task (the server).
- **Prefix cache reset** (``reset_prefix_cache``): every rank is asked (``ResetPrefixCache``) and answers
  (``PrefixCacheReset``); the reset succeeded only if every rank's did.
"""
from __future__ import annotations

import atexit
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from runner.config import RunnerConfig
from runner.core.messages import (
    ENCODER,
    AbortRequests,
    AddRequest,
    AddRequests,
    CoreFailed,
    CoreInfo,
    CoreStats,
    InputMessage,
    OutputMessage,
    Outputs,
    PrefixCacheReset,
    Profile,
    Ready,
    ResetPrefixCache,
    Shutdown,
    Wake,
    WaveDone,
    WaveStarted,
)
from runner.core.requests import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from runner.engine.protocol import EngineDeadError
from runner.tracing import RankTrace

if TYPE_CHECKING:  # the launcher pulls in multiprocessing and torch: imported where the ranks start
    import zmq

    from runner.distributed.launch import RankGroup, RankSupervisor

# Loading a checkpoint and capturing graphs happen before a rank says Ready; on top of the collective timeout.
STARTUP_GRACE_S = 600.0
# A rank that reports a failure is named by that report only if the launcher has not named a cause by then.
CORE_FAILED_GRACE_S = 3.0
# The most engine requests a rank is sent in one message by a client that takes them one by one (the server):
# a burst of arrivals is handled in one long event-loop turn, and a rank that waited for its end would sit idle.
ADD_BATCH = 16
# How long idle ranks get to leave their loops after Shutdown before they are killed.
SHUTDOWN_WAIT_S = 10.0
# How long the ranks get to answer a prefix-cache reset (a busy rank answers between two steps).
RESET_PREFIX_CACHE_WAIT_S = 60.0


class RanksDeadError(EngineDeadError):
    """The engine is dead because of its ranks: ``cause`` names them in one line, as the launcher does ("rank 1
    exited with signal SIGKILL"); ``tracebacks`` holds, by rank, those of ranks that failed with an exception."""

    def __init__(self, message: str, cause: str, tracebacks: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.cause = cause
        self.tracebacks = tracebacks or {}


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
    socket: Any  # third-party: pyzmq's PUSH socket, sync or asyncio (a test's recorder stands in for it)
    info: CoreInfo | None = None
    outstanding: int = 0  # this client's engine requests sent and not finished
    # other clients' requests on this rank (--api-server-count): the rank's reported load beyond this client's
    others: int = 0
    stats: CoreStats = field(default_factory=CoreStats)  # as last reported, kept as it came
    running: bool = False  # as last reported (WaveStarted / WaveDone)
    next_wave: int = 0  # one past the last wave the rank reported finished
    trace: RankTrace | None = None  # its timeline, once its Profile reply came (traced)
    traced: bool = False
    added: list[EngineCoreRequest] = field(default_factory=list)  # queued, sent in one message (_send_added)
    prefix_cache_reset: bool | None = None  # its answer to the last ResetPrefixCache (None: not yet)


def rank_threads(dp: int) -> int:
    """Torch threads of each rank process: ``OMP_NUM_THREADS`` when the environment sets it (as for any torch
    program), else the machine's cores shared among the ranks; the launcher's default for ranks sharing a
    machine would be one thread."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not value:
        return max(1, (os.cpu_count() or 1) // dp)
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"OMP_NUM_THREADS={value!r} must be a positive integer (the rank processes' torch threads)")
    return int(value)


def start_ranks(cfg: RunnerConfig, sockets: EngineSockets, *, child_tracebacks: bool = True) -> RankGroup:
    """Spawn one engine-core process per DP rank over ``sockets`` (a started ``RankGroup``; the ranks ignore
    SIGINT/SIGTERM/SIGHUP: the caller drains and stops them). ``child_tracebacks``: a rank that fails prints its
    traceback to stderr."""
    import logging

    from runner.core.engine_core_proc import run_engine_core
    from runner.distributed.launch import RankGroup

    dp = cfg.data_parallel_size
    group = RankGroup(run_engine_core, dp, args=(cfg, sockets.inputs, sockets.outputs), timeout_s=cfg.dist_timeout_s,
                      device=cfg.device, num_threads=rank_threads(dp), child_tracebacks=child_tracebacks,
                      parent_handles_signals=True, import_main=False)
    group.start()
    logging.getLogger("ubatch.engine").info(
        "engine: %d rank process(es): %s", dp, ", ".join(f"rank {r} pid {pid}" for r, pid in enumerate(group.pids)))
    return group


class EngineProcesses:
    """What must not outlive a client: the rank group and its supervisor, the ZeroMQ context and sockets, and the
    private socket directory. An object apart from the client, so that interpreter exit can close it
    (``atexit``) without keeping the client alive."""

    def __init__(self, sockets: EngineSockets, owns_ranks: bool) -> None:
        self.sockets = sockets
        self.owns_ranks = owns_ranks  # attached (--api-server-count): ranks and socket directory are another's
        self.group: RankGroup | None = None
        self.supervisor: RankSupervisor | None = None
        self.ctx: zmq.Context[Any] | None = None
        self.out: zmq.Socket[Any] | None = None
        self.inputs: list[zmq.Socket[Any]] = []
        self.leaving = False  # the ranks were told to leave: their exit is expected

    def connect(self, ctx: zmq.Context[Any], output: str | None) -> None:
        """Connect a PUSH socket to every rank's input and, for a client, bind its ``output`` address."""
        import zmq

        self.ctx = ctx
        if output is not None:
            self.out = ctx.socket(zmq.PULL)
            self.out.bind(output)
        for addr in self.sockets.inputs:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(addr)
            self.inputs.append(sock)

    def start(self, cfg: RunnerConfig, what: str, *, rank_tracebacks: bool = True,
              on_failure: Callable[[str], None] | None = None) -> None:
        """Spawn the ranks and supervise them: a failure while ``what`` runs is handed to ``on_failure`` (from the
        supervisor's thread) unless the ranks were told to leave."""
        from runner.distributed.launch import RankSupervisor

        self.group = start_ranks(cfg, self.sockets, child_tracebacks=rank_tracebacks)
        self.supervisor = RankSupervisor(self.group, what, lambda: self.leaving, on_failure)

    def alive(self) -> bool:
        """Some rank this client started is still running."""
        return self.group is not None and any(p.is_alive() for p in self.group.procs)

    def send_shutdown(self) -> None:
        """Tell every rank to leave its loop once its wave has ended."""
        self.leaving = True
        data = ENCODER.encode(Shutdown())
        for sock in self.inputs:
            sock.send(data)

    def stop_ranks(self, grace_s: float) -> list[int]:
        """Stop watching, then stop every rank still running (SIGTERM, SIGKILL after ``grace_s``); returns the
        ranks that had to be stopped. Idempotent."""
        if self.supervisor is not None:
            self.supervisor.stop()
        group, self.group = self.group, None
        return [] if group is None else group.close(grace_s=grace_s)

    def close(self, graceful: bool = True, wait_s: float = SHUTDOWN_WAIT_S) -> list[int]:
        """``graceful``: tell the ranks to leave and give idle ones ``wait_s``; then SIGKILL any rank
        still running and release the sockets. Returns the ranks that had to be stopped; a ``LaunchInterrupted``
        (a stop signal the caller armed) during the graceful wait stops them at once and is re-raised naming them.
        Idempotent; what interpreter exit runs for a synchronous client."""
        if self.group is None and self.ctx is None:  # closed already: nothing to import (a collected LLM at exit)
            return []
        from runner.distributed.launch import LaunchInterrupted

        atexit.unregister(self.close)
        interrupted: LaunchInterrupted | None = None
        if graceful and self.group is not None and self.ctx is not None:
            try:
                self.send_shutdown()
                deadline = time.monotonic() + wait_s
                while time.monotonic() < deadline and self.alive():
                    time.sleep(0.02)
            except LaunchInterrupted as exc:
                interrupted = exc
        self.leaving = True
        stopped = self.stop_ranks(grace_s=0.5)  # the ranks ignore SIGTERM: what is left gets SIGKILL
        self.release()
        if interrupted is not None:
            raise LaunchInterrupted(interrupted.signum, stopped) from None
        return stopped

    def release(self) -> None:
        """Close the sockets and remove the socket directory (an owned one). Idempotent."""
        if self.ctx is not None:
            for sock in self.inputs:
                sock.close(linger=0)
            if self.out is not None:
                self.out.close(linger=0)
            self.ctx.term()
            self.ctx = None
        if self.owns_ranks:
            self.sockets.remove()


class MPClient:
    """The shared part of the multi-process clients (module docstring). A subclass opens the sockets in its own
    I/O flavour (:meth:`_open`), waits for messages its own way and hands each to :meth:`_handle`, and gets the
    outputs of its requests in :meth:`_process`.

    ``sockets``: attach as client ``client_index`` to ranks another process started over these sockets
    (``--api-server-count``); that process supervises and stops them. Without it, this client starts, supervises
    and stops the ranks itself."""

    def __init__(self, cfg: RunnerConfig, *, sockets: EngineSockets | None = None, client_index: int = 0) -> None:
        num_clients = 1 if sockets is None else len(sockets.outputs)
        if not 0 <= client_index < num_clients:
            raise ValueError(f"client_index {client_index} is outside [0, {num_clients}) (the clients of the sockets)")
        self.cfg = cfg
        self.client_index = client_index
        self._num_clients = num_clients
        self._sockets = sockets
        self._owns_ranks = sockets is None
        self._procs: EngineProcesses | None = None
        self._ranks: list[_Rank] = []
        self._where: dict[int, int] = {}  # engine request id -> rank, until it finished or was aborted
        self._latest_wave = -1  # the latest wave some rank started
        self._dead_error: str | None = None
        self._failed: tuple[float, str] | None = None  # a rank's own failure report: (when to act on it, text)
        self._tracebacks: dict[int, str] = {}  # by rank, of the ranks that failed with an exception

    # ------------------------------------------------------------------ processes and sockets
    def _open(self, ctx: zmq.Context[Any], *, what: str, rank_tracebacks: bool = True) -> EngineProcesses:
        """Bind this client's output socket, connect one to each rank's input, and start and supervise the ranks
        unless attached. ``what`` names the caller in the supervisor's words ("every rank exited while ...")."""
        import weakref

        dp = self.cfg.data_parallel_size
        if self._sockets is None:
            self._sockets = EngineSockets.create(dp, 1)
        sockets = self._sockets
        if len(sockets.inputs) != dp:
            raise ValueError(f"the sockets serve {len(sockets.inputs)} ranks but --data-parallel-size is {dp}")
        procs = self._procs = EngineProcesses(sockets, self._owns_ranks)
        procs.connect(ctx, sockets.outputs[self.client_index])
        self._ranks.extend(_Rank(sock) for sock in procs.inputs)
        if self._owns_ranks:
            me = weakref.WeakMethod(self._rank_failed)  # the supervisor must not keep the client alive

            def on_failure(message: str) -> None:
                method = me()
                if method is not None:
                    method(message)

            procs.start(self.cfg, what, rank_tracebacks=rank_tracebacks, on_failure=on_failure)
        return procs

    @property
    def pids(self) -> list[int]:
        """The rank processes' ids, in rank order (empty when attached or closed)."""
        group = None if self._procs is None else self._procs.group
        return [] if group is None else list(group.pids)

    # ------------------------------------------------------------------ engine facts
    @property
    def core_info(self) -> CoreInfo:
        """What rank 0 reported once loaded (the model's dtype, its experts backend, ...; alike on every rank)."""
        if not self._ranks or self._ranks[0].info is None:
            raise RuntimeError("the engine has not started yet: no rank reported Ready")
        return self._ranks[0].info

    @property
    def max_model_len(self) -> int:
        return self.core_info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.core_info.vocab_size

    @property
    def dead_error(self) -> str | None:
        return self._dead_error

    def _missing_ranks(self, timeout_s: float) -> str:
        """Why the ready-wait ended without every rank: the ranks that did not say Ready in ``timeout_s``."""
        missing = [r for r, rank in enumerate(self._ranks) if rank.info is None]
        return f"rank {', '.join(map(str, missing))} did not load the model within {timeout_s:.0f} s"

    # ------------------------------------------------------------------ requests
    def _pick_rank(self) -> int:
        ranks = self._ranks
        if len(ranks) == 1:
            return 0
        return min(range(len(ranks)), key=lambda r: (ranks[r].outstanding + ranks[r].others, r))

    def _queue(self, request: EngineCoreRequest) -> _Rank:
        """Give ``request`` to the rank with the least outstanding work; it is sent with that rank's next
        message (:meth:`_send_added`). Returns that rank."""
        r = self._pick_rank()
        self._where[request.request_id] = r
        rank = self._ranks[r]
        rank.outstanding += 1
        rank.added.append(request)
        return rank

    def _send_added(self, rank: _Rank) -> None:
        """Send ``rank`` the requests queued for it, in one message: they start in the same step."""
        added = rank.added
        if added:
            rank.added = []
            message = AddRequest(added[0], self.client_index) if len(added) == 1 else \
                AddRequests(added, self.client_index)
            rank.socket.send(ENCODER.encode(message))

    def _send(self, rank: _Rank, message: InputMessage) -> Any:
        """Send ``message`` to ``rank`` after the requests queued for it (an abort never overtakes the request it
        aborts); returns the socket's send (an awaitable on an asyncio socket: pyzmq's, third-party)."""
        self._send_added(rank)
        return rank.socket.send(ENCODER.encode(message))

    def _release(self, request_id: int) -> int | None:
        """Forget a request that finished or was aborted; returns its rank (None if unknown)."""
        rank = self._where.pop(request_id, None)
        if rank is not None:
            self._ranks[rank].outstanding -= 1
        return rank

    def _abort_engine_requests(self, request_ids: list[int]) -> None:
        """Abort these engine requests on the ranks that have them; their later outputs are dropped."""
        by_rank: dict[int, list[int]] = {}
        for rid in request_ids:
            rank = self._release(rid)
            if rank is not None:
                by_rank.setdefault(rank, []).append(rid)
        if self._procs is None or self._procs.ctx is None:
            return
        for rank, ids in by_rank.items():
            self._send(self._ranks[rank], AbortRequests(ids))

    # ------------------------------------------------------------------ messages
    def _handle(self, msg: OutputMessage) -> None:
        """One message from a rank (module docstring)."""
        if isinstance(msg, Outputs):
            self._on_outputs(msg)
        elif isinstance(msg, WaveStarted):
            self._ranks[msg.rank].running = True
            self._latest_wave = max(self._latest_wave, msg.wave)
            for rank in self._ranks:
                self._send(rank, Wake(msg.wave))
        elif isinstance(msg, WaveDone):
            rank = self._ranks[msg.rank]
            rank.running = False
            rank.next_wave = max(rank.next_wave, msg.wave + 1)
        elif isinstance(msg, Ready):
            self._ranks[msg.info.rank].info = msg.info
            if all(r.info is not None for r in self._ranks):
                self._on_ready()
        elif isinstance(msg, PrefixCacheReset):
            self._ranks[msg.rank].prefix_cache_reset = msg.reset
            if all(r.prefix_cache_reset is not None for r in self._ranks):
                self._on_prefix_cache_reset()
        elif isinstance(msg, Profile):
            rank = self._ranks[msg.rank]
            rank.trace, rank.traced = pickle.loads(msg.payload), True
            if all(r.traced for r in self._ranks):
                self._on_profiles()
        elif isinstance(msg, CoreFailed) and self._failed is None:
            # The rank exits next and the launcher names the likely cause among all failed ranks (a peer that
            # died first, not the rank whose collective broke on it): give it a moment to say so.
            self._failed = (time.monotonic() + CORE_FAILED_GRACE_S, f"rank {msg.rank} failed: {msg.message}")
            self._failure_reported(CORE_FAILED_GRACE_S)

    def _on_outputs(self, msg: Outputs) -> None:
        """A rank's step: its stats kept as they came; the outputs of requests this client still tracks (an
        aborted request's may still come, sent before the abort arrived) go to :meth:`_process`. The plain
        tokens go as they came: none finishes a request, and the processor skips a request it no longer has."""
        rank = self._ranks[msg.rank]
        rank.stats = msg.stats
        mine: list[EngineCoreOutput] = []
        if msg.outputs:
            where, ranks = self._where, self._ranks
            for out in msg.outputs:
                r = where.pop(out.request_id, None) if out.finish_reason is not None else \
                    where.get(out.request_id)
                if r is not None:
                    if out.finish_reason is not None:
                        ranks[r].outstanding -= 1
                    mine.append(out)
        if mine or msg.has_array_tokens:
            self._process(msg.engine_core_outputs(mine))
        if self._num_clients > 1:  # the rank counts every client's requests; its outputs to us are processed
            rank.others = max(0, msg.stats.num_running + msg.stats.num_waiting - rank.outstanding)

    def _process(self, outputs: EngineCoreOutputs) -> None:
        """The outputs of this client's requests, as a rank's step brought them."""
        raise NotImplementedError

    def _on_ready(self) -> None:
        """Every rank has said Ready."""

    def _on_profiles(self) -> None:
        """Every rank has sent its timeline."""

    def _on_prefix_cache_reset(self) -> None:
        """Every rank has answered the last :meth:`_ask_prefix_cache_reset`."""

    def _ask_prefix_cache_reset(self) -> list[Any]:
        """Send every rank ``ResetPrefixCache`` (their answers are collected by :meth:`_handle`); returns the
        sockets' sends (awaitables on asyncio sockets)."""
        for rank in self._ranks:
            rank.prefix_cache_reset = None
        return [self._send(rank, ResetPrefixCache(self.client_index)) for rank in self._ranks]

    def _prefix_cache_reset(self) -> bool:
        """Whether every rank reset its prefix cache (all have answered)."""
        return all(r.prefix_cache_reset for r in self._ranks)

    # ------------------------------------------------------------------ failure
    def _failure_reported(self, grace_s: float) -> None:
        """A rank reported its own failure: :meth:`_check_failed` must run once ``grace_s`` has passed."""

    def _check_failed(self) -> None:
        """Act on a rank's failure report once its grace period is over (the launcher named no cause by then)."""
        if self._dead_error is None and self._failed is not None and time.monotonic() >= self._failed[0]:
            self._die(self._failed[1])

    def _rank_failed(self, message: str) -> None:
        """The supervisor named a failed rank (called from its thread)."""
        if self._procs is not None and self._procs.supervisor is not None:
            self._tracebacks = self._procs.supervisor.tracebacks
        self._die(message)

    def _die(self, message: str) -> None:
        if self._dead_error is not None:
            return
        self._dead_error = message
        self._on_dead(message)

    def _on_dead(self, message: str) -> None:
        """The engine just died (``message`` names the rank)."""

    def _dead(self) -> RanksDeadError:
        assert self._dead_error is not None
        return RanksDeadError(f"the engine is dead: {self._dead_error}", self._dead_error, self._tracebacks)
