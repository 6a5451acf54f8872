"""The model runner's future-token map: sampled ids kept on the device, placeholders resolved there.

Step N+1 is launched before step N's tokens reach the host, so its input ids name them by placeholders
``-(slot + 1)`` (``runner/core/slots.py``). Step N scatters its sampled-id tensor into a ``[slots]`` token
tensor on the device, under each sampling request's slot; step N+1's input ids, once copied to the device,
take their placeholders' tokens from it with one gather (and a scatter when not every id is one), on the
device, in stream order after N's scatter; the host names the positions and slots, so no placeholder is looked
for on the device (SGLang's GPU-resident future map, vLLM's async scheduling). Nothing waits for the device.

The checks stay on the host, where they need no token value (``FutureTokenBook.claim``): a placeholder whose
slot holds no fresh token of its own request raises before the step is launched.
"""
from __future__ import annotations

import numpy as np
import torch

from runner.attention.kv_cache import host_to_device
from runner.core.scheduler_output import SchedulerOutput
from runner.worker.future_book import FutureTokenBook

_MIN_SLOTS = 64


class DeviceFutureMap:
    """Host bookkeeping (:class:`FutureTokenBook`) and a ``[slots]`` int64 token tensor on ``device``."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.book = FutureTokenBook(_MIN_SLOTS)
        self.tokens = torch.zeros(_MIN_SLOTS, dtype=torch.int64, device=self.device)

    @property
    def num_resolved(self) -> int:
        return self.book.num_resolved

    def _ensure(self, num_slots: int) -> None:
        if num_slots <= self.tokens.shape[0]:
            return
        grown = torch.zeros(max(num_slots, 2 * self.tokens.shape[0]), dtype=torch.int64, device=self.device)
        grown[:self.tokens.shape[0]] = self.tokens
        self.tokens = grown
        self.book.ensure_capacity(grown.shape[0])

    def claim(self, out: SchedulerOutput) -> tuple[np.ndarray, np.ndarray] | None:
        """The placeholders of ``out``: their token positions and the slots they name, checked and consumed on the
        host (``FutureTokenBook.claim``); None when it has none. :meth:`gather_` then reads them on the device."""
        found = self.book.placeholders(out)
        if found is None:
            return None
        where, owners, slots = found
        self.book.claim(owners, slots)
        return where, slots

    def gather_(self, input_ids: torch.Tensor, where: torch.Tensor, slots: torch.Tensor) -> None:
        """``input_ids[where[i]] = token in slots[i]``, on the device (``where``, ``slots``: device int64 of one
        length, as :meth:`claim` gave them): one gather, and one scatter unless every id is a placeholder (a
        decode step), which the gather writes in place."""
        if where.shape[0] == input_ids.shape[0]:  # positions are distinct and in order: all of them
            torch.index_select(self.tokens, 0, slots, out=input_ids)
        else:
            input_ids.index_copy_(0, where, self.tokens.index_select(0, slots))

    def resolve_(self, out: SchedulerOutput, input_ids: torch.Tensor) -> None:
        """Replace the placeholders of ``out`` in ``input_ids`` (its ``num_tokens`` ids, already on the device),
        in place (:meth:`claim`, then :meth:`gather_`), no read of any token on the host."""
        found = self.claim(out)
        if found is not None:
            where, slots = found
            self.gather_(input_ids, host_to_device(torch.from_numpy(where), self.device),
                         host_to_device(torch.from_numpy(np.ascontiguousarray(slots)), self.device))

    def store_(self, req_ids: np.ndarray, slots: np.ndarray, sampled: torch.Tensor,
               slots_on_device: torch.Tensor | None = None) -> None:
        """Scatter ``sampled[i]`` (on the device) into slot ``slots[i]`` for request ``req_ids[i]``; rows
        without a slot (``-1``: steps built by hand) are left out. ``slots_on_device``: the same slots already
        on the device (the model runner stages them with the step's inputs)."""
        keep = slots >= 0
        if not keep.all():
            idx = np.flatnonzero(keep)
            req_ids, slots = req_ids[idx], slots[idx]
            sampled = sampled.index_select(0, host_to_device(torch.from_numpy(idx), sampled.device))
            slots_on_device = None
        if not len(slots):
            return
        self._ensure(int(slots.max()) + 1)
        self.book.mark_stored(req_ids, slots)
        if slots_on_device is None:
            slots_on_device = host_to_device(torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)),
                                             self.device)
        # A row that sampled no valid token (the sampler's INVALID_TOKEN, for non-finite logits) feeds the step in
        # flight a harmless id 0: the scheduler ends that request with an error and discards what it computes.
        self.tokens.index_copy_(0, slots_on_device, sampled.clamp_min(0))
