"""The scheduler's steady decodes as arrays: running requests that decode one token a step, their per-step state
in numpy rows, so that scheduling them and applying their results costs no Python per request.

A request joins the run once the scheduler has scheduled it as a plain decode (its prompt is computed; it stops
on at most ``MAX_RUN_STOP_IDS`` token ids, EOS included, which a ``[rows, k]`` table holds). From then on the
run's arrays hold the fields a decode step changes (``num_computed_tokens``, ``inflight``, ``num_pending``, its
new tokens and its last token); its ``Request`` reads them from here while it is in the run. It leaves the run,
its fields written back, whenever anything else is to happen to it: it finishes, is aborted or preempted, or the
scheduler needs the per-request path for the whole batch (a KV-block shortage, an invalid sample). While in the
run its output list holds its real tokens only; the tokens it generates collect in :attr:`DecodeRun.history`
and join the list when it leaves (or when the history fills up), followed by one placeholder per step in flight.
"""
from __future__ import annotations

import operator
from typing import Generic, Protocol, TypeVar

import numpy as np

from runner.core.scheduler_output import RequestSnapshot
from runner.core.slots import placeholder


class RunMember(Protocol):
    """What the run reads and writes of a request (the scheduler's ``Request``, which points at its run while in it)."""

    req_id: int
    slot: int
    prompt_token_ids: list[int]
    outputs: list[int]
    computed: int
    pending: int
    steps_inflight: int
    kv_capacity: int
    max_outputs: int
    stop_ids: frozenset[int]
    snapshot: RequestSnapshot


Member = TypeVar("Member", bound=RunMember)

HISTORY_STEPS = 64  # tokens a row keeps in the array before they are appended to its request's list
_COLUMNS = ("slots", "req_ids", "computed", "capacity", "num_out", "pending", "inflight", "max_outputs",
            "last_token", "history_len")


