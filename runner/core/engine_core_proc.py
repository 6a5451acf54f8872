"""One DP rank's engine-core process for the server: an :class:`EngineCore` behind ZeroMQ (vLLM V1's
``EngineCoreProc``).

It runs in a rank spawned by ``runner.distributed.launch.RankGroup`` (the process group is joined before
:func:`run_engine_core` is called), receives requests from the engine client between steps and sends the
outputs of every step back. The client tokenizes, detokenizes and checks stop strings; this loop only steps.

**Clients.** The rank binds its input socket, which every client (one per API-server process,
``--api-server-count``) connects to, and connects one output socket to each client. Each request arrives with
its client's index; its outputs go to that client only, while ``Ready``, ``WaveStarted``/``WaveDone`` and
``CoreFailed`` go to every client, and each client gets the rank's stats at least every ``STATS_INTERVAL_S``
while the rank is busy and at the end of every wave.

**Waves** (what keeps the DP collectives paired). A step of any rank takes part in one DP all-reduce (the
vote) and, with expert parallelism, in every layer's all-to-all, so all ranks must run the same steps. A rank
with work keeps stepping; the vote tells every rank in the same step when no rank has work left (the wave is
over, :class:`~runner.core.engine_core.EngineCoreStep` ``running=False``), and each rank then counts
``wave += 1`` and blocks on its socket: an idle server uses no CPU. A rank given a request while idle starts
the next wave and tells the client (:class:`~runner.core.messages.WaveStarted`), which wakes every rank for
that wave (:class:`~runner.core.messages.Wake`). A wake for a wave this rank has not reached yet (it is still
in the last step of the previous one) is remembered and honoured when that step ends; a wake for a wave
already over is ignored. So every rank runs every wave, and all leave it in the same step. With one rank a
wave simply ends when its scheduler is empty.
"""
from __future__ import annotations

import contextlib
import logging
import pickle
import time
from typing import TYPE_CHECKING

import numpy as np

from runner.config import RunnerConfig
from runner.core.engine_core import EngineCore
from runner.core.messages import (
    ENCODER,
    INPUT_DECODER,
    AbortRequests,
    AddRequest,
    AddRequests,
    CoreFailed,
    CoreInfo,
    CoreStats,
    DBOBucketStat,
    OutputMessage,
    Outputs,
    PrefixCacheReset,
    Profile,
    Ready,
    ResetPrefixCache,
    Shutdown,
    StartProfile,
    StopProfile,
    Wake,
    WaveDone,
    WaveStarted,
)
from runner.core.requests import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest

if TYPE_CHECKING:  # the model code is imported in the rank, once it runs; pyzmq where the loop starts
    import zmq

    from runner.tracing import Recording
    from runner.worker.model_runner import ModelRunner

logger = logging.getLogger("ubatch.engine_core")

# How long an idle rank blocks on its socket before looking again (it wakes at once when a message comes).
IDLE_POLL_MS = 1000
# Without outputs, a busy rank still reports its load this often, for the server's gauges.
STATS_INTERVAL_S = 0.5
# A profile window covers at least this many steps of a busy rank, however soon /stop_profile comes.
MIN_PROFILE_STEPS = 2


def run_engine_core(cfg: RunnerConfig, input_addresses: list[str], output_addresses: list[str]) -> None:
    """The body of one spawned rank (``RankGroup(run_engine_core, dp, args=(cfg, inputs, outputs))``): rank ``r``
    binds ``input_addresses[r]`` and sends to every client's ``output_addresses[c]``."""
    import torch.distributed as dist
    import zmq

    from runner.distributed.launch import describe_exception
    from runner.distributed.liveness import report_progress

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    ctx = zmq.Context()
    outs = []
    for address in output_addresses:
        out = ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 2000)  # let the last messages (a failure report) leave before the process ends
        out.connect(address)
        outs.append(out)
    inp = ctx.socket(zmq.PULL)
    inp.setsockopt(zmq.LINGER, 0)
    inp.bind(input_addresses[rank])
    core: EngineCore | None = None
    try:
        from runner.worker.model_runner import ModelRunner

        runner = ModelRunner(cfg, rank, world)
        core = EngineCore(cfg, runner, before_launch=report_progress)
        send_all(outs, Ready(rank_info(runner)))
        CoreLoop(core, inp, outs, rank, world).run()
    except BaseException as exc:
        send_all(outs, CoreFailed(rank, describe_exception(exc)))
        raise
    finally:
        if core is not None:
            core.close()
        inp.close()
        for out in outs:
            out.close()
        ctx.term()


