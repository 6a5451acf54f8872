"""What the offline front ends drive (vLLM's ``EngineCoreClient``): the protocol every client of the family
implements (``runner/engine/core_client.py`` picks one), and what one run reports.

Requests go in as :class:`~runner.core.requests.EngineCoreRequest` (the caller's ``OutputProcessor`` made them),
outputs come back as :class:`~runner.core.requests.EngineCoreOutput` s (one msgspec struct in process and on the
wire), and :meth:`EngineCoreClient.run` runs the engine until every request added has finished. The step loop
lives in the engine core (``EngineCore.run_wave`` in process, each rank's ``CoreLoop`` in its process); the caller
only turns outputs into ``RequestOutput`` s, while the cores step when they run in processes of their own.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from runner.config import RunnerConfig
from runner.core.messages import CoreInfo
from runner.core.overlap_loop import LoopStats
from runner.core.requests import EngineCoreOutputs, EngineCoreRequest
from runner.core.runner_protocol import ModelRunnerProtocol
from runner.tracing import RankTrace

OnOutputs = Callable[[EngineCoreOutputs], None]

@dataclass
class RunReport:
    """What one :meth:`EngineCoreClient.run` did, over every rank the client drives (steps are global: DP ranks
    step in lockstep). ``dbo_decisions``: per rank, the measured DBO cost model's buckets as they stand at the end
    (``BucketDecision.describe`` lines); ``traces``: per rank, the recorded timeline when a trace was asked for."""

    num_steps: int = 0
    num_ubatched_steps: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens of admitted requests looked up in the prefix cache, this run
    prefix_cache_hits: int = 0  # of which found there
    dbo_decisions: list[list[str]] = field(default_factory=list)
    traces: list[RankTrace | None] = field(default_factory=list)
    loop_stats: LoopStats | None = None  # the in-process engine core's step loop (None over processes)


class EngineCoreClient(Protocol):
    """One engine (every DP rank it runs) as the offline ``LLM`` sees it; used from one thread at a time."""

    @property
    def core_info(self) -> CoreInfo:
        """What the engine's rank 0 is: vocabulary, ``max_model_len``, dtype, experts backend, ..."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def runner(self) -> ModelRunnerProtocol | None:
        """The model runner when it is in this process (None: the engine runs in processes of its own)."""

    @property
    def forward_thread_id(self) -> int | None:
        """The thread the in-process engine core steps on (None: none in this process)."""

    def prepare(self, cfg: RunnerConfig) -> None:
        """Run the next :meth:`run` with ``cfg`` (benchmarks switch the loop settings between runs), or raise
        ValueError naming what cannot change any more."""

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request for the next :meth:`run`; ids are unique across the client's ranks."""

    def abort_requests(self, request_ids: list[int], message: str) -> None:
        """Finish these requests in the engine (the caller already finished them: a stop string); callable from
        ``on_outputs`` while :meth:`run` runs."""

    def reset_prefix_cache(self) -> bool:
        """Drop every rank's cached prefix blocks (vLLM's ``reset_prefix_cache``), between runs; True only if
        every rank did (False: a rank's requests still held KV blocks, and it dropped nothing)."""

    def run(self, on_outputs: OnOutputs, *, trace: bool = False) -> RunReport:
        """Run the engine until every request added has finished, handing each batch of outputs to
        ``on_outputs`` as it comes; ``trace`` records every rank's timeline for this run."""

    def close(self) -> None:
        """Stop the engine and release what it holds (rank processes, sockets, the model). Idempotent."""
