"""Request slots and the future-token map: how step N+1 names a token that step N has not produced yet.

With the overlap loop the CPU schedules step N+1 while step N still runs, so a request decoding in both
steps feeds N+1 a token nobody knows yet. The scheduler writes a *placeholder* ``-(slot + 1)`` instead
(negative, so it can never be a real token id); step N stores its sampled tokens into the map under each
request's slot, and the forward side of step N+1 replaces every placeholder with the stored token right
before its forward. Both the store and the read run on the forward side (one executor thread, the CPU's
"forward stream"), so step order alone makes the read see the write — no CPU synchronisation.

The map is indexed by a **request slot**: a small id allocated when a request is admitted and freed when
it finishes (after the last step that used it has finished, see ``Scheduler``). A public implementation
indexed it by a wrapping counter instead, advanced by the padded batch size; the ring wrapped early and
a slot named two requests at once, which silently corrupted outputs. A slot here means one request for
its whole life, and every entry records its owner: a read for another request, or a second read of the
same entry (a placeholder resolved without a fresh store), raises instead of returning a stale token.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from runner.worker.scheduled_batch import SchedulerOutput
from runner.core.slots import slot_of

_EMPTY = (-1, -1)  # (owner request id, token): nothing stored since the last read


class FutureTokenMap:
    """``slot -> (owner, token)``; written and read only on the forward side.

    ``store`` is called after each step with the tokens it sampled; ``resolve`` on the next step's inputs
    before its forward. An entry is consumed by the read that resolves it, so each placeholder needs exactly
    one fresh store (``CI mode`` of the pool-indexed SGLang map, always on here: it costs a tuple per token).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: list[tuple[int, int]] = [_EMPTY] * capacity
        self.num_resolved = 0  # placeholders replaced so far (tests assert the map really was used)

    def store(self, req_ids: Sequence[int], slots: Sequence[int], tokens: Sequence[int]) -> None:
        for rid, slot, tok in zip(req_ids, slots, tokens):
            self._entries[slot] = (rid, tok)

    def resolve_one(self, req_id: int, token: int) -> int:
        if token >= 0:
            return token
        slot = slot_of(token)
        owner, value = self._entries[slot]
        if owner != req_id or value < 0:
            raise RuntimeError(f"future-token map: request {req_id} reads slot {slot} but it holds "
                               f"{'nothing' if value < 0 else f'a token of request {owner}'} (a placeholder was "
                               "resolved without its producer's store, or two requests share a slot)")
        self._entries[slot] = _EMPTY
        self.num_resolved += 1
        return value

    def resolve(self, out: SchedulerOutput) -> SchedulerOutput:
        """``out`` with every placeholder replaced; fresh chunk objects, the scheduler's own are not touched
        (its CPU thread reads them while this step runs)."""
        if not any(t < 0 for c in out.chunks for t in c.token_ids):
            return out
        chunks = [c if min(c.token_ids) >= 0 else
                  dataclasses.replace(c, token_ids=[self.resolve_one(c.req_id, t) for t in c.token_ids])
                  for c in out.chunks]
        return dataclasses.replace(out, chunks=chunks)