def rank_info(runner: ModelRunner) -> CoreInfo:
    """What a client needs to know of a loaded rank (its ``Ready``)."""
    dtype = str(next(runner.model.parameters()).dtype).removeprefix("torch.")
    return CoreInfo(runner.rank, runner.max_model_len, runner.vocab_size, runner.num_kv_blocks, runner.block_size,
                    sorted(runner.eos_token_ids), dtype, runner.experts_backend)


def send_all(outs: list[zmq.Socket[bytes]], msg: OutputMessage) -> None:
    """One message to every client (encoded once)."""
    data = ENCODER.encode(msg)
    for out in outs:
        out.send(data)


class CoreLoop:
    """Receive between steps, step while the wave runs, send what each step produced (module docstring)."""

    def __init__(self, core: EngineCore, inp: zmq.Socket[bytes], outs: list[zmq.Socket[bytes]], rank: int,
                 world: int) -> None:
        import zmq

        self.core, self.inp, self.outs, self.rank, self.world = core, inp, outs, rank, world
        self.client_of: dict[int, int] = {}  # engine request id -> the client that sent it (its output socket)
        self.poller = zmq.Poller()
        self.poller.register(inp, zmq.POLLIN)
        self.wave = 0
        self.running = False
        self.wake_for = -1  # the latest wave a Wake asked for
        self.stopping = False
        self._last_stats = [0.0] * len(outs)  # per client
        self._profile: contextlib.ExitStack | None = None  # open while a /start_profile window records
        self._recording: Recording | None = None
        self._profiled_steps = 0  # steps run since the window opened
        self._stop_profile_after = False  # a stop came before MIN_PROFILE_STEPS steps: stop once they ran
        self._profile_client = 0  # the client that asked for that stop

    def run(self) -> None:
        while True:
            self._receive(0 if self.running else IDLE_POLL_MS)
            if self.stopping and not self.running:
                return
            if not self.running:
                self._send_outputs(self.core.take_outputs())  # requests refused at arrival
                continue
            step = self.core.step()
            self._send_outputs(step.outputs, force_stats=not step.running)
            if self._profile is not None:
                self._profiled_steps += 1
                if self._stop_profile_after and (self._profiled_steps >= MIN_PROFILE_STEPS or not step.running):
                    self._stop_profile(self._profile_client)
            if not step.running:
                self.running = False
                send_all(self.outs, WaveDone(self.rank, self.wave))
                self.wave += 1
                if self.wake_for >= self.wave and not self.stopping:
                    self.running = True

    def _receive(self, timeout_ms: int) -> None:
        while self.poller.poll(timeout_ms):
            timeout_ms = 0
            msg = INPUT_DECODER.decode(self.inp.recv())
            if isinstance(msg, AddRequest):
                self._add_request(msg.request, msg.client_index)
            elif isinstance(msg, AddRequests):
                for request in msg.requests:
                    self._add_request(request, msg.client_index)
            elif isinstance(msg, AbortRequests):
                self.core.abort_requests(msg.request_ids)
                for request_id in msg.request_ids:  # nothing more is reported for them
                    self.client_of.pop(request_id, None)
            elif isinstance(msg, Wake):
                self.wake_for = max(self.wake_for, msg.wave)
                if msg.wave == self.wave and not self.running and not self.stopping:
                    self.running = True
            elif isinstance(msg, Shutdown):
                self.stopping = True
            elif isinstance(msg, ResetPrefixCache):
                reset = self.core.reset_prefix_cache()
                self.outs[msg.client_index].send(ENCODER.encode(PrefixCacheReset(self.rank, reset)))
            elif isinstance(msg, StartProfile):
                self._start_profile()
            elif isinstance(msg, StopProfile):
                # A long step can hold both messages in one drain: a window of no step would say nothing.
                if self.running and self._profile is not None and self._profiled_steps < MIN_PROFILE_STEPS:
                    self._stop_profile_after = True
                    self._profile_client = msg.client_index
                else:
                    self._stop_profile(msg.client_index)

    def _add_request(self, request: EngineCoreRequest, client_index: int) -> None:
        if self.stopping:  # the client stops sending before Shutdown; never start a wave now
            refused = EngineCoreOutput(request.request_id, finish_reason="abort", error="the engine is shutting down")
            self.outs[client_index].send(ENCODER.encode(Outputs(self.rank, [refused], self._stats())))
            return
        self.client_of[request.request_id] = client_index
        self.core.add_request(request)
        self._start_wave()

    def _start_profile(self) -> None:
        from runner import tracing

        if self._profile is not None:
            return
        self._profiled_steps, self._stop_profile_after = 0, False
        self._profile = contextlib.ExitStack()
        self._recording = self._profile.enter_context(tracing.record("profile", self.core.runner.device))

    def _stop_profile(self, client_index: int) -> None:
        from runner import tracing

        spans = None
        if self._profile is not None:
            spans = tracing.local_spans(self._recording)
            self._profile.close()
            self._profile, self._recording, self._stop_profile_after = None, None, False
        self.outs[client_index].send(ENCODER.encode(Profile(self.rank, pickle.dumps(spans))))

    def _start_wave(self) -> None:
        if self.running:
            return
        self.running = True
        # with one rank too: a client's run ends once the wave it started is over, its final counters in
        send_all(self.outs, WaveStarted(self.rank, self.wave))

    def _send_outputs(self, outputs: EngineCoreOutputs, force_stats: bool = False) -> None:
        """Each client gets its requests' outputs; the stats go along, and alone to a client without outputs
        when ``force_stats`` or its last ones are ``STATS_INTERVAL_S`` old. With one client the array tokens go
        as they are (an aborted request makes none: the engine core drops its tokens); with several, each
        client's are picked out by its requests' ids."""
        now = time.monotonic()
        per_client: list[list[EngineCoreOutput]] = [[] for _ in self.outs]
        for out in outputs.outputs:
            client = self.client_of.pop(out.request_id, None) if out.finished else self.client_of.get(out.request_id)
            if client is not None:  # None: aborted by its client, which expects nothing more
                per_client[client].append(out)
        ids, tokens, blocks = outputs.request_ids, outputs.token_ids, outputs.logprob_tokens
        if len(self.outs) == 1:
            arrays = [(ids, tokens, blocks)]
        else:
            owner, block_owners = _owners(self.client_of, ids), [_owners(self.client_of, b.ids()) for b in blocks]
            arrays = [(ids[owner == c], tokens[owner == c],
                       [block.take(picked) for block, o in zip(blocks, block_owners, strict=True)
                        if len(picked := np.flatnonzero(o == c))])
                      for c in range(len(self.outs))]
        stats: CoreStats | None = None
        for client, mine in enumerate(per_client):
            mine_ids, mine_tokens, mine_blocks = arrays[client]
            if mine or len(mine_ids) or mine_blocks or force_stats or \
                    now - self._last_stats[client] >= STATS_INTERVAL_S:
                stats = stats if stats is not None else self._stats()
                self._last_stats[client] = now
                self.outs[client].send(ENCODER.encode(
                    Outputs.of(self.rank, EngineCoreOutputs(mine, mine_ids, mine_tokens, mine_blocks), stats)))

    def _stats(self) -> CoreStats:
        core, runner = self.core, self.core.runner
        sched = core.scheduler
        comm = runner.link_times()
        cost_model = runner.cost_model  # the measured DBO cost model (None without it)
        return CoreStats(num_running=core.num_running, num_waiting=core.num_waiting,
                         kv_cache_usage=core.kv_cache_usage, num_steps=runner.num_steps,
                         num_ubatched_steps=runner.num_ubatched_steps, num_preemptions=sched.num_preemptions,
                         prefix_cache_queries=sched.prefix_cache_queries, prefix_cache_hits=sched.prefix_cache_hits,
                         comm_s=comm[0] if comm else 0.0, comm_exposed_s=comm[1] if comm else 0.0,
                         dbo_buckets=[] if cost_model is None else [DBOBucketStat(d.label, d.dbo_on, d.ratio)
                                                                    for d in cost_model.decisions()])


def _owners(client_of: dict[int, int], request_ids: np.ndarray) -> np.ndarray:
    """The client of each request (-1: aborted by its client)."""
    get = client_of.get
    return np.fromiter((get(r, -1) for r in request_ids.tolist()), np.int64, count=len(request_ids))
