"""Asynchronous all-to-all over a process group, as the torch backends use it.

``alltoall_base`` is called on the ProcessGroup object itself, so the same code serves groups made by
``dist.new_group`` under torchrun (gloo or NCCL) and raw ``ProcessGroupGloo`` objects that tests build
for ranks-as-threads in one process.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ubatch import streams, trace


class Handle(Protocol):
    def wait(self) -> None: ...


class WorkHandle:
    """A posted collective; ``wait`` blocks until it is done (traced as ``transfer_wait``, a "copy" span:
    the time this ubatch spent blocked on the real transfer, e.g. gloo's copies on a CPU).

    ``done`` is the collective's completion event for the stream-order sanitizer (``None`` when it is off):
    ``wait`` makes the waiter's current stream wait for it, as ``work.wait()`` does with NCCL."""

    def __init__(self, work: Any, done: streams.Event | None = None) -> None:
        self.work = work
        self.done = done

    def wait(self) -> None:
        with trace.region("transfer_wait", "copy"):
            self.work.wait()
        if self.done is not None:
            streams.wait(self.done)


class AllToAll:
    """One rank's end of an all-to-all over ``group``; every rank must call in the same order."""

    def __init__(self, group: Any) -> None:
        if group is None:
            raise ValueError("an all-to-all backend needs a process group; got None")
        self.group = group
        self.rank = group.rank()
        self.world_size = group.size()

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int] | None = None,
                   input_split_sizes: Sequence[int] | None = None) -> Handle:
        """Start ``output = all_to_all(input)`` (row splits; ``None`` = equal) and return at once."""
        out_splits = list(output_split_sizes) if output_split_sizes is not None else []
        in_splits = list(input_split_sizes) if input_split_sizes is not None else []
        with trace.region("transfer_post", "copy"):  # handing the data to the collective is CPU work too
            send = input.contiguous()
            work = self.group.alltoall_base(output, send, out_splits, in_splits, dist.AllToAllOptions())
        return WorkHandle(work, streams.collective_posted("all_to_all", self.group, [send], [output]))
