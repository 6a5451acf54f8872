"""The engine client for DP > 1 from a plain script (vLLM's ``SyncMPClient``): the server's engine-core processes,
one per DP rank, driven synchronously from the calling thread.

- **Processes.** The ranks are spawned by ``runner.distributed.launch.RankGroup`` running
  ``runner.core.engine_core_proc.run_engine_core``, as the server's client spawns them: a private rendezvous on
  loopback, heartbeats, ranks that die with this process (``PR_SET_PDEATHSIG``) and ignore the terminal's Ctrl-C
  (this process stops them). A supervisor thread names a rank that dies or falls silent. :meth:`close` (also
  run at interpreter exit) tells idle ranks to leave, then stops any rank still there.
- **Requests.** Each request goes to the rank with the fewest outstanding, a run's requests in one message per
  rank (``AddRequests``: they start in the same step on every rank, as in SPMD); every rank must step in every wave
  (``runner/core/engine_core_proc.py``), so a ``WaveStarted`` from one rank is relayed to all as ``Wake``.
- **A run** ends once every request sent has finished and every rank has reported the end of the last wave
  (its final counters come just before that report, on the same socket), so the counters read then are exact.
- **Failure.** A dead rank ends the run with :class:`RanksDeadError` (an
  :class:`~runner.engine.protocol.EngineDeadError`) naming it as the launcher does; the client is dead from then
  on. ``rank_tracebacks=False`` keeps the ranks' tracebacks off stderr (the CLI prints them with ``--debug``).
- **Signals.** Where the caller armed ``runner.distributed.launch.ParentSignals`` (the CLI), a stop signal while
  the ranks load, step or leave raises :class:`~runner.distributed.launch.LaunchInterrupted`: the client stops
  every rank at once and re-raises it naming the ranks it stopped, as ``launch`` does.
"""
from __future__ import annotations

import atexit
import pickle
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from runner.config import RunnerConfig
from runner.core.messages import (
    ENCODER,
    OUTPUT_DECODER,
    AbortRequests,
    AddRequests,
    CoreFailed,
    CoreInfo,
    CoreStats,
    OutputMessage,
    Outputs,
    Profile,
    Ready,
    Shutdown,
    StartProfile,
    StopProfile,
    Wake,
    WaveDone,
    WaveStarted,
)
from runner.core.requests import EngineCoreRequest
from runner.distributed.launch import LaunchInterrupted, RankGroup
from runner.engine.core_client import CORE_FAILED_GRACE_S, STARTUP_GRACE_S, EngineSockets, start_ranks
from runner.engine.engine_core_client import OnOutputs, RunReport
from runner.engine.protocol import EngineDeadError
from runner.tracing import RankTrace
from runner.worker.dbo_cost_model import describe_bucket

# How long one wait on the ranks' socket lasts before the client looks at the supervisor's verdict again.
POLL_MS = 100
# How long idle ranks get to leave their loops after Shutdown before they are killed.
SHUTDOWN_WAIT_S = 10.0
# How long the ranks get to send their recorded timelines after StopProfile.
PROFILE_WAIT_S = 60.0


