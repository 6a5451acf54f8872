"""``max_num_seqs`` and ``max_num_batched_tokens`` left unset: defaults that fit the device, by vLLM's rule.

vLLM (``EngineArgs.get_batch_defaults`` and ``_set_default_max_num_seqs_and_batched_tokens_args``) picks them by
the GPU's memory and the usage context: the offline ``LLM`` class batches more tokens per step than the OpenAI
server, which keeps steps short for latency. On a GPU this module follows that rule exactly:

================================  ===============  ==================
GPU                                LLM class        OpenAI server
================================  ===============  ==================
>= 70 GiB and not an A100          1024 / 16384     1024 / 8192
otherwise                          256 / 8192       256 / 2048
================================  ===============  ==================

(``max_num_seqs`` / ``max_num_batched_tokens``). Then, for the defaulted values only, as vLLM with chunked
prefill (always on here): ``max_num_batched_tokens`` is capped at ``max_num_seqs x max_model_len`` and
``max_num_seqs`` at ``max_num_batched_tokens``.

:data:`SMALL_DEFAULTS` (64 / 512, the bare ``RunnerConfig``'s) stay in two cases, in both contexts:

- the CPU, rather than vLLM's CPU branch (256 / 4096 and 128 / 2048): a CPU here is the test and emulation
  platform, and its KV cache is sized per seat (``max_num_seqs`` requests of up to 1024 tokens,
  ``runner/worker/memory_budget.py``), so vLLM's CPU seats would quadruple its memory;
- experts spread over DP ranks without ``--max-dispatch-tokens-per-rank``: the all-to-all buffers are then
  sized for ``max_num_batched_tokens`` tokens per rank (a step's MoE is not cut into chunks, as vLLM's
  ``VLLM_MOE_DP_CHUNK_SIZE`` does), and DeepEP's low-latency buffer for 16384 tokens would not fit a GPU.

The DBO thresholds' defaults (vLLM's 32 decode and 512 prefill tokens) lie at or below every default here,
so DBO can engage under any of them.
"""
from __future__ import annotations

import enum
import logging
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runner.config import RunnerConfig

logger = logging.getLogger("ubatch.config")

GIB = 1 << 30
#: a GPU with at least this much memory (and not an A100) gets the large defaults (vLLM's threshold)
LARGE_GPU_BYTES = 70 * GIB


class UsageContext(enum.Enum):
    """Who builds the engine (vLLM's ``UsageContext`` values of the same names)."""

    LLM_CLASS = "LLM_CLASS"  # the offline LLM class, and the CLI's generate and bench
    OPENAI_API_SERVER = "OPENAI_API_SERVER"  # serve


@dataclass(frozen=True)
class BatchDefaults:
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass(frozen=True)
class DeviceInfo:
    """What the defaults depend on: the device type (``cuda`` or ``cpu``), and for a GPU its memory and name."""

    device_type: str
    total_memory: int = 0  # bytes
    name: str = ""

    def __post_init__(self) -> None:
        if self.device_type not in ("cuda", "cpu"):
            raise ValueError(f"device type must be 'cuda' or 'cpu', got {self.device_type!r}")
        if isinstance(self.total_memory, bool) or not isinstance(self.total_memory, int) or self.total_memory < 0:
            raise ValueError(f"device memory must be a non-negative integer of bytes, got {self.total_memory!r}")


SMALL_DEFAULTS = BatchDefaults(max_num_seqs=64, max_num_batched_tokens=512)
LARGE_GPU = {UsageContext.LLM_CLASS: BatchDefaults(1024, 16384),
             UsageContext.OPENAI_API_SERVER: BatchDefaults(1024, 8192)}
OTHER_GPU = {UsageContext.LLM_CLASS: BatchDefaults(256, 8192),
             UsageContext.OPENAI_API_SERVER: BatchDefaults(256, 2048)}

DeviceProbe = Callable[[str], DeviceInfo]


def probe_device(device: str) -> DeviceInfo:
    """The device ``device`` (a ``--device`` choice) resolves to here; on a GPU, the first visible one's memory
    and name, read through NVML (:func:`gpu_memory_and_name`)."""
    from runner.distributed.device import resolve_device_type

    device_type = resolve_device_type(device)
    if device_type == "cpu":
        return DeviceInfo("cpu")
    memory, name = gpu_memory_and_name()
    return DeviceInfo("cuda", memory, name)


