"""Whether ubatching pays for this step, decided from step times measured with DBO on and off.

Fixed thresholds (vLLM's, SGLang's) cannot tell a model and machine where DBO loses. Per bucket (phase, size as
the bit length of the token count, execution: graph replay or eager) this keeps each side's seconds per token
of its last ``window`` timed steps, votes for the side whose fastest recent step is faster (slow outliers are
one-sided) and re-checks the loser with exponential back-off, never more often than its measured loss allows
(``explore_budget``). Only the steps whose time it needs are timed (``needs_time``): a settled bucket's steps
cost nothing to measure. The vote is this rank's; ``runner.distributed.dp`` decides. Design:
docs/design_notes.md, "Model runner", "The DBO decision".
"""
from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass

COST_MODELS = ("measured", "off")


class Execution(str, enum.Enum):  # noqa: UP042  (StrEnum needs Python 3.11; setup.cfg allows 3.10)
    """How a step ran: steps of one kind are compared only with steps of the same kind."""

    REPLAYED = "replayed"  # a CUDA-graph replay
    EAGER = "eager"


@dataclass(frozen=True)
class StepRecord:
    """What one step of this rank ran: its real tokens, phase, whether it ubatched and how it executed."""

    num_tokens: int
    is_prefill: bool
    ubatched: bool
    execution: Execution


@dataclass(frozen=True)
class BucketDecision:
    """Where a measured bucket stands: DBO on or off, and DBO's speed-up (off time / on time per token, from
    each side's fastest recent step: > 1 means DBO is faster)."""

    is_prefill: bool
    min_tokens: int
    max_tokens: int
    execution: Execution
    dbo_on: bool
    ratio: float

    @property
    def label(self) -> str:
        """``decode 256-511 tok replayed``: the bucket's name in the summary, the metrics and the trace."""
        return (f"{'prefill' if self.is_prefill else 'decode'} {self.min_tokens}-{self.max_tokens} tok "
                f"{self.execution.value}")

    def describe(self) -> str:
        return describe_bucket(self.label, self.dbo_on, self.ratio)


def describe_bucket(label: str, dbo_on: bool, ratio: float) -> str:
    """One bucket's line, ``decode 1-31 tok eager: DBO on (1.23x)``: from a rank's own cost model, or from the
    bucket a rank process reported (``runner.core.messages.DBOBucketStat``)."""
    return f"{label}: DBO {'on' if dbo_on else 'off'} ({ratio:.2f}x)"


class _Bucket:
    """One (phase, size, execution) bucket: the seconds per token of the last ``window`` timed steps of each
    side, and when to look at the losing side again (``since_explore`` counts the bucket's votes since the last
    look, timed or not)."""
    def __init__(self, window: int, explore_every: int) -> None:
        self.on: deque[float] = deque(maxlen=window)  # DBO on
        self.off: deque[float] = deque(maxlen=window)
        self.since_explore = 0
        self.explore_every = explore_every

    @property
    def measured(self) -> bool:
        """Both sides have run at least once."""
        return bool(self.on) and bool(self.off)

    def prefers_dbo(self) -> bool:
        """The side whose fastest recent step is faster: slow outliers (compiles, GC, other processes) never
        lower a minimum."""
        return min(self.on) <= min(self.off)

    def loss(self) -> float:
        """What one step of the losing side costs more than one of the winner, as a share of the winner's."""
        fast, slow = sorted((min(self.on), min(self.off)))
        return slow / fast - 1.0