class DecodeRun(Generic[Member]):
    """Requests in steady decode, one row each, in the order they joined (module docstring).

    Columns (int64): ``slots``, ``req_ids``, ``computed`` (num_computed_tokens), ``capacity`` (tokens its KV
    blocks hold), ``num_out`` (outputs, placeholders included), ``pending`` (placeholders), ``inflight`` (steps
    in flight), ``max_outputs``, ``last_token`` (its newest real token), ``history_len`` (tokens in ``history``
    not yet in its list); ``stop_ids`` ``[rows, k]``: the tokens that stop each row, padded with -1 (never a
    token). ``row_of_slot[s]`` is the row of the request in slot ``s``, or -1."""

    def __init__(self, num_slots: int) -> None:
        self.reqs: list[Member] = []
        self.row_of_slot = np.full(num_slots, -1, dtype=np.int64)
        for name in _COLUMNS:
            setattr(self, name, np.zeros(0, dtype=np.int64))
        self.stop_ids = np.full((0, 1), -1, dtype=np.int64)
        self.history = np.zeros((0, HISTORY_STEPS), dtype=np.int64)
        self._snapshots: tuple[RequestSnapshot, ...] | None = None

    stop_ids: np.ndarray
    slots: np.ndarray
    req_ids: np.ndarray
    computed: np.ndarray
    capacity: np.ndarray
    num_out: np.ndarray
    pending: np.ndarray
    inflight: np.ndarray
    max_outputs: np.ndarray
    last_token: np.ndarray
    history_len: np.ndarray

    def __len__(self) -> int:
        return len(self.reqs)

    def snapshots(self) -> tuple[RequestSnapshot, ...]:
        """Every row's ``snapshot``, in row order (kept until the rows change)."""
        if self._snapshots is None:
            self._snapshots = tuple(map(operator.attrgetter("snapshot"), self.reqs))
        return self._snapshots

    # ---- joining and leaving ---------------------------------------------------------------------------
    def join(self, reqs: list[Member]) -> None:
        """Take these requests' decode state into new rows; their output lists keep their real tokens only."""
        if not reqs:
            return
        rows: dict[str, list[int]] = {name: [] for name in _COLUMNS}
        for req in reqs:
            out = req.outputs
            pending = req.pending
            if pending:
                del out[len(out) - pending:]
            rows["slots"].append(req.slot)
            rows["req_ids"].append(req.req_id)
            rows["computed"].append(req.computed)
            rows["capacity"].append(req.kv_capacity)
            rows["num_out"].append(len(out) + pending)
            rows["pending"].append(pending)
            rows["inflight"].append(req.steps_inflight)
            rows["max_outputs"].append(req.max_outputs)
            rows["last_token"].append(out[-1] if out else req.prompt_token_ids[-1])
            rows["history_len"].append(0)
        first = len(self.reqs)
        self.reqs.extend(reqs)
        for name in _COLUMNS:
            old = getattr(self, name)
            setattr(self, name, np.concatenate((old, np.array(rows[name], dtype=old.dtype))))
        width = max(self.stop_ids.shape[1], *(len(r.stop_ids) for r in reqs))
        stops = np.full((len(reqs), width), -1, dtype=np.int64)
        for j, req in enumerate(reqs):
            stops[j, :len(req.stop_ids)] = sorted(req.stop_ids)
        old_stops = self.stop_ids
        if old_stops.shape[1] < width:
            old_stops = np.pad(old_stops, ((0, 0), (0, width - old_stops.shape[1])), constant_values=-1)
        self.stop_ids = np.concatenate((old_stops, stops))
        self.history = np.concatenate((self.history, np.zeros((len(reqs), self.history.shape[1]), np.int64)))
        self.row_of_slot[self.slots[first:]] = np.arange(first, len(self.reqs))
        self._snapshots = None

    def leave(self, rows: np.ndarray) -> list[Member]:
        """Write rows ``rows`` back into their requests and drop them; returns those requests."""
        if not len(rows):
            return []
        gone = [self.reqs[i] for i in rows.tolist()]
        for i, req in zip(rows.tolist(), gone, strict=True):
            self._write_back(i, req)
        keep = np.ones(len(self.reqs), dtype=bool)
        keep[rows] = False
        self.row_of_slot[self.slots[rows]] = -1
        self.reqs = [r for r, k in zip(self.reqs, keep.tolist(), strict=True) if k]
        for name in _COLUMNS:
            setattr(self, name, getattr(self, name)[keep])
        self.history = self.history[keep]
        self.stop_ids = self.stop_ids[keep]
        self.row_of_slot[self.slots] = np.arange(len(self.reqs))
        self._snapshots = None
        return gone

    def _write_back(self, i: int, req: Member) -> None:
        out = req.outputs
        n = int(self.history_len[i])
        if n:
            out.extend(self.history[i, :n].tolist())
        pending = int(self.pending[i])
        slot = int(self.slots[i])
        if pending:
            out.extend([placeholder(slot)] * pending)
        req.computed = int(self.computed[i])
        req.steps_inflight = int(self.inflight[i])
        req.pending = pending

    def field_of(self, req: Member, column: str) -> int:
        """``req``'s value in ``column`` (one of :data:`_COLUMNS`)."""
        return int(getattr(self, column)[self.row_of_slot[req.slot]])

    def current_outputs(self, req: Member) -> list[int]:
        """``req``'s outputs as its list will read when it leaves: its list, its collected tokens, a placeholder
        per step in flight (a copy: the run keeps the state)."""
        i = int(self.row_of_slot[req.slot])
        n, pending = int(self.history_len[i]), int(self.pending[i])
        return req.outputs + self.history[i, :n].tolist() + [placeholder(req.slot)] * pending

    def flush_history(self) -> None:
        """Append every row's collected tokens to its request's list (the history is full)."""
        for req, tokens, n in zip(self.reqs, self.history.tolist(), self.history_len.tolist(), strict=True):
            if n:
                req.outputs.extend(tokens[:n])
        self.history_len[:] = 0

    # ---- a step ------------------------------------------------------------------------------------------
    def stops(self, rows: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Whether ``tokens[i]`` is a stop token of row ``rows[i]`` (bool per row)."""
        return (self.stop_ids[rows] == tokens[:, None]).any(axis=1)

    def record(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """The real tokens of a processed step for rows ``rows`` (each in the run, each with a step in flight)."""
        if int(self.history_len.max(initial=0)) >= self.history.shape[1]:
            self.flush_history()
        self.history[rows, self.history_len[rows]] = tokens
        self.history_len[rows] += 1
        self.last_token[rows] = tokens
        self.pending[rows] -= 1
        self.inflight[rows] -= 1
