"""Which graph, if any, a step may replay: batch descriptors, the capture plan and the dispatch rules.

A replayed graph re-executes exactly the kernels, shapes and ubatch interleaving frozen at capture, so
replaying the wrong one is not slow but *wrong* (vLLM #25625: a mixed batch whose token count matched a
decode graph replayed it and hung). Every rule is therefore a pure function of plain values, returning
a reason as well as the answer, and is table-tested on CPU:

- only uniform-decode batches replay (one query token per request: the graph's attention assumes it);
- the key holds the ubatch decision *and* split: a DBO graph never serves a non-ubatched step and vice
  versa; when DP coordination aborts ubatching at a size that only has a DBO graph, the step runs eager
  (vLLM's downgrade); with the measured cost model every DBO size has a plain graph as well, so both of its
  choices replay;
- a batch is padded to the nearest captured size; one past the largest runs eager;
- backends with a host sync cannot be captured at all, and DeepEP low-latency has its own rules.
"""
from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from cudagraph.sizes import pad_to_capture_size
from ubatch.slicing import is_last_ubatch_empty


class BatchKind(str, enum.Enum):  # noqa: UP042 - StrEnum needs Python 3.11 (setup.cfg allows 3.10) and changes str()
    UNIFORM_DECODE = "uniform_decode"  # every request computes exactly one token
    MIXED = "mixed"  # any prefill or chunked-prefill chunk
    DUMMY = "dummy"  # no request: an idle DP rank keeping collectives matched


def classify_batch(num_reqs: int, num_tokens: int, max_query_len: int) -> BatchKind:
    """Kind by *shape*, which is what a graph depends on (a 1-token prompt is decode-shaped too)."""
    if num_reqs <= 0:
        return BatchKind.DUMMY
    if max_query_len == 1 and num_tokens == num_reqs:
        return BatchKind.UNIFORM_DECODE
    return BatchKind.MIXED


def token_split(num_tokens: int, num_ubatches: int) -> tuple[int, ...]:
    """Tokens per ubatch under the ``tokens`` split: cut at ``padded // n``, the last takes the rest."""
    width = num_tokens // num_ubatches
    return (width,) * (num_ubatches - 1) + (num_tokens - width * (num_ubatches - 1),)


@dataclass(frozen=True, order=True)
class GraphKey:
    """One captured graph: its token count and its ubatch split (``()`` = captured without DBO)."""

    num_tokens: int
    ubatch_sizes: tuple[int, ...] = ()

    @property
    def ubatched(self) -> bool:
        return bool(self.ubatch_sizes)

    def __str__(self) -> str:
        return f"{self.num_tokens}" + (f"[dbo {'+'.join(map(str, self.ubatch_sizes))}]" if self.ubatched else "")


def plan_captures(sizes: Sequence[int], *, dbo_enabled: bool, decode_threshold: int,
                  num_ubatches: int = 2, both_kinds: bool = False) -> list[GraphKey]:
    """The graphs to capture: per size a DBO graph where a decode batch of that size would ubatch, else plain.

    A size ubatches when DBO is on, it reaches ``--dbo-decode-token-threshold`` and every ubatch gets at
    least one token -- the same vote the runner takes at run time, so the common case finds its graph.

    ``both_kinds``: the measured DBO cost model runs such a size either way, so it gets a plain graph too
    (one graph per size, as vLLM #25779, would run every step the cost model tries without DBO eager, and
    the cost model would compare a replayed DBO step with an eager one). Without it, one graph per size:
    the runner votes on the *real* token count, so a batch just below the threshold (25..31 with the
    default ladder and threshold 32) would pad into a DBO-only size and run eager; a plain graph at
    ``threshold - 1`` is added so those batches replay too.
    """
    def ubatches(size: int) -> bool:
        return (dbo_enabled and size >= decode_threshold and size // num_ubatches > 0
                and not is_last_ubatch_empty(size, size, num_ubatches))

    wanted = set(sizes)
    if not both_kinds and any(ubatches(s) for s in wanted) and decode_threshold > 1:
        wanted.add(decode_threshold - 1)
    keys = []
    for s in sorted(wanted):
        if not ubatches(s) or both_kinds:
            keys.append(GraphKey(s))
        if ubatches(s):
            keys.append(GraphKey(s, token_split(s, num_ubatches)))
    return keys


