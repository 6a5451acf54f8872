"""benchmarks/bench_gpu.py: refuses to run without a GPU (every section), the experts' roofline inputs, and the
overlap arithmetic its 'link hidden %' uses (``ubatch.trace_metrics``: the sleep kernels' time that overlaps
compute kernels)."""
from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ubatch.trace_metrics import intersect, length

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "benchmarks")]

import bench_gpu  # noqa: E402
from common import write_csv  # noqa: E402


@pytest.mark.parametrize("args", [[], ["--sections", "qwen3-30b"], ["--sections", "tails"]],
                         ids=["default", "qwen3-30b", "tails"])
def test_exits_2_and_says_why_without_a_gpu(args: list[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_gpu.py"), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr


def test_union_counts_overlapping_intervals_once() -> None:
    assert length([]) == 0.0
    assert length([(0, 2), (1, 3), (5, 6)]) == 4.0
    assert length([(5, 6), (0, 10)]) == 10.0


def test_overlap_is_the_time_both_sets_run() -> None:
    sleeps = [(0.0, 4.0), (10.0, 12.0)]
    compute = [(1.0, 2.0), (3.0, 11.0)]
    # [1,2] + [3,4] + [10,11] = 3
    assert length(intersect(sleeps, compute)) == 3.0
    assert length(intersect(sleeps, [])) == 0.0


def test_qwen3_30b_section_is_named_not_default() -> None:
    assert bench_gpu.parse_args([]).sections == ["kernels", "sampling", "step"]
    assert bench_gpu.parse_args(["--sections", "qwen3-30b"]).sections == ["qwen3-30b"]
    cfg = bench_gpu.QWEN3_30B_A3B
    assert (cfg["num_hidden_layers"], cfg["num_experts"], cfg["moe_intermediate_size"], cfg["hidden_size"],
            cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (48, 128, 768, 2048, 32, 4)
    assert bench_gpu.QWEN3_30B_TOKENS == (256, 2048)


def test_experts_traffic_of_a_qwen3_30b_layer() -> None:
    """bf16 gate/up/down weights of each touched expert (3 * 768 * 2048 * 2 bytes) plus the tokens' rows;
    2 * 3 * 2048 * 768 FLOPs per (token, expert) route, 8 routes a token."""
    cfg = bench_gpu.QWEN3_30B_A3B
    assert bench_gpu.experts_traffic(cfg, 256, 128) == (128 * 9_437_184 + 2_097_152, 19_327_352_832)
    assert bench_gpu.experts_traffic(cfg, 2048, 100) == (100 * 9_437_184 + 16_777_216, 154_618_822_656)


def test_tails_section_is_named_and_its_traffic() -> None:
    """Bytes read + written per call at Qwen3-30B-A3B's shapes, bf16 activations: add + RMSNorm moves four
    [T, 2048] rows and the weight; q/k norm + RoPE 36 heads of 128 in and out, a 64 + 64 cos/sin row per token and
    two 128 weights; the router reads 128 fp32 logits and writes 8 fp32 weights and 8 int64 ids per token."""
    assert bench_gpu.parse_args(["--sections", "tails"]).sections == ["tails"]
    cfg = bench_gpu.QWEN3_30B_A3B
    assert bench_gpu.tails_traffic("add + RMSNorm", cfg, 256) == 4_198_400
    assert bench_gpu.tails_traffic("q/k RMSNorm + RoPE", cfg, 256) == 4_784_640
    assert bench_gpu.tails_traffic("router top-k", cfg, 2048) == 1_245_184
    with pytest.raises(ValueError, match="unknown tail 'gelu'"):
        bench_gpu.tails_traffic("gelu", cfg, 1)


def test_csv_columns_are_every_rows_keys(tmp_path: Path) -> None:
    """The torch backend's row (not capturable: no graph_x_limit) comes first; a timed row has more columns."""
    rows: list[dict[str, object]] = [{"backend": "torch", "graph_ms": "not capturable: RuntimeError"},
                                     {"backend": "triton", "graph_ms": 0.5, "graph_x_limit": 2.0}]
    write_csv(rows, tmp_path / "k.csv")
    with open(tmp_path / "k.csv", newline="") as fh:
        assert list(csv.reader(fh)) == [["backend", "graph_ms", "graph_x_limit"],
                                        ["torch", "not capturable: RuntimeError", ""], ["triton", "0.5", "2.0"]]


def test_a_run_that_cannot_be_captured_keeps_its_eager_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """``time_against_limit``: the eager time and its multiple of the limit stand; the graph column says why it
    is missing instead of failing the row (the CUDA timer and capture replaced: each call's time is the next number)."""
    times = iter([0.5, 0.25, 0.5])
    monkeypatch.setattr(bench_gpu, "cuda_median_ms", lambda run, iters: next(times))
    monkeypatch.setattr(bench_gpu, "as_graph", lambda run: run)
    row: bench_gpu.Row = {}
    bench_gpu.time_against_limit(row, lambda: None, 0.2, iters=3)
    assert row == {"eager_ms": 0.5, "eager_x_limit": 2.5, "graph_ms": 0.25, "graph_x_limit": 1.25}

    def no_capture(run: object) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(bench_gpu, "as_graph", no_capture)
    row = {}
    bench_gpu.time_against_limit(row, lambda: None, 0.2, iters=3)
    assert row == {"eager_ms": 0.5, "eager_x_limit": 2.5,
                   "graph_ms": "not capturable: RuntimeError: operation not permitted when stream is capturing"}


@pytest.mark.triton_interpreter  # the fused-draw modes' kernel
def test_sampling_modes_run_as_the_engine_samples_and_greedy_needs_no_float32_copy() -> None:
    """The sampling section's runs on CPU tensors: each mode samples one token per row, and greedy from the bf16
    logits picks what greedy from their float32 copy picks (the engine's greedy steps skip the copy); a fused-draw
    mode's head draws what its mode's settings keep (a token of the row's top 20, for the top-k head)."""
    pytest.importorskip("triton")
    runs = bench_gpu.sampling_runs(16, 512, 64, device="cpu")
    assert list(runs) == list(bench_gpu.SAMPLING_MODES)
    out = {mode: run() for mode, run in runs.items()}
    assert out["greedy"].tolist() == out["greedy, float32 logits"].tolist()
    for mode in bench_gpu.FUSED_SAMPLING_MODES:
        assert out[mode].shape == (16,) and bool(((out[mode] >= 0) & (out[mode] < 512)).all())
    logits = runs_logits(16, 512, 64)
    kept = logits >= logits.topk(20, dim=-1).values[:, -1:]  # top-k 20, ties with the 20th kept (bf16 logits tie)
    assert bool(kept.gather(1, out["qwen3, fused draw (top-k head)"][:, None]).all())
    for mode in ("temperature", "qwen3: temperature, top-k 20, top-p", "llama3: temperature, top-p",
                 "top-k, top-p, min-p, logprobs 5"):
        sampled, logprobs = out[mode]
        assert sampled.shape == (16,) and bool(((sampled >= 0) & (sampled < 512)).all())
        assert (logprobs is None) is (mode != "top-k, top-p, min-p, logprobs 5")
    assert bench_gpu.sampling_shape(256, 8192) == "256 rows x 8192 vocab"


def runs_logits(rows: int, vocab: int, hidden: int) -> torch.Tensor:
    """The logits :func:`bench_gpu.sampling_runs` samples from (its seeded hidden rows and LM head), float32."""
    x, weight = bench_gpu.sampling_inputs(rows, vocab, hidden, device="cpu")
    return torch.nn.functional.linear(x, weight).float()
