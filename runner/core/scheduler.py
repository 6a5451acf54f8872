"""Continuous batching with chunked prefill over a paged KV cache (vLLM V1 style, one rank).

Each step takes running requests first (decodes, then chunked prefills), then admits waiting ones within
``max_num_seqs`` and ``max_num_batched_tokens``. A running request short of a block preempts the most recently
admitted request not yet scheduled (recompute; its draws do not change); admission never preempts, so FCFS
guarantees progress. ``schedule()`` advances requests as if their step had run (placeholders for sampled
tokens) and ``update()`` fills in the real tokens, so step N+1 can be scheduled before N's results; with a step
in flight nothing is preempted (``wants_sync``). Steady decodes are scheduled and updated as arrays, in the
decode run (``decode_run.py``), with Python per request only where a request's state changes.

Prefix caching (on by default, as vLLM V1): a request being admitted takes the longest run of cached full blocks
of its known tokens (never its last token, which must be computed to sample), and a request's full blocks are
registered in the :class:`~runner.core.kv_blocks.BlockPool` under their chained content hashes once their KV is
scheduled: blocks a chunk fills (prompts, recomputes) at the end of the ``schedule()`` that takes it, so the
first step that may read them from another request is the next one (steps run in order on the device), and
blocks filled by decodes when the request's blocks are released (nothing to hash on a decode step). A request
asking for prompt logprobs or using penalties computes its whole history (both are computed from the step's
inputs, position 0 on). Design: docs/design_notes.md, "Engine core".
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import cast

import numpy as np

from runner.attention.kv_cache import BlockRows, BlockTable, blocks_needed
from runner.config import RunnerConfig
from runner.core.block_hash import extend_block_hashes
from runner.core.decode_run import DecodeRun
from runner.core.kv_blocks import BlockPool
from runner.core.prompt_checks import prompt_token_problem
from runner.core.runner_protocol import ModelRunnerProtocol
from runner.core.scheduler_output import RequestSnapshot, SchedulerOutput
from runner.core.slots import SlotPool, placeholder
from runner.sampling_params import SamplingParams, SamplingParamsError

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
# A decode joins the decode run if it stops on at most this many token ids (EOS and stop_token_ids): the run
# checks them as a [rows, k] table.
MAX_RUN_STOP_IDS = 16
FINISH_REASONS = ("stop", "length", "abort", "error")
# Why a request whose step sampled no valid token ends (its logits were NaN or infinite once its sampling
# settings were applied: a model overflow, or extreme settings); the rank goes on with the other requests.
INVALID_SAMPLE_ERROR = ("sampling produced no valid token: the logits were not finite (NaN or infinite) after this "
                        "request's sampling settings were applied")


@dataclass(eq=False, slots=True)  # identity semantics: requests live in lists that are searched and removed from
class Request:
    """The scheduler's own, mutable record of one request; a step hands the model runner its ``snapshot``."""

    req_id: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    seed: int = 0  # the seed of its draws (runner.worker.sampler.request_seed)
    outputs: list[int] = field(default_factory=list)  # output_token_ids' storage (see the properties below)
    computed: int = 0  # num_computed_tokens' storage
    block_ids: list[int] = field(default_factory=list)
    status: str = WAITING
    finish_reason: str | None = None
    error: str | None = None
    num_preemptions: int = 0
    slot: int = -1  # future-token-map slot (and block-table row) while admitted
    pending: int = 0  # num_pending's storage: trailing outputs that are still placeholders (step in flight)
    steps_inflight: int = 0  # inflight's storage: steps that scheduled it and are not yet updated
    stop_reason: int | None = None  # the stop token id when one of stop_token_ids ended it (vLLM's stop_reason)
    block_hashes: list[bytes] = field(default_factory=list)  # content hashes of its first full blocks of known tokens
    num_cached_blocks: int = 0  # leading blocks of block_ids found in, or registered with, the prefix cache
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache at its first scheduling (-1: not yet)
    num_cached_tokens_reported: bool = False  # the engine core sent num_cached_tokens with an output
    forgotten: bool = False  # finished and reported: drop it from Scheduler.requests once no step uses it
    # Fixed at add_request, so the per-step checks are one set lookup and one comparison:
    stop_ids: frozenset[int] = frozenset()  # tokens that stop it: EOS (unless ignore_eos) and stop_token_ids
    max_outputs: int = 0  # outputs after which it stops for length: max_tokens, or what max_model_len leaves
    # What the forward side reads of it (settings, seed, prompt), taken once: steps in flight hold it, never `self`.
    snapshot: RequestSnapshot = field(init=False)
    # Kept so that schedule() recognises a steady decode in few operations:
    prompt_len: int = field(init=False)  # len(prompt_token_ids), which never changes
    kv_capacity: int = 0  # tokens its blocks hold: len(block_ids) * block_size (Scheduler._add_blocks keeps it)
    # While in the scheduler's decode run, its computed, steps_inflight and pending fields and the tail of its
    # outputs are the run's (runner/core/decode_run.py); the properties below read them from there.
    run: DecodeRun[Request] | None = None

    def __post_init__(self) -> None:
        self.snapshot = RequestSnapshot(self.sampling, self.seed, tuple(self.prompt_token_ids))
        self.prompt_len = len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """Its outputs so far, a placeholder for each token still in flight last (a copy while in the run)."""
        return self.outputs if self.run is None else self.run.current_outputs(self)

    @property
    def num_computed_tokens(self) -> int:
        return self.computed if self.run is None else self.run.field_of(self, "computed")

    @property
    def num_pending(self) -> int:
        """Trailing outputs that are still placeholders (their step is in flight)."""
        return self.pending if self.run is None else self.run.field_of(self, "pending")

    @property
    def inflight(self) -> int:
        """Steps that scheduled it and are not yet updated."""
        return self.steps_inflight if self.run is None else self.run.field_of(self, "inflight")

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + (len(self.outputs) if self.run is None else self.run.field_of(self, "num_out"))

    def token_slice(self, start: int, stop: int) -> list[int]:
        p = self.prompt_len
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        return self.prompt_token_ids[start:] + self.outputs[max(start - p, 0):stop - p]

    @property
    def is_finished(self) -> bool:
        return self.status == FINISHED


