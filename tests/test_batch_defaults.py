"""max_num_seqs / max_num_batched_tokens defaults by device and usage context (vLLM's rule), with the GPU faked
through the device probe."""
from __future__ import annotations

import logging
import sys
import types

import pytest

import runner.batch_defaults as bd
from runner.batch_defaults import (
    GIB,
    DeviceInfo,
    UsageContext,
    batch_defaults,
    resolve_batch_sizes,
    with_batch_defaults,
)
from runner.config import RunnerConfig, make_config

LLM_CLASS, SERVER = UsageContext.LLM_CLASS, UsageContext.OPENAI_API_SERVER
H100 = DeviceInfo("cuda", 80 * GIB, "NVIDIA H100 80GB HBM3")
H200 = DeviceInfo("cuda", 141 * GIB, "NVIDIA H200")
A100_80 = DeviceInfo("cuda", 80 * GIB, "NVIDIA A100-SXM4-80GB")
L4 = DeviceInfo("cuda", 24 * GIB, "NVIDIA L4")
CPU = DeviceInfo("cpu")


@pytest.mark.parametrize(("device", "context", "seqs", "tokens"), [
    (H100, LLM_CLASS, 1024, 16384), (H100, SERVER, 1024, 8192),
    (H200, LLM_CLASS, 1024, 16384), (H200, SERVER, 1024, 8192),
    (A100_80, LLM_CLASS, 256, 8192), (A100_80, SERVER, 256, 2048),  # an A100 never gets the large ones
    (L4, LLM_CLASS, 256, 8192), (L4, SERVER, 256, 2048),
    (DeviceInfo("cuda", 70 * GIB - 1, "gpu"), LLM_CLASS, 256, 8192),  # just under vLLM's 70 GiB
    (DeviceInfo("cuda", 70 * GIB, "gpu"), LLM_CLASS, 1024, 16384),
    (CPU, LLM_CLASS, 64, 512), (CPU, SERVER, 64, 512),
])
def test_vllm_table(device: DeviceInfo, context: UsageContext, seqs: int, tokens: int) -> None:
    d = batch_defaults(device, context)
    assert (d.max_num_seqs, d.max_num_batched_tokens) == (seqs, tokens)


def test_caps_apply_to_defaulted_values_only() -> None:
    # tokens capped at seqs x max_model_len; seqs capped at tokens
    assert resolve_batch_sizes(None, None, 8, H100, LLM_CLASS) == bd.BatchDefaults(1024, 8192)
    assert resolve_batch_sizes(None, None, 4096, H100, SERVER) == bd.BatchDefaults(1024, 8192)
    assert resolve_batch_sizes(None, 100, 4096, H100, LLM_CLASS) == bd.BatchDefaults(100, 100)
    assert resolve_batch_sizes(8, None, 64, H100, LLM_CLASS) == bd.BatchDefaults(8, 512)
    assert resolve_batch_sizes(2048, 100, 64, H100, LLM_CLASS) == bd.BatchDefaults(2048, 100)  # both given: kept
    with pytest.raises(ValueError, match="max_model_len must be a positive integer, got 0"):
        resolve_batch_sizes(None, None, 0, H100, LLM_CLASS)


def test_bad_device_info_is_named() -> None:
    with pytest.raises(ValueError, match="'tpu'"):
        DeviceInfo("tpu")
    with pytest.raises(ValueError, match="-1"):
        DeviceInfo("cuda", -1)


def test_with_batch_defaults_uses_the_probe_and_keeps_given_fields() -> None:
    cfg = RunnerConfig(device="cpu", max_num_seqs=7)
    seen: list[str] = []

    def fake(device: str) -> DeviceInfo:
        seen.append(device)
        return H100

    out = with_batch_defaults(cfg, ["max_num_seqs"], 2048, SERVER, fake)
    assert (out.max_num_seqs, out.max_num_batched_tokens, seen) == (7, 8192, ["cpu"])
    out = with_batch_defaults(cfg, [], 2048, LLM_CLASS, fake)
    assert (out.max_num_seqs, out.max_num_batched_tokens) == (1024, 16384)
    assert with_batch_defaults(cfg, ["max_num_seqs", "max_num_batched_tokens"], 2048, LLM_CLASS, fake) is cfg
    with pytest.raises(ValueError, match="max_num_sequences"):
        with_batch_defaults(cfg, ["max_num_sequences"], 2048, LLM_CLASS, fake)


def test_experts_over_dp_ranks_keep_the_small_defaults_unless_the_dispatch_capacity_is_given() -> None:
    ep = make_config(device="cpu", data_parallel_size=2, enable_expert_parallel=True)
    out = with_batch_defaults(ep, [], 2048, LLM_CLASS, lambda _: H100)
    assert (out.max_num_seqs, out.max_num_batched_tokens, out.dispatch_tokens_per_rank) == (64, 512, 512)
    sized = make_config(device="cpu", data_parallel_size=2, enable_expert_parallel=True,
                        max_dispatch_tokens_per_rank=256)
    out = with_batch_defaults(sized, [], 2048, LLM_CLASS, lambda _: H100)
    assert (out.max_num_seqs, out.max_num_batched_tokens) == (1024, 16384)
    dp_only = make_config(device="cpu", data_parallel_size=2)  # no expert parallelism: no all-to-all buffers
    assert with_batch_defaults(dp_only, [], 2048, LLM_CLASS, lambda _: H100).max_num_seqs == 1024


