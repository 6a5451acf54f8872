"""Which request slots hold a fresh token of which request: the future-token map's checks, without the tokens.

A placeholder ``-(slot + 1)`` (``runner/core/slots.py``) names the next token of the request in ``slot``. Before a
step whose inputs hold placeholders is run, each one must name a slot that holds a token of its own request,
stored since the slot was last read; anything else is a bug (a placeholder resolved without its producer's
store, or two requests sharing a slot) that would feed a stale or foreign token. These checks need no token
value, so they stay on the host both for the tests' host map (``tests/future_token_map.py``) and for the model
runner's device-resident map (``runner/worker/device_future_map.py``).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from runner.core.scheduler_output import SchedulerOutput


class FutureTokenBook:
    """``slot -> (owner, fresh)`` as numpy arrays; ``num_resolved`` counts the placeholders claimed."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._owner = np.full(capacity, -1, dtype=np.int64)
        self._stored = np.zeros(capacity, dtype=bool)  # False: nothing stored since the last read
        self.num_resolved = 0  # placeholders replaced so far (tests assert the map really was used)

    def ensure_capacity(self, capacity: int) -> None:
        """Room for slots ``0 .. capacity - 1`` (new slots hold nothing)."""
        if capacity <= self.capacity:
            return
        grow = capacity - self.capacity
        self._owner = np.concatenate((self._owner, np.full(grow, -1, dtype=np.int64)))
        self._stored = np.concatenate((self._stored, np.zeros(grow, dtype=bool)))
        self.capacity = capacity

    def mark_stored(self, req_ids: Sequence[int] | np.ndarray, slots: np.ndarray) -> None:
        """Record that ``slots`` now hold a fresh token of ``req_ids`` (the value is kept by the caller)."""
        if len(slots) and int(slots.max()) >= self.capacity:
            self.ensure_capacity(int(slots.max()) + 1)
        self._owner[slots] = req_ids
        self._stored[slots] = True

    def claim(self, req_ids: np.ndarray, slots: np.ndarray) -> None:
        """Consume the entries of ``slots`` for the reads of ``req_ids``; raises on a foreign or stale read."""
        if not len(slots):
            return
        if int(slots.max()) < self.capacity:  # every slot exists (always, but for a bug)
            owners, stored = self._owner[slots], self._stored[slots]
        else:
            inside = slots < self.capacity
            owners = np.where(inside, self._owner[np.minimum(slots, self.capacity - 1)], -1)
            stored = inside & self._stored[np.minimum(slots, self.capacity - 1)]
        bad = np.flatnonzero((owners != req_ids) | ~stored)
        if bad.size:
            i = int(bad[0])
            rid, slot, owner = int(req_ids[i]), int(slots[i]), int(owners[i])
            raise RuntimeError(f"future-token map: request {rid} reads slot {slot} but it holds "
                               f"{'a token of request ' + str(owner) if stored[i] else 'nothing'} (a placeholder "
                               "was resolved without its producer's store, or two requests share a slot)")
        self._stored[slots] = False
        self.num_resolved += len(slots)

    @staticmethod
    def placeholders(out: SchedulerOutput) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Where ``out``'s placeholders are (token positions), whose they are (request ids) and which slots they
        name; None when it has none."""
        ids = out.token_ids
        if not len(ids) or int(ids.min()) >= 0:
            return None
        if len(ids) == out.num_reqs and int(ids.max()) < 0:  # a decode step: every input is a placeholder
            return np.arange(len(ids)), out.req_ids, -ids - 1
        where = np.flatnonzero(ids < 0)
        owners = np.repeat(out.req_ids, out.query_lens)[where]
        return where, owners, -ids[where] - 1
