"""An engine step makes no host sync inside the model's forward (DBO off and on).

On a GPU a sync in one ubatch stops the CPU from launching the other ubatch's work, so eager DBO would
serialise. On CPU, ``tests/sync_counter.py`` counts the operations that would sync on a GPU (scalar reads,
tensors from Python lists, data-dependent shapes, ``.tolist()``/``.cpu()``/``.numpy()``) while the model's
forward runs; a decode step, a prefill step and a mixed step (prefill + decodes, a request cut across the
two ubatches) must count zero. The engine runs its default CPU attention backend (``torch``), the
``grouped_mm`` experts and the ``none`` all-to-all on one rank. ``test_cuda_*`` runs a decode step under
``torch.cuda.set_sync_debug_mode("error")``.
"""
from __future__ import annotations

import pytest
import torch

from runner.attention.kv_cache import build_attention_metadata
from runner.config import RunnerConfig
from runner.core.scheduler_output import ScheduledChunk, SchedulerOutput
from runner.sampling_params import SamplingParams
from runner.worker.model_runner import ModelRunner
from sync_counter import SyncCounter
from ubatch.forward_context import set_forward_context

CONTEXT = [5, 9, 3, 7]
MODELS = [("tiny-qwen3-moe", "moe"), ("tiny-deepseek-v3", "moe"), ("tiny-deepseek-v3", "deepseek")]


def make_runner(model: str, dbo: bool, schedule: str = "moe", device: str = "cpu") -> ModelRunner:
    return ModelRunner(RunnerConfig(
        model=model, device=device, experts_backend="grouped_mm", all2all_backend="none", enable_dbo=dbo,
        dbo_schedule=schedule, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=2, dbo_cost_model="off",
        max_model_len=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, enforce_eager=True))


def chunk(i: int, tokens: list[int], computed: int) -> ScheduledChunk:
    return ScheduledChunk(i, tokens, computed, list(range(i * 16, (i + 1) * 16)), True, SamplingParams(), 0)


def prefill_step() -> SchedulerOutput:
    return SchedulerOutput([chunk(i, list(range(1, c + 1)), 0) for i, c in enumerate(CONTEXT)])


def decode_step() -> SchedulerOutput:
    return SchedulerOutput([chunk(i, [7], c) for i, c in enumerate(CONTEXT)])


def mixed_step() -> SchedulerOutput:
    """Decodes after a new 6-token prompt: 10 tokens, cut at 5 -> the prompt's last token is in ubatch 1."""
    return SchedulerOutput([chunk(4, list(range(1, 7)), 0)] + [chunk(i, [8], c + 1) for i, c in enumerate(CONTEXT)])


def counted(runner: ModelRunner, sched: SchedulerOutput) -> SyncCounter:
    counter = SyncCounter()
    with counter.watching(runner.model):
        runner.step(sched)
    return counter


@pytest.mark.parametrize("dbo", [False, True], ids=["plain", "dbo"])
@pytest.mark.parametrize("model, schedule", MODELS, ids=["qwen3", "deepseek-v3", "deepseek-v3-staged"])
def test_engine_steps_make_no_host_sync_in_the_forward(model: str, schedule: str, dbo: bool) -> None:
    if schedule == "deepseek" and not dbo:
        pytest.skip("the staged schedule only differs with DBO")
    runner = make_runner(model, dbo, schedule)
    try:
        assert runner.attention_backend.name == "torch"  # auto on CPU
        calls_per_step = 2 if dbo else 1  # one forward per ubatch
        for name, sched in (("prefill", prefill_step()), ("decode", decode_step()), ("mixed", mixed_step())):
            before = runner.num_ubatched_steps
            counter = counted(runner, sched)
            assert runner.num_ubatched_steps - before == (1 if dbo else 0), name
            assert counter.forward_calls == calls_per_step, name
            assert counter.count == 0, f"{name} step: {dict(counter.summary())}"
    finally:
        runner.close()


def test_the_counter_sees_the_syncs_of_the_reference_attention() -> None:
    """The reference path (a model called with CommonAttentionMetadata) syncs: the counter must say so."""
    runner = make_runner("tiny-qwen3-moe", dbo=False)
    try:
        meta = build_attention_metadata([0, 0], [3, 2], [[0], [1]], runner.block_size, num_padded_tokens=6)
        counter = SyncCounter()
        with torch.inference_mode(), counter.watching(runner.model), set_forward_context(attn_metadata=meta):
            runner.model(input_ids=torch.zeros(6, dtype=torch.int64), positions=meta.positions)
        layers = runner.model.config.num_hidden_layers
        where = {w.split(" ")[-1] for _, w in counter.events}
        assert counter.count >= layers and {"write_kv", "_paged_attend"} <= where, counter.summary()
    finally:
        runner.close()


def test_the_counter_counts_each_kind_and_only_inside_the_forward() -> None:
    class Syncs(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            int(x.max())
            bool(x.all())
            x.tolist()
            x.cpu()
            x[x > 1]
            x.nonzero()
            torch.repeat_interleave(x, x)
            x[0] = 5  # a Python scalar: not counted
            return torch.tensor([1, 2]) + x[:2]

    model, counter = Syncs(), SyncCounter()
    x = torch.arange(4)
    int(x.max())  # outside the forward: not counted
    with counter.watching(model):
        model(x)
        model(x.clone())
    kinds = [what for what, _ in counter.events]
    assert len(kinds) == 16 and counter.forward_calls == 2, kinds
    assert {"Tensor.tolist()", "Tensor.cpu()", "aten.lift_fresh", "aten.nonzero",
            "repeat_interleave without output_size", "aten.index with a boolean mask"} <= set(kinds)
    assert "forward" not in vars(model) and "tolist" not in vars(torch.Tensor)  # everything restored


@pytest.mark.cuda
@pytest.mark.parametrize("dbo", [False, True], ids=["plain", "dbo"])
@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_cuda_eager_decode_step_runs_under_sync_debug_error(model: str, dbo: bool) -> None:
    """The eager forward (input preparation, metadata, the model) under ``set_sync_debug_mode("error")``;
    the DP vote and sampling, which may sync, run outside it."""
    runner = make_runner(model, dbo, device="cuda")
    try:
        assert runner.attention_backend.name == "triton"  # auto on CUDA
        runner.step(prefill_step())
        sched = decode_step()
        decision, split_point = runner.decide(sched)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            hidden, _ = runner._forward(sched, decision, split_point)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        assert torch.isfinite(hidden[:len(CONTEXT)]).all()
        assert runner.num_ubatched_steps == (2 if dbo else 0)  # the prefill step and this one
    finally:
        runner.close()
