"""Steps launched before the previous step's results are read (``PendingStep`` in runner/core/runner_output.py,
the overlap loop with the model runner's device-resident future-token map) and the emulated device
(``--emulate-device``).

- With the emulated device, the loop's own counters show that in steady decode no step's launch waited for the
  previous step's results, and the emulated stream never drained; the synchronous loop's counters show the
  opposite on the same run (so the counters can fail).
- Tokens (and finish reasons, logprobs) are identical between the pipelined loop and the synchronous loop on
  the real model runner: greedy, seeded sampling, penalties, stop strings, ``n > 1``, logprobs, preemption,
  chunked prefill, DBO, DP=2 with DBO (one rank running dummy steps), and the DeepSeek schedule.
- The spec's parsing and bad values, the stream's order, the device map's checks, and the attention
  metadata's one packed copy.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from runner.config import ConfigError, RunnerConfig
from runner.core.scheduler_output import ScheduledChunk, SchedulerOutput
from runner.core.slots import placeholder
from runner.entrypoints.cli import build_parser, job_from_args
from runner.sampling_params import SamplingParams
from runner.worker.device_future_map import DeviceFutureMap
from runner.worker.emulated_device import DeviceSpec, DeviceWaitTimeout, EmulatedDevice
from tiny_checkpoint import tiny_chat_checkpoint  # noqa: F401 - a fixture

PIPELINED: dict[str, Any] = dict(disable_overlap_schedule=False)  # LLM keyword arguments
SYNC: dict[str, Any] = dict(disable_overlap_schedule=True)


# ------------------------------------------------------------------------------------------- emulated device
def test_spec_parses_and_bad_values_are_named() -> None:
    assert DeviceSpec.parse("step_us=3000,us_per_token=2.5") == DeviceSpec(3000, 2.5)
    assert DeviceSpec.parse(" step_us=10 ") == DeviceSpec(10, 0)
    assert DeviceSpec.parse(DeviceSpec(7, 0.5).to_text()) == DeviceSpec(7, 0.5)
    assert DeviceSpec(1000, 2).seconds(500) == pytest.approx(2e-3)
    for text, message in (("", "empty --emulate-device spec ''"),
                          ("step_ms=3", "bad --emulate-device item 'step_ms=3'"),
                          ("step_us=fast", "bad --emulate-device value 'fast' for step_us"),
                          ("step_us=-1", "step_us must lie in \\[0, 1e\\+06\\] microseconds, got -1.0"),
                          ("us_per_token=nan", "us_per_token must lie"),
                          ("step_us=1,step_us=2", "names step_us twice")):
        with pytest.raises(ValueError, match=message):
            DeviceSpec.parse(text)
    with pytest.raises(ConfigError, match="emulate_device 'step_us=x': bad --emulate-device value 'x'"):
        RunnerConfig(emulate_device="step_us=x")


def test_cli_flag_reaches_the_config() -> None:
    parser = build_parser()
    args = parser.parse_args(["generate", "--emulate-device", "step_us=3000,us_per_token=1"])
    assert job_from_args(args, args.subparser).cfg.emulate_device == "step_us=3000,us_per_token=1"
    assert RunnerConfig().emulate_device is None


def test_stream_runs_steps_in_launch_order_and_counts_drains() -> None:
    dev = EmulatedDevice(DeviceSpec(step_us=1e6, us_per_token=0))  # a second per step: nothing drains meanwhile
    first = dev.launch(10)
    second = dev.launch(10)
    assert second - first == pytest.approx(1.0)  # queued behind the first, not started at its own launch
    assert dev.num_launches == 2 and dev.idle_launches == 1 and dev.busy_s == pytest.approx(2.0)
    with pytest.raises(DeviceWaitTimeout, match="more than the reader's timeout of 0.01 s"):
        dev.wait(second, timeout_s=0.01)
    EmulatedDevice.wait(first - 10.0)  # long done: returns at once


# -------------------------------------------------------------------------------------- device future map
def _step(req_ids: list[int], slots: list[int], tokens: list[int]) -> SchedulerOutput:
    """One decode token per request."""
    return SchedulerOutput([ScheduledChunk(r, [t], 4, [0], True, SamplingParams(), slot=s)
                            for r, s, t in zip(req_ids, slots, tokens, strict=True)])


def test_device_map_resolves_on_the_device_and_rejects_stale_or_foreign_reads() -> None:
    fmap = DeviceFutureMap("cpu")
    fmap.store_(np.array([7, 8]), np.array([2, 100]), torch.tensor([42, 43]))  # slot 100: the map grows
    out = _step([7, 8, 9], [2, 100, 5], [placeholder(2), placeholder(100), 11])
    ids = torch.from_numpy(out.token_ids.copy())
    fmap.resolve_(out, ids)
    assert ids.tolist() == [42, 43, 11] and fmap.num_resolved == 2
    with pytest.raises(RuntimeError, match="request 7 reads slot 2 but it holds nothing"):
        fmap.resolve_(out, torch.from_numpy(out.token_ids.copy()))  # consumed by the first read
    fmap.store_(np.array([8]), np.array([2]), torch.tensor([5]))
    with pytest.raises(RuntimeError, match="request 7 reads slot 2 but it holds a token of request 8"):
        fmap.resolve_(_step([7], [2], [placeholder(2)]), torch.tensor([placeholder(2)]))


# ----------------------------------------------------------------------------------- steady decode counters
def test_in_steady_decode_no_launch_waits_for_the_previous_results(tmp_path: Path) -> None:
    """A device time far above this engine's host time per step (0.25 s against a few ms, tens on a loaded
    machine), so only a launch that waits for the previous step's results can drain the stream."""
    from runner.entrypoints.llm import LLM
    from runner.sampling_params import SamplingParams

    prompts = [[(5 * i + j) % 400 for j in range(6)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    counters, tokens = {}, {}
    for name, loop in (("pipelined", PIPELINED), ("sync", SYNC)):
        llm = LLM(model="tiny-qwen3-moe", cache_dir=str(tmp_path / "cache"), device="cpu", max_num_seqs=4,
                  emulate_device="step_us=250000", **loop)
        try:
            tokens[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            stats, dev = llm.last_loop_stats, llm.model_runner.emulated_device
            assert stats is not None and dev is not None
            counters[name] = (stats.num_steps, stats.launches_after_read, dict(stats.sync_reasons),
                              dev.num_launches, dev.idle_launches, stats.num_placeholders_resolved)
        finally:
            llm.close()
    assert tokens["pipelined"] == tokens["sync"]
    # one prefill step, five decode steps; the loop's only sync point is the end (nothing left to schedule)
    assert counters["pipelined"] == (6, [], {"nothing_to_schedule": 1}, 6, 1, 4 * 5)
    assert counters["sync"] == (6, [1, 2, 3, 4, 5], {}, 6, 6, 0)


# ------------------------------------------------------------------------------ tokens: pipelined == sync
def run_workloads(path: str, rank: int = 0, **engine: Any) -> dict[str, Any]:
    """Every workload on one engine (one rank of it with DP): each request's outputs (tokens, finish reason,
    the logprobs' top ids) and the loop's counters. Module level: DP ranks run it after being spawned."""
    from runner.entrypoints.llm import LLM
    from runner.sampling_params import SamplingParams

    llm = LLM(model=path, max_num_seqs=6, emulate_device="step_us=300", **engine)
    texts = ["The quick brown fox", "Hello world! How are", "Dual batch overlap hides", "One, two, three:",
             "Caf\u00e9 cr\u00e8me", "the lazy dog jumps over the quick brown fox again and again"]
    if rank:  # a second DP rank with less work: it runs dummy steps while rank 0 still has requests
        texts = texts[:2]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=18),
              SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.5, frequency_penalty=0.4,
                             presence_penalty=0.3, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=24, stop=["e", "o"], ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=20, seed=3, n=2, max_tokens=12, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0.7, min_p=0.05, max_tokens=22, stop_token_ids=[5, 9], ignore_eos=True)]
    try:
        outs = llm.generate(texts, params[:len(texts)], use_tqdm=False)
        stats, gen_stats = llm.last_loop_stats, llm.last_stats
        assert stats is not None and gen_stats is not None
        return {"outputs": [[(c.token_ids, c.finish_reason, c.text,
                              [sorted(lp) for lp in c.logprobs] if c.logprobs else None) for c in o.outputs]
                            for o in outs],
                "overlap": stats.overlap, "sync_reasons": dict(stats.sync_reasons),
                "placeholders": stats.num_placeholders_resolved, "ubatched": gen_stats.num_ubatched_steps,
                "dummy": llm.model_runner.num_dummy_steps}
    finally:
        llm.close()


CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    # few KV blocks (preemption, which the pipelined loop syncs for) and a small token budget (chunked prefill)
    "preempt-chunked": dict(num_kv_blocks=8, block_size=8, max_num_batched_tokens=8),
    "dbo": dict(enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=4, dbo_cost_model="off"),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_pipelined_tokens_equal_the_synchronous_loops(tiny_chat_checkpoint: Any, config: str) -> None:  # noqa: F811
    path = str(tiny_chat_checkpoint.path)
    pipelined = run_workloads(path, device="cpu", **PIPELINED, **CONFIGS[config])
    sync = run_workloads(path, device="cpu", **SYNC, **CONFIGS[config])
    assert pipelined["outputs"] == sync["outputs"]
    assert pipelined["overlap"] and not sync["overlap"] and pipelined["placeholders"] > 0
    finish = {f for o in sync["outputs"] for c in o for f in [c[1]]}
    assert finish == {"length", "stop"}  # the stop strings and stop tokens did end requests
    if config == "preempt-chunked":
        assert pipelined["sync_reasons"].get("preemption", 0) > 0
    if config == "dbo":
        assert pipelined["ubatched"] > 0 and sync["ubatched"] > 0


def _dp_rank(path: str) -> dict[str, dict[str, Any]]:
    import torch.distributed as dist

    rank = dist.get_rank()
    dp = dict(data_parallel_size=2, enable_expert_parallel=True, all2all_backend="torch_ll", device="cpu",
              **CONFIGS["dbo"])
    return {name: run_workloads(path, rank, **loop, **dp) for name, loop in (("pipelined", PIPELINED),
                                                                             ("sync", SYNC))}


