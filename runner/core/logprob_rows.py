"""Log-probabilities as arrays from the sampler to the front (vLLM's ``LogprobsLists``): a run of tokens' ids,
log-probabilities, ranks and top alternatives in five arrays, never an object per token.

:class:`LogprobRows` holds the arrays as little-endian bytes, so one crosses the process boundary as a msgpack
array of six values and ``np.frombuffer`` reads it back without a copy. The sampler makes one per step
(:class:`StepLogprobs`), a prefill chunk one for its prompt positions; the engine core hands a running request's
rows on in a step's :class:`LogprobTokens` (no struct per request) and the front builds vLLM's per-token dicts
from them. :class:`TokenLogprobs` is one row as an object, for readers that want one (tests, tools).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec
import numpy as np

INT64 = np.dtype("<i8")
FLOAT64 = np.dtype("<f8")  # float32 log-probabilities widened exactly


@dataclass
class TokenLogprobs:
    """One token: its log-probability and rank (1 = the most likely token), and the ``top_n`` most likely
    tokens with theirs, most likely first."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


class LogprobLists(NamedTuple):
    """:class:`LogprobRows` as Python lists, read in one call per array: ``top_token_ids[i]`` is row ``i``'s."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]


class LogprobRows(msgspec.Struct, array_like=True, gc=False):
    """``len(self)`` tokens' log-probabilities: row ``i`` is token ``token_ids[i]``, its log-probability and
    rank, and the ``num_top`` most likely tokens at its position with their log-probabilities (int64 and
    float64 bytes; the top arrays are ``[rows, num_top]`` row-major)."""

    num_top: int = 0
    token_ids: bytes = b""
    logprobs: bytes = b""
    ranks: bytes = b""
    top_token_ids: bytes = b""
    top_logprobs: bytes = b""

    @classmethod
    def of(cls, token_ids: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray, top_token_ids: np.ndarray,
           top_logprobs: np.ndarray) -> LogprobRows:
        """From arrays: three of ``n`` and two of ``[n, num_top]``."""
        n = len(token_ids)
        if len(logprobs) != n or len(ranks) != n or top_token_ids.shape != top_logprobs.shape \
                or top_token_ids.ndim != 2 or top_token_ids.shape[0] != n:
            raise ValueError(f"log-probability arrays of {n} tokens do not agree: logprobs {logprobs.shape}, ranks "
                             f"{ranks.shape}, top ids {top_token_ids.shape}, top logprobs {top_logprobs.shape}")
        return cls(top_token_ids.shape[1], _bytes(token_ids, INT64), _bytes(logprobs, FLOAT64), _bytes(ranks, INT64),
                   _bytes(top_token_ids, INT64), _bytes(top_logprobs, FLOAT64))

    @classmethod
    def of_entries(cls, entries: Sequence[TokenLogprobs]) -> LogprobRows:
        """From objects of one top width (tests, tools)."""
        k = len(entries[0].top_token_ids) if entries else 0
        if any(len(e.top_token_ids) != k or len(e.top_logprobs) != k for e in entries):
            raise ValueError(f"entries of different top widths: {[len(e.top_token_ids) for e in entries]}")
        return cls.of(np.array([e.token_id for e in entries], INT64), np.array([e.logprob for e in entries], FLOAT64),
                      np.array([e.rank for e in entries], INT64),
                      np.array([e.top_token_ids for e in entries], INT64).reshape(len(entries), k),
                      np.array([e.top_logprobs for e in entries], FLOAT64).reshape(len(entries), k))

    def __len__(self) -> int:
        return len(self.token_ids) // INT64.itemsize

    def ids(self) -> np.ndarray:
        return np.frombuffer(self.token_ids, INT64)

    def values(self) -> np.ndarray:
        return np.frombuffer(self.logprobs, FLOAT64)

    def rank_values(self) -> np.ndarray:
        return np.frombuffer(self.ranks, INT64)

    def top_ids(self) -> np.ndarray:
        return np.frombuffer(self.top_token_ids, INT64).reshape(len(self), self.num_top)

    def top_values(self) -> np.ndarray:
        return np.frombuffer(self.top_logprobs, FLOAT64).reshape(len(self), self.num_top)

    def lists(self) -> LogprobLists:
        return LogprobLists(self.ids().tolist(), self.values().tolist(), self.rank_values().tolist(),
                            self.top_ids().tolist(), self.top_values().tolist())

    def take(self, rows: np.ndarray | slice, num_top: int | None = None) -> LogprobRows:
        """The rows ``rows`` picks (indices or a slice), their top columns cut to ``num_top`` when given."""
        k = self.num_top if num_top is None else min(num_top, self.num_top)
        return LogprobRows.of(self.ids()[rows], self.values()[rows], self.rank_values()[rows],
                              self.top_ids()[rows, :k], self.top_values()[rows, :k])

    def row(self, i: int, num_top: int) -> LogprobRows:
        """Row ``i`` alone, its top columns cut to ``num_top`` (its request's count)."""
        return self.take(slice(i, i + 1), num_top)

    @staticmethod
    def concat(parts: Sequence[LogprobRows]) -> LogprobRows:
        """The rows of ``parts`` in order (one request's, so one top width)."""
        if len(parts) == 1:
            return parts[0]
        widths = {p.num_top for p in parts}
        if len(widths) > 1:
            raise ValueError(f"cannot join log-probability rows of top widths {sorted(widths)}")
        return LogprobRows(parts[0].num_top, *(b"".join(getattr(p, f) for p in parts) for f in _ARRAYS))

    def __getitem__(self, i: int) -> TokenLogprobs:
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        i %= len(self)
        return TokenLogprobs(int(self.ids()[i]), float(self.values()[i]), int(self.rank_values()[i]),
                             self.top_ids()[i].tolist(), self.top_values()[i].tolist())

    def __iter__(self) -> Iterator[TokenLogprobs]:
        lists = self.lists()
        for row in zip(*lists, strict=True):
            yield TokenLogprobs(*row)


_ARRAYS = ("token_ids", "logprobs", "ranks", "top_token_ids", "top_logprobs")


class LogprobTokens(msgspec.Struct, array_like=True, gc=False):
    """A step's new tokens of running requests that asked for log-probabilities and need nothing else (not
    finished, not their first output): request ``request_ids[i]`` got token ``rows.token_ids[i]`` with row
    ``i`` of ``rows``, of which its request asked for ``num_top[i]`` alternatives (int64 bytes; ``rows``' top
    width is the step's largest)."""

    request_ids: bytes
    num_top: bytes
    rows: LogprobRows

    @classmethod
    def of(cls, request_ids: np.ndarray, num_top: np.ndarray, rows: LogprobRows) -> LogprobTokens:
        if not len(request_ids) == len(num_top) == len(rows):
            raise ValueError(f"{len(request_ids)} request ids and {len(num_top)} counts for {len(rows)} "
                             "log-probability rows")
        return cls(_bytes(request_ids, INT64), _bytes(num_top, INT64), rows)

    def ids(self) -> np.ndarray:
        return np.frombuffer(self.request_ids, INT64)

    def counts(self) -> np.ndarray:
        return np.frombuffer(self.num_top, INT64)

    def row(self, i: int) -> LogprobRows:
        """Row ``i`` alone, cut to its request's count."""
        return self.rows.row(i, int(self.counts()[i]))

    def __len__(self) -> int:
        return len(self.rows)

    def take(self, rows: np.ndarray) -> LogprobTokens:
        return LogprobTokens.of(self.ids()[rows], self.counts()[rows], self.rows.take(rows))


@dataclass(eq=False)
class StepLogprobs:
    """The log-probabilities of one step's sampled tokens: row ``positions[j]`` of the step (its sampled rows,
    or its chunks once :meth:`scattered`) has row ``j`` of ``rows``, its request having asked for ``num_top[j]``
    alternatives (``rows``' width is the largest). ``size``: the step's rows. As a sequence, row ``i``'s
    :class:`TokenLogprobs` or None where it asked for none."""

    positions: np.ndarray
    num_top: np.ndarray
    rows: LogprobRows
    size: int
    _where: np.ndarray | None = field(default=None, init=False, repr=False)

    @classmethod
    def of_entries(cls, entries: Sequence[TokenLogprobs | None]) -> StepLogprobs:
        """From an object or None per row, the objects of one top width (tests, stand-in runners)."""
        positions = [i for i, e in enumerate(entries) if e is not None]
        rows = LogprobRows.of_entries([e for e in entries if e is not None])
        return cls(np.array(positions, dtype=np.int64), np.full(len(positions), rows.num_top, dtype=np.int64), rows,
                   len(entries))

    def index(self) -> np.ndarray:
        """For each of the step's rows its row of ``rows``, -1 where it asked for none (made once)."""
        if self._where is None:
            self._where = np.full(self.size, -1, dtype=np.int64)
            self._where[self.positions] = np.arange(len(self.positions))
        return self._where

    def row(self, j: int) -> LogprobRows:
        """Row ``j`` of ``rows`` alone, cut to its request's count."""
        return self.rows.row(j, int(self.num_top[j]))

    def row_at(self, position: int) -> LogprobRows | None:
        """The step's row ``position`` alone (cut to its request's count), None where it asked for none."""
        j = int(self.index()[position])
        return None if j < 0 else self.row(j)

    def scattered(self, picks: np.ndarray, size: int) -> StepLogprobs:
        """The same rows placed among ``size`` rows, sampled row ``i`` at ``picks[i]``."""
        return StepLogprobs(picks[self.positions], self.num_top, self.rows, size)

    def __len__(self) -> int:
        return self.size

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StepLogprobs) and self.size == other.size and self.rows == other.rows \
            and np.array_equal(self.positions, other.positions) and np.array_equal(self.num_top, other.num_top)

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value

    def __getitem__(self, i: int) -> TokenLogprobs | None:
        row = self.row_at(i)
        return None if row is None else row[0]

    def __iter__(self) -> Iterator[TokenLogprobs | None]:
        return (self[i] for i in range(self.size))


def _bytes(a: np.ndarray, dtype: np.dtype) -> bytes:
    return np.ascontiguousarray(a, dtype=dtype).tobytes()
