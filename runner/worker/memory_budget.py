"""KV cache sized from the GPU memory left after weights, activations and CUDA graphs (vLLM's
``--gpu-memory-utilization``).

On a GPU without ``--num-kv-blocks``: a minimal cache, a profiling forward of the largest step and a trial
capture of the largest graph size give the activation peak and graph memory; the rest (capped at what
``--max-num-seqs`` requests of ``--max-model-len`` can use: no prefix cache would use more) becomes the cache,
which must exist before the real graphs are captured (they bind its addresses). On CPU nothing here runs.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from runner.attention.kv_cache import (
    KVCacheTooLargeError,
    allocate_kv_caches,
    blocks_needed,
    build_attention_metadata,
    kv_bytes_per_block,
)
from runner.config import RunnerConfig, check_gpu_memory_utilization
from runner.worker.cuda_graphs import CapturingRunner

logger = logging.getLogger("ubatch.runner")
GIB = 1 << 30
#: the CPU default (unchanged): blocks for max_num_seqs requests of min(max_model_len, this) tokens
CPU_DEFAULT_TOKENS_PER_SEQ = 1024


@dataclass(frozen=True)
class MemoryFigures:
    """What the device reported (injected in tests). Bytes."""

    total: int  # the device's memory
    in_use: int  # in use after the weights are loaded (device-wide, as the driver reports: total - free)
    activation_peak: int  # the largest step's allocator peak above that
    graph: int  # what the CUDA graphs are expected to hold (0 without graphs)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"memory figure {f.name} must be a non-negative integer of bytes, got {value!r}")
        if self.total == 0:
            raise ValueError("memory figure total must be > 0 bytes")


@dataclass(frozen=True)
class KVCacheBudget:
    """The KV cache size chosen from :class:`MemoryFigures`, with the arithmetic kept for the log line."""

    figures: MemoryFigures
    utilization: float
    bytes_per_block: int
    max_useful_blocks: int  # what max_num_seqs requests of max_model_len tokens can use
    num_blocks: int  # the scheduler's blocks (the cache holds one more: the null block)

    @property
    def budget_bytes(self) -> int:
        return int(self.utilization * self.figures.total)

    @property
    def available_bytes(self) -> int:
        f = self.figures
        return self.budget_bytes - f.in_use - f.activation_peak - f.graph

    @property
    def capped(self) -> bool:
        return self.num_blocks == self.max_useful_blocks and self.fitting_blocks > self.max_useful_blocks

    @property
    def fitting_blocks(self) -> int:
        """Blocks the memory would hold, before the cap (one is the null block)."""
        return max(0, self.available_bytes // self.bytes_per_block - 1)

    def summary(self) -> str:
        f = self.figures
        cap = (f", capped at the {self.max_useful_blocks} that --max-num-seqs requests of --max-model-len tokens "
               "can use" if self.capped else "")
        return (f"KV cache: {self.num_blocks} blocks ({self.num_blocks * self.bytes_per_block / GIB:.2f} GiB){cap}; "
                f"{self.utilization:g} x {f.total / GIB:.2f} GiB - {f.in_use / GIB:.2f} GiB in use after weights - "
                f"{f.activation_peak / GIB:.2f} GiB activation peak - {f.graph / GIB:.2f} GiB CUDA graphs = "
                f"{self.available_bytes / GIB:.2f} GiB")


def plan_kv_cache(figures: MemoryFigures, *, utilization: float, bytes_per_block: int, max_useful_blocks: int,
                  min_blocks: int = 1) -> KVCacheBudget:
    """The number of KV blocks that fit (pure arithmetic; raises naming every figure when too few fit).

    ``min_blocks``: the fewest worth running with (the caller passes one ``max_model_len`` request's blocks).
    """
    check_gpu_memory_utilization(utilization)
    if bytes_per_block < 1 or max_useful_blocks < 1 or min_blocks < 1:
        raise ValueError(f"bad KV geometry: bytes_per_block={bytes_per_block}, max_useful_blocks={max_useful_blocks}, "
                         f"min_blocks={min_blocks}")
    probe = KVCacheBudget(figures, float(utilization), bytes_per_block, max_useful_blocks, 0)
    fitting = probe.fitting_blocks
    num_blocks = min(fitting, max_useful_blocks)
    budget = dataclasses.replace(probe, num_blocks=num_blocks)
    if num_blocks < min(min_blocks, max_useful_blocks):
        raise KVCacheTooLargeError(
            f"not enough GPU memory for the KV cache: {budget.summary()}, room for {num_blocks} blocks of "
            f"{bytes_per_block} bytes but one --max-model-len request needs {min_blocks}; raise "
            "--gpu-memory-utilization, or lower --max-num-batched-tokens (activation peak), --cuda-graph-sizes "
            "or --max-num-seqs (graph memory), or run with --enforce-eager")
    return budget


# ---- the GPU procedure ----------------------------------------------------------------------------------
def profile_query_lens(max_num_batched_tokens: int, max_num_seqs: int) -> list[int]:
    """The profiling step: ``max_num_batched_tokens`` prompt tokens over ``min(max_num_seqs, tokens)`` requests."""
    n = min(max_num_seqs, max_num_batched_tokens)
    base, extra = divmod(max_num_batched_tokens, n)
    return [base + (i < extra) for i in range(n)]


def _sizes_from_memory(cfg: RunnerConfig, device: torch.device) -> bool:
    return cfg.num_kv_blocks is None and torch.device(device).type == "cuda"


def initial_num_kv_blocks(cfg: RunnerConfig, max_model_len: int, block_size: int, device: torch.device) -> int:
    """The cache ``ModelRunner`` allocates first: ``--num-kv-blocks``; on CPU the old default; on a GPU a
    minimal cache for the profiling step, replaced by :func:`fit_kv_cache_to_memory`."""
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    if not _sizes_from_memory(cfg, device):
        return cfg.max_num_seqs * blocks_needed(min(max_model_len, CPU_DEFAULT_TOKENS_PER_SEQ), block_size)
    lens = profile_query_lens(cfg.max_num_batched_tokens, cfg.max_num_seqs)
    return sum(blocks_needed(n, block_size) for n in lens)


def _profile_activation_peak(runner: CapturingRunner) -> int:
    """Allocator peak of the largest step (prompt forward and its logits) above what was allocated before."""
    from ubatch.forward_context import DPMetadata, set_forward_context

    cfg = runner.cfg
    lens = profile_query_lens(cfg.max_num_batched_tokens, cfg.max_num_seqs)
    blocks, first = [], 0
    for n in lens:
        count = blocks_needed(n, runner.block_size)
        blocks.append(list(range(first, first + count)))
        first += count
    total = sum(lens)
    torch.cuda.synchronize(runner.device)
    torch.cuda.reset_peak_memory_stats(runner.device)
    base = torch.cuda.memory_allocated(runner.device)
    meta = build_attention_metadata([0] * len(lens), lens, blocks, runner.block_size, runner.device)
    # Every DP rank profiles the same step at the same point of start-up, so MoE collectives pair up.
    dp = DPMetadata((total,) * max(1, runner.world_size), step_token_bound=total, num_real_tokens=total,
                    any_prefill=True)
    attn = runner.attention_backend.build_metadata(meta)  # the eager attention's metadata, as a step builds it
    with torch.inference_mode(), set_forward_context(attn_metadata=attn, trace_rank=runner.rank, dp_metadata=dp):
        ids = torch.zeros(total, dtype=torch.int64, device=runner.device)
        hidden = runner.model(input_ids=ids, positions=meta.positions)
        last = torch.cumsum(torch.tensor(lens, device=runner.device), 0) - 1
        runner.model.compute_logits(hidden[last])
        del hidden
    torch.cuda.synchronize(runner.device)
    return max(0, torch.cuda.max_memory_allocated(runner.device) - base)


def _trial_graph_bytes(runner: CapturingRunner) -> int:
    """Graph memory of the planned ladder, from a trial capture of its largest size on the minimal cache (both
    its graphs where the plan holds a plain and a DBO one: they share the pool, each with its own needs)."""
    from runner.worker.cuda_graphs import graphs_enabled, make_graph_runner, planned_keys

    if not graphs_enabled(runner):  # eager: --enforce-eager or an uncapturable backend
        return 0
    keys = planned_keys(runner)
    size = max(k.num_tokens for k in keys)
    largest = [k for k in keys if k.num_tokens == size]
    trial = make_graph_runner(runner, keys=largest, progress=False)
    runner.graph_capture_stream = trial.capture_stream  # the real capture reuses it (no new cuBLAS workspaces)
    try:
        report = trial.capture()
    finally:
        trial.clear()
    torch.cuda.empty_cache()
    hidden_bytes = runner.model_config.hidden_size * next(runner.model.parameters()).element_size()
    outputs = sum(k.num_tokens for k in keys if k not in largest) * hidden_bytes  # each graph's static output
    return report.graph_bytes + outputs


def fit_kv_cache_to_memory(runner: CapturingRunner) -> KVCacheBudget | None:
    """On a GPU without ``--num-kv-blocks``: measure, size and re-bind the KV cache (module doc); else ``None``.

    Sets ``runner.num_kv_blocks``. Must run after the runner's persistent buffers and wrapper exist and
    before its graphs are captured.
    """
    cfg = runner.cfg
    if not _sizes_from_memory(cfg, runner.device):
        return None
    dtype = next(runner.model.parameters()).dtype
    per_block = kv_bytes_per_block(runner.model.kv_cache_specs(), runner.block_size, dtype)
    torch.cuda.synchronize(runner.device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(runner.device)
    minimal_bytes = (runner.num_kv_blocks + 1) * per_block
    in_use = max(0, total - free - minimal_bytes)
    peak = _profile_activation_peak(runner)
    graph = _trial_graph_bytes(runner)
    per_request = blocks_needed(runner.max_model_len, runner.block_size)
    budget = plan_kv_cache(MemoryFigures(total, in_use, peak, graph), utilization=cfg.gpu_memory_utilization,
                           bytes_per_block=per_block, max_useful_blocks=cfg.max_num_seqs * per_request,
                           min_blocks=per_request)
    runner.num_kv_blocks = budget.num_blocks
    runner.model.bind_kv_caches(allocate_kv_caches(runner.model.kv_cache_specs(), budget.num_blocks + 1,
                                                   runner.block_size, dtype, runner.device))
    torch.cuda.empty_cache()  # the minimal cache
    if runner.rank == 0:
        logger.info(budget.summary())
    return budget
