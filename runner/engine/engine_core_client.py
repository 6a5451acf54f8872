"""What the offline front ends drive: one engine client, in-process for one rank or over the engine-core processes
for DP > 1 (vLLM's ``EngineCoreClient``: ``InprocClient`` / ``SyncMPClient``).

The client speaks the engine core's language: requests go in as :class:`~runner.core.requests.EngineCoreRequest`
(the caller's :class:`~runner.engine.output_processor.OutputProcessor` made them), outputs come back as
:class:`~runner.core.requests.EngineCoreOutput` s (over ZeroMQ, their fields as the ranks sent them:
``CoreOutput``), and :meth:`EngineCoreClient.run` runs the engine until every request added has finished. The
step loop lives in the engine core (``EngineCore.run_wave`` in process, each rank's ``CoreLoop`` over ZeroMQ);
the caller only turns outputs into ``RequestOutput`` s between steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from runner.core.overlap_loop import LoopStats
from runner.core.requests import CoreOutput, EngineCoreRequest
from runner.tracing import RankTrace

OnOutputs = Callable[[Sequence[CoreOutput]], None]


@dataclass
class RunReport:
    """What one :meth:`EngineCoreClient.run` did, over every rank the client drives (steps are global: DP ranks
    step in lockstep). ``dbo_decisions``: per rank, the measured DBO cost model's buckets as they stand at the end
    (``BucketDecision.describe`` lines); ``traces``: per rank, the recorded timeline when a trace was asked for."""

    num_steps: int = 0
    num_ubatched_steps: int = 0
    num_preemptions: int = 0
    dbo_decisions: list[list[str]] = field(default_factory=list)
    traces: list[RankTrace | None] = field(default_factory=list)
    loop_stats: LoopStats | None = None  # the in-process engine core's step loop (None over processes)


class EngineCoreClient(Protocol):
    """One engine (every DP rank it runs) as the offline ``LLM`` sees it; used from one thread at a time."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def forward_thread_id(self) -> int | None:
        """The thread the in-process engine core steps on (None: none in this process)."""

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request for the next :meth:`run`; ids are unique across the client's ranks."""

    def abort_requests(self, request_ids: list[int], message: str) -> None:
        """Finish these requests in the engine (the caller already finished them: a stop string); callable from
        ``on_outputs`` while :meth:`run` runs."""

    def run(self, on_outputs: OnOutputs, *, trace: bool = False) -> RunReport:
        """Run the engine until every request added has finished, handing each batch of outputs to
        ``on_outputs`` as it comes; ``trace`` records every rank's timeline for this run."""

    def close(self) -> None:
        """Stop the engine and release what it holds (rank processes, sockets, the model). Idempotent."""
