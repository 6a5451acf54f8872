"""Counts, on CPU, the operations inside a model's forward that would make the host wait for a GPU.

On a GPU a host sync in one DBO ubatch stops the CPU from launching the other ubatch's work, so the
engine's forward must contain none. CPU runs cannot see a sync, so this counter looks for the operations
that cause one:

- ``aten._local_scalar_dense`` and ``aten.item`` (``.item()``, ``bool(t)``, ``int(t)``; under inference mode the
  composite ops reach the mode undecomposed), ``aten.is_nonzero``, ``aten.equal``;
- tensors made from Python data (``torch.tensor(list)``: ``aten.lift_fresh``/``lift_fresh_copy``), which are
  pageable host-to-device copies when a device is given (0-dim ones are Python scalars wrapped for an op,
  as in ``x[i] = 0``, and are not counted);
- data-dependent output shapes: ``nonzero``, ``masked_select``, ``unique``, ``bincount``, boolean-mask
  indexing (``x[mask]``, ``x[mask] = v``) and ``repeat_interleave`` without ``output_size``;
- ``.tolist()``, ``.cpu()`` and ``.numpy()`` calls on tensors (Python-level: they dispatch no op on CPU).

Only operations run while the watched model's ``forward`` is on the stack are counted. The dispatch mode is
pushed once per OS thread, so the two ubatches of the greenlet executor (one worker thread, interleaved)
share it and the threads executor gets one per thread; the depth count keeps the push/pop order right
however the ubatches interleave.
"""
from __future__ import annotations

import contextlib
import threading
import traceback
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_SYNC_OPS = {aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.equal, aten.lift_fresh,
             aten.lift_fresh_copy, aten.nonzero, aten.nonzero_numpy, aten.masked_select, aten.bincount, aten._unique,
             aten._unique2, aten.unique_dim, aten.unique_consecutive, aten.argwhere}
_INDEX_OPS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
_HOST_METHODS = ("tolist", "cpu", "numpy")


def _has_bool_index(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


class _Mode(TorchDispatchMode):
    def __init__(self, counter: SyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in (aten.lift_fresh, aten.lift_fresh_copy) and args[0].dim() == 0:
            pass  # a Python scalar wrapped for an op (``x[i] = 0``): no copy of host data to wait for
        elif packet in _SYNC_OPS:
            self.counter.record(str(packet))
        elif packet in _INDEX_OPS and _has_bool_index(args):
            self.counter.record(f"{packet} with a boolean mask")
        elif packet is aten.repeat_interleave and func._overloadname in ("Tensor", "self_Tensor") and \
                kwargs.get("output_size") is None:  # tensor repeats: the output length is read on the host
            self.counter.record("repeat_interleave without output_size")
        return func(*args, **kwargs)


class SyncCounter:
    """``with counter.watching(model): ...`` counts what the model's forward does; ``counter.events`` holds
    ``(what, where)`` pairs (``where`` is the innermost frame outside torch and this file)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.forward_calls = 0  # proof the watched forward ran (once per ubatch under DBO)
        self._lock = threading.Lock()
        self._local = threading.local()

    @property
    def count(self) -> int:
        return len(self.events)

    def summary(self) -> Counter[tuple[str, str]]:
        return Counter(self.events)

    def record(self, what: str) -> None:
        where = "?"
        for frame in reversed(traceback.extract_stack()[:-1]):
            f = frame.filename
            if "/torch/" not in f and not f.endswith("sync_counter.py") and "/greenlet" not in f:
                where = f"{'/'.join(f.split('/')[-2:])}:{frame.lineno} {frame.name}"
                break
        with self._lock:
            self.events.append((what, where))

    def _depth(self) -> int:
        return getattr(self._local, "depth", 0)

    @contextlib.contextmanager
    def _in_forward(self) -> Iterator[None]:
        local = self._local
        if self._depth() == 0:
            local.mode = _Mode(self)
            local.mode.__enter__()
        local.depth = self._depth() + 1
        try:
            yield
        finally:
            local.depth -= 1
            if local.depth == 0:
                local.mode.__exit__(None, None, None)

    @contextlib.contextmanager
    def watching(self, model: torch.nn.Module) -> Iterator[SyncCounter]:
        original_forward = model.forward
        counter = self

        def forward(*args: Any, **kwargs: Any) -> Any:
            with counter._lock:
                counter.forward_calls += 1
            with counter._in_forward():
                return original_forward(*args, **kwargs)

        def host_method(name: str, original: Any) -> Any:
            def method(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if counter._depth() > 0:
                    counter.record(f"Tensor.{name}()")
                return original(tensor, *args, **kwargs)
            return method

        saved = {name: torch.Tensor.__dict__.get(name) for name in _HOST_METHODS}
        originals = {name: getattr(torch.Tensor, name) for name in _HOST_METHODS}
        own_forward = model.__dict__.get("forward")
        model.forward = forward
        for name in _HOST_METHODS:
            setattr(torch.Tensor, name, host_method(name, originals[name]))
        try:
            yield self
        finally:
            if own_forward is None:
                del model.forward
            else:
                model.forward = own_forward
            for name, value in saved.items():
                if value is None:
                    delattr(torch.Tensor, name)
                else:
                    setattr(torch.Tensor, name, value)