class DBOCostModel:
    """Per-rank DBO vote from measured step times; ``vote(...)`` before a step, ``record(...)`` after it."""

    def __init__(self, explore_every: int = 32, max_explore_every: int = 512, window: int = 3,
                 explore_budget: float | None = 0.01) -> None:
        """``explore_budget``: the share of a bucket's time its looks at a confirmed loser may cost: once a look
        confirms the loser, the next is at least ``loss / explore_budget`` steps later, ``loss`` being what a
        step of the loser costs more than one of the winner, as a share of it (a side twice as slow: 100 steps
        at 1 %), on top of the doubling; ``None``: the doubling alone."""
        if explore_every < 1 or max_explore_every < explore_every:
            raise ValueError(f"need 1 <= explore_every <= max_explore_every, got {explore_every}, {max_explore_every}")
        if window < 1:
            raise ValueError(f"window must be at least 1 step, got {window}")
        if explore_budget is not None and not 0 < explore_budget <= 1:
            raise ValueError(f"explore_budget must lie in (0, 1] (a share of the bucket's time) or be None, got "
                             f"{explore_budget!r}")
        self.explore_every, self.max_explore_every, self.window = explore_every, max_explore_every, window
        self.explore_budget = explore_budget
        self.buckets: dict[tuple[bool, int, Execution], _Bucket] = {}

    def _bucket(self, num_tokens: int, is_prefill: bool, execution: Execution) -> _Bucket:
        key = (*self.key(num_tokens, is_prefill), execution)
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = _Bucket(self.window, self.explore_every)
        return b

    @staticmethod
    def key(num_tokens: int, is_prefill: bool) -> tuple[bool, int]:
        return is_prefill, max(num_tokens, 1).bit_length()

    def vote(self, num_tokens: int, is_prefill: bool, execution: Execution | None) -> bool:
        """Does this rank want the step ubatched? (Called only once the thresholds allow it.)

        ``execution``: how the step would run with DBO and without -- the same either way -- or ``None`` when
        the two differ (one replays a graph, the other runs eager): such a step is never measured against the
        other side, and the thresholds alone decide (``True``).
        """
        if execution is None:
            return True
        b = self._bucket(num_tokens, is_prefill, execution)
        if b.measured and b.since_explore >= b.explore_every:  # time to look at the losing side again
            b.since_explore = 0
            return not b.prefers_dbo()
        b.since_explore += 1
        if not b.on:
            return True
        if not b.off:
            return False
        return b.prefers_dbo()

    def needs_time(self, num_tokens: int, is_prefill: bool, execution: Execution | None, ubatched: bool) -> bool:
        """Whether a step just voted for (``execution`` as the vote saw it) should be timed and recorded.

        Yes while the side it runs has fewer than ``window`` figures, for a look at the losing side (or a step
        the DP ranks ubatched against this rank's vote), and for the winner's last ``window`` steps before the
        next look, so the look is compared with current figures. A settled bucket's other steps are not timed:
        DBO decided off costs no timing events. A step whose two choices execute differently is always timed.
        """
        if execution is None:
            return True
        b = self.buckets.get((*self.key(num_tokens, is_prefill), execution))
        if b is None or len(b.on if ubatched else b.off) < self.window:
            return True
        if not b.measured:
            return False  # one side has its figures, the other has none yet: only the other's steps count
        return b.prefers_dbo() != ubatched or b.since_explore + self.window >= b.explore_every

    def record(self, step: StepRecord, seconds: float) -> None:
        """What a step took, in the bucket of the execution it actually ran as."""
        if step.num_tokens <= 0 or seconds <= 0:
            return
        b = self._bucket(step.num_tokens, step.is_prefill, step.execution)
        ubatched = step.ubatched
        exploring = b.measured and b.prefers_dbo() != ubatched
        (b.on if ubatched else b.off).append(seconds / step.num_tokens)
        if exploring:  # the loser had its look: if it still loses, wait longer before the next one
            stands = b.prefers_dbo() != ubatched
            b.explore_every = self._next_gap(b) if stands else self.explore_every

    def _next_gap(self, b: _Bucket) -> int:
        """Steps until the next look at a loser that a look just confirmed: twice the last gap, and at least what
        keeps a look's extra cost within ``explore_budget`` of the bucket's time; at most ``max_explore_every``.
        A decision that a look overturned starts again from ``explore_every``, so a wrong one (a noisy figure)
        is looked at again soon."""
        gap = 2 * b.explore_every
        if self.explore_budget is not None:
            gap = max(gap, math.ceil(b.loss() / self.explore_budget))
        return min(gap, self.max_explore_every)

    def decisions(self) -> list[BucketDecision]:
        """Every bucket that has run both ways, in (phase, size, execution) order."""
        out = []
        for (prefill, bits, execution), b in sorted(self.buckets.items(), key=lambda kv: (kv[0][:2], kv[0][2].value)):
            if b.measured:
                out.append(BucketDecision(prefill, 1 << (bits - 1), (1 << bits) - 1, execution, b.prefers_dbo(),
                                          min(b.off) / min(b.on)))
        return out

    def summary(self) -> str:
        return "; ".join(d.describe() for d in self.decisions())
