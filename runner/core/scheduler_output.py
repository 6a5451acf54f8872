"""What the scheduler hands the model runner for one step (vLLM's ``vllm/v1/core/sched/output.py``): the chunk
of tokens each request computes, as immutable arrays and per-request snapshots.

A step is arrays over its requests in schedule order (``req_ids``, ``slots``, ``num_computed``, ``query_lens``,
``sample``, the flat ``token_ids``, the requests' block-table rows) and one :class:`RequestSnapshot` per
request: what the forward side reads of it, fixed when the request was added. With the overlap loop the
scheduler schedules step N+1 (and mutates its own ``Request`` objects) while step N runs, so nothing here
refers to a live request: the arrays are read-only, the snapshots frozen. The block-table rows are the one
shared piece, by design (vLLM's persistent block table): the scheduler only appends past the blocks a step in
flight holds (``held``) and clears a row only once no step in flight uses it
(``runner/attention/kv_cache.py``, ``BlockTable``). ``chunks`` gives the same step as one
:class:`ScheduledChunk` per request, built on first use for stand-ins and tests.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from runner.attention.kv_cache import BlockRows
from runner.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestSnapshot:
    """What the forward side reads of one request, fixed for its life: its sampling settings, the seed of its
    draws and its prompt (prompt logprobs, penalty counts, where its outputs start). A batch built by hand from
    :class:`ScheduledChunk` objects carries no prompt (``()``): its chunks give their prompt lengths."""

    sampling: SamplingParams
    seed: int = 0  # params.seed, else the engine's per-request default (runner.worker.sampler.request_seed)
    prompt_token_ids: tuple[int, ...] = ()


@dataclass
class ScheduledChunk:
    """The tokens one request computes in this step, at positions ``num_computed_tokens ..``."""

    req_id: int
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]  # the blocks the request holds for this step: enough for num_computed + len(token_ids)
    sample: bool  # this chunk reaches the end of the known tokens -> sample one token
    sampling: SamplingParams
    seed: int = 0  # the request's sampling seed: params.seed, else the engine's per-request default
    slot: int = -1  # the request's slot for its life: its future-map entry and its penalty counts
    prompt_len: int | None = None  # None: every token up to this chunk's end is prompt (no outputs yet)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return self.num_computed_tokens + len(self.token_ids) if self.prompt_len is None else self.prompt_len

    @property
    def output_index(self) -> int:
        """How many outputs the request has before the token this chunk samples (0: its first)."""
        return self.num_computed_tokens + len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == 1 and self.num_computed_tokens > 0


def _frozen(a: np.ndarray) -> np.ndarray:
    """``a`` made read-only (a view when it is someone else's array: theirs stays writable)."""
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


class SchedulerOutput:
    """One step: its requests in schedule order, as arrays and snapshots (module docstring).

    ``SchedulerOutput(chunks, finished_req_ids, step_id)`` builds one from chunks (hand-built batches);
    the scheduler uses :meth:`from_arrays`. Read-only: the forward side reads it while the scheduler already
    builds the next step; :meth:`with_token_ids` and :meth:`with_finished_before` make changed copies.
    """

    req_ids: np.ndarray  # int64 [R]
    slots: np.ndarray  # int64 [R]: each request's future-map slot (-1: none)
    num_computed: np.ndarray  # int64 [R]: tokens already in the KV cache (the chunk's first position)
    query_lens: np.ndarray  # int64 [R]: tokens computed this step
    sample: np.ndarray  # bool [R]: the chunk reaches the end of the known tokens -> sample one token
    token_ids: np.ndarray  # int64 [T]: every chunk's tokens, in order (placeholders < 0 until resolved)
    blocks: BlockRows  # the requests' block-table rows
    requests: tuple[RequestSnapshot, ...]  # per request: its sampling settings, seed and prompt
    finished_req_ids: tuple[int, ...]  # finished since the previous schedule()
    step_id: int  # schedule() numbers its outputs: update() must see them in this order

    def __init__(self, chunks: Sequence[ScheduledChunk] = (), finished_req_ids: Sequence[int] = (),
                 step_id: int = -1) -> None:
        chunks = list(chunks)
        tokens = [t for c in chunks for t in c.token_ids]
        self._set(np.array([c.req_id for c in chunks], dtype=np.int64),
                  np.array([c.slot for c in chunks], dtype=np.int64),
                  np.array([c.num_computed_tokens for c in chunks], dtype=np.int64),
                  np.array([len(c.token_ids) for c in chunks], dtype=np.int64),
                  np.array([c.sample for c in chunks], dtype=bool), np.array(tokens, dtype=np.int64),
                  BlockRows.from_lists([c.block_ids for c in chunks]),
                  tuple(RequestSnapshot(c.sampling, c.seed) for c in chunks), tuple(finished_req_ids), step_id)
        self._chunks: list[ScheduledChunk] | None = chunks
        self.hand_built = True  # the chunks carry prompt lengths, the snapshots no prompts

    @classmethod
    def from_arrays(cls, *, req_ids: np.ndarray, slots: np.ndarray, num_computed: np.ndarray,
                    query_lens: np.ndarray, sample: np.ndarray, token_ids: np.ndarray, blocks: BlockRows,
                    requests: Sequence[RequestSnapshot], finished_req_ids: Sequence[int],
                    step_id: int) -> SchedulerOutput:
        out = cls.__new__(cls)
        out._set(req_ids, slots, num_computed, query_lens, sample, token_ids, blocks, tuple(requests),
                 tuple(finished_req_ids), step_id)
        out._chunks = None
        out.hand_built = False
        return out

    def _set(self, req_ids: np.ndarray, slots: np.ndarray, num_computed: np.ndarray, query_lens: np.ndarray,
             sample: np.ndarray, token_ids: np.ndarray, blocks: BlockRows, requests: tuple[RequestSnapshot, ...],
             finished_req_ids: tuple[int, ...], step_id: int) -> None:
        n = len(req_ids)
        if not (len(slots) == len(num_computed) == len(query_lens) == len(sample) == len(blocks) == len(requests)
                == n):
            raise ValueError(f"a step of {n} requests needs one slot, context length, query length, sample flag, "
                             "block row and request snapshot each")
        self.req_ids, self.slots = _frozen(req_ids), _frozen(slots)
        self.num_computed, self.query_lens = _frozen(num_computed), _frozen(query_lens)
        self.sample, self.token_ids = _frozen(sample), _frozen(token_ids)
        self.blocks, self.requests = blocks, requests
        self.finished_req_ids, self.step_id = finished_req_ids, step_id
        self.num_reqs = n
        self.num_tokens = len(token_ids)  # computed once: the runner, the vote and the loop all ask
        decode = int(np.count_nonzero((query_lens == 1) & (num_computed > 0))) if n else 0
        self.is_uniform_decode = n > 0 and decode == n  # every chunk is one token on top of cached context
        self.has_prefill = decode < n

    # ---- per-request views ----------------------------------------------------------------------------
    @property
    def num_scheduled_tokens(self) -> list[int]:
        return self.query_lens.tolist()

    @property
    def chunks(self) -> list[ScheduledChunk]:
        """One :class:`ScheduledChunk` per request (built on first use from the arrays)."""
        if self._chunks is None:
            n, held = self.num_reqs, self.blocks.held
            if self.num_tokens == n and (n == 0 or int(self.query_lens.min()) == 1):  # one token each: no slicing
                token_lists = [[t] for t in self.token_ids.tolist()]
            else:
                tokens = self.token_ids.tolist()
                starts = np.concatenate(([0], np.cumsum(self.query_lens))).tolist()
                token_lists = [tokens[a:b] for a, b in itertools.pairwise(starts)]
            width = int(held.max()) if n else 0
            block_lists = self.blocks.table.table[self.blocks.rows, :width].tolist()  # one gather for all
            if n and int(held.min()) < width:
                block_lists = [row[:h] for row, h in zip(block_lists, held.tolist(), strict=True)]
            self._chunks = [
                ScheduledChunk(rid, toks, nc, blocks, s, r.sampling, r.seed, slot, len(r.prompt_token_ids))
                for rid, toks, nc, blocks, s, r, slot in zip(
                    self.req_ids.tolist(), token_lists, self.num_computed.tolist(), block_lists,
                    self.sample.tolist(), self.requests, self.slots.tolist(), strict=True)]
        return self._chunks

    def with_token_ids(self, token_ids: np.ndarray) -> SchedulerOutput:
        """A copy of this step with other token ids (placeholders resolved); this one is not touched."""
        if len(token_ids) != self.num_tokens:
            raise ValueError(f"{len(token_ids)} token ids for a step of {self.num_tokens} tokens")
        out = copy.copy(self)
        out.token_ids = _frozen(token_ids)
        if self._chunks is not None and self.hand_built:  # keep its chunk objects' type
            tokens, a = token_ids.tolist(), 0
            chunks = []
            for c in self._chunks:
                b = a + len(c.token_ids)
                chunks.append(dataclasses.replace(c, token_ids=tokens[a:b]))
                a = b
            out._chunks = chunks
        else:
            out._chunks = None
        return out

    def with_finished_before(self, finished_req_ids: Sequence[int]) -> SchedulerOutput:
        """A copy of this step that also reports ``finished_req_ids``, ahead of its own (a step the loop
        scheduled and dropped for being empty hands its finished ids on to the next one)."""
        out = copy.copy(self)
        out.finished_req_ids = tuple(finished_req_ids) + self.finished_req_ids
        return out

    def __len__(self) -> int:
        return self.num_reqs
