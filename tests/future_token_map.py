"""The future-token map on the host, for the tests' stand-in runner: how step N+1 names a token step N has not made.

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

from collections.abc import Sequence

import numpy as np

from runner.core.scheduler_output import SchedulerOutput
from runner.core.slots import slot_of
from runner.worker.future_book import FutureTokenBook


class FutureTokenMap(FutureTokenBook):
    """``slot -> (owner, token)``: the checks of :class:`FutureTokenBook` and the tokens as a numpy array; written
    and read only on the forward side.

    ``store`` is called after each step with the tokens it sampled; ``resolve`` on the next step's inputs
    before its forward. An entry is consumed by the read that resolves it, so each placeholder needs exactly
    one fresh store (``CI mode`` of the pool-indexed SGLang map, always on here). Both are vectorised over the
    step: a few numpy operations, whatever the batch size. The model runner keeps its tokens on its device
    instead (``runner/worker/device_future_map.py``); this map serves the tests' runners, whose steps compute on
    the host (``fake_runner.py``).
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._token = np.full(capacity, -1, dtype=np.int64)

    def ensure_capacity(self, capacity: int) -> None:
        if capacity > self.capacity:
            self._token = np.concatenate((self._token, np.full(capacity - self.capacity, -1, dtype=np.int64)))
        super().ensure_capacity(capacity)

    def store(self, req_ids: Sequence[int] | np.ndarray, slots: Sequence[int] | np.ndarray,
              tokens: Sequence[int] | np.ndarray) -> None:
        slots = np.asarray(slots, dtype=np.int64)
        self.mark_stored(req_ids, slots)
        self._token[slots] = tokens

    def resolve_one(self, req_id: int, token: int) -> int:
        if token >= 0:
            return token
        return int(self._take(np.array([req_id]), np.array([slot_of(token)]))[0])

    def _take(self, req_ids: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """The stored tokens of ``slots``, read by ``req_ids``, consumed; raises on a foreign or stale read."""
        self.claim(req_ids, slots)
        return self._token[slots]

    def resolve(self, out: SchedulerOutput) -> SchedulerOutput:
        """``out`` with every placeholder replaced; a copy, the scheduler's own output is not touched (its CPU
        thread reads it while this step runs). A step has at most one placeholder per request: the token its
        previous step samples."""
        found = self.placeholders(out)
        if found is None:
            return out
        where, owners, slots = found
        resolved = out.token_ids.copy()
        resolved[where] = self._take(owners, slots)
        return out.with_token_ids(resolved)

    def store_sampled(self, out: SchedulerOutput, sampled: Sequence[int | None]) -> None:
        """Store what step ``out`` sampled (``sampled[i]``: request ``i``'s token, None if it sampled none)
        under each request's slot; requests without a slot are skipped."""
        if len(sampled) != out.num_reqs:
            raise ValueError(f"{len(sampled)} sampled tokens for a step of {out.num_reqs} requests")
        keep = out.slots >= 0
        try:
            tokens = np.array(sampled, dtype=np.int64)  # every request sampled
        except TypeError:  # None where a request sampled nothing (a prefill chunk)
            given = np.array([t is not None for t in sampled], dtype=bool)
            keep &= given
            tokens = np.zeros(len(sampled), dtype=np.int64)
            tokens[given] = [t for t in sampled if t is not None]
        # A row that sampled no valid token (the sampler's INVALID_TOKEN) feeds the step already in flight a
        # harmless id 0: the scheduler ends that request with an error and discards what that step computes.
        np.maximum(tokens, 0, out=tokens)
        if keep.all():
            self.store(out.req_ids, out.slots, tokens)
        elif keep.any():
            self.store(out.req_ids[keep], out.slots[keep], tokens[keep])