def test_pipelined_tokens_equal_the_synchronous_loops_with_dp2_and_dbo(tiny_chat_checkpoint: Any) -> None:  # noqa: F811
    from runner.distributed.launch import launch

    ranks = launch(_dp_rank, 2, (str(tiny_chat_checkpoint.path),), timeout_s=240, device="cpu")
    for rank in ranks:
        assert rank["pipelined"]["outputs"] == rank["sync"]["outputs"]
        assert rank["pipelined"]["ubatched"] > 0 and rank["pipelined"]["placeholders"] > 0
    assert ranks[1]["pipelined"]["dummy"] > 0 and ranks[1]["sync"]["dummy"] > 0  # rank 1 idled while rank 0 ran


# --------------------------------------------------------------------------------- one copy for the metadata
def test_metadata_arrays_travel_as_one_packed_copy() -> None:
    """The attention metadata's five arrays go to the device in one copy: packed at aligned offsets into one
    staging tensor and viewed back with their dtypes and shapes (here the host stands for the device)."""
    from runner.attention.kv_cache import PACK_ALIGN, arrays_to_device, pack_arrays, unpack_arrays

    rng = np.random.default_rng(0)
    arrays: list[np.ndarray] = [rng.integers(-9, 9, 5).astype(np.int32), rng.integers(-9, 9, (3, 7)).astype(np.int64),
              np.zeros((0, 4), np.int32), rng.integers(-9, 9, (4, 3)).astype(np.int32), np.array([-1], np.int64)]
    staging, offsets = pack_arrays(arrays)
    assert all(off % PACK_ALIGN == 0 for off in offsets) and staging.dtype == torch.uint8
    moved = unpack_arrays(staging.clone(), offsets, arrays)  # a copy, as the device's would be
    assert [(t.dtype, tuple(t.shape)) for t in moved] == [(torch.from_numpy(a).dtype, a.shape) for a in arrays]
    assert all(np.array_equal(t.numpy(), a) for t, a in zip(moved, arrays, strict=True))
    assert all(np.array_equal(t.numpy(), a) for t, a in zip(arrays_to_device(arrays, "cpu"), arrays, strict=True))
    if torch.cuda.is_available():
        on_gpu = arrays_to_device(arrays, "cuda")
        assert all(np.array_equal(t.cpu().numpy(), a) for t, a in zip(on_gpu, arrays, strict=True))


def test_pipelined_tokens_equal_the_synchronous_loops_under_the_deepseek_schedule(tmp_path: Path) -> None:
    """DeepSeek's decode pipeline (yields inside attention too) on the DeepSeek-V3-shaped tiny model, DBO on
    every step past the thresholds."""
    from runner.entrypoints.llm import LLM
    from runner.sampling_params import SamplingParams

    prompts = [[(7 * i + 13 * j) % 509 for j in range(n)] for i, n in enumerate([6, 9, 4, 7, 8, 5])]
    params = [SamplingParams(max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=2, max_tokens=6, ignore_eos=True),
              SamplingParams(max_tokens=8, repetition_penalty=1.3, presence_penalty=0.5, ignore_eos=True)] * 2
    results = {}
    for name, loop in (("pipelined", PIPELINED), ("sync", SYNC)):
        llm = LLM(model="tiny-deepseek-v3", cache_dir=str(tmp_path / "cache"), device="cpu", max_num_seqs=6,
                  enable_dbo=True, dbo_schedule="deepseek", dbo_decode_token_threshold=2,
                  dbo_prefill_token_threshold=4, dbo_cost_model="off", emulate_device="step_us=300", **loop)
        try:
            tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            assert llm.last_stats is not None
            results[name] = (tokens, llm.last_stats.num_ubatched_steps)
        finally:
            llm.close()
    assert results["pipelined"] == results["sync"] and results["sync"][1] > 0