class Why(str, enum.Enum):  # noqa: UP042 - StrEnum needs Python 3.11 (setup.cfg allows 3.10) and changes str()
    """Why a step replays or runs eager (a stable code for tests and counters; ``Dispatch.detail`` explains)."""

    REPLAY = "replay"
    DISABLED = "graphs disabled"
    MIXED = "mixed batch"
    DUMMY = "dummy step"
    TOO_LARGE = "no capture size large enough"
    DBO_ONLY = "ubatching aborted at a DBO-only size"
    NO_DBO_GRAPH = "ubatched step at a size captured without DBO"
    LAST_UBATCH_EMPTY = "padding empties the last ubatch"
    SPLIT_MISMATCH = "ubatch split differs from the captured one"
    NOT_PADDED = "batch not padded to a capture size"


@dataclass(frozen=True)
class Dispatch:
    """The decision for one step: replay ``key`` at ``num_tokens`` padded tokens, or eager (``key is None``)."""

    key: GraphKey | None
    num_tokens: int
    why: Why
    detail: str = ""

    @property
    def replay(self) -> bool:
        return self.key is not None


def select_graph(kind: BatchKind, num_tokens: int, should_ubatch: bool, captured: Collection[GraphKey], *,
                 min_real_tokens: int | None = None, num_ubatches: int = 2, enabled: bool = True) -> Dispatch:
    """Pick the graph a step of ``num_tokens`` (already DP-padded) tokens replays, with the reason.

    ``should_ubatch`` is the final (DP-agreed) decision. ``min_real_tokens`` is the smallest real token
    count over DP ranks: padding up to a bucket must not leave the last ubatch without real tokens on
    any rank (every rank sees the same values, so every rank decides alike). When eager, ``num_tokens``
    is returned unchanged: padding only pays when a graph is replayed.
    """
    def eager(why: Why, detail: str) -> Dispatch:
        return Dispatch(None, num_tokens, why, detail)

    if not enabled:
        return eager(Why.DISABLED, "CUDA graphs are off (--enforce-eager or no GPU)")
    if kind is BatchKind.DUMMY:
        return eager(Why.DUMMY, "a dummy step (no requests) runs eager")
    if kind is not BatchKind.UNIFORM_DECODE:
        return eager(Why.MIXED, "a batch with prefill tokens never replays a decode graph (vLLM #25625)")
    sizes = sorted({k.num_tokens for k in captured})
    size = pad_to_capture_size(num_tokens, sizes)
    if size is None:
        largest = sizes[-1] if sizes else 0
        return eager(Why.TOO_LARGE, f"{num_tokens} tokens exceed the largest captured size ({largest})")
    want = GraphKey(size, token_split(size, num_ubatches) if should_ubatch else ())
    if want not in captured:
        if should_ubatch:
            return eager(Why.NO_DBO_GRAPH, f"the step ubatches but size {size} has no DBO graph")
        return eager(Why.DBO_ONLY, f"ubatching was not agreed for this step and size {size} only has a DBO "
                                   "graph: eager, as vLLM downgrades (one graph per shape)")
    if should_ubatch and min_real_tokens is not None and is_last_ubatch_empty(min_real_tokens, size, num_ubatches):
        return eager(Why.LAST_UBATCH_EMPTY, f"padding {min_real_tokens} real tokens to {size} leaves the last "
                                            "ubatch with padding only")
    return Dispatch(want, size, Why.REPLAY, f"replay graph {want}")


