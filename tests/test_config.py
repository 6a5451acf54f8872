"""RunnerConfig validation: every bad value is a ConfigError naming the field and the value."""
from __future__ import annotations

import pytest

from runner.config import ConfigError, RunnerConfig, make_config


@pytest.mark.parametrize("kwargs,field,msg", [
    ({"ubatch_split": "halves"}, "ubatch_split", "ubatch_split must be one of tokens, balanced; got 'halves'"),
    ({"all2all_backend": "nccl"}, "all2all_backend", "all2all_backend must be one of none, torch_ll, .*; got 'nccl'"),
    ({"experts_backend": "cutlass"}, "experts_backend", "got 'cutlass'"),
    ({"tbo_token_distribution_threshold": 0.7}, "tbo_token_distribution_threshold", r"\[0, 0.5\].*got 0.7"),
    ({"tbo_token_distribution_threshold": -0.1}, "tbo_token_distribution_threshold", "got -0.1"),
    ({"max_num_seqs": 0}, "max_num_seqs", "max_num_seqs must be >= 1, got 0"),
    ({"max_num_batched_tokens": -5}, "max_num_batched_tokens", "got -5"),
    ({"block_size": 0}, "block_size", "block_size must be >= 1"),
    ({"data_parallel_size": 0}, "data_parallel_size", "data_parallel_size must be >= 1, got 0"),
    ({"dbo_decode_token_threshold": 0}, "dbo_decode_token_threshold", "got 0"),
    ({"max_model_len": 0}, "max_model_len", "max_model_len must be >= 1, got 0"),
    ({"num_kv_blocks": 0}, "num_kv_blocks", "got 0"),
    ({"max_num_seqs": 2.5}, "max_num_seqs", "must be an integer, got 2.5"),
    ({"dtype": "int8"}, "dtype", "dtype must be one of auto, float32, bfloat16, float16; got 'int8'"),
    ({"dist_timeout_s": 0}, "dist_timeout_s", "dist_timeout_s must be > 0 seconds, got 0"),
    ({"emulate_link": "fast"}, "emulate_link", "emulate_link 'fast'"),
    ({"enable_dbo": "yes"}, "enable_dbo", "enable_dbo must be True or False"),
    ({"model": ""}, "model", "model must be a non-empty"),
    ({"device": "gpu"}, "device", "device must be one of auto, cuda, cpu; got 'gpu'"),
    ({"data_parallel_size": 2, "enable_expert_parallel": True}, "all2all_backend",
     "all2all_backend 'none' cannot move tokens between 2 expert-parallel ranks.*torch_ll"),
])
def test_validation(kwargs: dict, field: str, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg) as info:
        RunnerConfig(**kwargs)
    assert info.value.field == field
    assert info.value.flag == "--" + field.replace("_", "-")


def test_defaults_and_normalisation() -> None:
    cfg = RunnerConfig()
    assert (cfg.model, cfg.all2all_backend, cfg.ep_size) == ("tiny-qwen3-moe", "none", 1)
    assert cfg.dispatch_tokens_per_rank == 512  # derived from max_num_batched_tokens
    assert RunnerConfig(dtype="half").dtype == "float16" and RunnerConfig(dtype="bf16").dtype == "bfloat16"
    assert RunnerConfig(data_parallel_size=2).all2all_backend == "none"  # DP without EP replicates experts
    assert RunnerConfig(emulate_link="latency_us=5,gbps=10").emulate_link == "latency_us=5,gbps=10"
    with pytest.raises(ConfigError, match="max_num_seqs must be >= 1"):
        cfg.replace(max_num_seqs=0)  # copies are validated too


def test_make_config_defaults_and_unknown_names() -> None:
    cfg = make_config(data_parallel_size=2, enable_expert_parallel=True)
    assert cfg.all2all_backend == "auto" and cfg.ep_size == 2
    assert make_config(data_parallel_size=2, enable_expert_parallel=True, all2all_backend="torch_ht").all2all_backend \
        == "torch_ht"
    assert make_config(all2all_backend=None).all2all_backend == "none"
    with pytest.raises(TypeError, match="unknown engine argument 'enable_dbo_'; did you mean 'enable_dbo'"):
        make_config(enable_dbo_=True)


def test_make_config_on_top_of_a_base() -> None:
    base = RunnerConfig(max_num_seqs=4)
    cfg = make_config(base, data_parallel_size=2, enable_expert_parallel=True)
    assert (cfg.max_num_seqs, cfg.all2all_backend) == (4, "auto")
    explicit = RunnerConfig(data_parallel_size=2, enable_expert_parallel=True, all2all_backend="torch_ht")
    assert make_config(explicit, enable_dbo=True).all2all_backend == "torch_ht"
    assert base.max_num_seqs == 4 and base.all2all_backend == "none"  # the base is not modified


def test_device_cuda_needs_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    assert RunnerConfig().device == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="device 'cuda' was requested but CUDA is not available") as info:
        RunnerConfig(device="cuda")
    assert info.value.flag == "--device"
    assert RunnerConfig(device="cpu").device == "cpu" and RunnerConfig(device="auto").device == "auto"


def test_dtype_auto_is_the_default_and_runs_float32_checkpoints_in_bfloat16_on_a_gpu() -> None:
    """vLLM's ``--dtype auto``: the checkpoint's dtype, with float32 checkpoints served in 16 bits on a GPU."""
    import torch

    from runner.models.loader import auto_dtype

    assert RunnerConfig().dtype == "auto"
    assert auto_dtype(torch.float32, "cpu") == torch.float32
    assert auto_dtype(None, "cpu") == torch.float32
    assert auto_dtype(torch.bfloat16, "cpu") == torch.bfloat16
    assert auto_dtype(torch.float32, torch.device("cuda", 0)) == torch.bfloat16
    assert auto_dtype(None, "cuda") == torch.bfloat16
    assert auto_dtype(torch.float16, "cuda") == torch.float16