def _check_prompt(prompt: object, vocab_size: int, max_model_len: int) -> str | None:
    """Why this prompt cannot run, or None."""
    problem = prompt_token_problem(prompt, vocab_size, max_model_len)
    return None if problem is None else f"prompt: {problem}"


def _check_sampling(sampling: SamplingParams, vocab_size: int) -> str | None:
    """Why these settings cannot run on this vocabulary (a token id they name is outside it), or None."""
    try:
        sampling.check_vocab(vocab_size)
    except SamplingParamsError as exc:
        return str(exc)
    return None


class Scheduler:
    """One rank's request queue, token budget and KV-block bookkeeping."""

    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, block_size: int, num_kv_blocks: int,
                 max_model_len: int, vocab_size: int, eos_token_ids: Iterable[int] = (),
                 enable_prefix_caching: bool = True) -> None:
        for name, v in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                        ("block_size", block_size), ("num_kv_blocks", num_kv_blocks),
                        ("max_model_len", max_model_len), ("vocab_size", vocab_size)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (one prompt token + one generated), got {max_model_len}")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.allocator = BlockPool(num_kv_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        # vLLM's vllm:prefix_cache_queries / _hits: tokens of admitted requests looked up, and found (cumulative)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Slots: scheduled requests (<= max_num_seqs), requests whose last token is in flight (they already
        # gave up their seat, < max_num_seqs) and finished ones still in a step in flight (< max_num_seqs).
        self.slots = SlotPool(3 * max_num_seqs)
        # Every admitted request's blocks, a row per slot, kept from step to step (the steps' metadata gathers
        # the rows); wide enough for max_model_len tokens.
        self.block_table = BlockTable(self.slots.capacity, blocks_needed(max_model_len, block_size))
        # Scheduled, non-empty steps not yet updated: their ids and their (live) requests, in schedule order
        self._inflight_steps: deque[tuple[int, list[Request]]] = deque()
        # Running requests in steady decode, as arrays (runner/core/decode_run.py)
        self._run: DecodeRun[Request] = DecodeRun(self.slots.capacity)
        self.wants_sync = False  # the last schedule() left a request out rather than preempt with a step in flight
        # the requests whose token the last update() discarded (they had finished while its step ran)
        self.last_discarded: list[int] = []
        self._step_seq = 0
        self.requests: dict[int, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._finished_since_schedule: list[int] = []
        self._finished_unreported: list[Request] = []  # for take_finished(), whatever finished them
        self._next_id = 0

    @property
    def num_decode_run_rows(self) -> int:
        """Running requests whose decode state is in the arrays of the decode run now."""
        return len(self._run)

    @property
    def num_inflight_steps(self) -> int:
        """Scheduled, non-empty outputs not yet updated."""
        return len(self._inflight_steps)

    @classmethod
    def from_runner(cls, cfg: RunnerConfig, runner: ModelRunnerProtocol) -> Scheduler:
        """Budgets from the config; cache geometry, vocabulary and EOS from the model runner."""
        return cls(max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                   block_size=runner.block_size, num_kv_blocks=runner.num_kv_blocks,
                   max_model_len=runner.max_model_len, vocab_size=runner.vocab_size,
                   eos_token_ids=runner.eos_token_ids, enable_prefix_caching=cfg.enable_prefix_caching)

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_token_ids: Sequence[int], sampling: SamplingParams | None = None,
                    seed: int = 0, req_id: int | None = None) -> Request:
        """Queue a request; a bad one is returned already finished with ``finish_reason == "error"``."""
        if req_id is None:
            req_id = self._next_id
        if req_id in self.requests:
            raise ValueError(f"request id {req_id} is already in use")
        self._next_id = max(self._next_id, req_id + 1)
        sampling = sampling or SamplingParams()
        prompt = list(prompt_token_ids) if isinstance(prompt_token_ids, Sequence) \
            and not isinstance(prompt_token_ids, (str, bytes)) else prompt_token_ids
        req = Request(req_id, prompt if isinstance(prompt, list) else [], sampling, seed)
        self.requests[req_id] = req
        error = _check_prompt(prompt, self.vocab_size, self.max_model_len) or \
            _check_sampling(sampling, self.vocab_size)
        max_tokens = sampling.max_tokens
        assert max_tokens is not None, "max_tokens=None is resolved before a request reaches the scheduler"
        if error is None:
            # KV positions ever written: every token but the last sampled one.
            longest = min(self.max_model_len, len(prompt) + max_tokens) - 1
            need = blocks_needed(longest, self.block_size)
            if need > self.allocator.num_blocks:
                error = (f"request may grow to {longest + 1} tokens, which needs {need} KV-cache blocks of "
                         f"{self.block_size} tokens but the cache has only {self.allocator.num_blocks}; raise "
                         "--num-kv-blocks or lower max_tokens / --max-model-len")
        if error is not None:
            self._finish(req, "error", error)
        else:
            req.stop_ids = frozenset(sampling.stop_token_ids or ()) | (
                frozenset() if sampling.ignore_eos else self.eos_token_ids)
            req.max_outputs = min(max_tokens, self.max_model_len - len(prompt))
            self.waiting.append(req)
        return req

    def abort_request(self, req_id: int, message: str = "aborted", reason: str = "error") -> None:
        """Finish a request now (``reason`` "error", or "abort" for one its client gave up on); its KV blocks are
        freed once no step in flight uses them. An id that is unknown or already finished is left alone: a
        client may abort a request that finished a moment before."""
        req = self.requests.get(req_id)
        if req is not None and not req.is_finished:
            self._finish(req, reason, message)

    def take_finished(self) -> list[Request]:
        """Requests finished since the last call, in the order they finished, whatever finished them (a stop
        check in ``update``, an error found while scheduling, an abort, a bad prompt at ``add_request``)."""
        done, self._finished_unreported = self._finished_unreported, []
        return done

    def forget(self, req_id: int) -> None:
        """Drop a finished request from :attr:`requests` once no step in flight uses it (its outputs were read;
        a server's scheduler would otherwise keep every request it ever saw)."""
        req = self.requests.get(req_id)
        if req is None:
            return
        if not req.is_finished:
            raise ValueError(f"request {req_id} is still {req.status}: only finished requests can be forgotten")
        req.forgotten = True
        if not req.steps_inflight:
            del self.requests[req_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's ``reset_prefix_cache``); False, changing nothing, while any request
        holds blocks (one running, or finished with a step in flight)."""
        return self.allocator.reset()

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        """The next step: running decodes first, then running prefills' next chunks, then admissions.

        Each scheduled request is advanced at once (module docstring). The per-request work is a few attribute
        updates and list appends; the step's arrays are built once at the end, and a request's KV blocks are
        allocated only when it crosses a block boundary (a block at a time for a decode).
        """
        budget = self.max_num_batched_tokens
        bs = self.block_size
        step_id = self._step_seq + 1
        inflight = bool(self._inflight_steps)
        preemptions_before = self.num_preemptions
        self.wants_sync = False
        batch = _StepArrays()
        run_rows, budget, leaving = self._schedule_run(budget)
        batch.run = run_rows
        reqs, starts, tokens = batch.reqs, batch.starts, batch.tokens
        prefills: list[Request] = []
        reqs_append, starts_append, tokens_append = reqs.append, starts.append, tokens.append
        for req in list(self.running) if len(self._run) < len(self.running) else ():
            if req.run is not None or req.status is not RUNNING:  # the run's (scheduled above), or preempted here
                continue
            out_ids = req.outputs
            n_out = len(out_ids)
            start = req.computed
            if req.prompt_len + n_out != start + 1:
                prefills.append(req)
                continue
            if req.pending and n_out >= req.max_outputs:  # its final token is in flight: it is done
                leaving += 1
                continue
            if not budget:
                continue
            if start >= req.kv_capacity and not self._grow(req, start // bs + 1, batch):
                continue
            # A decode: one token (the last one, perhaps a placeholder), and it samples.
            tokens_append(out_ids[-1] if n_out else req.prompt_token_ids[-1])
            reqs_append(req)
            starts_append(start)
            req.computed = start + 1
            req.steps_inflight += 1
            out_ids.append(-req.slot - 1)  # slots.placeholder(slot): the token this step samples
            req.pending += 1
            budget -= 1
        batch.num_decodes = len(reqs)
        for req in prefills:
            if not budget:
                break
            if req.status is not RUNNING:
                continue
            n = min(req.num_tokens - req.computed, budget)
            need = blocks_needed(req.computed + n, bs)
            if need > len(req.block_ids) and not self._grow(req, need, batch):
                continue
            self._take(req, n, batch)
            budget -= n
        # Like vLLM: admitting right after a preemption (or instead of one) thrashes. A request whose last token
        # is in flight gives up its seat now, as it would have finished before this step in a synchronous loop.
        if self.num_preemptions == preemptions_before and not self.wants_sync:
            leaving = leaving if inflight else 0
            while self.waiting and budget > 0 and len(self.running) - leaving < self.max_num_seqs:
                req = self.waiting[0]
                hit_blocks = self._cached_prefix(req) if self.enable_prefix_caching else []
                hit = len(hit_blocks) * bs
                n = min(req.num_tokens - hit, budget)
                need = blocks_needed(hit + n, bs) - len(hit_blocks)
                if not self.allocator.can_allocate(need + self.allocator.num_evictable(hit_blocks)):
                    break
                self.waiting.popleft()
                req.slot = self.slots.alloc()
                if self.enable_prefix_caching and not _reads_whole_history(req):
                    self.prefix_cache_queries += req.num_tokens
                    self.prefix_cache_hits += hit
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = hit
                if hit_blocks:
                    self.allocator.touch(hit_blocks)
                    self._add_blocks(req, hit_blocks)
                    req.num_cached_blocks = len(hit_blocks)
                    req.computed = hit
                self._give_blocks(req, need)
                req.status = RUNNING
                self.running.append(req)
                self._take(req, n, batch)
                budget -= n
        if self.enable_prefix_caching:  # after every admission: no request reads a block this step fills
            for req in reqs[batch.num_decodes:]:  # chunks; decodes' blocks are cached when they are freed
                self._cache_full_blocks(req)
        # this step's plain decodes outside the run join it (their fields include this step)
        self._join_run([r for r in reqs[:batch.num_decodes] if len(r.stop_ids) <= MAX_RUN_STOP_IDS])
        finished, self._finished_since_schedule = self._finished_since_schedule, []
        self._step_seq = step_id
        step_reqs = reqs if run_rows is None else run_rows.reqs + reqs
        if step_reqs:
            self._inflight_steps.append((step_id, step_reqs))
        return batch.output(self.block_table, bs, finished, step_id)

    def _schedule_run(self, budget: int) -> tuple[_RunRows | None, int, int]:
        """The decode run's part of a step, as arrays: every row takes one token, in row order as far as the
        budget goes, except those whose last token is in flight (they give up their seat: counted as leaving).
        Returns the rows scheduled (None if none), the budget left and the leaving count. A KV-block shortage
        where some row crosses a block boundary sends every row back to the per-request path (which chooses whom
        to preempt), before anything changed."""
        run = self._run
        if not len(run):
            return None, budget, 0
        gone = (run.pending > 0) & (run.num_out >= run.max_outputs)  # final token in flight: done
        leaving = int(np.count_nonzero(gone))
        count = len(run) - leaving
        sel: slice | np.ndarray = slice(None)
        if leaving or count > budget:  # some rows only: those not leaving, as many as the budget takes, in order
            sel = np.flatnonzero(~gone)[:budget]
            count = len(sel)
        crossing = np.flatnonzero(run.computed >= run.capacity) if isinstance(sel, slice) else \
            sel[run.computed[sel] >= run.capacity[sel]]
        if len(crossing) and not self.allocator.can_allocate(len(crossing)):
            self._leave_run(np.arange(len(run)))  # the per-request path chooses whom to preempt
            return None, budget, 0
        if len(crossing):  # a decode crosses into exactly one new block: all of them in one allocation
            bs, blocks = self.block_size, self.allocator.allocate(len(crossing))
            for i, block in zip(crossing.tolist(), blocks, strict=True):
                req = run.reqs[i]
                req.block_ids.append(block)
                req.kv_capacity += bs
            self.block_table.append_one_each(run.slots[crossing], blocks)
            run.capacity[crossing] += bs
        if not count:
            return None, budget, leaving
        if isinstance(sel, slice):
            reqs, snapshots = list(run.reqs), run.snapshots()
        else:
            reqs, snaps = [run.reqs[i] for i in sel.tolist()], run.snapshots()
            snapshots = tuple(snaps[i] for i in sel.tolist())
        starts = run.computed[sel].copy()
        slots = run.slots[sel].copy()
        tokens = np.where(run.pending[sel] > 0, -slots - 1, run.last_token[sel])  # slots.placeholder, vectorised
        run.computed[sel] += 1
        run.inflight[sel] += 1
        run.pending[sel] += 1
        run.num_out[sel] += 1
        return _RunRows(reqs, run.req_ids[sel].copy(), slots, starts, tokens, snapshots), budget - count, leaving

    def _join_run(self, reqs: list[Request]) -> None:
        self._run.join(reqs)
        for req in reqs:
            req.run = self._run

    def _leave_run(self, rows: np.ndarray) -> list[Request]:
        """Send run rows back to the per-request path (their requests' fields written back)."""
        gone = self._run.leave(rows)
        for req in gone:
            req.run = None
        return gone

    def _leave_run_of(self, req: Request) -> None:
        if req.run is not None:
            self._leave_run(np.array([self._run.row_of_slot[req.slot]]))

    def _take(self, req: Request, n: int, batch: _StepArrays) -> None:
        """Schedule ``n`` tokens of ``req`` (a prefill chunk, or any chunk of an admitted request) and advance it."""
        start = req.computed
        stop = start + n
        batch.tokens.extend(req.token_slice(start, stop))
        batch.reqs.append(req)
        batch.starts.append(start)
        batch.lens.append(n)
        sample = stop == req.num_tokens
        batch.samples.append(sample)
        req.computed = stop
        req.steps_inflight += 1
        if sample:
            req.outputs.append(placeholder(req.slot))
            req.pending += 1

    def _grow(self, req: Request, need_total: int, batch: _StepArrays) -> bool:
        """Give ``req`` blocks up to ``need_total``, preempting later requests not scheduled in this step
        (``batch``); False if ``req`` itself had to be preempted (or failed)."""
        if need_total > self.allocator.num_blocks:  # cannot happen after add_request's check; never livelock
            self._finish(req, "error", f"request needs {need_total} KV-cache blocks, more than the whole cache "
                                       f"({self.allocator.num_blocks}); raise --num-kv-blocks")
            return False
        scheduled: set[Request] | None = None
        while not self.allocator.can_allocate(need_total - len(req.block_ids)):
            if self._inflight_steps:  # victims' state may be speculative: leave req out, sync first
                self.wants_sync = True
                return False
            if scheduled is None:
                scheduled = set(batch.reqs) if batch.run is None else set(batch.reqs).union(batch.run.reqs)
            victim = next((r for r in reversed(self.running) if r not in scheduled), None)
            assert victim is not None  # req itself is running and unscheduled
            self._preempt(victim)
            if victim is req:
                return False
        self._give_blocks(req, need_total - len(req.block_ids))
        return True

    def _give_blocks(self, req: Request, n: int) -> None:
        if n > 0:
            self._add_blocks(req, self.allocator.allocate(n))

    def _add_blocks(self, req: Request, blocks: list[int]) -> None:
        """Append ``blocks`` to ``req``'s blocks and its block-table row."""
        req.block_ids.extend(blocks)
        req.kv_capacity = len(req.block_ids) * self.block_size
        self.block_table.append(req.slot, blocks)

    def _cached_prefix(self, req: Request) -> list[int]:
        """The cached blocks a waiting request can start from: the longest run of its full blocks of known
        tokens in the cache, leaving at least its last token to compute (none for a request that reads its
        whole history: :func:`_reads_whole_history`)."""
        if _reads_whole_history(req):
            return []
        most = (req.num_tokens - 1) // self.block_size
        if most <= 0:
            return []
        self._hash_blocks(req, most)
        return self.allocator.cached_prefix(req.block_hashes[:most])

    def _hash_blocks(self, req: Request, num_blocks: int) -> None:
        """Extend ``req.block_hashes`` to its first ``num_blocks`` blocks (full, of known tokens)."""
        done = len(req.block_hashes)
        if done < num_blocks:
            bs = self.block_size
            extend_block_hashes(req.block_hashes, req.token_slice(done * bs, num_blocks * bs), bs)

    def _cache_full_blocks(self, req: Request) -> None:
        """Register ``req``'s full blocks of known tokens whose KV is scheduled (by steps scheduled before now, or
        by the one being scheduled, whose readers come in later steps), past those already cached."""
        bs = self.block_size
        full = min(req.computed, req.num_tokens - req.pending) // bs
        done = req.num_cached_blocks
        if full <= done:
            return
        self._hash_blocks(req, full)
        hashes, blocks, register = req.block_hashes, req.block_ids, self.allocator.register
        for i in range(done, full):
            register(blocks[i], hashes[i])
        req.num_cached_blocks = full

    def _free_blocks(self, req: Request) -> None:
        """Give back ``req``'s blocks (no step in flight uses them), its full ones cached first; the last block is
        freed first, so an evicted prefix loses its tail before its head."""
        if self.enable_prefix_caching:
            self._cache_full_blocks(req)
        self.allocator.free(reversed(req.block_ids))
        req.block_ids = []
        req.kv_capacity = 0
        req.num_cached_blocks = 0

    def _preempt(self, req: Request) -> None:
        self._leave_run_of(req)
        assert not req.steps_inflight, "preemption with a step in flight (the scheduler syncs first)"
        self._free_blocks(req)
        self.block_table.clear(req.slot)
        self.slots.free(req.slot)
        req.slot = -1
        req.computed = 0
        req.status = WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    # ------------------------------------------------------------------ results
    def update(self, sched: SchedulerOutput, sampled: Sequence[int | None]) -> list[Request]:
        """Apply the results of ``sched`` (outputs must come back in schedule order): fill in each sampled
        token, run the stop checks; return the requests that finished. Nothing changes if it raises."""
        if len(sampled) != sched.num_reqs:
            raise ValueError(f"model runner returned {len(sampled)} results for {sched.num_reqs} chunks")
        if not sched.num_reqs:
            return []
        if not self._inflight_steps or self._inflight_steps[0][0] != sched.step_id:
            oldest = self._inflight_steps[0][0] if self._inflight_steps else None
            raise RuntimeError(f"results of step {sched.step_id} arrive out of order (update() called twice?); the "
                               f"oldest step in flight is {oldest}")
        reqs = self._inflight_steps[0][1]
        self.last_discarded = []
        samples = sched.sample.tolist()
        invalid = self._invalid_samples(reqs, samples, sampled)
        self._inflight_steps.popleft()
        done: list[Request] = []
        if invalid and len(self._run):  # the per-request path for every row: it ends those requests
            self._leave_run(np.arange(len(self._run)))
        rest: Sequence[int] = range(len(reqs))
        if len(self._run):
            rest = self._update_run_rows(sched, sampled, done)
        if rest:
            self._update_rows(reqs, sampled, samples, invalid, rest, done)
        if done:
            self.running = [r for r in self.running if r.status is RUNNING]
        return done

    def _update_run_rows(self, sched: SchedulerOutput, sampled: Sequence[int | None], done: list[Request]
                         ) -> list[int]:
        """``update`` for the step's rows whose requests are in the decode run now (joined before or after this
        step was scheduled: the run holds their state either way), as arrays: their tokens recorded, the stop
        checks (EOS, length) vectorised; the few that stop leave the run and finish. Returns the other rows."""
        run = self._run
        pos = run.row_of_slot[sched.slots]
        in_run = pos >= 0
        if in_run.all() and sched.sample.all():
            rest: list[int] = []
        else:
            rest = np.flatnonzero(~in_run).tolist()
            idle = in_run & ~sched.sample  # a chunk that sampled nothing (a prefill before it joined)
            if idle.any():
                run.inflight[pos[idle]] -= 1
            picked = np.flatnonzero(in_run & sched.sample)
            if not len(picked):
                return rest
            pos = pos[picked]
            sampled = [sampled[i] for i in picked.tolist()]
        tokens = np.array(sampled, dtype=np.int64)  # ints: update() checked them
        run.record(pos, tokens)
        stop = run.num_out[pos] - run.pending[pos] >= run.max_outputs[pos]
        stop |= run.stops(pos, tokens)
        if stop.any():
            for req, token in zip(self._leave_run(pos[stop]), tokens[stop].tolist(), strict=True):
                self._finish(req, self._stop_reason(req, token), in_running=False)
                done.append(req)
        return rest

    def _update_rows(self, reqs: list[Request], sampled: Sequence[int | None], samples: list[bool],
                     invalid: set[int], rows: Sequence[int], done: list[Request]) -> None:
        """``update``'s per-request path for the step's rows ``rows``: each row's token, its stop checks."""
        for i_req in rows:
            req, token, sample = reqs[i_req], sampled[i_req], samples[i_req]
            req.steps_inflight -= 1
            if req.status is FINISHED:  # stopped or aborted while this step ran: its token is discarded
                self.last_discarded.append(req.req_id)
                self._release_if_idle(req)
                continue
            if not sample:
                continue
            if invalid and i_req in invalid:
                self._finish(req, "error", INVALID_SAMPLE_ERROR, in_running=False)
                done.append(req)
                continue
            assert token is not None  # a sampling row's token (_invalid_samples found none missing)
            pending = req.pending
            out = req.outputs
            out[-pending] = token  # its oldest placeholder (pending >= 1: this step sampled it)
            req.pending = pending - 1
            if token in req.stop_ids or len(out) - pending >= req.max_outputs - 1:
                self._finish(req, self._stop_reason(req, token), in_running=False)
                done.append(req)

    def _invalid_samples(self, reqs: Sequence[Request], samples: list[bool], sampled: Sequence[int | None]
                         ) -> set[int]:
        """The positions of live sampling chunks whose token is outside the vocabulary (the sampler's
        ``INVALID_TOKEN`` for non-finite logits): those requests end with an error, the others go on. One pass
        of C over the batch when every token is valid. A token that is not an ``int`` is a bug of the model
        runner, not of a request: it raises."""
        picked = sampled if all(samples) else [t for t, s in zip(sampled, samples, strict=True) if s]
        if not picked or (set(map(type, picked)) == {int} and min(cast("list[int]", picked)) >= 0
                          and max(cast("list[int]", picked)) < self.vocab_size):
            return set()
        invalid = set()
        for i, (req, token, sample) in enumerate(zip(reqs, sampled, samples, strict=True)):
            if not sample or req.status is FINISHED:
                continue
            if type(token) is not int:
                raise RuntimeError(f"request {req.req_id}: model runner sampled {token!r}, expected a token id")
            if not 0 <= token < self.vocab_size:
                invalid.add(i)
        return invalid

    def _stop_reason(self, req: Request, token: int) -> str:
        """Why a request whose output ``token`` is in its stop set or reached its length limit stops, in vLLM's
        order: EOS, then stop_token_ids ("stop", recording ``stop_reason``), then max_tokens / max_model_len
        ("length")."""
        if token in req.stop_ids:
            if req.sampling.ignore_eos or token not in self.eos_token_ids:
                req.stop_reason = token
            return "stop"
        return "length"

    def _release_if_idle(self, req: Request) -> None:
        """Free a finished request's KV blocks and slot once no step in flight reads or writes them."""
        if req.steps_inflight:
            return
        if req.forgotten:
            self.requests.pop(req.req_id, None)
        if req.block_ids:
            self._free_blocks(req)
        if req.slot >= 0:
            self.block_table.clear(req.slot)
            self.slots.free(req.slot)
            req.slot = -1

    def _finish(self, req: Request, reason: str, error: str | None = None, *, in_running: bool = True) -> None:
        """``in_running=False``: the caller takes finished requests out of ``running`` itself (all at once)."""
        self._leave_run_of(req)
        if req.pending:  # outputs of steps still in flight, past the finishing token: discarded
            del req.outputs[len(req.outputs) - req.pending:]
            req.pending = 0
        if in_running and req.status is RUNNING:
            self.running.remove(req)
        if req.status is WAITING and req in self.waiting:
            self.waiting.remove(req)
        req.status = FINISHED
        req.finish_reason = reason
        req.error = error
        self._release_if_idle(req)
        self._finished_since_schedule.append(req.req_id)
        self._finished_unreported.append(req)


def _reads_whole_history(req: Request) -> bool:
    """Whether ``req`` must compute every token from position 0 (no prefix-cache hit): the model runner computes
    prompt logprobs, and penalty counts, from the step's inputs."""
    return req.sampling.prompt_logprobs is not None or req.sampling.uses_penalties


_SLOT, _REQ_ID, _SNAPSHOT = attrgetter("slot"), attrgetter("req_id"), attrgetter("snapshot")


@dataclass(frozen=True)
class _RunRows:
    """The decode run's rows of one step (``Scheduler._schedule_run``): one token each, all sampling."""

    reqs: list[Request]
    req_ids: np.ndarray
    slots: np.ndarray
    starts: np.ndarray
    tokens: np.ndarray
    snapshots: tuple[RequestSnapshot, ...]


class _StepArrays:
    """One step's requests as ``schedule()`` collects them: first the decode run's rows (arrays), then the
    other decodes (one token each, all sampling, only their start recorded), then chunks with their lengths and
    sample flags."""

    __slots__ = ("run", "reqs", "starts", "tokens", "lens", "samples", "num_decodes")

    def __init__(self) -> None:
        self.run: _RunRows | None = None
        self.reqs: list[Request] = []
        self.starts: list[int] = []
        self.tokens: list[int] = []
        self.lens: list[int] = []
        self.samples: list[bool] = []
        self.num_decodes = 0

    def output(self, table: BlockTable, block_size: int, finished: list[int], step_id: int) -> SchedulerOutput:
        reqs, d = self.reqs, self.num_decodes
        n = len(reqs)
        starts = np.array(self.starts, dtype=np.int64)
        lens = np.ones(n, dtype=np.int64)
        sample = np.ones(n, dtype=bool)
        if n > d:
            lens[d:] = self.lens
            sample[d:] = self.samples
        slots = np.fromiter(map(_SLOT, reqs), dtype=np.int64, count=n)
        req_ids = np.fromiter(map(_REQ_ID, reqs), dtype=np.int64, count=n)
        tokens = np.array(self.tokens, dtype=np.int64)
        snapshots = tuple(map(_SNAPSHOT, reqs))
        run = self.run
        if run is not None:
            r = len(run.reqs)
            starts = np.concatenate((run.starts, starts)) if n else run.starts
            lens = np.concatenate((np.ones(r, dtype=np.int64), lens))
            sample = np.concatenate((np.ones(r, dtype=bool), sample))
            slots = np.concatenate((run.slots, slots)) if n else run.slots
            req_ids = np.concatenate((run.req_ids, req_ids)) if n else run.req_ids
            tokens = np.concatenate((run.tokens, tokens)) if n else run.tokens
            snapshots = run.snapshots + snapshots
        held = (starts + lens + (block_size - 1)) // block_size  # a request holds exactly what its tokens need
        return SchedulerOutput.from_arrays(
            req_ids=req_ids, slots=slots, num_computed=starts, query_lens=lens, sample=sample, token_ids=tokens,
            blocks=BlockRows(table, slots, held), requests=snapshots, finished_req_ids=finished, step_id=step_id)