class RanksDeadError(EngineDeadError):
    """The engine is dead because of its ranks: ``cause`` names them in one line, as the launcher does ("rank 1
    exited with signal SIGKILL"); ``tracebacks`` holds, by rank, those of ranks that failed with an exception."""

    def __init__(self, message: str, cause: str, tracebacks: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.cause = cause
        self.tracebacks = tracebacks or {}


@dataclass
class _Rank:
    socket: Any  # zmq PUSH: client -> this rank
    info: CoreInfo | None = None
    stats: CoreStats = field(default_factory=CoreStats)  # as of the rank's latest report
    next_wave: int = 0  # one past the last wave the rank reported finished
    trace: RankTrace | None = None
    traced: bool = False  # its Profile reply arrived


class _Processes:
    """What must not outlive the client: the rank processes, the sockets and their private directory. One object
    apart from the client, so interpreter exit can close it (``atexit``) without keeping the client alive."""

    def __init__(self) -> None:
        self.group: RankGroup | None = None
        self.ctx: Any = None
        self.out: Any = None
        self.ranks: list[_Rank] = []
        self.sockets: EngineSockets | None = None
        self.stop_supervising = threading.Event()
        self.supervisor: threading.Thread | None = None
        self.leaving = False  # close() told the ranks to leave: their exit is expected

    def close(self, graceful: bool = True) -> list[int]:
        """``graceful``: send Shutdown and give idle ranks :data:`SHUTDOWN_WAIT_S` to leave; then SIGKILL any
        rank still running. Returns the ranks that had to be stopped; a :class:`LaunchInterrupted` during the
        graceful wait stops them at once and is re-raised naming them. Idempotent."""
        atexit.unregister(self.close)
        group, self.group = self.group, None
        stopped: list[int] = []
        interrupted: LaunchInterrupted | None = None
        if group is not None:
            self.leaving = True
            if graceful and self.ctx is not None:
                try:
                    for rank in self.ranks:
                        rank.socket.send(ENCODER.encode(Shutdown()))
                    deadline = time.monotonic() + SHUTDOWN_WAIT_S
                    while time.monotonic() < deadline and any(p.is_alive() for p in group.procs):
                        time.sleep(0.02)
                except LaunchInterrupted as exc:
                    interrupted = exc
            self.stop_supervising.set()
            stopped = group.close(grace_s=0.5)  # the ranks ignore SIGTERM: what is left gets SIGKILL
        if self.supervisor is not None:
            self.supervisor.join(timeout=10)
            self.supervisor = None
        if self.ctx is not None:
            for rank in self.ranks:
                rank.socket.close(linger=0)
            self.out.close(linger=0)
            self.ctx.term()
            self.ctx = None
        if self.sockets is not None:
            self.sockets.remove()
            self.sockets = None
        if interrupted is not None:
            raise LaunchInterrupted(interrupted.signum, stopped) from None
        return stopped


class SyncMPClient:
    """``SyncMPClient(cfg)`` starts ``cfg.data_parallel_size`` rank processes and returns once each has loaded the
    model (or raises :class:`EngineDeadError` naming the rank that could not)."""

    def __init__(self, cfg: RunnerConfig, *, rank_tracebacks: bool = True) -> None:
        import multiprocessing.util  # noqa: F401 - its exit hook registered before ours, so ours runs first

        import zmq

        self.cfg = cfg
        self._dead: str | None = None
        self._failed: tuple[float, str] | None = None  # a rank's own failure report: (when to act on it, text)
        self._tracebacks: dict[int, str] = {}  # by rank, of the ranks that failed with an exception
        self._where: dict[int, int] = {}  # engine request id -> rank, until it finished or was aborted
        self._outstanding = [0] * cfg.data_parallel_size  # per rank: requests sent and not finished
        self._pending: list[EngineCoreRequest] = []
        self._latest_wave = -1  # the latest wave some rank started
        procs = self._procs = _Processes()
        dp = cfg.data_parallel_size
        try:
            procs.sockets = EngineSockets.create(dp, 1)
            procs.ctx = zmq.Context()
            procs.out = procs.ctx.socket(zmq.PULL)
            procs.out.bind(procs.sockets.outputs[0])
            for addr in procs.sockets.inputs:
                sock = procs.ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(addr)
                procs.ranks.append(_Rank(sock))
            procs.group = start_ranks(cfg, procs.sockets, child_tracebacks=rank_tracebacks)
            atexit.register(procs.close)  # after multiprocessing's own exit hook: runs before it
            procs.supervisor = threading.Thread(target=self._supervise, args=(procs.group,),
                                                name="ubatch-rank-supervisor", daemon=True)
            procs.supervisor.start()
            self._wait_ready(STARTUP_GRACE_S + cfg.dist_timeout_s)
        except LaunchInterrupted as exc:
            raise self._interrupted(exc) from None
        except BaseException:
            procs.close(graceful=False)
            raise

    # ------------------------------------------------------------------ engine facts
    @property
    def core_info(self) -> CoreInfo:
        """What rank 0 reported once loaded (the model's dtype, its experts backend, ...; alike on every rank)."""
        info = self._procs.ranks[0].info
        assert info is not None  # every rank said Ready before __init__ returned
        return info

    @property
    def max_model_len(self) -> int:
        return self.core_info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.core_info.vocab_size

    @property
    def forward_thread_id(self) -> int | None:
        return None  # the ranks step in their own processes

    @property
    def pids(self) -> list[int]:
        """The rank processes' ids, in rank order (empty once closed)."""
        group = self._procs.group
        return [] if group is None else list(group.pids)

    # ------------------------------------------------------------------ requests
    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        self._pending.append(request)

    def abort_requests(self, request_ids: list[int], message: str) -> None:
        by_rank: dict[int, list[int]] = {}
        for rid in request_ids:
            rank = self._release(rid)
            if rank is not None:
                by_rank.setdefault(rank, []).append(rid)
        for rank, ids in by_rank.items():
            self._send(rank, AbortRequests(ids))

    def run(self, on_outputs: OnOutputs, *, trace: bool = False) -> RunReport:
        self._check_alive()
        ranks = self._procs.ranks
        before = [r.stats for r in ranks]
        pending, self._pending = self._pending, []
        if trace:
            for r in range(len(ranks)):
                self._send(r, StartProfile())
        batches: list[list[EngineCoreRequest]] = [[] for _ in ranks]
        for request in pending:
            rank = min(range(len(ranks)), key=lambda r: (self._outstanding[r], r))
            self._where[request.request_id] = rank
            self._outstanding[rank] += 1
            batches[rank].append(request)
        for rank, batch in enumerate(batches):  # one message per rank: its requests start in the same step
            if batch:
                self._send(rank, AddRequests(batch))
        try:
            while self._where or any(r.next_wave <= self._latest_wave for r in ranks):
                self._handle(self._next_message(), on_outputs)
        except LaunchInterrupted as exc:
            raise self._interrupted(exc) from None
        except BaseException:
            if self._dead is None and self._procs.ctx is not None:  # a run cut short here: the ranks drop its rest
                self.abort_requests(list(self._where), "the run was interrupted")
            raise
        traces: list[RankTrace | None] = []
        if trace:
            traces = self._collect_traces()
        leaked = [(r, rank.stats.kv_cache_usage) for r, rank in enumerate(ranks) if rank.stats.kv_cache_usage > 0]
        if leaked:
            raise RuntimeError("KV blocks leaked: " + ", ".join(f"rank {r} still holds {u:.1%} of its KV cache"
                                                                for r, u in leaked)
                               + " after every request finished")
        return RunReport(
            num_steps=max(r.stats.num_steps - b.num_steps for r, b in zip(ranks, before)),
            num_ubatched_steps=max(r.stats.num_ubatched_steps - b.num_ubatched_steps for r, b in zip(ranks, before)),
            num_preemptions=sum(r.stats.num_preemptions - b.num_preemptions for r, b in zip(ranks, before)),
            dbo_decisions=[[describe_bucket(b.bucket, b.dbo_on, b.speedup) for b in r.stats.dbo_buckets]
                           for r in ranks],
            traces=traces)

    def _collect_traces(self) -> list[RankTrace | None]:
        ranks = self._procs.ranks
        for r, rank in enumerate(ranks):
            rank.trace, rank.traced = None, False
            self._send(r, StopProfile())
        deadline = time.monotonic() + PROFILE_WAIT_S
        while not all(rank.traced for rank in ranks):
            if time.monotonic() > deadline:
                missing = [r for r, rank in enumerate(ranks) if not rank.traced]
                cause = (f"rank {', '.join(map(str, missing))} sent no timeline within {PROFILE_WAIT_S:.0f} s of "
                         "being asked")
                raise RanksDeadError(cause, cause)
            self._handle(self._next_message(), None)
        return [rank.trace for rank in ranks]

    def _release(self, request_id: int) -> int | None:
        """Forget a request that finished or was aborted; returns its rank (None if unknown)."""
        rank = self._where.pop(request_id, None)
        if rank is not None:
            self._outstanding[rank] -= 1
        return rank

    # ------------------------------------------------------------------ messages
    def _send(self, rank: int, msg: Any) -> None:
        self._procs.ranks[rank].socket.send(ENCODER.encode(msg))

    def _next_message(self) -> OutputMessage:
        """The next message from any rank; raises :class:`EngineDeadError` once a rank is known dead."""
        out = self._procs.out
        while True:
            self._check_alive()
            if out.poll(POLL_MS):
                return OUTPUT_DECODER.decode(out.recv())

    def _handle(self, msg: OutputMessage, on_outputs: OnOutputs | None) -> None:
        ranks = self._procs.ranks
        if isinstance(msg, Outputs):
            ranks[msg.rank].stats = msg.stats
            # outputs of requests aborted here may still come (sent before the abort arrived): dropped
            outputs = [out for out in msg.outputs if out.request_id in self._where]
            for out in outputs:
                if out.finished:
                    self._release(out.request_id)
            if outputs and on_outputs is not None:
                on_outputs(outputs)
        elif isinstance(msg, WaveStarted):
            self._latest_wave = max(self._latest_wave, msg.wave)
            for r in range(len(ranks)):
                self._send(r, Wake(msg.wave))
        elif isinstance(msg, WaveDone):
            ranks[msg.rank].next_wave = max(ranks[msg.rank].next_wave, msg.wave + 1)
        elif isinstance(msg, Ready):
            ranks[msg.info.rank].info = msg.info
        elif isinstance(msg, Profile):
            ranks[msg.rank].trace = pickle.loads(msg.payload)
            ranks[msg.rank].traced = True
        elif isinstance(msg, CoreFailed) and self._failed is None:
            # The rank exits next and the launcher names the likely cause among all failed ranks (a peer that
            # died first, not the rank whose collective broke on it): give it a moment to say so.
            self._failed = (time.monotonic() + CORE_FAILED_GRACE_S, f"rank {msg.rank} failed: {msg.message}")

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        ranks = self._procs.ranks
        while not all(r.info is not None for r in ranks):
            if time.monotonic() > deadline:
                missing = [r for r, rank in enumerate(ranks) if rank.info is None]
                cause = f"rank {', '.join(map(str, missing))} did not load the model within {timeout_s:.0f} s"
                raise RanksDeadError(cause, cause)
            self._handle(self._next_message(), None)

    # ------------------------------------------------------------------ failure
    def _supervise(self, group: RankGroup) -> None:
        """Thread: wait on the rank processes; a failure (or an unexpected exit) kills the engine."""
        from runner.distributed.launch import RankFailedError

        procs = self._procs
        failure = group.watch(procs.stop_supervising, lambda: procs.leaving, "the engine")
        if failure is not None:
            if isinstance(failure, RankFailedError):
                self._tracebacks = failure.tracebacks
            self._dead = str(failure)

    def _check_alive(self) -> None:
        if self._dead is None and self._failed is not None and time.monotonic() >= self._failed[0]:
            self._dead = self._failed[1]
        if self._dead is not None:
            self._procs.close(graceful=False)  # the surviving ranks cannot step without their peer
            raise RanksDeadError(f"the engine is dead: {self._dead}", self._dead, self._tracebacks)

    @property
    def dead_error(self) -> str | None:
        return self._dead

    def _interrupted(self, exc: LaunchInterrupted) -> LaunchInterrupted:
        """A stop signal while the ranks load or step: stop them all now; the client is dead from then on."""
        if self._dead is None:
            self._dead = str(exc)
        return LaunchInterrupted(exc.signum, self._procs.close(graceful=False))

    def close(self) -> None:
        """Let the ranks leave (requests still running are aborted first: a run cut short by an exception),
        stop any that do not, release the sockets. Idempotent."""
        self._pending = []
        if self._dead is None and self._where and self._procs.ctx is not None:
            self.abort_requests(list(self._where), "the engine client was closed")
        self._procs.close(graceful=self._dead is None)
