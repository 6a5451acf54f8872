"""Continuous batching with chunked prefill over a paged KV cache (vLLM-V1 style, one rank).

Each :meth:`Scheduler.schedule` builds one step under two budgets: at most ``max_num_seqs`` running requests
and at most ``max_num_batched_tokens`` tokens. Running requests come first — decodes (one token each), then
prefills that were chunked in an earlier step — and only then are waiting requests admitted, each with as
much of its prompt as the remaining token budget allows (a long prompt is split across steps).

KV blocks are allocated as a request grows and freed the moment it finishes, so nothing leaks. When a
running request needs a block and none is free, the most recently admitted request not yet scheduled in this
step is *preempted by recompute*: its blocks are freed, it goes back to the front of the waiting queue and
later recomputes prompt + generated tokens as one prefill (its sampled tokens are kept, and a draw depends only
on the request's seed and output index, so its output does not change). Admission never preempts: a waiting
request waits until blocks free up. FCFS order guarantees progress because the oldest request can always
reclaim every block, and a request that could not fit even in an empty cache is rejected up front with an error.

Requests that cannot run (empty prompt, token id outside the vocabulary, prompt + 1 > max_model_len, cache too
small) finish immediately with ``finish_reason == "error"`` and a message; the other requests are unaffected.

**Results may lag one step** (the overlap loop, ``runner/core/overlap_loop.py``). ``schedule()`` advances each
scheduled request at once, as if its step had already run: ``num_computed_tokens`` moves forward and a
sampling chunk appends a *placeholder* output (``slots.placeholder(slot)``); ``update()`` later
replaces the oldest placeholder with the real token and runs the stop checks. So step N+1 can be scheduled
before step N's results are in: a request decoding in both feeds N+1 the placeholder, which the forward
side resolves from the future-token map. Called in lock-step (schedule, step, update), this is exactly the
synchronous scheduler. With a step in flight:
- a request whose last token is already in flight (max_tokens / max_model_len reached counting placeholders)
  is not scheduled again: that is known in advance; its seat goes to a waiting request right away;
- a stop token is not known in advance, so the request may be scheduled once more; when ``update()`` of
  the earlier step finishes it, the speculative placeholder is dropped, the later step's token is discarded,
  and its KV blocks and slot are released only once every step it is in has been updated (that step is
  still reading and writing them);
- no preemption: victims could be requests whose state is speculative. A request that would need one is
  left out of the step and ``wants_sync`` asks the loop to process the in-flight results first.
Every request holds a *slot* (allocated at admission, freed at finish or preemption) that names its entry
in the future-token map for its whole life.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from runner.core.slots import SlotPool, placeholder
from runner.core.kv_blocks import BlockAllocator
from runner.attention.kv_cache import blocks_needed
from runner.sampling_params import SamplingParams, SamplingParamsError
from runner.worker.scheduled_batch import ScheduledChunk, SchedulerOutput

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(eq=False)  # identity semantics: requests live in lists that are searched and removed from
class Request:
    req_id: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    seed: int = 0  # the seed of its draws (runner.worker.sampler.request_seed)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: str = WAITING
    finish_reason: str | None = None
    error: str | None = None
    num_preemptions: int = 0
    slot: int = -1  # future-token-map slot while admitted
    num_pending: int = 0  # trailing outputs that are still placeholders (their step is in flight)
    inflight: deque[int] = field(default_factory=deque)  # step ids scheduled but not yet updated, oldest first
    stop_reason: int | None = None  # the stop token id when one of stop_token_ids ended it (vLLM's stop_reason)
    forgotten: bool = False  # finished and reported: drop it from Scheduler.requests once no step uses it

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        return (self.prompt_token_ids + self.output_token_ids)[start:stop]

    @property
    def is_finished(self) -> bool:
        return self.status == FINISHED


def _check_prompt(prompt: Any, vocab_size: int, max_model_len: int) -> str | None:
    """Why this prompt cannot run, or None."""
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
        return f"prompt must be a list of token ids, got {type(prompt).__name__}"
    if len(prompt) == 0:
        return "prompt is empty: at least one token is needed"
    for i, t in enumerate(prompt):
        if isinstance(t, bool) or not isinstance(t, int):
            return f"prompt token at position {i} is {t!r}, not an integer token id"
        if not 0 <= t < vocab_size:
            return f"prompt token id {t} at position {i} is outside the vocabulary [0, {vocab_size})"
    if len(prompt) + 1 > max_model_len:
        return (f"prompt has {len(prompt)} tokens but max_model_len is {max_model_len}: prompt + 1 generated "
                f"token must fit (prompt length <= {max_model_len - 1})")
    return None


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
                 max_model_len: int, vocab_size: int, eos_token_ids: Iterable[int] = ()) -> None:
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
        self.allocator = BlockAllocator(num_kv_blocks)
        # Slots: scheduled requests (<= max_num_seqs), requests whose last token is in flight (they already
        # gave up their seat, < max_num_seqs) and finished ones still in a step in flight (< max_num_seqs).
        self.slots = SlotPool(3 * max_num_seqs)
        self.num_inflight_steps = 0  # scheduled, non-empty outputs not yet updated
        self.wants_sync = False  # the last schedule() left a request out rather than preempt with a step in flight
        self._step_seq = 0
        self.requests: dict[int, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._finished_since_schedule: list[int] = []
        self._finished_unreported: list[Request] = []  # for take_finished(), whatever finished them
        self._next_id = 0

    @classmethod
    def from_runner(cls, cfg: Any, runner: Any) -> "Scheduler":
        """Budgets from the config; cache geometry, vocabulary and EOS from the model runner."""
        return cls(max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                   block_size=runner.block_size, num_kv_blocks=runner.num_kv_blocks,
                   max_model_len=runner.max_model_len, vocab_size=runner.vocab_size,
                   eos_token_ids=runner.eos_token_ids)

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
        if error is None:
            # KV positions ever written: every token but the last sampled one.
            longest = min(self.max_model_len, len(prompt) + sampling.max_tokens) - 1
            need = blocks_needed(longest, self.block_size)
            if need > self.allocator.num_blocks:
                error = (f"request may grow to {longest + 1} tokens, which needs {need} KV-cache blocks of "
                         f"{self.block_size} tokens but the cache has only {self.allocator.num_blocks}; raise "
                         "--num-kv-blocks or lower max_tokens / --max-model-len")
        if error is not None:
            self._finish(req, "error", error)
        else:
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
        if not req.inflight:
            del self.requests[req_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        scheduled: set[int] = set()
        preemptions_before = self.num_preemptions
        self.wants_sync = False
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for req in decodes + prefills:
            if budget == 0:
                break
            if req.status != RUNNING:  # preempted (or failed) earlier in this loop
                continue
            if self._last_token_in_flight(req):
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._grow(req, n, scheduled):
                continue
            chunks.append(self._chunk(req, n))
            scheduled.add(req.req_id)
            budget -= n
        # Like vLLM: admitting right after a preemption (or instead of one) thrashes. A request whose last token
        # is in flight gives up its seat now, as it would have finished before this step in a synchronous loop.
        leaving = sum(self._last_token_in_flight(r) for r in self.running) if self.num_inflight_steps else 0
        if self.num_preemptions == preemptions_before and not self.wants_sync:
            while self.waiting and budget > 0 and len(self.running) - leaving < self.max_num_seqs:
                req = self.waiting[0]
                n = min(req.num_tokens - req.num_computed_tokens, budget)
                need = blocks_needed(req.num_computed_tokens + n, self.block_size) - len(req.block_ids)
                if not self.allocator.can_allocate(need):
                    break
                self.waiting.popleft()
                req.block_ids.extend(self.allocator.allocate(need))
                req.slot = self.slots.alloc()
                req.status = RUNNING
                self.running.append(req)
                chunks.append(self._chunk(req, n))
                scheduled.add(req.req_id)
                budget -= n
        finished, self._finished_since_schedule = self._finished_since_schedule, []
        self._step_seq += 1
        out = SchedulerOutput(chunks, finished, step_id=self._step_seq)
        self._advance(out)
        return out

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        return ScheduledChunk(req_id=req.req_id, token_ids=req.token_slice(start, start + n),
                              num_computed_tokens=start, block_ids=list(req.block_ids),
                              sample=start + n == req.num_tokens, sampling=req.sampling, seed=req.seed,
                              slot=req.slot, prompt_len=len(req.prompt_token_ids))

    def _advance(self, out: SchedulerOutput) -> None:
        """Move every scheduled request past its chunk now; a sampling chunk's token is a placeholder until
        ``update()`` (see the module docstring)."""
        if not out.chunks:
            return
        self.num_inflight_steps += 1
        for c in out.chunks:
            req = self.requests[c.req_id]
            req.num_computed_tokens += len(c.token_ids)
            req.inflight.append(out.step_id)
            if c.sample:
                req.output_token_ids.append(placeholder(req.slot))
                req.num_pending += 1

    def _last_token_in_flight(self, req: Request) -> bool:
        """The request's final token (by max_tokens / max_model_len) is already scheduled: it is done."""
        return req.num_pending > 0 and (len(req.output_token_ids) >= req.sampling.max_tokens
                                        or req.num_tokens >= self.max_model_len)

    def _grow(self, req: Request, n: int, scheduled: set[int]) -> bool:
        """Give ``req`` blocks for ``n`` more tokens, preempting later unscheduled requests; False if ``req``
        itself had to be preempted (or failed)."""
        need_total = blocks_needed(req.num_computed_tokens + n, self.block_size)
        if need_total > self.allocator.num_blocks:  # cannot happen after add_request's check; never livelock
            self._finish(req, "error", f"request needs {need_total} KV-cache blocks, more than the whole cache "
                                       f"({self.allocator.num_blocks}); raise --num-kv-blocks")
            return False
        while not self.allocator.can_allocate(need_total - len(req.block_ids)):
            if self.num_inflight_steps:  # victims' state may be speculative: leave req out, sync first
                self.wants_sync = True
                return False
            victim = next((r for r in reversed(self.running) if r.req_id not in scheduled), None)
            assert victim is not None  # req itself is running and unscheduled
            self._preempt(victim)
            if victim is req:
                return False
        req.block_ids.extend(self.allocator.allocate(need_total - len(req.block_ids)))
        return True

    def _preempt(self, req: Request) -> None:
        assert not req.inflight, "preemption with a step in flight (the scheduler syncs first)"
        self.allocator.free(req.block_ids)
        req.block_ids = []
        self.slots.free(req.slot)
        req.slot = -1
        req.num_computed_tokens = 0
        req.status = WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    # ------------------------------------------------------------------ results
    def update(self, sched: SchedulerOutput, sampled: Sequence[int | None]) -> list[Request]:
        """Apply the results of ``sched`` (outputs must come back in schedule order): fill in each sampled
        token, run the stop checks; return the requests that finished."""
        if len(sampled) != len(sched.chunks):
            raise ValueError(f"model runner returned {len(sampled)} results for {len(sched.chunks)} chunks")
        for chunk, token in zip(sched.chunks, sampled):
            req = self.requests[chunk.req_id]
            if not req.inflight or req.inflight[0] != sched.step_id:
                raise RuntimeError(f"request {req.req_id}: results of step {sched.step_id} arrive out of order "
                                   f"(update() called twice?)")
            if chunk.sample and not req.is_finished and (
                    isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size):
                raise RuntimeError(f"request {req.req_id}: model runner sampled {token!r}, expected a token id in "
                                   f"[0, {self.vocab_size})")
        if sched.chunks:
            self.num_inflight_steps -= 1
        done: list[Request] = []
        for chunk, token in zip(sched.chunks, sampled):
            req = self.requests[chunk.req_id]
            req.inflight.popleft()
            if req.is_finished:  # stopped or aborted while this step ran: its token is discarded
                self._release_if_idle(req)
                continue
            if not chunk.sample:
                continue
            assert isinstance(token, int)
            i = len(req.output_token_ids) - req.num_pending
            req.output_token_ids[i] = token
            req.num_pending -= 1
            reason = self._stop_reason(req, token, i + 1)
            if reason is not None:
                self._finish(req, reason)
                done.append(req)
        return done

    def _stop_reason(self, req: Request, token: int, num_outputs: int) -> str | None:
        """vLLM's order: EOS, then stop_token_ids ("stop"), then max_tokens / max_model_len ("length"), for the
        request's ``num_outputs``-th output (later outputs may be placeholders of steps still in flight)."""
        s = req.sampling
        if not s.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if s.stop_token_ids and token in s.stop_token_ids:
            req.stop_reason = token
            return "stop"
        if num_outputs >= s.max_tokens or len(req.prompt_token_ids) + num_outputs >= self.max_model_len:
            return "length"
        return None

    def _release_if_idle(self, req: Request) -> None:
        """Free a finished request's KV blocks and slot once no step in flight reads or writes them."""
        if req.inflight:
            return
        if req.forgotten:
            self.requests.pop(req.req_id, None)
        if req.block_ids:
            self.allocator.free(req.block_ids)
            req.block_ids = []
        if req.slot >= 0:
            self.slots.free(req.slot)
            req.slot = -1

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if req.num_pending:  # outputs of steps still in flight, past the finishing token: discarded
            del req.output_token_ids[len(req.output_token_ids) - req.num_pending:]
            req.num_pending = 0
        if req in self.running:
            self.running.remove(req)
        if req.status == WAITING and req in self.waiting:
            self.waiting.remove(req)
        req.status = FINISHED
        req.finish_reason = reason
        req.error = error
        self._release_if_idle(req)
        self._finished_since_schedule.append(req.req_id)
        self._finished_unreported.append(req)
