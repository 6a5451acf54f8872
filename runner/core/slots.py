"""Request slots: a small id per live request, and the placeholder token that names its next token.

A slot is allocated when a request is admitted and freed after the last step that used it has finished,
so one slot means one request for its whole life. The scheduler hands slots out; the future-token maps
(``runner/worker/device_future_map.py``, the tests' host map) are indexed by them.
"""
from __future__ import annotations


def placeholder(slot: int) -> int:
    """The token id that stands for "the next token of the request in ``slot``" (always < 0)."""
    return -(slot + 1)


def slot_of(token: int) -> int:
    return -token - 1


class SlotPool:
    """Free list of request slots, lowest id first (deterministic, O(1)); double frees raise."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"slot capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._free = list(range(capacity - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise RuntimeError(f"all {self.capacity} request slots are in use: a slot leaked (a finished request "
                               "kept it) or more requests ran at once than the scheduler allows")
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise RuntimeError(f"request slot {slot} freed twice or never allocated")
        self._used.remove(slot)
        self._free.append(slot)
