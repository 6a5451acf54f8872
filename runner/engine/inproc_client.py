"""The engine client for one rank in this process (vLLM's ``InprocClient``): an :class:`EngineCore` over a model
runner, stepped by the core's own loop (:meth:`EngineCore.run_wave`) in the calling thread.

The offline ``LLM`` uses it with one DP rank under ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` or an injected runner,
and on each rank of a world someone else launched (``torchrun``, or ``runner.distributed.launch``: vLLM's
``external_launcher``), where every rank steps its own core and the DP vote inside the runner keeps the ranks in
lockstep. The core is built on the first request, so its one-time
set-up (the garbage collector's tuning) is not counted in the first call's time.
"""
from __future__ import annotations

from runner import tracing
from runner.config import RunnerConfig
from runner.core.engine_core import EngineCore
from runner.core.messages import CoreInfo
from runner.core.requests import EngineCoreRequest
from runner.core.runner_protocol import ModelRunnerProtocol
from runner.distributed.liveness import report_progress
from runner.engine.engine_core_client import OnOutputs, RunReport


class InprocClient:
    """``InprocClient(cfg, runner)``; ``cfg`` may be replaced between runs (:meth:`prepare`: benchmarks switch
    the loop settings), the runner stays."""

    def __init__(self, cfg: RunnerConfig, runner: ModelRunnerProtocol) -> None:
        self.cfg = cfg
        self.runner = runner
        self._core: EngineCore | None = None

    @property
    def core(self) -> EngineCore:
        if self._core is None:
            self._core = EngineCore(self.cfg, self.runner, before_launch=report_progress)  # liveness: step count
        return self._core

    @property
    def core_info(self) -> CoreInfo:
        """What a rank process would report of this runner once loaded (a ModelRunner's; a stand-in has none)."""
        from runner.core.engine_core_proc import rank_info
        from runner.worker.model_runner import ModelRunner

        if not isinstance(self.runner, ModelRunner):
            raise TypeError(f"this client runs an injected {type(self.runner).__name__}, not a ModelRunner")
        return rank_info(self.runner)

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def forward_thread_id(self) -> int | None:
        return self._core.forward_thread_id if self._core is not None else None

    def prepare(self, cfg: RunnerConfig) -> None:
        """Step with ``cfg`` from the next run on (the loop settings; the model and its cache stay), and build the
        core now if this is the first run, so its set-up is not counted in the run's time."""
        self.cfg = cfg
        self.core.cfg = cfg

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[int], message: str) -> None:
        self.core.abort_requests(request_ids, message)

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def run(self, on_outputs: OnOutputs, *, trace: bool = False) -> RunReport:
        core, runner = self.core, self.runner
        steps0, ubatched0 = runner.num_steps, runner.num_ubatched_steps
        sched = core.scheduler
        preemptions0, queries0, hits0 = sched.num_preemptions, sched.prefix_cache_queries, sched.prefix_cache_hits
        with tracing.record("trace" if trace else None, runner.device) as rec:  # clock: the runner's device
            core.run_wave(on_outputs)
        allocator = core.scheduler.allocator
        if allocator.num_free_blocks != allocator.num_blocks:  # a leak would starve later runs
            raise RuntimeError(f"KV blocks leaked: {allocator.num_blocks - allocator.num_free_blocks} still "
                               "allocated after every request finished")
        cost_model = runner.cost_model
        return RunReport(num_steps=runner.num_steps - steps0, num_ubatched_steps=runner.num_ubatched_steps - ubatched0,
                         num_preemptions=sched.num_preemptions - preemptions0,
                         prefix_cache_queries=sched.prefix_cache_queries - queries0,
                         prefix_cache_hits=sched.prefix_cache_hits - hits0,
                         dbo_decisions=[[] if cost_model is None else [d.describe() for d in cost_model.decisions()]],
                         traces=[tracing.local_spans(rec)], loop_stats=core.last_loop_stats)

    def close(self) -> None:
        """Stop the core's forward thread and release the runner (the runner alone if no core was built)."""
        if self._core is not None:
            core, self._core = self._core, None
            core.close()
            return
        self.runner.close()
