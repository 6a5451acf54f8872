"""Whether ubatching pays for this step, decided from step times measured with DBO on and off.

vLLM and SGLang gate DBO/TBO with fixed token thresholds (SGLang's source notes the gap: "may smartly
disable TBO when batch size is too small b/c it will slow down"). Whether splitting a step pays depends on
the model, the batch, the machine and the interconnect: a tiny model whose every op is dispatch-bound loses
at any batch size, a compute-bound one with a slow link wins well below the thresholds. So, on top of the
thresholds (which still apply first), the engine measures.

Steps are grouped by phase (prefill or uniform decode) and size (the bit length of the rank's token count:
each bucket spans a factor of two). Per bucket it keeps an exponential moving average of seconds per token
with DBO on and with it off. The first step of a bucket runs with DBO, the next without; after that the
faster side wins. The losing side is tried again after ``explore_every`` steps of the bucket, and that gap
doubles each time the result stands (up to ``max_explore_every``), so a wrong early call -- a noisy first
sample -- is corrected, and a right one costs less and less. The decision is this rank's *vote*; the DP
vote (``runner.distributed.dp``) turns the ranks' votes into one decision, and each rank records what actually ran.
"""
from __future__ import annotations

from dataclasses import dataclass, field

COST_MODELS = ("measured", "off")


@dataclass
class _Side:
    mean: float = 0.0  # EWMA of seconds per token
    count: int = 0

    def add(self, value: float, alpha: float) -> None:
        self.mean = value if self.count == 0 else (1 - alpha) * self.mean + alpha * value
        self.count += 1


@dataclass
class _Bucket:
    on: _Side = field(default_factory=_Side)
    off: _Side = field(default_factory=_Side)
    since_explore: int = 0
    explore_every: int = 0

    def prefers_dbo(self) -> bool:
        return self.on.mean <= self.off.mean


class DBOCostModel:
    """Per-rank DBO vote from measured step times; ``vote(...)`` before a step, ``record(...)`` after it."""

    def __init__(self, explore_every: int = 32, max_explore_every: int = 512, alpha: float = 0.3) -> None:
        if explore_every < 1 or max_explore_every < explore_every:
            raise ValueError(f"need 1 <= explore_every <= max_explore_every, got {explore_every}, {max_explore_every}")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must lie in (0, 1], got {alpha}")
        self.explore_every, self.max_explore_every, self.alpha = explore_every, max_explore_every, alpha
        self.buckets: dict[tuple[bool, int], _Bucket] = {}

    @staticmethod
    def key(num_tokens: int, is_prefill: bool) -> tuple[bool, int]:
        return is_prefill, max(num_tokens, 1).bit_length()

    def vote(self, num_tokens: int, is_prefill: bool) -> bool:
        """Does this rank want the step ubatched? (Called only once the thresholds allow it.)"""
        b = self.buckets.setdefault(self.key(num_tokens, is_prefill), _Bucket(explore_every=self.explore_every))
        if b.on.count == 0:
            return True
        if b.off.count == 0:
            return False
        if b.since_explore >= b.explore_every:  # time to look at the losing side again
            return not b.prefers_dbo()
        return b.prefers_dbo()

    def record(self, num_tokens: int, is_prefill: bool, ubatched: bool, seconds: float) -> None:
        """What a step of this rank's ``num_tokens`` took, and whether it actually ran ubatched."""
        if num_tokens <= 0 or seconds <= 0:
            return
        b = self.buckets.setdefault(self.key(num_tokens, is_prefill), _Bucket(explore_every=self.explore_every))
        was_preferred = b.on.count > 0 and b.off.count > 0 and b.prefers_dbo() == ubatched
        exploring = b.on.count > 0 and b.off.count > 0 and not was_preferred
        (b.on if ubatched else b.off).add(seconds / num_tokens, self.alpha)
        if exploring:  # the loser had its look: if it still loses, wait twice as long before the next one
            stands = b.prefers_dbo() != ubatched
            b.explore_every = min(2 * b.explore_every, self.max_explore_every) if stands else self.explore_every
            b.since_explore = 0
        else:
            b.since_explore += 1

    def summary(self) -> str:
        parts = []
        for (prefill, bits), b in sorted(self.buckets.items()):
            if b.on.count and b.off.count:
                lo, hi = (1 << (bits - 1)), (1 << bits) - 1
                parts.append(f"{'prefill' if prefill else 'decode'} {lo}-{hi} tok: DBO "
                             f"{'on' if b.prefers_dbo() else 'off'} ({b.off.mean / b.on.mean:.2f}x)")
        return "; ".join(parts)
