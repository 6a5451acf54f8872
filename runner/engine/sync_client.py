"""The multi-process engine client driven synchronously from the calling thread (vLLM's ``SyncMPClient``): what
the offline ``LLM`` and the CLI run by default, one engine-core process per DP rank (one for one rank).

The ranks are the server's (``runner.engine.mp_client``): they die with this process (``PR_SET_PDEATHSIG``),
ignore the terminal's Ctrl-C (this process stops them), and are stopped by :meth:`SyncMPClient.close`, also run
at interpreter exit, registered after multiprocessing's own exit hook (which would otherwise wait on them).

- **A run** sends each rank its share of the requests in one message (they start in the same step on every
  rank, as in SPMD) and ends once every request has finished and every rank reported the end of the last wave
  (its final counters come just before that report, on the same socket), so the counters read then are exact.
  The front end turns one step's outputs into ``RequestOutput`` s while the ranks run the next steps.
- **Failure.** A dead rank ends the run with :class:`~runner.engine.mp_client.RanksDeadError` naming it as the
  launcher does; the client is dead from then on. ``rank_tracebacks=False`` keeps the ranks' tracebacks off
  stderr (the CLI prints them with ``--debug``).
- **Signals.** Where the caller armed ``runner.distributed.launch.ParentSignals`` (the CLI), a stop signal while
  the ranks load, step or leave raises :class:`~runner.distributed.launch.LaunchInterrupted`: the client stops
  every rank at once and re-raises it naming the ranks it stopped, as ``launch`` does.
"""
from __future__ import annotations

import atexit
import time

from runner.config import RunnerConfig
from runner.core.messages import OUTPUT_DECODER, OutputMessage, StartProfile, StopProfile
from runner.core.requests import EngineCoreOutputs, EngineCoreRequest
from runner.core.runner_protocol import ModelRunnerProtocol
from runner.distributed.launch import LaunchInterrupted
from runner.engine.engine_core_client import OnOutputs, RunReport
from runner.engine.mp_client import RESET_PREFIX_CACHE_WAIT_S, STARTUP_GRACE_S, MPClient, RanksDeadError
from runner.tracing import RankTrace
from runner.worker.dbo_cost_model import describe_bucket

# How long one wait on the ranks' socket lasts before the client looks at the supervisor's verdict again.
POLL_MS = 100
# How long the ranks get to send their recorded timelines after StopProfile.
PROFILE_WAIT_S = 60.0


