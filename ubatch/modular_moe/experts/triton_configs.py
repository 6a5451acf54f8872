"""Tuned launch configurations for the Triton fused-MoE experts, read from JSON tables in vLLM's format.

A table is one file per (experts ``E``, intermediate size ``N``, GPU, weight dtype): its name is
``E={E},N={N},device_name={GPU}[,dtype={dtype}][,block_shape=[bn,bk]].json`` (vLLM's
``get_config_file_name``; ``,K={hidden}`` after ``N`` where the table was tuned for one hidden size, which is
how ``benchmarks/tune_moe.py`` writes it). Its keys are token counts, its values the launch parameters
``BLOCK_SIZE_M/N/K``, ``GROUP_SIZE_M``, ``num_warps``, ``num_stages``; a launch with ``M`` tokens takes the
entry of the nearest token count. So vLLM's published tables drop in unchanged.

Tables are looked up in the directory named by ``UBATCH_MOE_CONFIG_DIR``, then in the tables that ship with the
package (:data:`BUILTIN_CONFIG_DIR`, as vLLM's ``fused_moe/configs``; tuned by ``benchmarks/tune_moe.py`` on the
GPU they name), or only in a directory passed explicitly; the ``K``-qualified name first. Without a table,
:func:`default_config` (vLLM's untuned rule) applies: the documented default for a GPU no table names.

The same directories, in the same order (:func:`config_dirs`, :func:`find_config_file`), hold the backend-choice
tables ``--experts-backend auto`` reads (:func:`choice_file_name`, :mod:`.backend_choice`); both kinds of table
are keyed by token count and take the nearest one (:func:`nearest_bucket`).
"""
from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "BUILTIN_CONFIG_DIR",
    "CONFIG_DIR_ENV",
    "MoEConfigTable",
    "TritonMoEConfig",
    "choice_file_name",
    "config_dirs",
    "config_dtype",
    "default_config",
    "device_file_name",
    "device_table_name",
    "find_config_file",
    "find_table",
    "load_table",
    "nearest_bucket",
    "read_count_table",
    "table_file_names",
]

CONFIG_DIR_ENV = "UBATCH_MOE_CONFIG_DIR"
BUILTIN_CONFIG_DIR = Path(__file__).resolve().parent / "configs"  # the tables committed with the package
_FIELDS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
_IGNORED_KEYS = ("triton_version",)  # metadata vLLM's newer tables carry next to the token counts
_IGNORED_FIELDS = ("SPLIT_K",)  # vLLM's kernels take it (always 1); this kernel has no split-K


