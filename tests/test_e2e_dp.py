"""End to end over DP=2 real processes (built-in spawner, gloo, torch_ll): DBO on == DBO off, token for token,
and the overlap loop (the default on a GPU, asked for here) == the synchronous loop (``disable_overlap_schedule``).

Launches are the expensive part (~3 s each), so one launch runs every workload under four engines (DBO off,
DBO with the ``tokens`` split, DBO with the ``balanced`` split, all with the overlap loop; and DBO ``tokens``
with the synchronous loop); then one CLI ``bench`` run (which also writes a merged two-rank trace). Faults
(killed, stopped or interrupted ranks) are tests/test_faults.py's.
Thresholds are tiny so the tiny batches really ubatch, and each DBO run must report ubatched steps.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from devices import device_args, device_for
from runner.distributed.launch import launch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BASE: dict[str, Any] = dict(
    model="tiny-qwen3-moe", data_parallel_size=2, enable_expert_parallel=True, all2all_backend="torch_ll",
    dbo_decode_token_threshold=2, dbo_prefill_token_threshold=8, dbo_cost_model="off", dist_timeout_s=60.0,
    device=device_for(2))
VARIANTS: dict[str, dict[str, Any]] = {
    "off": dict(enable_dbo=False, disable_overlap_schedule=False),
    "tokens": dict(enable_dbo=True, ubatch_split="tokens", disable_overlap_schedule=False),
    "balanced": dict(enable_dbo=True, ubatch_split="balanced", disable_overlap_schedule=False),
    "sync": dict(enable_dbo=True, ubatch_split="tokens", disable_overlap_schedule=True)}


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def _prompts(lengths: list[int], salt: int) -> list[list[int]]:
    return [[(salt * 131 + 17 * i + 29 * j) % 509 for j in range(n)] for i, n in enumerate(lengths)]


# name -> (engine settings, prompts, max_tokens per prompt)
WORKLOADS: dict[str, tuple[dict[str, Any], list[list[int]], list[int]]] = {
    # prefill step, then pure uniform-decode steps (4 decodes per rank >= threshold 2)
    "decode": (dict(max_num_batched_tokens=64), _prompts([2] * 8, 1), [8] * 8),
    # one token each: every step is a prefill (27 vs 45 tokens per rank: DP pads to 45, and the last ubatch of the
    # smaller rank must stay non-empty, 45 // 2 < 27, or no rank ubatches)
    "prefill": (dict(max_num_batched_tokens=64), _prompts([5, 9, 12, 10, 7, 15, 3, 11], 2), [1] * 8),
    # one 24-token prompt per rank: the token split (12) and the balanced two-chunk split both cut inside it
    "straddle": (dict(max_num_batched_tokens=64), _prompts([24, 24], 3), [4, 4]),
    # two seats per rank, different lengths: new prefills join running decodes
    "mixed": (dict(max_num_seqs=2, max_num_batched_tokens=16), _prompts([3, 6, 2, 9, 4, 5, 7, 2], 4),
              [2, 8, 3, 5, 8, 2, 6, 4]),
    # prompts longer than the 16-token budget: prefill is chunked across steps
    "chunked": (dict(max_num_seqs=2, max_num_batched_tokens=16), _prompts([30, 21, 40, 18], 5), [4, 6, 3, 5]),
    # temperature + top-p with each request's own generator: batch composition must not matter either
    "sampled": (dict(max_num_batched_tokens=64), _prompts([4, 6, 5, 3, 7, 4], 6), [6] * 6),
}
SAMPLING: dict[str, dict[str, Any]] = {"sampled": dict(temperature=0.8, top_p=0.9)}


def run_workloads() -> dict:
    """Rank body: every workload under every variant; tokens and step counts as this rank sees them."""
    from runner.entrypoints.llm import LLM
    from runner.sampling_params import SamplingParams

    results: dict = {}
    settings = {tuple(sorted(w[0].items())) for w in WORKLOADS.values()}
    for variant, v in VARIANTS.items():
        for setting in sorted(settings):
            llm = LLM(**BASE, **v, **dict(setting))
            for name, (eng, prompts, max_tokens) in WORKLOADS.items():
                if tuple(sorted(eng.items())) != setting:
                    continue
                extra = SAMPLING.get(name, {})
                outs = llm.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True, **extra)
                                              for m in max_tokens])
                st, loop = llm.last_stats, llm.last_loop_stats
                assert st is not None and loop is not None
                results[(variant, name)] = {"token_ids": [o.outputs[0].token_ids for o in outs],
                                            "reasons": [o.outputs[0].finish_reason for o in outs],
                                            "steps": st.num_steps, "ubatched": st.num_ubatched_steps,
                                            "overlapped": loop.num_overlapped_steps}
            llm.close()
    return results


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return launch(run_workloads, 2, timeout_s=120, device=device_for(2))


@pytest.fixture(scope="module")
def results(per_rank: list[dict]) -> dict:
    return per_rank[0]


def _global(results: dict) -> dict:
    """What every rank must agree on (the overlapped-step count is a rank's own loop statistic)."""
    return {k: {f: v for f, v in r.items() if f != "overlapped"} for k, r in results.items()}


def test_every_rank_gets_every_result_in_input_order(per_rank: list[dict]) -> None:
    assert _global(per_rank[0]) == _global(per_rank[1])
    assert all(len(per_rank[0][(v, n)]["token_ids"]) == len(w[1]) for v in VARIANTS for n, w in WORKLOADS.items())


@pytest.mark.parametrize("name", list(WORKLOADS))
@pytest.mark.parametrize("variant", ["tokens", "balanced"])
def test_dbo_matches_no_dbo(results: dict, name: str, variant: str) -> None:
    off, on = results[("off", name)], results[(variant, name)]
    assert on["token_ids"] == off["token_ids"]
    assert [len(t) for t in off["token_ids"]] == WORKLOADS[name][2]
    assert off["ubatched"] == 0
    assert on["ubatched"] > 0, f"{name}/{variant}: no step ran ubatched ({on['steps']} steps)"


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_overlap_loop_matches_synchronous_loop(per_rank: list[dict], name: str) -> None:
    for rank, results in enumerate(per_rank):
        sync, overlapped = results[("sync", name)], results[("tokens", name)]
        assert overlapped["token_ids"] == sync["token_ids"] and overlapped["reasons"] == sync["reasons"]
        assert sync["overlapped"] == 0 and sync["ubatched"] > 0
        if name != "prefill":  # one token per request: a single step, nothing to overlap it with
            assert overlapped["overlapped"] > 0, f"{name}, rank {rank}: no step overlapped ({overlapped['steps']})"


def test_bench_cli_reports_identical_outputs(tmp_path: Path) -> None:
    csv_path, trace_path = tmp_path / "bench.csv", tmp_path / "trace.json"
    proc = subprocess.run(
        [sys.executable, "-m", "runner", "bench", "--data-parallel-size", "2", "--enable-expert-parallel",
         "--dbo-decode-token-threshold", "2", "--dbo-prefill-token-threshold", "8", "--num-prompts", "6",
         "--random-prompt-len", "10", "--random-range-ratio", "0.5", "--max-tokens", "6", "--ignore-eos",
         "--bench-repeats", "1",  # one timed run: its first steps are the cost model's look at DBO
         "--output-csv", str(csv_path), "--trace-file", str(trace_path), *device_args(2)],
        cwd=ROOT, env=_env(TMPDIR=str(tmp_path)), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "token outputs DBO off vs on: identical (6 requests)" in proc.stdout, proc.stdout
    assert list(tmp_path.glob("ubatch-rdzv-*")) == []  # the launcher's private rendezvous directory is gone
    m = re.search(r"ubatched steps\s+(\d+)\s+(\d+)", proc.stdout)
    assert m and int(m.group(1)) == 0 and int(m.group(2)) > 0, proc.stdout
    assert csv_path.read_text().splitlines()[0].startswith("dbo,output_tok_per_s")
    # --trace-file traces the DBO-on run: one Chrome trace, one process per rank, metrics printed for each
    events = json.loads(trace_path.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}
    assert "DBO overlap, rank 0" in proc.stdout and "DBO overlap, rank 1" in proc.stdout, proc.stdout
