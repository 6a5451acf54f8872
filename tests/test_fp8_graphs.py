"""FP8 checkpoints under CUDA graphs with DBO, on the eager stand-in the CPU tests use for graph dispatch.

A runner on an FP8 checkpoint (128 x 128 blocks, partial ones at the edges) with DBO on every decode step of
the batch captures its graph ladder with :class:`~cudagraph.backends.EagerReplayBackend`; its greedy tokens over
a prefill and several decode steps must equal those of the same runner without graphs, every decode step
replaying a DBO graph of its padded size. The FP8 linears run dequantised (the CPU's path) or through the
DeepGEMM stand-in's ``fp8_gemm_nt`` (Hopper's path: the activations are quantised per token inside the step,
padding rows included), and the layouts are Qwen3-MoE's (a dense last layer: ubatch 1 runs it after ubatch 0
has returned) and DeepSeek-V3's (MLA, a shared expert, a dense first layer).
tests/test_cudagraph_cuda.py runs replay against eager with real graphs on a GPU.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cudagraph import GraphKey  # noqa: E402
from fp8_checkpoint import write_fp8_pair  # noqa: E402
from graph_replays import install_graphs  # noqa: E402
from runner.config import RunnerConfig  # noqa: E402
from runner.core.runner_output import ModelRunnerOutput  # noqa: E402
from runner.core.scheduler_output import ScheduledChunk, SchedulerOutput  # noqa: E402
from runner.models import loader  # noqa: E402
from runner.models.quantization.fp8_linear import Fp8Linear  # noqa: E402
from runner.sampling_params import SamplingParams  # noqa: E402
from runner.worker import model_runner  # noqa: E402
from runner.worker.model_runner import ModelRunner  # noqa: E402
from standins import deep_gemm as dg  # noqa: E402
from test_fp8_checkpoints import QWEN, make_hf  # noqa: E402
from ubatch.fp8 import FP8_DTYPE  # noqa: E402

if TYPE_CHECKING:
    from transformers import PreTrainedModel

NUM_REQS, PROMPT, BLOCKS_PER_REQ, DECODE_STEPS = 6, 5, 8, 5  # 6 decode tokens replay the padded (8, (4, 4)) graph
GREEDY = SamplingParams(temperature=0.0)


def qwen3_hf() -> PreTrainedModel:
    """tests/test_fp8_checkpoints.py's Qwen3-MoE (a dense last layer, experts of 0.75 blocks) at hidden 256, so
    that DeepGEMM takes its attention projections and the dense MLP's gate and up (K a multiple of 128)."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(**{**QWEN, "hidden_size": 256, "head_dim": 64}, attn_implementation="eager")
    return transformers.Qwen3MoeForCausalLM(cfg).eval()


@pytest.fixture(scope="module", params=["qwen3", "dsv3"])
def fp8_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    hf = qwen3_hf() if request.param == "qwen3" else make_hf(request.param)
    return write_fp8_pair(hf, tmp_path_factory.mktemp(f"{request.param}-fp8")).fp8


@pytest.fixture(params=["dequantised", "deep_gemm_standin"])
def dense_gemm(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """How the dense FP8 linears compute: dequantised, or the DeepGEMM stand-in given to the loader."""
    if request.param == "deep_gemm_standin":
        dg.set_arch_major(9)
        monkeypatch.setattr(model_runner, "load_model", functools.partial(loader.load_model, deep_gemm_module=dg))
    yield request.param


def fp8_runner(path: Path) -> ModelRunner:
    cfg = RunnerConfig(model=str(path), device="cpu", dtype="float32", experts_backend="torch", enable_dbo=True,
                       dbo_decode_token_threshold=4, dbo_prefill_token_threshold=4, dbo_cost_model="off",
                       max_num_seqs=8, max_model_len=BLOCKS_PER_REQ * 4, max_num_batched_tokens=64, block_size=4,
                       num_kv_blocks=NUM_REQS * BLOCKS_PER_REQ)
    return ModelRunner(cfg)


def chunk(i: int, tokens: list[int], computed: int) -> ScheduledChunk:
    return ScheduledChunk(i, tokens, computed, list(range(i * BLOCKS_PER_REQ, (i + 1) * BLOCKS_PER_REQ)), True,
                          GREEDY, 0, slot=i, prompt_len=PROMPT)


def sampled(out: ModelRunnerOutput | None) -> list[int]:
    """A step's sampled ids, one per request (every chunk of these steps samples)."""
    assert out is not None
    ids = list(out.sampled_token_ids)
    assert len(ids) == NUM_REQS and all(t is not None for t in ids), ids
    return [int(t) for t in ids if t is not None]


def greedy_tokens(runner: ModelRunner) -> list[list[int]]:
    """A prefill of every request (eager: a mixed batch), then greedy decode steps of all of them."""
    prompts = [[(7 * i + 3 * j) % 200 + 1 for j in range(PROMPT)] for i in range(NUM_REQS)]
    tokens = [sampled(runner.step(SchedulerOutput([chunk(i, prompts[i], 0) for i in range(NUM_REQS)])))]
    for s in range(DECODE_STEPS):
        tokens.append(sampled(runner.step(SchedulerOutput([chunk(i, [tokens[-1][i]], PROMPT + s)
                                                           for i in range(NUM_REQS)]))))
    return tokens


def test_fp8_tokens_with_graphs_and_dbo_equal_tokens_without(fp8_checkpoint: Path, dense_gemm: str) -> None:
    eager = fp8_runner(fp8_checkpoint)
    try:
        assert eager.graph_runner is None  # CPU: no graphs of its own
        want = greedy_tokens(eager)
        eager_ubatched = eager.wrapper.num_ubatched_steps if eager.wrapper is not None else 0
    finally:
        eager.close()
    graphed = fp8_runner(fp8_checkpoint)
    try:
        model = graphed.model
        linears = [m for m in model.modules() if isinstance(m, Fp8Linear)]
        assert linears and all(m.weight.dtype == FP8_DTYPE for m in linears)
        assert any(m.uses_fp8_gemm() for m in linears) is (dense_gemm == "deep_gemm_standin")
        assert all(moe.w13_weight.dtype == FP8_DTYPE for moe in model.weight_spec().moe_layers.values())
        replays = install_graphs(graphed)
        got = greedy_tokens(graphed)
        assert graphed.wrapper is not None
        graph_ubatched = graphed.wrapper.num_ubatched_steps
    finally:
        graphed.close()
    assert got == want
    # every decode step replayed the DBO graph, and its head sampled the greedy rows
    assert replays.forward == replays.heads["greedy"] == [GraphKey(8, (4, 4))] * DECODE_STEPS
    assert eager_ubatched >= DECODE_STEPS and graph_ubatched > 0