@pytest.mark.parametrize("device", [H100, A100_80, L4, CPU])
@pytest.mark.parametrize("context", [LLM_CLASS, SERVER])
def test_dbo_threshold_defaults_fit_every_batch_default(device: DeviceInfo, context: UsageContext) -> None:
    cfg, d = RunnerConfig(), batch_defaults(device, context)
    assert cfg.dbo_decode_token_threshold <= d.max_num_seqs
    assert cfg.dbo_prefill_token_threshold <= d.max_num_batched_tokens


def test_llm_applies_the_llm_class_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from runner.entrypoints.llm import LLM

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setattr(bd, "probe_device", lambda _: H100)
    llm = LLM(model="tiny-qwen3-moe", device="cpu", max_model_len=64, cache_dir=str(tmp_path))
    try:
        assert (llm.cfg.max_num_seqs, llm.cfg.max_num_batched_tokens) == (1024, 16384)
    finally:
        llm.close()
    llm = LLM(model="tiny-qwen3-moe", device="cpu", max_model_len=8, max_num_seqs=None, max_num_batched_tokens=96,
              cache_dir=str(tmp_path))
    try:  # None is unset (vLLM's), a given value stays, and the default seqs are capped at the tokens
        assert (llm.cfg.max_num_seqs, llm.cfg.max_num_batched_tokens) == (96, 96)
    finally:
        llm.close()
    monkeypatch.setattr(bd, "probe_device", lambda _: CPU)
    llm = LLM(model="tiny-qwen3-moe", device="cpu", cache_dir=str(tmp_path))
    try:
        assert (llm.cfg.max_num_seqs, llm.cfg.max_num_batched_tokens) == (64, 512)
    finally:
        llm.close()


def test_cli_applies_the_context_of_its_command(monkeypatch: pytest.MonkeyPatch) -> None:
    from runner.entrypoints.cli import build_parser, job_from_args

    monkeypatch.setattr(bd, "probe_device", lambda _: L4)
    parser = build_parser()
    job = job_from_args(parser.parse_args(["generate", "--device", "cpu"]), parser)
    assert (job.cfg.max_num_seqs, job.cfg.max_num_batched_tokens) == (256, 8192)
    job = job_from_args(parser.parse_args(["bench", "--device", "cpu", "--max-num-batched-tokens", "128"]), parser)
    assert (job.cfg.max_num_seqs, job.cfg.max_num_batched_tokens) == (128, 128)


def test_serve_flags_get_the_server_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from runner.entrypoints.engine_args import with_batch_defaults_from_args

    monkeypatch.setattr(bd, "probe_device", lambda _: H100)
    cfg = RunnerConfig(device="cpu")
    args = argparse.Namespace(max_num_seqs=None, max_num_batched_tokens=None)
    out = with_batch_defaults_from_args(cfg, args, 4096, SERVER)
    assert (out.max_num_seqs, out.max_num_batched_tokens) == (1024, 8192)
    args = argparse.Namespace(max_num_seqs=32, max_num_batched_tokens=None)
    out = with_batch_defaults_from_args(RunnerConfig(device="cpu", max_num_seqs=32), args, 4096, SERVER)
    assert (out.max_num_seqs, out.max_num_batched_tokens) == (32, 8192)


class _FakeNvml:
    """pynvml's calls that gpu_memory_and_name makes, over a table of (index, uuid, name, bytes)."""

    class NVMLError(Exception):
        pass

    def __init__(self, gpus: list[tuple[int, str, str, int]], fail: bool = False) -> None:
        self.gpus, self.fail, self.shut = gpus, fail, 0

    def nvmlInit(self) -> None:
        if self.fail:
            raise self.NVMLError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        self.shut += 1

    def nvmlDeviceGetHandleByIndex(self, i: int) -> tuple[int, str, str, int]:
        return self.gpus[i]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> tuple[int, str, str, int]:
        return next(g for g in self.gpus if g[1] == uuid)

    def nvmlDeviceGetMemoryInfo(self, h: tuple[int, str, str, int]) -> types.SimpleNamespace:
        return types.SimpleNamespace(total=h[3])

    def nvmlDeviceGetName(self, h: tuple[int, str, str, int]) -> str:
        return h[2]


GPUS = [(0, "GPU-aaa", "NVIDIA L4", 24 * bd.GIB), (1, "GPU-bbb", "NVIDIA H200", 141 * bd.GIB)]


@pytest.mark.parametrize(("visible", "expected"), [(None, (24 * bd.GIB, "NVIDIA L4")),
                                                   ("1,0", (141 * bd.GIB, "NVIDIA H200")),
                                                   ("GPU-bbb", (141 * bd.GIB, "NVIDIA H200"))])
def test_the_gpu_is_read_through_nvml_as_cuda_numbers_it(monkeypatch: pytest.MonkeyPatch, visible: str | None,
                                                          expected: tuple[int, str]) -> None:
    nvml = _FakeNvml(GPUS)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert bd.gpu_memory_and_name() == expected
    assert nvml.shut == 1


def test_nvml_failing_gives_the_smaller_gpu_defaults_and_says_why(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml(GPUS, fail=True))
    with caplog.at_level(logging.WARNING, logger="ubatch.config"):
        assert bd.gpu_memory_and_name() == (0, "")
    assert "NVMLError: NVML Shared Library Not Found" in caplog.text
    assert "GPU under 70 GiB" in caplog.text
    info = bd.DeviceInfo("cuda", 0, "")
    assert bd.batch_defaults(info, bd.UsageContext.LLM_CLASS) == bd.OTHER_GPU[bd.UsageContext.LLM_CLASS]
