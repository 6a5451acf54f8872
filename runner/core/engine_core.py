"""EngineCore: one DP rank's engine -- its scheduler, its model runner and the step loop between them.

The in-process engine client drives one with :meth:`EngineCore.run_wave` (``runner/engine/inproc_client.py``);
each rank process runs one behind ZeroMQ (``runner/core/engine_core_proc.py``). Either way requests come in as
token ids (:class:`~runner.core.requests.EngineCoreRequest`), may be added or aborted between steps, join the
running batch at the next step (continuous batching), and come out as per-step
:class:`~runner.core.requests.EngineCoreOutput` s.

**Waves.** With DP every rank must take part in every step (the MoE all-to-alls pair up), so the ranks step
together from the moment any of them has work until the per-step DP vote finds that none has
(``runner.step`` returns None on every rank in the same step). That run of steps is a *wave*: :meth:`step`
returns ``running=False`` at its end, and the caller stops calling it until there is work again (the server
then blocks on its socket, using no CPU). With one rank a wave ends as soon as this rank has nothing left.
"""
from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from runner.config import RunnerConfig
from runner.core.logprob_rows import LogprobRows, LogprobTokens, StepLogprobs
from runner.core.overlap_loop import (
    LoopStats,
    StepLauncher,
    StepLoop,
    make_step_launcher,
    make_step_loop,
    use_overlap_loop,
)
from runner.core.requests import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from runner.core.runner_output import ModelRunnerOutput, PromptLogprobs
from runner.core.runner_protocol import ModelRunnerProtocol
from runner.core.scheduler import FINISHED, Request, Scheduler
from runner.core.scheduler_output import SchedulerOutput
from runner.worker.sampler import request_seed

#: The cyclic collector's first threshold once an engine core is built (CPython's default: 700). See tune_gc().
GC_THRESHOLD0 = 50_000


def tune_gc() -> tuple[int, ...]:
    """Keep Python's cyclic garbage collector off the step path; once, when an engine core is built.

    - Every object alive now (the model, the imported modules, the engine) leaves the collector's scans
      (``gc.freeze()``, after a full collection so no garbage is frozen), as vLLM does once its engine is up
      (``freeze_gc_heap``, ``vllm/utils/gc_utils.py``): a full collection would otherwise walk hundreds of
      thousands of objects once torch and a model are loaded.
    - The first generation's threshold is raised to :data:`GC_THRESHOLD0` (never lowered). The collector runs
      when allocations minus frees of container objects pass it; a step allocates a few per request (outputs,
      token lists) and frees them by the end of the step, so at 700 a step of 1024 requests would run about seven
      collections that found only that step's live objects to walk, and nothing to free. Garbage cycles are
      still collected once that many objects outlive their steps. The API server calls this too, where the
      defaults' cost was measured (``docs/benchmarks.md``, "The API server's CPU per streamed token").

    Objects made later are collected as usual; :meth:`EngineCore.close` unfreezes and puts the thresholds it
    returns (the ones before) back, so an offline ``LLM`` leaves its user's process as it found it.
    """
    gc.collect()
    gc.freeze()
    threshold = gc.get_threshold()
    if threshold[0] < GC_THRESHOLD0:
        gc.set_threshold(GC_THRESHOLD0, *threshold[1:])
    return threshold


@dataclass
class EngineCoreStep:
    """What one :meth:`EngineCore.step` produced; ``running`` is False when the wave ended with it."""

    outputs: EngineCoreOutputs = field(default_factory=EngineCoreOutputs)
    running: bool = True