@dataclass(frozen=True)
class TritonMoEConfig:
    """One launch configuration of both expert GEMMs (tile sizes, L2 grouping of row blocks, warps, stages)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 32
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for label, size in (("block_m", self.block_m), ("block_n", self.block_n), ("block_k", self.block_k)):
            if size < 16 or size & (size - 1):
                raise ValueError(f"{label}={size} must be a power of two >= 16 (tl.dot's minimum tile)")
        for label, value in (("group_m", self.group_m), ("num_warps", self.num_warps),
                             ("num_stages", self.num_stages)):
            if value < 1:
                raise ValueError(f"{label}={value} must be >= 1")

    def to_json(self) -> dict[str, int]:
        """The entry as a table stores it (vLLM's field names)."""
        return dict(zip(_FIELDS, (self.block_m, self.block_n, self.block_k, self.group_m, self.num_warps,
                                  self.num_stages), strict=True))


@dataclass(frozen=True)
class MoEConfigTable:
    """A loaded table: token count -> configuration, and the file it came from (for the log line)."""

    path: Path
    entries: dict[int, TritonMoEConfig]

    def lookup(self, num_tokens: int) -> TritonMoEConfig:
        """The entry of the token count nearest ``num_tokens`` (the smaller one on a tie, as vLLM's ``min``)."""
        return self.entries[nearest_bucket(self.entries, num_tokens)]


def nearest_bucket(buckets: Iterable[int], num_tokens: int) -> int:
    """The bucket (a table's token count) nearest ``num_tokens``: the smaller one on a tie, as vLLM's ``min``
    over the keys in ascending order (whatever order the file lists them in)."""
    return min(buckets, key=lambda m: (abs(m - num_tokens), m))


def default_config(num_tokens: int, num_experts: int) -> TritonMoEConfig:
    """vLLM's untuned rule: small tiles while there are fewer tokens than experts (decode), else 64x64x32
    with row blocks grouped by 8."""
    if num_tokens <= num_experts:
        return TritonMoEConfig(block_m=16, block_n=32, block_k=64, group_m=1)
    return TritonMoEConfig(block_m=64, block_n=64, block_k=32, group_m=8)


def device_file_name(device_name: str) -> str:
    """A GPU name as file names spell it: spaces become underscores, every H200 variant is ``NVIDIA_H200``."""
    name = device_name.replace(" ", "_")
    return "NVIDIA_H200" if "H200" in name.split("_") else name


@functools.cache
def device_table_name(device: torch.device) -> str:
    """The name tables are keyed by for ``device``: ``torch.cuda.get_device_name`` (``cpu`` off CUDA: the
    interpreter); cached, as the Triton experts ask it every launch."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def config_dtype(dtype_name: str, fp8_block: tuple[int, int] | None) -> str | None:
    """The ``dtype=`` of a table name: none for 16-bit activations with 16-bit weights (vLLM's default
    tables), ``float32``, or ``fp8_w8a16`` for block-FP8 weights (dequantised in the kernel, so vLLM's
    ``fp8_w8a8`` tables, tuned for an FP8 tensor-core kernel, are not used for it)."""
    if fp8_block is not None:
        return "fp8_w8a16"
    if dtype_name in ("bfloat16", "float16"):
        return None
    return dtype_name


def table_file_names(num_experts: int, inter: int, hidden: int, device_name: str, dtype: str | None,
                     block_shape: tuple[int, int] | None) -> tuple[str, str]:
    """The two names looked up, in order: with ``K={hidden}`` (a table tuned for this hidden size), and
    vLLM's name without it."""
    suffix = f",device_name={device_file_name(device_name)}"
    if dtype:
        suffix += f",dtype={dtype}"
    if block_shape is not None:
        suffix += f",block_shape=[{block_shape[0]},{block_shape[1]}]"
    return (f"E={num_experts},N={inter},K={hidden}{suffix}.json", f"E={num_experts},N={inter}{suffix}.json")


def choice_file_name(num_experts: int, inter: int, hidden: int, device_name: str, dtype: str | None,
                     block_shape: tuple[int, int] | None) -> str:
    """The backend-choice table's name (:mod:`.backend_choice`): the ``K``-qualified Triton table name with
    ``,backends.json`` for ``.json`` (no vLLM counterpart, so no name without ``K``; vLLM's format stays untouched)."""
    name = table_file_names(num_experts, inter, hidden, device_name, dtype, block_shape)[0]
    return name.removesuffix(".json") + ",backends.json"


def _entry(path: Path, key: str, value: object) -> TritonMoEConfig:
    if not isinstance(value, dict):
        raise ValueError(f"{path}: entry {key!r} is {type(value).__name__}, expected an object of {_FIELDS}")
    unknown = sorted(set(value) - set(_FIELDS) - set(_IGNORED_FIELDS))
    if unknown:
        raise ValueError(f"{path}: entry {key!r} has unknown fields {unknown}; expected {_FIELDS}")
    for field, v in value.items():
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"{path}: entry {key!r} field {field!r} is {v!r}, expected an integer")
    if value.get("SPLIT_K", 1) != 1:
        raise ValueError(f"{path}: entry {key!r} has SPLIT_K={value['SPLIT_K']}; this kernel has no split-K")
    defaults = TritonMoEConfig()
    try:
        return TritonMoEConfig(
            block_m=value.get("BLOCK_SIZE_M", defaults.block_m), block_n=value.get("BLOCK_SIZE_N", defaults.block_n),
            block_k=value.get("BLOCK_SIZE_K", defaults.block_k), group_m=value.get("GROUP_SIZE_M", defaults.group_m),
            num_warps=value.get("num_warps", defaults.num_warps),
            num_stages=value.get("num_stages", defaults.num_stages),
        )
    except ValueError as exc:
        raise ValueError(f"{path}: entry {key!r}: {exc}") from None


