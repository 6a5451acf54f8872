"""Backend-choice tables: which experts backend ``--experts-backend auto`` runs per token-count bucket.

One JSON file per (experts ``E``, intermediate size ``N``, hidden size ``K``, GPU, dtype[, FP8 block shape]),
named as the ``K``-qualified Triton table with ``,backends.json`` for ``.json``
(:func:`~.triton_configs.choice_file_name`), found in the Triton tables' directories and order
(``$UBATCH_MOE_CONFIG_DIR``, then the package's ``configs/``). ``benchmarks/tune_moe.py`` writes it beside the
Triton table it tunes. Its keys are token counts; each value holds the backend chosen and every backend's
measured time, so a reader sees why: ``{"64": {"backend": "triton", "ms": {"triton": 0.08, "grouped_mm": 0.11}}}``.
A call with ``M`` tokens takes the bucket of the nearest count (the Triton tables' rule).

Only :data:`MIXABLE_BACKENDS` may be chosen: one layer runs a different backend per call size, so every choice
must be capturable in a CUDA graph (a captured size replays the backend it captured; ``torch`` syncs the host)
and take the layer's weights as they are held (vLLM's fused ``w13``/``w2``: ``deep_gemm`` wants its own FP8
layout and FP8 activations from the dispatch, fixed per layer, not per call). ``triton`` and ``grouped_mm`` are
both. Other backends may still appear among the measured times (the CPU dry run times ``torch``).
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ubatch.modular_moe.experts.triton_configs import (
    choice_file_name,
    find_config_file,
    nearest_bucket,
    read_count_table,
)

__all__ = [
    "MIXABLE_BACKENDS",
    "BackendChoiceTable",
    "BucketChoice",
    "choose_backend",
    "find_choice_table",
    "load_choice_table",
    "write_choice_table",
]

MIXABLE_BACKENDS: tuple[str, ...] = ("triton", "grouped_mm")


@dataclass(frozen=True)
class BucketChoice:
    """One token count's entry: the backend run there, and each measured backend's time (ms)."""

    backend: str
    ms: Mapping[str, float]

    def to_json(self) -> dict[str, object]:
        return {"backend": self.backend, "ms": dict(self.ms)}


@dataclass(frozen=True)
class BackendChoiceTable:
    """A loaded table: token count -> :class:`BucketChoice`, and the file it came from (for log lines)."""

    path: Path
    entries: Mapping[int, BucketChoice]

    def lookup(self, num_tokens: int) -> str:
        """The backend of the token count nearest ``num_tokens`` (the smaller on a tie, as the Triton tables)."""
        return self.entries[nearest_bucket(self.entries, num_tokens)].backend

    @property
    def backends(self) -> tuple[str, ...]:
        """The backends some bucket runs, in :data:`MIXABLE_BACKENDS` order."""
        chosen = {entry.backend for entry in self.entries.values()}
        return tuple(name for name in MIXABLE_BACKENDS if name in chosen)

    def buckets_of(self, backend: str) -> list[int]:
        """The token counts whose entry runs ``backend`` (ascending; for messages)."""
        return sorted(m for m, entry in self.entries.items() if entry.backend == backend)


def choose_backend(ms: Mapping[str, float]) -> str:
    """The fastest of the measured backends that may be mixed per bucket; ``ValueError`` if none was measured."""
    mixable = {name: t for name, t in ms.items() if name in MIXABLE_BACKENDS}
    if not mixable:
        raise ValueError(f"no backend that can be mixed per bucket ({', '.join(MIXABLE_BACKENDS)}) among the "
                         f"measured {sorted(ms)}")
    return min(mixable, key=lambda name: (mixable[name], MIXABLE_BACKENDS.index(name)))


def _entry(path: Path, key: str, value: object) -> BucketChoice:
    if not isinstance(value, dict) or set(value) != {"backend", "ms"}:
        raise ValueError(f"{path}: entry {key!r} is {value!r}, expected an object with exactly 'backend' and 'ms'")
    backend, ms = value["backend"], value["ms"]
    if backend not in MIXABLE_BACKENDS:
        raise ValueError(f"{path}: entry {key!r} chooses backend {backend!r}, which cannot be mixed per bucket; "
                         f"expected one of {', '.join(MIXABLE_BACKENDS)} (both CUDA-graph capturable, same weights)")
    if not isinstance(ms, dict):
        raise ValueError(f"{path}: entry {key!r} field 'ms' is {ms!r}, expected an object of backend -> ms")
    for name, t in ms.items():
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise ValueError(f"{path}: entry {key!r} time of {name!r} is {t!r}, expected a finite number >= 0")
    if backend not in ms:
        raise ValueError(f"{path}: entry {key!r} chooses {backend!r} but has no time measured for it in 'ms'")
    return BucketChoice(backend, {name: float(t) for name, t in ms.items()})


def load_choice_table(path: Path) -> BackendChoiceTable:
    """Read and check one table; a malformed one raises ``ValueError`` naming the file and the key."""
    raw = read_count_table(path, "backend choice")
    return BackendChoiceTable(path, {count: _entry(path, key, value) for count, (key, value) in raw.items()})


def write_choice_table(path: Path, measured: Mapping[int, Mapping[str, float]]) -> BackendChoiceTable:
    """Write the table for ``measured`` (token count -> backend -> ms): each count runs its fastest mixable
    backend (:func:`choose_backend`). Returns the table as read back, so a written file always loads."""
    entries = {str(m): BucketChoice(choose_backend(ms), dict(ms)).to_json() for m, ms in sorted(measured.items())}
    path.write_text(json.dumps(entries, indent=4) + "\n")
    return load_choice_table(path)


def find_choice_table(config_dir: Path | None, num_experts: int, inter: int, hidden: int, device_name: str,
                      dtype: str | None, block_shape: tuple[int, int] | None
                      ) -> tuple[BackendChoiceTable | None, str]:
    """The table for this shape and GPU, and a sentence for the log line saying which file was used or which
    name was looked for where (the Triton tables' directories: :func:`~.triton_configs.config_dirs`)."""
    name = choice_file_name(num_experts, inter, hidden, device_name, dtype, block_shape)
    path, missing = find_config_file(config_dir, [name])
    if path is None:
        return None, missing
    return load_choice_table(path), f"using the backend-choice table {path}"
