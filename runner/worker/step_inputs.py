"""The model runner's persistent step inputs: typed fields of one device buffer, written through pinned staging.

vLLM V1's persistent input buffers (``CpuGpuBuffer`` in ``vllm/v1/worker/gpu_model_runner.py``): a step's input
ids, positions, real-token mask, attention metadata (query offsets, sequence lengths, slot mapping, block
table), the future-token map's placeholder gather and the sampler's rows each have a fixed place in one device
byte buffer and the same place in a pinned host buffer. The host writes a step's values there with numpy, then
one non-blocking copy moves the bytes in use (the block table, sized by the step, is last). Nothing is allocated
per step, and the device views keep their addresses: captured CUDA graphs read the input ids and positions.

Two staging buffers are used in turn, each with an event recorded after its copy, and a buffer is rewritten only
once that copy has run. In the step loops the copy belongs to the step before the previous one, whose results
the host has read before this step is launched, so the check does not wait (``num_staging_waits`` counts the
times it did). On the CPU the host buffer is the device buffer and nothing is copied.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_ALIGN = 64  # bytes: every field starts on a cache line (and a 16-byte boundary, which Triton specializes on)
_MAX_PREFIXES = 4096  # cached prefix views (a handful per step size in use)


@dataclass(frozen=True)
class StepInputSizes:
    """The bounds a step's fields are sized by: tokens per step, requests per step, KV blocks per request."""

    max_tokens: int
    max_reqs: int
    max_blocks: int

    def fields(self) -> tuple[tuple[str, np.dtype, int], ...]:
        """(name, dtype, length) in buffer order; the block table last, so a step copies only the rows it uses."""
        t, r = self.max_tokens, self.max_reqs
        i64, i32 = np.dtype(np.int64), np.dtype(np.int32)
        return (("input_ids", i64, t), ("positions", i64, t), ("slot_mapping", i64, t),
                ("placeholder_at", i64, t), ("placeholder_slot", i64, t), ("sample_rows", i64, r),
                ("sample_slots", i64, r), ("query_start_loc", i32, r + 1), ("seq_lens", i32, r),
                ("real_token_mask", np.dtype(np.bool_), t), ("block_table", i32, r * self.max_blocks))


_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.bool_): torch.bool}


class _Layout:
    def __init__(self, sizes: StepInputSizes) -> None:
        self.spans: dict[str, tuple[np.dtype, int, int]] = {}  # name -> (dtype, byte offset, length)
        offset = 0
        for name, dtype, length in sizes.fields():
            self.spans[name] = (dtype, offset, length)
            offset += -(-(length * dtype.itemsize) // _ALIGN) * _ALIGN
        self.num_bytes = offset

    def numpy_views(self, raw: np.ndarray) -> dict[str, np.ndarray]:
        return {name: raw[off:off + n * dt.itemsize].view(dt) for name, (dt, off, n) in self.spans.items()}

    def torch_views(self, raw: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: raw[off:off + n * dt.itemsize].view(_TORCH[dt]) for name, (dt, off, n) in self.spans.items()}


class StagedFields:
    """One staging buffer's fields as numpy arrays (the step's host side; :meth:`StepInputs.stage`)."""

    def __init__(self, views: dict[str, np.ndarray]) -> None:
        self.input_ids = views["input_ids"]
        self.positions = views["positions"]
        self.slot_mapping = views["slot_mapping"]
        self.placeholder_at = views["placeholder_at"]  # token positions whose id is a placeholder
        self.placeholder_slot = views["placeholder_slot"]  # the future-map slot each one names
        self.sample_rows = views["sample_rows"]  # the hidden row each sampling request reads
        self.sample_slots = views["sample_slots"]  # the future-map slot each sampled token goes to
        self.query_start_loc = views["query_start_loc"]
        self.seq_lens = views["seq_lens"]
        self.real_token_mask = views["real_token_mask"]
        self.block_table = views["block_table"]


class StepInputs:
    """One rank's step-input buffers (module docstring): :meth:`stage` gives the host fields to write,
    :meth:`upload` copies them, :meth:`prefix` gives device views; ``input_ids``, ``positions`` and
    ``real_token_mask`` are the whole device fields (what captured graphs read)."""

    def __init__(self, sizes: StepInputSizes, device: torch.device) -> None:
        if min(sizes.max_tokens, sizes.max_reqs, sizes.max_blocks) < 1:
            raise ValueError(f"step input buffers need positive sizes, got {sizes}")
        self.sizes = sizes
        self.device_type = device.type
        self._layout = _Layout(sizes)
        raw = torch.zeros(self._layout.num_bytes, dtype=torch.uint8, device=device)
        self._device_views = self._layout.torch_views(raw)
        self.input_ids = self._device_views["input_ids"]
        self.positions = self._device_views["positions"]
        self.real_token_mask = self._device_views["real_token_mask"]
        # Prefix views by (field, length): a step of the same size as an earlier one makes no torch call for them
        # (each call is a dispatch, and releases the GIL to the other thread).
        self._prefixes: dict[tuple[str, int, int], torch.Tensor] = {}
        self._device_raw = raw
        if device.type == "cpu":  # the host buffer is the device buffer
            self._staging = [raw]
        else:
            self._staging = [torch.zeros(self._layout.num_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
                             for _ in range(2)]
        self._host = [StagedFields(self._layout.numpy_views(t.numpy())) for t in self._staging]
        self._events: list[torch.cuda.Event | None] = [None] * len(self._staging)
        self._next = 0
        self._current = 0
        table_dtype, self._block_table_offset, _ = self._layout.spans["block_table"]
        self._block_table_itemsize = table_dtype.itemsize
        self.num_staging_waits = 0  # stage() calls that found their buffer's previous copy not yet run

    def stage(self) -> StagedFields:
        """The next staging buffer's fields, once the copy that last read it has run (module docstring)."""
        k = self._current = self._next
        self._next = (k + 1) % len(self._staging)
        event = self._events[k]
        if event is not None and not event.query():
            self.num_staging_waits += 1
            event.synchronize()
        return self._host[k]

    def upload(self, block_table_entries: int) -> None:
        """Queue the copy of the staged fields (the block table's first ``block_table_entries`` entries) to the
        device, non-blocking; nothing to do on the CPU."""
        if self.device_type == "cpu":
            return
        end = self._block_table_offset + self._block_table_itemsize * block_table_entries
        k = self._current
        self._device_raw[:end].copy_(self._staging[k][:end], non_blocking=True)
        if self.device_type == "cuda":
            event = self._events[k]
            if event is None:
                event = self._events[k] = torch.cuda.Event()
            event.record()

    def prefix(self, name: str, length: int, width: int = 0) -> torch.Tensor:
        """The device field ``name``'s first ``length`` entries (``width`` > 0: its first ``length x width``
        entries as a ``[length, width]`` matrix, the block table), a view kept for the next step of that size."""
        key = (name, length, width)
        view = self._prefixes.get(key)
        if view is None:
            if len(self._prefixes) >= _MAX_PREFIXES:
                self._prefixes.clear()
            field = self._device_views[name]
            with torch.inference_mode(False):  # a plain view: usable in place inside and outside inference mode
                view = field[:length * width].view(length, width) if width else field[:length]
            self._prefixes[key] = view
        return view
