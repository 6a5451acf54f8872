"""Whether ubatching pays for this step, decided from step times measured with DBO on and off.

vLLM and SGLang gate DBO/TBO with fixed token thresholds (SGLang's source notes the gap: "may smartly
disable TBO when batch size is too small b/c it will slow down"). Whether splitting a step pays depends on
the model, the batch, the machine and the interconnect: a tiny model whose every op is dispatch-bound loses
at any batch size, a compute-bound one with a slow link wins well below the thresholds. So, on top of the
thresholds (which still apply first), the engine measures.

Steps are grouped by phase (prefill or uniform decode), size (the bit length of the rank's token count:
each bucket spans a factor of two) and execution (a CUDA-graph replay or an eager step). A replayed step
costs a fraction of an eager one, so a step is only ever compared with steps that ran the same way: the
vote names the execution both choices would get (``None`` when one would replay and the other not, which
the graph plan avoids by capturing both kinds where the model may choose; the thresholds then decide
alone), and a step is recorded in the bucket of the execution it actually got.

Per bucket the model keeps the seconds per token of the last ``window`` steps with DBO on and of the last
``window`` with it off, and compares the two sides by their fastest recent step. The first step of a
bucket runs with DBO, the next without; after that the faster side wins. The losing side is tried again
after ``explore_every`` steps of the bucket, and that gap doubles each time the result stands (up to
``max_explore_every``), so a wrong early call is corrected, and a right one costs less and less.

Why the fastest recent step and not an average: what disturbs a step time is one-sided. A step that compiles
a kernel for a new shape, plans an attention kernel, collects garbage or shares the CPU with another process
is slower, never faster, and one such step can be 100x the others; an average remembers it for as long as
the looks at that side are rare. The minimum of the last few forgets a slow step after one more look, and
follows a real change within ``window`` steps of that side. Both sides keep the same number of samples, so
neither gets more chances at a low one.

The seconds come from ``runner.worker.dbo_step_timing`` (the forward's GPU time on CUDA, host time on CPU).
The decision is this rank's *vote*; the DP vote (``runner.distributed.dp``) turns the ranks' votes into one
decision, and each rank records what actually ran.
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

COST_MODELS = ("measured", "off")


class Execution(str, enum.Enum):
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
        return f"{self.label}: DBO {'on' if self.dbo_on else 'off'} ({self.ratio:.2f}x)"


class _Bucket:
    """One (phase, size, execution) bucket: the seconds per token of the last ``window`` steps of each side,
    and when to look at the losing side again."""
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


class DBOCostModel:
    """Per-rank DBO vote from measured step times; ``vote(...)`` before a step, ``record(...)`` after it."""

    def __init__(self, explore_every: int = 32, max_explore_every: int = 512, window: int = 3) -> None:
        if explore_every < 1 or max_explore_every < explore_every:
            raise ValueError(f"need 1 <= explore_every <= max_explore_every, got {explore_every}, {max_explore_every}")
        if window < 1:
            raise ValueError(f"window must be at least 1 step, got {window}")
        self.explore_every, self.max_explore_every, self.window = explore_every, max_explore_every, window
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
        if not b.on:
            return True
        if not b.off:
            return False
        if b.since_explore >= b.explore_every:  # time to look at the losing side again
            return not b.prefers_dbo()
        return b.prefers_dbo()

    def record(self, step: StepRecord, seconds: float) -> None:
        """What a step took, in the bucket of the execution it actually ran as."""
        if step.num_tokens <= 0 or seconds <= 0:
            return
        b = self._bucket(step.num_tokens, step.is_prefill, step.execution)
        ubatched = step.ubatched
        exploring = b.measured and b.prefers_dbo() != ubatched
        (b.on if ubatched else b.off).append(seconds / step.num_tokens)
        if exploring:  # the loser had its look: if it still loses, wait twice as long before the next one
            stands = b.prefers_dbo() != ubatched
            b.explore_every = min(2 * b.explore_every, self.max_explore_every) if stands else self.explore_every
            b.since_explore = 0
        else:
            b.since_explore += 1

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
