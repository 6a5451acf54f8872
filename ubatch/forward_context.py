"""Per-step state the model reads without it being threaded through every call (vLLM's ForwardContext).

The context is thread-local: the caller sets it for the whole batch, and each ubatch thread gets its own
view (its split attention metadata and slice). vLLM keeps one module global and rewrites it at every
resume; a thread-local needs no rewriting and cannot leak one ubatch's metadata into another.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

_local = threading.local()


@dataclass
class ForwardContext:
    attn_metadata: Any = None
    ubatch_slices: list[Any] | None = None
    ubatch_slice: Any = None  # set inside a ubatch thread: this ubatch's UBatchSlice
    ubatch_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        # Only called for names that are not fields: expose extras as attributes (ctx.dp_metadata, ...).
        extra = self.__dict__.get("extra", {})
        if name in extra:
            return extra[name]
        raise AttributeError(f"forward context has no field or extra named {name!r}")


def get_forward_context() -> ForwardContext:
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("no forward context is set on this thread; run the model inside set_forward_context(...)")
    return ctx


def maybe_get_forward_context() -> ForwardContext | None:
    return getattr(_local, "ctx", None)


def set_thread_forward_context(ctx: ForwardContext | None) -> None:
    """Install ``ctx`` for this thread without restoring anything (a ubatch resuming after a handoff)."""
    _local.ctx = ctx


@contextlib.contextmanager
def override_forward_context(ctx: ForwardContext | None) -> Iterator[None]:
    previous = getattr(_local, "ctx", None)
    _local.ctx = ctx
    try:
        yield
    finally:
        _local.ctx = previous


@contextlib.contextmanager
def set_forward_context(attn_metadata: Any = None, ubatch_slices: list[Any] | None = None,
                        **extra: Any) -> Iterator[ForwardContext]:
    """Set the forward context for this thread for the duration of the block (nests; restores on exit)."""
    ctx = ForwardContext(attn_metadata=attn_metadata, ubatch_slices=ubatch_slices, extra=dict(extra))
    with override_forward_context(ctx):
        yield ctx