def check_replay(key: GraphKey, num_tokens: int, ubatch_sizes: Sequence[int] | None) -> Dispatch | None:
    """Last check before a replay, against the inputs actually built: ``None`` if they fit ``key``.

    The inputs must be padded to the graph's size, and a DBO step's ubatch slices must be the captured
    split (``--ubatch-split balanced`` may cut elsewhere: that step runs eager).
    """
    if num_tokens != key.num_tokens:
        return Dispatch(None, num_tokens, Why.NOT_PADDED, f"{num_tokens} tokens, graph {key} needs {key.num_tokens}")
    got = tuple(ubatch_sizes or ())
    if got != key.ubatch_sizes:
        return Dispatch(None, num_tokens, Why.SPLIT_MISMATCH, f"ubatch sizes {got} but graph {key} was captured "
                                                              f"with {key.ubatch_sizes}")
    return None


# ---- what can be captured at all ----------------------------------------------------------------------
_ALL2ALL_BLOCKERS = {
    "torch_ht": "all2all backend torch_ht exchanges counts and reads them on the host (.tolist()) every layer",
    "deepep_high_throughput": "DeepEP high-throughput mode syncs with the host (vLLM forces eager for it)",
}
# Experts backends not listed capture: grouped_mm (device-side offsets), triton, deep_gemm. Callers pass the
# resolved name (``auto`` is resolved by ``ubatch.modular_moe.experts.resolve_experts_backend`` first); a layer
# whose ``auto`` runs per-bucket members from a backend-choice table runs only triton and grouped_mm, so it
# captures wherever that answer does.
_EXPERTS_BLOCKERS = {
    "torch": "experts backend torch selects each expert's tokens with nonzero() (a host sync); "
             "use --experts-backend auto (grouped_mm on a 9.x/10.x GPU), grouped_mm, triton or deep_gemm "
             "for CUDA graphs",
}


def capture_blocker(all2all_backend: str, experts_backend: str) -> str | None:
    """Why a model with these backends cannot be captured (``None``: it can). Unknown names are allowed.

    ``experts_backend`` must be resolved already: ``auto`` names no backend (it depends on the device), so it
    raises rather than pass as capturable.
    """
    if experts_backend == "auto":
        raise ValueError("capture_blocker needs the resolved experts backend, got 'auto': resolve it with "
                         "ubatch.modular_moe.experts.resolve_experts_backend(name, device)")
    return _ALL2ALL_BLOCKERS.get(all2all_backend) or _EXPERTS_BLOCKERS.get(experts_backend)


class CaptureRuleError(RuntimeError):
    """A capture would produce a graph that misbehaves on replay; raised at capture time, never silently."""


def check_deepep_ll_rules(num_ll_calls: int, num_ubatches: int, num_handles: int) -> None:
    """DeepEP low-latency capture rules (from DeepEP's ``deep_ep/buffer.py``: ``low_latency_dispatch`` and
    ``low_latency_combine`` flip ``self.low_latency_buffer_idx`` on every call).

    The RDMA buffer has two slots and every LL call flips the slot index *on the CPU*; a graph freezes
    the slots it used. An even number of LL calls per graph leaves the CPU index where it was, so eager
    steps and any sequence of replays keep using the slots the graphs expect. Two slots also mean at most
    two ubatches in flight, each with its own dispatch handle for its combine.
    """
    if num_ubatches > 2:
        raise CaptureRuleError(f"DeepEP low-latency holds at most 2 ubatches in flight (two RDMA buffer "
                               f"slots); this graph runs {num_ubatches}")
    if num_handles < num_ubatches:
        raise CaptureRuleError(f"DeepEP low-latency needs one dispatch handle per ubatch: {num_handles} "
                               f"handle slot(s) for {num_ubatches} ubatches")
    if num_ll_calls % 2:
        raise CaptureRuleError(f"captured {num_ll_calls} DeepEP low-latency calls, an odd number: the buffer "
                               "slot parity baked into the graph would be wrong on every other replay")
