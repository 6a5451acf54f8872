"""CLI: flag parsing and validation (exit 2 naming the flag), prompt files, one real single-process run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner.cli import build_parser, compare_outputs, job_from_args, main, random_prompts

ROOT = Path(__file__).resolve().parents[1]


def job(argv: list[str]):
    parser = build_parser()
    args = parser.parse_args(argv)
    return job_from_args(args, args.subparser)


def usage_error(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as info:
        job(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv,expected", [
    (["--ubatch-split", "halves"], "argument --ubatch-split: invalid choice: 'halves'"),
    (["--all2all-backend", "mpi"], "argument --all2all-backend: invalid choice: 'mpi'"),
    (["--max-num-seqs", "0"], "argument --max-num-seqs: max_num_seqs must be >= 1, got 0"),
    (["--tbo-token-distribution-threshold", "0.9"], "argument --tbo-token-distribution-threshold:"),
    (["--dbo-decode-token-threshold", "x"], "argument --dbo-decode-token-threshold: invalid int value: 'x'"),
    (["--emulate-link", "fast"], "argument --emulate-link:"),
    (["--dist-timeout-s", "-1"], "argument --dist-timeout-s: dist_timeout_s must be > 0"),
    (["-dp", "2", "--enable-expert-parallel", "--all2all-backend", "none"],
     "argument --all2all-backend: all2all_backend 'none' cannot move tokens between 2 expert-parallel ranks"),
    (["--max-tokens", "0"], "argument --max-tokens: max_tokens must be an integer >= 1, got 0"),
    (["--temperature", "-0.5"], "argument --temperature: temperature must be"),
    (["--top-p", "0"], "argument --top-p: top_p must lie in (0, 1]"),
    (["--num-prompts", "0"], "argument --num-prompts: must be >= 1, got 0"),
    (["--random-range-ratio", "1.5"], "argument --random-range-ratio:"),
    (["--model", "no-such-model"], "argument --model: model 'no-such-model' is neither a local directory"),
    (["--prompts-file", "/nonexistent/p.jsonl"], "argument --prompts-file: cannot read '/nonexistent/p.jsonl'"),
    (["--cuda-graph-sizes", "1,2,x"], "argument --cuda-graph-sizes: --cuda-graph-sizes: 'x' is not an integer"),
])
def test_bad_arguments_exit_2_naming_the_flag(argv: list[str], expected: str, capsys: pytest.CaptureFixture) -> None:
    err = usage_error(["generate", *argv], capsys)
    assert expected in err, err
    assert err.startswith("usage: python -m runner generate")


def test_bad_prompts_file_lines(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt_token_ids": [1, 2]}\n{"prompt": 3}\n')
    err = usage_error(["bench", "--prompts-file", str(f)], capsys)
    assert f"argument --prompts-file: {f}:2: prompt must be a string" in err
    f.write_text('{"prompt_token_ids": [1, 2]}\nnot json\n')
    assert f"{f}:2: not valid JSON" in usage_error(["generate", "--prompts-file", str(f)], capsys)
    f.write_text('{"prompt": "hello"}\n')
    assert "prompt 0 is text but model 'tiny-qwen3-moe' has no tokenizer.json" in usage_error(
        ["generate", "--prompts-file", str(f)], capsys)
    f.write_text('{"text": "x"}\n')
    assert 'expected {"prompt": str} or {"prompt_token_ids"' in usage_error(["generate", "--prompts-file", str(f)],
                                                                            capsys)


def test_defaults_and_vllm_names(tmp_path: Path) -> None:
    j = job(["generate", "--data-parallel-size", "2", "--enable-expert-parallel"])
    assert j.cfg.all2all_backend == "auto" and j.cfg.ep_size == 2  # default backend for DP + EP
    j = job(["bench", "-dp", "2", "--enable-dbo", "--dbo-decode-token-threshold", "2",
             "--dbo-prefill-token-threshold", "8", "--ubatch-split", "balanced", "--max-num-seqs", "4",
             "--max-num-batched-tokens", "64", "--max-model-len", "128", "--enforce-eager",
             "--disable-overlap-schedule", "--enable-single-batch-overlap", "--dist-timeout-s", "30",
             "--emulate-link", "latency_us=10,gbps=5", "--max-tokens", "3", "--temperature", "0.5", "--ignore-eos",
             "--dtype", "half"])
    c = j.cfg
    assert (c.data_parallel_size, c.all2all_backend, c.enable_dbo, c.ubatch_split, c.dtype) == (2, "none", True,
                                                                                              "balanced", "float16")
    assert (c.dbo_decode_token_threshold, c.dbo_prefill_token_threshold) == (2, 8)
    assert (c.max_num_seqs, c.max_model_len) == (4, 128)
    assert c.enforce_eager and c.disable_overlap_schedule and c.enable_single_batch_overlap
    assert (j.sampling.max_tokens, j.sampling.temperature, j.sampling.ignore_eos) == (3, 0.5, True)
    assert len(j.prompts) == 8 and all(len(p) == 16 for p in j.prompts)  # random prompt defaults
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt_token_ids": [4]}\n\n{"prompt_token_ids": [5, 6]}\n')
    assert job(["generate", "--prompts-file", str(f)]).prompts == [[4], [5, 6]]


def test_random_prompts_deterministic_and_in_vocab() -> None:
    a = random_prompts(20, 10, 0.5, 50, seed=3)
    assert a == random_prompts(20, 10, 0.5, 50, seed=3) and a != random_prompts(20, 10, 0.5, 50, seed=4)
    assert all(5 <= len(p) <= 15 and all(0 <= t < 50 for t in p) for p in a)
    assert len({len(p) for p in a}) > 1


def test_compare_outputs() -> None:
    a = [{"index": 0, "token_ids": [1, 2]}, {"index": 1, "token_ids": [3, 4]}]
    b = [{"index": 0, "token_ids": [1, 2]}, {"index": 1, "token_ids": [3, 5]}]
    assert compare_outputs(a, a) is None
    assert compare_outputs(a, b) == "1 of 2 requests differ (first: request 1 at output token 1)"


def test_generate_in_process_with_a_bad_prompt(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt_token_ids": [1, 2, 3]}\n{"prompt_token_ids": []}\n{"prompt_token_ids": [7]}\n')
    out = tmp_path / "o.json"
    assert main(["generate", "--prompts-file", str(f), "--max-tokens", "3", "--output-json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["finish_reason"] for r in res] == ["length", "error", "length"]
    assert res[1]["error"] == "prompt is empty: at least one token is needed" and res[1]["token_ids"] == []
    captured = capsys.readouterr()
    assert "request 1: error: prompt is empty" in captured.err
    assert "requests: 3 (1 errors)" in captured.out


def test_generate_subprocess_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "o.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "runner", "generate", "--model", "tiny-qwen3-moe", "--max-tokens", "4",
                           "--num-prompts", "2", "--output-json", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert [r["index"] for r in res] == [0, 1]
    for r in res:
        assert len(r["token_ids"]) == 4 and r["finish_reason"] == "length" and r["error"] is None
        assert all(isinstance(t, int) and 0 <= t < 512 for t in r["token_ids"])
    assert "requests: 2 (0 errors)" in proc.stdout and "output tokens: 8" in proc.stdout


def test_torchrun_world_sets_dp(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    j = job(["generate", "--enable-expert-parallel"])
    assert (j.cfg.data_parallel_size, j.cfg.all2all_backend) == (2, "auto")
    assert "--data-parallel-size: 4 does not match torchrun's WORLD_SIZE=2" in usage_error(["generate", "-dp", "4"],
                                                                                             capsys)