def gpu_memory_and_name() -> tuple[int, str]:
    """The first visible GPU's memory in bytes and its name, from NVML (``nvidia-ml-py``, as vLLM reads them).

    NVML rather than ``torch.cuda.get_device_properties``: that would create a CUDA context in this process,
    the front end, which must leave the GPUs to the engine's ranks (and fork no CUDA state). Where NVML cannot
    answer (no library or driver), ``(0, "")`` and a warning that names why: the defaults are then those of a
    GPU under 70 GiB, the smaller ones."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = _first_visible_gpu(pynvml)
            memory = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
            name = pynvml.nvmlDeviceGetName(handle)
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001 - ImportError or pynvml's NVMLError (an Exception); logged, not silent
        return _unknown_gpu(exc)
    return memory, name.decode() if isinstance(name, bytes) else str(name)


def _first_visible_gpu(pynvml: ModuleType) -> object:
    """NVML's handle of the GPU that CUDA numbers 0: the first entry of ``CUDA_VISIBLE_DEVICES`` (an index or a
    UUID), else device 0."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if first.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(first))
    if first.startswith(("GPU-", "MIG-")):
        return pynvml.nvmlDeviceGetHandleByUUID(first)
    return pynvml.nvmlDeviceGetHandleByIndex(0)


def _unknown_gpu(exc: BaseException) -> tuple[int, str]:
    logger.warning("max_num_seqs / max_num_batched_tokens defaults: the GPU's memory could not be read through "
                   "NVML (%s: %s), so the defaults of a GPU under 70 GiB apply; give --max-num-seqs and "
                   "--max-num-batched-tokens to choose", type(exc).__name__, exc)
    return 0, ""


def batch_defaults(device: DeviceInfo, context: UsageContext, *, dispatch_follows_budget: bool = False
                   ) -> BatchDefaults:
    """The table of the module docstring, before the caps. ``dispatch_follows_budget``: the all-to-all buffers
    are sized by ``max_num_batched_tokens`` (experts over DP ranks, no dispatch capacity given)."""
    if device.device_type == "cpu" or dispatch_follows_budget:
        return SMALL_DEFAULTS
    large = device.total_memory >= LARGE_GPU_BYTES and "a100" not in device.name.lower()
    return (LARGE_GPU if large else OTHER_GPU)[context]


def resolve_batch_sizes(max_num_seqs: int | None, max_num_batched_tokens: int | None, max_model_len: int,
                        device: DeviceInfo, context: UsageContext, *, dispatch_follows_budget: bool = False
                        ) -> BatchDefaults:
    """Each of the two that is None gets its default, capped as the module docstring says; a given one stays."""
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1:
        raise ValueError(f"max_model_len must be a positive integer, got {max_model_len!r}")
    defaults = batch_defaults(device, context, dispatch_follows_budget=dispatch_follows_budget)
    seqs = defaults.max_num_seqs if max_num_seqs is None else max_num_seqs
    tokens = max_num_batched_tokens
    if tokens is None:
        tokens = min(seqs * max_model_len, defaults.max_num_batched_tokens)
    if max_num_seqs is None:
        seqs = min(seqs, tokens)
    return BatchDefaults(seqs, tokens)


BATCH_FIELDS = ("max_num_seqs", "max_num_batched_tokens")


def with_batch_defaults(cfg: RunnerConfig, given: Collection[str], max_model_len: int, context: UsageContext,
                        probe: DeviceProbe | None = None) -> RunnerConfig:
    """``cfg`` with the fields of :data:`BATCH_FIELDS` not in ``given`` set to their defaults for the device of
    ``cfg.device`` and ``context``. ``probe`` tells what the device is (default :func:`probe_device`, looked up
    when called: tests fake a GPU by replacing it)."""
    unknown = set(given) - set(BATCH_FIELDS)
    if unknown:
        raise ValueError(f"given must name fields of {BATCH_FIELDS}, got {sorted(unknown)}")
    if all(f in given for f in BATCH_FIELDS):
        return cfg
    sizes = resolve_batch_sizes(cfg.max_num_seqs if "max_num_seqs" in given else None,
                                cfg.max_num_batched_tokens if "max_num_batched_tokens" in given else None,
                                max_model_len, (probe or probe_device)(cfg.device), context,
                                dispatch_follows_budget=cfg.ep_size > 1 and cfg.max_dispatch_tokens_per_rank is None)
    return cfg.replace(max_num_seqs=sizes.max_num_seqs, max_num_batched_tokens=sizes.max_num_batched_tokens)
