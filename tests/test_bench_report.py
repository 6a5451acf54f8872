"""What ``python -m runner bench`` prints: the median tok/s with its run-to-run spread, and token comparisons that
say what they compare (in bfloat16 a difference may be rounding; the float32 re-run decides)."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest

from runner.entrypoints.report import Throughput, report_bench, token_verdict


def request(index: int, tokens: list[int]) -> dict[str, Any]:
    return {"index": index, "request_id": str(index), "prompt": None, "prompt_token_ids": [5], "finished": True,
            "error": None, "outputs": [{"index": 0, "text": None, "token_ids": tokens, "cumulative_logprob": None,
                                        "logprobs": None, "finish_reason": "length", "stop_reason": None}]}


def run(dbo: bool, tokens: list[list[int]], seconds: list[float], dtype: str = "float32") -> dict[str, Any]:
    repeats = [{"num_steps": 4, "num_ubatched_steps": 3 if dbo else 0, "num_output_tokens": 100, "elapsed_s": s,
                "dbo_decisions": ["decode 8-15 tok replayed: DBO off (0.57x)"] if dbo else []} for s in seconds]
    return {"dbo": dbo, "outputs": [request(i, t) for i, t in enumerate(tokens)], "stats": repeats[-1],
            "repeats": repeats, "summary": "", "trace": None, "dtype": dtype}


def test_throughput_is_the_median_with_its_spread() -> None:
    t = Throughput([100.0, 90.0, 110.0])
    assert (t.median, t.spread) == (100.0, pytest.approx(0.2))
    assert Throughput.of(run(False, [[1]], [1.0, 0.5, 2.0])).runs == [100.0, 200.0, 50.0]


def test_float32_differences_are_differences() -> None:
    verdict, identical = token_verdict(run(False, [[1, 2], [3, 4]], [1.0]), run(True, [[1, 2], [3, 9]], [1.0]), None)
    assert verdict == "DIFFERENT: 1 of 2 requests differ (first: request 1 at output token 1)" and not identical


def test_bfloat16_differences_are_reported_as_rounding_with_the_float32_verdict() -> None:
    off, on = run(False, [[1, 2], [3, 4]], [1.0], "bfloat16"), run(True, [[1, 2], [3, 9]], [1.0], "bfloat16")
    same = {"experts_backend": "triton", "off": [request(0, [7, 8])], "on": [request(0, [7, 8])]}
    verdict, identical = token_verdict(off, on, same)
    assert verdict.startswith("1 of 2 requests differ (first: request 1 at output token 1) in bfloat16, which may "
                              "differ by rounding")
    assert verdict.endswith("in float32 (DBO on every step the thresholds allow, triton experts): identical "
                            "(1 requests)") and identical
    wrong = {**same, "on": [request(0, [7, 6])]}
    verdict, identical = token_verdict(off, on, wrong)
    assert "in float32 (DBO on every step the thresholds allow, triton experts): DIFFERENT: 1 of 1 requests " \
           "differ" in verdict and not identical
    assert token_verdict(off, off, None) == ("identical (2 requests, bfloat16)", True)


def test_report_prints_the_spread_and_the_cost_model(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "b.csv"
    off, on = run(False, [[1]], [1.0, 1.25, 1.0]), run(True, [[1]], [0.5, 0.5, 0.5])
    assert report_bench({"runs": [off, on], "float32_check": None}, str(out)) == 0
    text = capsys.readouterr().out
    assert "run-to-run" in text and "20.0 % (3 runs)" in text and "0.0 % (3 runs)" in text
    assert "token outputs DBO off vs on: identical (1 requests)" in text
    assert "DBO cost model: decode 8-15 tok replayed: DBO off (0.57x)" in text
    rows = list(csv.DictReader(out.open()))
    assert [(r["output_tok_per_s"], r["runs"], r["spread_pct"]) for r in rows] == [("100.0", "3", "20.0"),
                                                                                   ("200.0", "3", "0.0")]


def test_the_float32_check_reruns_both_variants_in_float32_when_bfloat16_tokens_differ() -> None:
    from runner.config import RunnerConfig
    from runner.entrypoints.cli import Job, float32_check
    from runner.sampling_params import SamplingParams

    cfg = RunnerConfig(dtype="bfloat16", enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=2,
                       max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64, block_size=4)
    job = Job("bench", cfg, [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]], SamplingParams(max_tokens=4, ignore_eos=True),
              True)
    off, on = run(False, [[1]], [1.0], "bfloat16"), run(True, [[2]], [1.0], "bfloat16")
    for r in (off, on):
        r["experts_backend"] = "torch"
    assert float32_check(job, [off, off]) is None  # identical tokens: nothing to check
    assert float32_check(job, [run(False, [[1]], [1.0]), run(True, [[2]], [1.0])]) is None  # float32 already
    got = float32_check(job, [off, on])
    assert got is not None and (got["dtype"], got["experts_backend"]) == ("bfloat16", "auto")
    assert len(got["off"]) == 4 and [r["outputs"][0]["token_ids"] for r in got["off"]] == \
        [r["outputs"][0]["token_ids"] for r in got["on"]]
    assert token_verdict(off, on, got)[1]


def test_a_dbo_run_without_ubatched_steps_says_whether_the_cost_model_or_the_thresholds_kept_it_off() -> None:
    from runner.entrypoints.report import COST_MODEL_OFF_HINT, NO_UBATCH_HINT, no_ubatch_hint

    stats = {"num_steps": 4, "num_ubatched_steps": 0, "dbo_decisions": ["decode 8-15 tok eager: DBO off (0.64x)"]}
    assert no_ubatch_hint(stats) == COST_MODEL_OFF_HINT
    assert no_ubatch_hint({**stats, "dbo_decisions": []}) == NO_UBATCH_HINT
    assert no_ubatch_hint({**stats, "num_ubatched_steps": 1}) is None


def test_bench_times_each_variant_as_often_as_asked(capsys: pytest.CaptureFixture) -> None:
    from runner.entrypoints.cli import main

    assert main(["bench", "--num-prompts", "2", "--max-tokens", "3", "--ignore-eos", "--bench-repeats", "2",
                 "--disable-tqdm"]) == 0
    out = capsys.readouterr().out
    assert out.count("(2 runs)") == 2 and "token outputs DBO off vs on: identical (2 requests)" in out
    with pytest.raises(SystemExit):
        main(["bench", "--bench-repeats", "0"])
    assert "argument --bench-repeats: must be >= 1, got 0" in capsys.readouterr().err
