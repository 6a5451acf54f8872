"""``python -m runner bench-serve`` against a real server it starts: a few seconds of load, then its reported
counts are checked against what the server itself counted and what the workload asked for (no timing)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runner.entrypoints.benchserve.metrics import compute_metrics
from runner.entrypoints.benchserve.http_client import RequestResult
from runner.entrypoints.benchserve.workload import arrival_offsets, random_requests

pytestmark = pytest.mark.slow


def test_bench_serve_counts_equal_what_the_server_sent(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "runner", "bench-serve", "tiny-qwen3-moe", "--server-args",
           f"--device cpu --max-num-seqs 8 --cache-dir {tmp_path}", "--num-prompts", "12", "--input-len", "9",
           "--output-len", "7", "--max-concurrency", "6", "--request-rate", "50", "--output-json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Output token throughput (tok/s)" in proc.stdout
    run = json.loads(out.read_text())["runs"][0]["metrics"]
    assert (run["completed"], run["failed"]) == (12, 0)
    assert run["total_input_tokens"] == 12 * 9 == run["server_prompt_tokens"]
    assert run["total_output_tokens"] == 12 * 7 == run["server_generation_tokens"]
    assert run["total_chunks"] == 12 * 7  # one streamed chunk per token with this engine
    assert run["engine_steps"] >= 7


def test_workload_and_metrics_definitions() -> None:
    reqs = random_requests(5, 10, 4, vocab_size=50, range_ratio=0.5, seed=1)
    assert [len(r.prompt_token_ids) for r in reqs] == [len(r.prompt_token_ids) for r in
                                                        random_requests(5, 10, 4, 50, range_ratio=0.5, seed=1)]
    assert all(5 <= len(r.prompt_token_ids) <= 15 and 2 <= r.output_len <= 6 for r in reqs)
    assert arrival_offsets(3, float("inf")) == [0.0, 0.0, 0.0]
    gaps = arrival_offsets(2000, 100.0, seed=0)
    assert gaps == sorted(gaps) and 15 < gaps[-1] < 25  # mean gap 10 ms
    with pytest.raises(ValueError, match="request_rate must be > 0"):
        arrival_offsets(3, 0.0)
    results = [RequestResult(True, 10, 5, 5, 0.1, [0.02] * 4, 0.18), RequestResult(False, error="HTTP 503: full")]
    m = compute_metrics(results, 2.0)
    assert (m.completed, m.failed, m.total_output_tokens, m.errors) == (1, 1, 5, ("HTTP 503: full",))
    assert m.output_throughput == 2.5 and round(m.tpot_ms["mean"], 6) == 20.0  # (0.18 - 0.1) / (5 - 1)
