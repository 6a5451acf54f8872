"""What the scheduler hands the model runner for one step: the chunk of tokens each request computes.

A step is arrays over its requests in schedule order (``req_ids``, ``slots``, ``num_computed``, ``query_lens``,
``sample``, the flat ``token_ids``, the requests' block-table rows); ``chunks`` gives the same step as one
:class:`ScheduledChunk` per request, built on first use for stand-ins and tests. Of ``requests[i]`` the forward
side may read only what is fixed for its life (``sampling``, ``seed``, ``prompt_token_ids``): the scheduler
keeps changing the rest while the step runs.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from runner.attention.kv_cache import BlockRows
from runner.sampling_params import SamplingParams


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


class SchedulerOutput:
    """One step: its requests in schedule order, as arrays (module docstring).

    ``SchedulerOutput(chunks, finished_req_ids, step_id)`` builds one from chunks (hand-built batches);
    the scheduler uses :meth:`from_arrays`. Treat both as read-only: the forward side reads them while the
    scheduler already builds the next step.
    """

    req_ids: np.ndarray  # int64 [R]
    slots: np.ndarray  # int64 [R]: each request's future-map slot (-1: none)
    num_computed: np.ndarray  # int64 [R]: tokens already in the KV cache (the chunk's first position)
    query_lens: np.ndarray  # int64 [R]: tokens computed this step
    sample: np.ndarray  # bool [R]: the chunk reaches the end of the known tokens -> sample one token
    token_ids: np.ndarray  # int64 [T]: every chunk's tokens, in order (placeholders < 0 until resolved)
    blocks: BlockRows  # the requests' block-table rows
    requests: Sequence[Any]  # per request: an object with .sampling and .seed (see module docstring)
    finished_req_ids: list[int]  # finished since the previous schedule()
    step_id: int  # schedule() numbers its outputs: update() must see them in this order

    def __init__(self, chunks: Sequence[ScheduledChunk] = (), finished_req_ids: list[int] | None = None,
                 step_id: int = -1) -> None:
        chunks = list(chunks)
        tokens = [t for c in chunks for t in c.token_ids]
        self._set(np.array([c.req_id for c in chunks], dtype=np.int64), np.array([c.slot for c in chunks],
                                                                                 dtype=np.int64),
                  np.array([c.num_computed_tokens for c in chunks], dtype=np.int64),
                  np.array([len(c.token_ids) for c in chunks], dtype=np.int64),
                  np.array([c.sample for c in chunks], dtype=bool), np.array(tokens, dtype=np.int64),
                  BlockRows.from_lists([c.block_ids for c in chunks]), chunks,
                  [] if finished_req_ids is None else finished_req_ids, step_id)
        self._chunks: list[ScheduledChunk] | None = chunks

    @classmethod
    def from_arrays(cls, *, req_ids: np.ndarray, slots: np.ndarray, num_computed: np.ndarray,
                    query_lens: np.ndarray, sample: np.ndarray, token_ids: np.ndarray, blocks: BlockRows,
                    requests: Sequence[Any], finished_req_ids: list[int], step_id: int) -> SchedulerOutput:
        out = cls.__new__(cls)
        out._set(req_ids, slots, num_computed, query_lens, sample, token_ids, blocks, requests, finished_req_ids,
                 step_id)
        out._chunks = None
        return out

    def _set(self, req_ids: np.ndarray, slots: np.ndarray, num_computed: np.ndarray, query_lens: np.ndarray,
             sample: np.ndarray, token_ids: np.ndarray, blocks: BlockRows, requests: Sequence[Any],
             finished_req_ids: list[int], step_id: int) -> None:
        n = len(req_ids)
        if not (len(slots) == len(num_computed) == len(query_lens) == len(sample) == len(blocks) == len(requests)
                == n):
            raise ValueError(f"a step of {n} requests needs one slot, context length, query length, sample flag, "
                             "block row and request each")
        self.req_ids, self.slots, self.num_computed, self.query_lens = req_ids, slots, num_computed, query_lens
        self.sample, self.token_ids, self.blocks, self.requests = sample, token_ids, blocks, requests
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
    def hand_built(self) -> bool:
        """Built from :class:`ScheduledChunk` objects (``requests`` are the chunks), not by the scheduler."""
        return self._chunks is not None and self.requests is self._chunks

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
                token_lists = [tokens[a:b] for a, b in zip(starts, starts[1:])]
            width = int(held.max()) if n else 0
            block_lists = self.blocks.table.table[self.blocks.rows, :width].tolist()  # one gather for all
            if n and int(held.min()) < width:
                block_lists = [row[:h] for row, h in zip(block_lists, held.tolist())]
            self._chunks = [
                ScheduledChunk(rid, toks, nc, blocks, s, r.sampling, r.seed, slot, len(r.prompt_token_ids))
                for rid, toks, nc, blocks, s, r, slot in zip(
                    self.req_ids.tolist(), token_lists, self.num_computed.tolist(), block_lists,
                    self.sample.tolist(), self.requests, self.slots.tolist())]
        return self._chunks

    def with_token_ids(self, token_ids: np.ndarray) -> SchedulerOutput:
        """A copy of this step with other token ids (placeholders resolved); this one is not touched."""
        if len(token_ids) != self.num_tokens:
            raise ValueError(f"{len(token_ids)} token ids for a step of {self.num_tokens} tokens")
        out = copy.copy(self)
        out.token_ids = token_ids
        if self._chunks is not None and self.hand_built:  # keep its chunk objects' type
            tokens, a = token_ids.tolist(), 0
            chunks = []
            for c in self._chunks:
                b = a + len(c.token_ids)
                chunks.append(dataclasses.replace(c, token_ids=tokens[a:b]))
                a = b
            out._chunks = out.requests = chunks
        else:
            out._chunks = None
        return out

    def __len__(self) -> int:
        return self.num_reqs