class SyncMPClient(MPClient):
    """``SyncMPClient(cfg)`` starts ``cfg.data_parallel_size`` rank processes and returns once each has loaded the
    model (or raises :class:`RanksDeadError` naming the rank that could not)."""

    def __init__(self, cfg: RunnerConfig, *, rank_tracebacks: bool = True) -> None:
        import multiprocessing.util  # noqa: F401 - its exit hook registered before ours, so ours runs first

        import zmq

        super().__init__(cfg)
        self._pending: list[EngineCoreRequest] = []
        self._on_step: OnOutputs | None = None  # the running run()'s callback
        try:
            procs = self._open(zmq.Context(), what="the engine", rank_tracebacks=rank_tracebacks)
            atexit.register(procs.close)  # after multiprocessing's own exit hook: runs before it
            self._wait_ready(STARTUP_GRACE_S + cfg.dist_timeout_s)
        except LaunchInterrupted as exc:
            raise self._interrupted(exc) from None
        except BaseException:
            if self._procs is not None:
                self._procs.close(graceful=False)
            raise

    # ------------------------------------------------------------------ EngineCoreClient
    @property
    def runner(self) -> ModelRunnerProtocol | None:
        return None  # the model runners are in the rank processes

    @property
    def forward_thread_id(self) -> int | None:
        return None  # the ranks step in their own processes

    def prepare(self, cfg: RunnerConfig) -> None:
        """The ranks fixed their settings when they loaded: a changed ``cfg`` needs a new client, but for
        ``trace_file``, which this process writes."""
        import dataclasses

        changed = [f.name for f in dataclasses.fields(cfg)
                   if f.name != "trace_file" and getattr(cfg, f.name) != getattr(self.cfg, f.name)]
        if changed:
            raise ValueError(f"the engine-core processes were started with other settings ({', '.join(changed)}); "
                             "build a new LLM to change them")

    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        self._pending.append(request)

    def abort_requests(self, request_ids: list[int], message: str) -> None:
        self._abort_engine_requests(request_ids)

    def run(self, on_outputs: OnOutputs, *, trace: bool = False) -> RunReport:
        self._check_alive()
        ranks = self._ranks
        before = [r.stats for r in ranks]
        pending, self._pending = self._pending, []
        if trace:
            for rank in ranks:
                self._send(rank, StartProfile())
        for request in pending:
            self._queue(request)
        for rank in ranks:  # one message per rank: its requests start in the same step
            self._send_added(rank)
        self._on_step = on_outputs
        try:
            while self._where or any(r.next_wave <= self._latest_wave for r in ranks):
                self._handle(self._next_message())
        except LaunchInterrupted as exc:
            raise self._interrupted(exc) from None
        except BaseException:
            if self._dead_error is None and self._procs is not None and self._procs.ctx is not None:
                self._abort_engine_requests(list(self._where))  # a run cut short here: the ranks drop its rest
            raise
        finally:
            self._on_step = None
        traces = self._collect_traces() if trace else []
        leaked = [(r, rank.stats.kv_cache_usage) for r, rank in enumerate(ranks) if rank.stats.kv_cache_usage > 0]
        if leaked:
            raise RuntimeError("KV blocks leaked: " + ", ".join(f"rank {r} still holds {u:.1%} of its KV cache"
                                                                for r, u in leaked)
                               + " after every request finished")
        pairs = list(zip(ranks, before, strict=True))
        return RunReport(
            num_steps=max(r.stats.num_steps - b.num_steps for r, b in pairs),
            num_ubatched_steps=max(r.stats.num_ubatched_steps - b.num_ubatched_steps for r, b in pairs),
            num_preemptions=sum(r.stats.num_preemptions - b.num_preemptions for r, b in pairs),
            prefix_cache_queries=sum(r.stats.prefix_cache_queries - b.prefix_cache_queries for r, b in pairs),
            prefix_cache_hits=sum(r.stats.prefix_cache_hits - b.prefix_cache_hits for r, b in pairs),
            dbo_decisions=[[describe_bucket(b.bucket, b.dbo_on, b.speedup) for b in r.stats.dbo_buckets]
                           for r in ranks],
            traces=traces)

    def reset_prefix_cache(self) -> bool:
        """Drop every rank's cached prefix blocks (between runs); True only if every rank did (a rank whose
        requests still held KV blocks answers False and drops nothing)."""
        self._check_alive()
        assert self._procs is not None and self._procs.out is not None
        self._ask_prefix_cache_reset()
        deadline = time.monotonic() + RESET_PREFIX_CACHE_WAIT_S
        out = self._procs.out
        while not all(rank.prefix_cache_reset is not None for rank in self._ranks):
            self._check_alive()
            if time.monotonic() > deadline:
                missing = [r for r, rank in enumerate(self._ranks) if rank.prefix_cache_reset is None]
                cause = (f"rank {', '.join(map(str, missing))} did not answer a prefix-cache reset within "
                         f"{RESET_PREFIX_CACHE_WAIT_S:.0f} s")
                raise RanksDeadError(cause, cause)
            if out.poll(POLL_MS):
                self._handle(OUTPUT_DECODER.decode(out.recv()))
        return self._prefix_cache_reset()

    def _process(self, outputs: EngineCoreOutputs) -> None:
        if self._on_step is not None:
            self._on_step(outputs)

    def _collect_traces(self) -> list[RankTrace | None]:
        ranks = self._ranks
        for rank in ranks:
            rank.trace, rank.traced = None, False
            self._send(rank, StopProfile(self.client_index))
        deadline = time.monotonic() + PROFILE_WAIT_S
        while not all(rank.traced for rank in ranks):
            if time.monotonic() > deadline:
                missing = [r for r, rank in enumerate(ranks) if not rank.traced]
                cause = (f"rank {', '.join(map(str, missing))} sent no timeline within {PROFILE_WAIT_S:.0f} s of "
                         "being asked")
                raise RanksDeadError(cause, cause)
            self._handle(self._next_message())
        return [rank.trace for rank in ranks]

    # ------------------------------------------------------------------ waiting
    def _next_message(self) -> OutputMessage:
        """The next message from any rank; raises :class:`RanksDeadError` once a rank is known dead."""
        assert self._procs is not None and self._procs.out is not None
        out = self._procs.out
        while True:
            self._check_alive()
            if out.poll(POLL_MS):
                return OUTPUT_DECODER.decode(out.recv())

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(r.info is not None for r in self._ranks):
            if time.monotonic() > deadline:
                cause = self._missing_ranks(timeout_s)
                raise RanksDeadError(cause, cause)
            self._handle(self._next_message())

    def _check_alive(self) -> None:
        self._check_failed()
        if self._dead_error is not None:
            if self._procs is not None:
                self._procs.close(graceful=False)  # the surviving ranks cannot step without their peer
            raise self._dead()

    def _interrupted(self, exc: LaunchInterrupted) -> LaunchInterrupted:
        """A stop signal while the ranks load or step: stop them all now; the client is dead from then on."""
        if self._dead_error is None:
            self._dead_error = str(exc)
        stopped = [] if self._procs is None else self._procs.close(graceful=False)
        return LaunchInterrupted(exc.signum, stopped)

    def close(self) -> None:
        """Let the ranks leave (requests still running are aborted first: a run cut short by an exception),
        stop any that do not, release the sockets. Idempotent."""
        self._pending = []
        if self._procs is None:
            return
        if self._dead_error is None and self._where and self._procs.ctx is not None:
            self._abort_engine_requests(list(self._where))
        self._procs.close(graceful=self._dead_error is None)