def load_table(path: Path) -> MoEConfigTable:
    """Read and check one table file; a malformed one raises ``ValueError`` naming the file and the key.

    Fields an entry leaves out take :class:`TritonMoEConfig`'s defaults (vLLM's tables omit ``num_stages``
    in places, as Triton has a default for it).
    """
    raw = read_count_table(path, "configuration", _IGNORED_KEYS)
    return MoEConfigTable(path, {count: _entry(path, key, value) for count, (key, value) in raw.items()})


def read_count_table(path: Path, what: str, ignored_keys: tuple[str, ...] = ()) -> dict[int, tuple[str, object]]:
    """A JSON object of token count -> ``what``, as token count -> (the key as written, its raw value), keys in
    ``ignored_keys`` left out; a file that is not such an object, or has no entries, raises ``ValueError`` naming
    it and the key."""
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected an object of token count -> {what}, got {type(raw).__name__}")
    entries: dict[int, tuple[str, object]] = {}
    for key, value in raw.items():
        if key in ignored_keys:
            continue
        if not key.isdigit() or int(key) < 1:
            raise ValueError(f"{path}: key {key!r} is not a positive token count")
        entries[int(key)] = (key, value)
    if not entries:
        raise ValueError(f"{path}: no token-count entries")
    return entries


def config_dirs(config_dir: Path | None) -> list[Path]:
    """Where tables are looked up, in order: ``config_dir`` alone when given, else ``$UBATCH_MOE_CONFIG_DIR``
    (when set) and then :data:`BUILTIN_CONFIG_DIR`; a directory named that does not exist raises."""
    if config_dir is not None:
        dirs = [config_dir]
    else:
        env = os.environ.get(CONFIG_DIR_ENV)
        dirs = ([Path(env)] if env else []) + [BUILTIN_CONFIG_DIR]
    for d in dirs:
        if d is not BUILTIN_CONFIG_DIR and not d.is_dir():
            raise FileNotFoundError(f"MoE config directory {d} does not exist (from {CONFIG_DIR_ENV} or the "
                                    "experts' config_dir)")
    return dirs


def find_config_file(config_dir: Path | None, names: Sequence[str]) -> tuple[Path | None, str]:
    """The first of ``names`` found in :func:`config_dirs` (each directory in turn, ``names`` in order), or
    ``None`` and where they were looked for (``"no table A or B in D1 or D2[ (... is not set)]"``)."""
    dirs = config_dirs(config_dir)
    for d in dirs:
        for name in names:
            path = d / name
            if path.is_file():
                return path, ""
    where = " or ".join(str(d) for d in dirs)
    unset = f" ({CONFIG_DIR_ENV} is not set)" if config_dir is None and not os.environ.get(CONFIG_DIR_ENV) else ""
    return None, f"no table {' or '.join(names)} in {where}{unset}"


def find_table(config_dir: Path | None, num_experts: int, inter: int, hidden: int, device_name: str,
               dtype: str | None, block_shape: tuple[int, int] | None) -> tuple[MoEConfigTable | None, str]:
    """The table for this shape and GPU, and a sentence saying which file was used, or which were looked for
    where, for the log line: in ``config_dir`` alone when given, else in ``$UBATCH_MOE_CONFIG_DIR`` (when set)
    and then :data:`BUILTIN_CONFIG_DIR`."""
    names = table_file_names(num_experts, inter, hidden, device_name, dtype, block_shape)
    path, missing = find_config_file(config_dir, names)
    if path is None:
        return None, f"{missing}; using the default configurations"
    return load_table(path), f"using the tuned table {path}"
