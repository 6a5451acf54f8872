"""KV cache sized from GPU memory (``--gpu-memory-utilization``): the arithmetic with injected memory figures, the
cap, the error naming every figure, the validated setting and flag, and that CPU keeps its old default."""
from __future__ import annotations

import pytest
import torch

from runner.attention.kv_cache import KVCacheTooLargeError
from runner.config import ConfigError, RunnerConfig
from runner.entrypoints.cli import build_parser
from runner.worker.memory_budget import (
    GIB,
    MemoryFigures,
    fit_kv_cache_to_memory,
    initial_num_kv_blocks,
    plan_kv_cache,
    profile_query_lens,
)

MIB = 1 << 20


def figures(total_gib: float = 80, in_use_gib: float = 10, peak_gib: float = 4, graph_gib: float = 2) -> MemoryFigures:
    return MemoryFigures(int(total_gib * GIB), int(in_use_gib * GIB), int(peak_gib * GIB), int(graph_gib * GIB))


def test_blocks_are_what_is_left_after_weights_activations_and_graphs() -> None:
    # 0.9 x 80 GiB = 72 GiB; - 10 - 4 - 2 = 56 GiB; 2 MiB blocks -> 28672, one of them the null block
    budget = plan_kv_cache(figures(), utilization=0.9, bytes_per_block=2 * MIB, max_useful_blocks=10**6)
    assert budget.available_bytes == 56 * GIB
    assert budget.num_blocks == 28671 and not budget.capped
    assert "28671 blocks" in budget.summary() and "0.9 x 80.00 GiB" in budget.summary()


def test_utilization_scales_the_budget() -> None:
    low = plan_kv_cache(figures(), utilization=0.5, bytes_per_block=2 * MIB, max_useful_blocks=10**6)
    assert low.available_bytes == 24 * GIB and low.num_blocks == 24 * 512 - 1


def test_blocks_are_capped_at_what_max_num_seqs_requests_can_use() -> None:
    budget = plan_kv_cache(figures(), utilization=0.9, bytes_per_block=2 * MIB, max_useful_blocks=4096)
    assert budget.num_blocks == 4096 and budget.capped and budget.fitting_blocks == 28671
    assert "capped at the 4096" in budget.summary()


def test_too_little_memory_names_every_figure() -> None:
    with pytest.raises(KVCacheTooLargeError) as info:
        plan_kv_cache(figures(in_use_gib=60, peak_gib=8, graph_gib=3.8), utilization=0.9,
                      bytes_per_block=2 * MIB, max_useful_blocks=4096, min_blocks=128)
    message = str(info.value)
    for part in ("80.00 GiB", "60.00 GiB in use", "8.00 GiB activation peak", "3.80 GiB CUDA graphs",
                 "room for 101 blocks", "--gpu-memory-utilization", "--enforce-eager"):
        assert part in message, part


def test_a_negative_remainder_is_an_error_not_a_negative_cache() -> None:
    with pytest.raises(KVCacheTooLargeError, match="room for 0 blocks"):
        plan_kv_cache(figures(in_use_gib=79), utilization=0.9, bytes_per_block=MIB, max_useful_blocks=10)


@pytest.mark.parametrize("bad", [0, -0.1, 1.01, True, "0.9"])
def test_plan_refuses_a_bad_utilization(bad: object) -> None:
    with pytest.raises(ValueError, match=repr(bad).replace(".", r"\.")):
        plan_kv_cache(figures(), utilization=bad, bytes_per_block=MIB, max_useful_blocks=10)  # type: ignore[arg-type]


def test_memory_figures_are_checked() -> None:
    with pytest.raises(ValueError, match="in_use"):
        MemoryFigures(GIB, -1, 0, 0)
    with pytest.raises(ValueError, match="total must be > 0"):
        MemoryFigures(0, 0, 0, 0)


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.5, True, "high", None])
def test_config_validates_gpu_memory_utilization(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization must lie in \(0, 1\]") as info:
        RunnerConfig(gpu_memory_utilization=bad)  # type: ignore[arg-type]
    assert info.value.flag == "--gpu-memory-utilization" and repr(bad) in str(info.value)
    assert RunnerConfig().gpu_memory_utilization == 0.9
    assert RunnerConfig(gpu_memory_utilization=1).gpu_memory_utilization == 1


def test_cli_flag_reaches_the_config() -> None:
    args = build_parser().parse_args(["generate", "--gpu-memory-utilization", "0.5"])
    assert args.gpu_memory_utilization == 0.5


def test_profile_step_spreads_the_token_budget_over_the_requests() -> None:
    assert profile_query_lens(512, 64) == [8] * 64
    assert profile_query_lens(10, 4) == [3, 3, 2, 2]
    assert profile_query_lens(3, 64) == [1, 1, 1]


def test_initial_cache_cpu_keeps_its_default_gpu_starts_minimal() -> None:
    cfg = RunnerConfig(num_kv_blocks=None, max_num_seqs=8, max_num_batched_tokens=64)
    assert initial_num_kv_blocks(cfg, 4096, 16, torch.device("cpu")) == 8 * (1024 // 16)  # as before this change
    assert initial_num_kv_blocks(cfg, 100, 16, torch.device("cpu")) == 8 * 7
    assert initial_num_kv_blocks(cfg, 4096, 16, torch.device("cuda", 0)) == 8  # 8 requests of 8 tokens: 1 block each
    given = RunnerConfig(num_kv_blocks=33, max_num_seqs=8, max_num_batched_tokens=64)
    assert initial_num_kv_blocks(given, 4096, 16, torch.device("cuda", 0)) == 33


def test_a_cpu_runner_is_not_resized() -> None:
    """``device="cpu"``: on a GPU machine too (``auto`` would pick the GPU, whose runner is resized)."""
    from runner.worker.model_runner import ModelRunner

    r = ModelRunner(RunnerConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64, block_size=4,
                                 device="cpu"))
    try:
        assert r.kv_budget is None and fit_kv_cache_to_memory(r) is None
        assert r.num_kv_blocks == 4 * (64 // 4)
    finally:
        r.close()


@pytest.mark.cuda
@pytest.mark.triton_compiled  # the GPU runner's default attention is the compiled Triton kernel
def test_a_gpu_runner_is_sized_from_memory_up_to_what_its_requests_can_use() -> None:
    """The twin of the CPU test above: on a GPU the cache is measured, and capped at 4 requests x 16 blocks."""
    from runner.worker.model_runner import ModelRunner

    r = ModelRunner(RunnerConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64, block_size=4,
                                 device="cuda"))
    try:
        assert r.kv_budget is not None and r.kv_budget.utilization == 0.9
        assert r.kv_budget.max_useful_blocks == r.kv_budget.num_blocks == r.num_kv_blocks == 4 * (64 // 4)
    finally:
        r.close()