class EngineCore:
    """``EngineCore(cfg, runner)``: ``cfg`` is the ``RunnerConfig`` (loop settings, step timeout), ``runner``
    the rank's model runner (or a test stand-in with its ``step`` and cache geometry)."""

    def __init__(self, cfg: RunnerConfig, runner: ModelRunnerProtocol, *,
                 before_launch: Callable[[int], None] | None = None) -> None:
        self.cfg = cfg
        self.runner = runner
        self.before_launch = before_launch
        self.scheduler = Scheduler.from_runner(cfg, runner)
        self.last_loop_stats: LoopStats | None = None  # the loop of the last wave that ended
        self._executor: StepLauncher | None = None
        self._loop: StepLoop | None = None
        self._live: set[int] = set()  # requests added and neither aborted by the client nor reported finished
        # gathered while steps run, until take_outputs(): plain tokens and tokens with log-probabilities as
        # arrays, per step; structs by request
        self._plain_tokens: list[tuple[np.ndarray, np.ndarray]] = []
        self._logprob_tokens: list[LogprobTokens] = []
        self._step_outputs: dict[int, EngineCoreOutput] = {}
        self._first_output_due: set[int] = set()  # added, first output (with num_cached_tokens) not yet made
        self._due_array: np.ndarray | None = None  # that set as an array (None: rebuild)
        self._gc_threshold = tune_gc()

    # ------------------------------------------------------------------ requests
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request for the next step; one that cannot run finishes at once with ``finish_reason``
        "error" (reported by the next :meth:`step` or :meth:`take_outputs`)."""
        params = request.sampling_params
        self.scheduler.add_request(request.prompt_token_ids, params, request_seed(params, request.default_seed),
                                   req_id=request.request_id)
        self._live.add(request.request_id)
        self._first_output_due.add(request.request_id)
        self._due_array = None

    def abort_requests(self, request_ids: Iterable[int], message: str = "aborted by the client") -> None:
        """Finish these requests with ``finish_reason`` "abort"; nothing more is reported for them (the caller
        knows). Their KV blocks are freed once no step in flight uses them. Unknown or finished ids are ignored."""
        for rid in request_ids:
            if rid not in self._live:
                continue
            self._live.discard(rid)
            self._forget_first_output(rid)
            self.scheduler.abort_request(rid, message, reason="abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Share of the KV blocks held by requests, in [0, 1] (cached blocks no request holds count as free)."""
        a = self.scheduler.allocator
        return 1.0 - a.num_free_blocks / a.num_blocks

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False (nothing dropped) while any request holds KV blocks."""
        return self.scheduler.reset_prefix_cache()

    # ------------------------------------------------------------------ stepping
    def step(self) -> EngineCoreStep:
        """One iteration of the step loop (with the overlap loop: launch step N+1, process step N). Returns
        what it produced; ``running=False`` when no DP rank had work (the wave is over: see module doc)."""
        if self._loop is None:
            self._loop = make_step_loop(
                self.scheduler, self.runner,
                executor=self._step_launcher() if use_overlap_loop(
                    self.cfg.disable_overlap_schedule, self.runner.device,
                    emulated_device=self.cfg.emulate_device is not None) else None,
                consecutive_prefill_overlap=not self.cfg.disable_consecutive_prefill_overlap,
                before_launch=self.before_launch, on_results=self._on_results,
                step_timeout_s=self.cfg.dist_timeout_s)
        try:
            running = self._loop.step()
        except BaseException:
            self._end_wave()
            raise
        if not running:
            self._end_wave()
        return EngineCoreStep(self.take_outputs(), running)

    def run_wave(self, on_outputs: Callable[[EngineCoreOutputs], None]) -> None:
        """Step until the wave ends (no DP rank has work), handing what each step produced to ``on_outputs``
        (which may add or abort requests between steps: a stop string found by the client). A request still
        unfinished when the wave ends (a runner that stopped early) finishes with an error, never silently."""
        on_outputs(self.take_outputs())  # requests refused at add time
        while True:
            step = self.step()
            on_outputs(step.outputs)
            if not step.running:
                break
        for rid in list(self._live):
            self.scheduler.abort_request(rid, "engine stopped before the request finished (model runner reported "
                                              "no work while this request was still queued)")
        on_outputs(self.take_outputs())

    def take_outputs(self) -> EngineCoreOutputs:
        """Outputs gathered since the last call, in order: new tokens, then each request that finished, once
        (also requests refused at add time while no wave runs)."""
        by_id = self._step_outputs
        for req in self.scheduler.take_finished():
            rid = req.req_id
            self.scheduler.forget(rid)
            if rid not in self._live:  # aborted by the client: it reports nothing more
                continue
            self._live.discard(rid)
            out = by_id.get(rid)
            if out is None:
                out = by_id[rid] = EngineCoreOutput(rid, num_prompt_tokens=len(req.prompt_token_ids),
                                                    num_cached_tokens=self._take_num_cached_tokens(req))
            self._forget_first_output(rid)  # never scheduled (refused): it made none
            out.finish_reason = req.finish_reason or "error"
            out.stop_reason, out.error = req.stop_reason, req.error
        self._step_outputs = {}
        parts, self._plain_tokens = self._plain_tokens, []
        blocks, self._logprob_tokens = self._logprob_tokens, []
        if not parts:
            return EngineCoreOutputs(list(by_id.values()), logprob_tokens=blocks)
        ids, tokens = parts[0] if len(parts) == 1 else (np.concatenate([p[0] for p in parts]),
                                                        np.concatenate([p[1] for p in parts]))
        return EngineCoreOutputs(list(by_id.values()), ids, tokens, blocks)

    def _end_wave(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None:
            self.last_loop_stats = loop.finish()

    def _on_results(self, out: SchedulerOutput, output: ModelRunnerOutput, done: list[Request]) -> None:
        """The tokens one processed step added, per request (finished requests are added by take_outputs).

        ``update`` has just applied the step: a sampling request got its token unless it had finished before
        (a stop found in an earlier step, an abort: ``Scheduler.last_discarded``), and the requests it finished
        are ``done``. The step's sampling rows become array tokens with numpy (no Python per request), plain or
        with their log-probabilities' rows, except the few that need a struct: a finished request (its last token
        goes with its finish), a discarded token, a request's first output (it carries ``num_cached_tokens``),
        and a request that already has a struct in this take.
        """
        finished = set(done)
        if output.prompt_logprobs is not None:
            self._add_prompt_logprobs(out, output.prompt_logprobs, finished)
        n = out.num_reqs
        if not n:
            return
        # a sampling row's token is an int (Scheduler.update checked it); only those rows are read below
        sampled = cast("list[int]", output.sampled_token_ids)
        if out.sample.all():
            rows: np.ndarray | None = None
            ids, tokens = out.req_ids, np.fromiter(sampled, np.int64, count=n)
        else:
            rows = np.flatnonzero(out.sample)
            ids = out.req_ids[rows]
            tokens = np.fromiter((sampled[i] for i in rows.tolist()), np.int64, count=len(rows))
        special = self._special_rows(ids, done)
        lp = output.logprobs
        if special is not None and special.any():
            where = np.flatnonzero(special)
            self._add_token_outputs(out, sampled, lp, finished, (where if rows is None else rows[where]).tolist())
            keep = ~special
            ids, tokens = ids[keep], tokens[keep]
            rows = np.flatnonzero(keep) if rows is None else rows[keep]
        if lp is not None and len(ids):  # the rows with log-probabilities: their arrays, the others plain
            lp_row = lp.index() if rows is None else lp.index()[rows]
            asked = lp_row >= 0
            if asked.any():
                picked = lp_row[asked]
                self._logprob_tokens.append(LogprobTokens.of(ids[asked], lp.num_top[picked], lp.rows.take(picked)))
                ids, tokens = ids[~asked], tokens[~asked]
        if len(ids):
            self._plain_tokens.append((ids, tokens))

    def _special_rows(self, ids: np.ndarray, done: list[Request]) -> np.ndarray | None:
        """Which of a step's sampling requests ``ids`` need a struct rather than a plain token
        (:meth:`_on_results`); None when none does (the steady decode)."""
        special: set[int] = {r.req_id for r in done}
        special.update(self.scheduler.last_discarded)
        special.update(self._step_outputs)
        mask = None
        if special:
            mask = np.isin(ids, np.fromiter(special, np.int64, count=len(special)))
        if self._first_output_due:
            due = self._first_output_due_ids()
            mask = np.isin(ids, due) if mask is None else mask | np.isin(ids, due)
        return mask if mask is not None and mask.any() else None

    def _first_output_due_ids(self) -> np.ndarray:
        """:attr:`_first_output_due` as an array, rebuilt only when the set changed."""
        if self._due_array is None:
            due = self._first_output_due
            self._due_array = np.fromiter(due, np.int64, count=len(due))
        return self._due_array

    def _add_token_outputs(self, out: SchedulerOutput, sampled: list[int], logprobs: StepLogprobs | None,
                           finished: set[Request], rows: Iterable[int]) -> None:
        """Structs for the sampling ``rows`` of a processed step (the ones :meth:`_on_results` does not make
        plain tokens), appended to a request's struct of this take if it has one."""
        live, step_outputs = self.scheduler.requests, self._step_outputs
        req_ids, sample = out.req_ids, out.sample
        for i in rows:
            rid = int(req_ids[i])
            req = live.get(rid)
            if not sample[i] or req is None or not _reports_token(req, finished):  # none, or discarded
                continue
            token = sampled[i]
            entry = None if logprobs is None else logprobs.row_at(i)
            prev = step_outputs.get(rid)
            if prev is None:
                step_outputs[rid] = EngineCoreOutput(rid, [token], entry,
                                                     num_prompt_tokens=len(out.requests[i].prompt_token_ids),
                                                     num_cached_tokens=self._take_num_cached_tokens(req))
            else:  # a second processed step in one take (a sync point): append
                prev.new_token_ids.append(token)
                if entry is not None:
                    prev.new_logprobs = entry if prev.new_logprobs is None else \
                        LogprobRows.concat([prev.new_logprobs, entry])

    def _add_prompt_logprobs(self, out: SchedulerOutput, entries: list[PromptLogprobs | None],
                             finished: set[Request]) -> None:
        """The prompt log-probabilities a prefill chunk computed, on its request's output (made for a chunk that
        sampled nothing); the client joins them by position (``prompt_logprobs_start``)."""
        live = self.scheduler.requests
        for rid, snap, chunk in zip(out.req_ids.tolist(), out.requests, entries, strict=True):  # one per request
            req = live.get(rid)
            if chunk is None or req is None or (req.status is FINISHED and req not in finished):
                continue
            prev = self._step_outputs.get(rid)
            if prev is None:
                self._step_outputs[rid] = EngineCoreOutput(rid, num_prompt_tokens=len(snap.prompt_token_ids),
                                                           new_prompt_logprobs=chunk.rows,
                                                           prompt_logprobs_start=chunk.start,
                                                           num_cached_tokens=self._take_num_cached_tokens(req))
            elif prev.new_prompt_logprobs is None:
                prev.new_prompt_logprobs, prev.prompt_logprobs_start = chunk.rows, chunk.start
            elif prev.prompt_logprobs_start + len(prev.new_prompt_logprobs) == chunk.start:
                prev.new_prompt_logprobs = LogprobRows.concat([prev.new_prompt_logprobs, chunk.rows])

    def _take_num_cached_tokens(self, req: Request) -> int | None:
        """The ``num_cached_tokens`` of a request's next output: its value on the first output made once the
        request was scheduled (the client keeps it), None on every other (one byte on the wire)."""
        if req.num_cached_tokens < 0 or req.num_cached_tokens_reported:
            return None
        req.num_cached_tokens_reported = True
        self._forget_first_output(req.req_id)
        return req.num_cached_tokens

    def _forget_first_output(self, req_id: int) -> None:
        if req_id in self._first_output_due:
            self._first_output_due.discard(req_id)
            self._due_array = None

    # ------------------------------------------------------------------ lifetime
    def _step_launcher(self) -> StepLauncher:
        """What launches the overlap loop's steps (created on first use, closed by close()): the scheduling
        thread itself where the runner queues steps on a device, a persistent forward thread otherwise."""
        if self._executor is None:
            self._executor = make_step_launcher(self.runner.device,
                                                emulated_device=self.cfg.emulate_device is not None)
        return self._executor

    @property
    def forward_thread_id(self) -> int | None:
        return self._executor.thread_id if self._executor is not None else None

    def close(self) -> None:
        """Wait for anything in flight, stop the forward thread and release the runner (and hand the frozen heap
        back to the garbage collector, so what this engine leaves behind can be collected)."""
        self._end_wave()
        gc.unfreeze()
        gc.set_threshold(*self._gc_threshold)
        if self._executor is not None:
            self._executor.close()
            self._executor = None
        self.runner.close()


def _reports_token(req: Request, finished: set[Request]) -> bool:
    """Whether a request reports the token of the step just processed: yes while it runs, and if that step
    finished it (a stop token, its length) unless it ended in error (no valid token was sampled); no if it
    had finished before."""
    return req.status is not FINISHED or (req in finished and req.finish_reason != "error")
