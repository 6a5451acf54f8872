"""Whether ubatching pays for this step, decided from step times measured with DBO on and off.

vLLM and SGLang gate DBO/TBO with fixed token thresholds (SGLang's source notes the gap: "may smartly
disable TBO when batch size is too small b/c it will slow down"). Whether splitting a step pays depends on
the model, the batch, the machine and the interconnect: a tiny model whose every op is dispatch-bound loses
at any batch size, a compute-bound one with a slow link wins well below the thresholds. So, on top of the
thresholds (which still apply first), the engine measures.

Steps are grouped by phase (prefill or uniform decode) and size (the bit length of the rank's token count:
each bucket spans a factor of two). Per bucket it keeps the seconds per token of the last ``window`` steps
with DBO on and of the last ``window`` with it off, and compares the two sides by their fastest recent step.
The first step of a bucket runs with DBO, the next without; after that the faster side wins. The losing side
is tried again after ``explore_every`` steps of the bucket, and that gap doubles each time the result stands
(up to ``max_explore_every``), so a wrong early call is corrected, and a right one costs less and less.

Why the fastest recent step and not an average: what disturbs a step time is one-sided. A step that compiles
a kernel for a new shape, plans an attention kernel, collects garbage or shares the CPU with another process
is slower, never faster, and one such step can be 100x the others. The exponential average this model used
before remembered it: one slow first step without DBO kept a bucket ubatched for hundreds of steps, since each
later look at that side added only a fraction of a normal sample and the looks grow rarer. The minimum of the
last few forgets a slow step after one more look, and follows a real change within ``window`` steps of that
side. Both sides keep the same number of samples, so neither gets more chances at a low one.

The decision is this rank's *vote*; the DP vote (``runner.distributed.dp``) turns the ranks' votes into one decision, and each rank records what actually ran.
"""
from __future__ import annotations

from collections import deque

COST_MODELS = ("measured", "off")


class _Bucket:
    """One (phase, size) bucket: the seconds per token of the last ``window`` steps of each side, and when to
    look at the losing side again."""

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
        self.buckets: dict[tuple[bool, int], _Bucket] = {}

    def _bucket(self, num_tokens: int, is_prefill: bool) -> _Bucket:
        key = self.key(num_tokens, is_prefill)
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = _Bucket(self.window, self.explore_every)
        return b

    @staticmethod
    def key(num_tokens: int, is_prefill: bool) -> tuple[bool, int]:
        return is_prefill, max(num_tokens, 1).bit_length()

    def vote(self, num_tokens: int, is_prefill: bool) -> bool:
        """Does this rank want the step ubatched? (Called only once the thresholds allow it.)"""
        b = self._bucket(num_tokens, is_prefill)
        if not b.on:
            return True
        if not b.off:
            return False
        if b.since_explore >= b.explore_every:  # time to look at the losing side again
            return not b.prefers_dbo()
        return b.prefers_dbo()

    def record(self, num_tokens: int, is_prefill: bool, ubatched: bool, seconds: float) -> None:
        """What a step of this rank's ``num_tokens`` took, and whether it actually ran ubatched."""
        if num_tokens <= 0 or seconds <= 0:
            return
        b = self._bucket(num_tokens, is_prefill)
        exploring = b.measured and b.prefers_dbo() != ubatched
        (b.on if ubatched else b.off).append(seconds / num_tokens)
        if exploring:  # the loser had its look: if it still loses, wait twice as long before the next one
            stands = b.prefers_dbo() != ubatched
            b.explore_every = min(2 * b.explore_every, self.max_explore_every) if stands else self.explore_every
            b.since_explore = 0
        else:
            b.since_explore += 1

    def summary(self) -> str:
        parts = []
        for (prefill, bits), b in sorted(self.buckets.items()):
            if b.measured:
                lo, hi = (1 << (bits - 1)), (1 << bits) - 1
                parts.append(f"{'prefill' if prefill else 'decode'} {lo}-{hi} tok: DBO "
                             f"{'on' if b.prefers_dbo() else 'off'} ({min(b.off) / min(b.on):.2f}x)")
        return "; ".join(parts)
