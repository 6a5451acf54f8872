"""CLI: flag parsing and validation (exit 2 naming the flag), prompt files, one real single-process run."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner.entrypoints.cli import build_parser, compare_outputs, job_from_args, main, random_prompts

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
    (["--device", "gpu"], "argument --device: invalid choice: 'gpu'"),
    (["--max-num-seqs", "0"], "argument --max-num-seqs: max_num_seqs must be >= 1, got 0"),
    (["--tbo-token-distribution-threshold", "0.9"], "argument --tbo-token-distribution-threshold:"),
    (["--dbo-decode-token-threshold", "x"], "argument --dbo-decode-token-threshold: invalid int value: 'x'"),
    (["--emulate-link", "fast"], "argument --emulate-link:"),
    (["--dist-timeout-s", "-1"], "argument --dist-timeout-s: dist_timeout_s must be > 0"),
    (["-dp", "2", "--enable-expert-parallel", "--all2all-backend", "none"],
     "argument --all2all-backend: all2all_backend 'none' cannot move tokens between 2 expert-parallel ranks"),
    (["--max-tokens", "0"], "argument --max-tokens: max_tokens must be an integer >= 1 (or None), got 0"),
    (["--temperature", "-0.5"], "argument --temperature: temperature must be"),
    (["--top-p", "0"], "argument --top-p: top_p must be a number in (0, 1]"),
    (["--num-prompts", "0"], "argument --num-prompts: must be >= 1, got 0"),
    (["--random-range-ratio", "1.5"], "argument --random-range-ratio:"),
    (["--model", "no-such-model"], "argument --model: model 'no-such-model' is neither a local directory"),
    (["--prompts-file", "/nonexistent/p.jsonl"], "argument --prompts-file: cannot read '/nonexistent/p.jsonl'"),
    (["--cuda-graph-sizes", "1,2,x"], "argument --cuda-graph-sizes: --cuda-graph-sizes: 'x' is not an integer"),
    (["--emulate-link", "latency_us=1e9"],
     "argument --emulate-link: emulate_link 'latency_us=1e9': emulated link latency_us must be <= 1000000 (1 s per "
     "transfer), got 1e+09"),
    (["--emulate-link", "latency_us=nan,gbps=inf"],
     "argument --emulate-link: emulate_link 'latency_us=nan,gbps=inf': bad --emulate-link value 'nan' for "
     "latency_us; expected a finite number"),
    (["--emulate-link", "gbps=inf"], "bad --emulate-link value 'inf' for gbps; expected a finite number (omit gbps "
                                     "for a link without a bandwidth limit)"),
    (["--emulate-link", "gbps=1e-6"], "emulated link gbps must be >= 0.001 (1 MB/s), got 1e-06"),
    (["--max-model-len", "5000"], "argument --max-model-len: max_model_len 5000 is above the model's "
                                  "max_position_embeddings (4096); use at most 4096"),
    (["--cache-dir", "/proc/no-such-dir"], "argument --cache-dir: cannot create '/proc/no-such-dir/models' to write "
                                           "the built-in model 'tiny-qwen3-moe'"),
    (["--dbo-schedule", "deepseek"], "argument --dbo-schedule: Qwen3MoeForCausalLM does not support the 'deepseek' "
                                     "DBO schedule (it supports: moe)"),
    (["--output-json", "/nonexistent/dir/o.json"],
     "argument --output-json: cannot write '/nonexistent/dir/o.json': its directory '/nonexistent/dir' does not "
     "exist (create it first)"),
    (["--trace-file", "/nonexistent/t.json"],
     "argument --trace-file: cannot write '/nonexistent/t.json': its directory '/nonexistent' does not exist"),
    (["--n", "0"], "argument --n: n must be an integer >= 1, got 0"),
    (["--n", "2"], "argument --n: n must be 1 with greedy sampling (temperature 0), got 2"),
    (["--top-k", "-3"], "argument --top-k: top_k must be an integer >= 1, or 0 / -1 for off; got -3"),
    (["--min-p", "1.5"], "argument --min-p: min_p must be a number in [0, 1], got 1.5"),
    (["--presence-penalty", "3"], "argument --presence-penalty: presence_penalty must be a number in [-2, 2]"),
    (["--repetition-penalty", "0"],
     "argument --repetition-penalty: repetition_penalty must be a number in [0.01, 100], got 0.0"),
    (["--logprobs", "-1"], "argument --logprobs: logprobs must be an integer >= 0"),
    (["--min-tokens", "20"], "argument --min-tokens: min_tokens (20) must not exceed max_tokens (16)"),
    (["--stop", "\n"], "argument --stop: model 'tiny-qwen3-moe' has no tokenizer to find stop strings in the text"),
    (["-dp", "2", "--distributed-executor-backend", "external_launcher"],
     "argument --distributed-executor-backend: external_launcher runs this command as one rank of a world launched "
     "outside it: `torchrun --nproc-per-node N -m runner ...`"),
    (["--generation-config", "/nonexistent"],
     "argument --generation-config: generation_config '/nonexistent' is "
     "neither 'auto', 'vllm' nor a directory holding a generation_config.json"),
])
def test_bad_arguments_exit_2_naming_the_flag(argv: list[str], expected: str, capsys: pytest.CaptureFixture) -> None:
    err = usage_error(["generate", *argv], capsys)
    assert expected in err, err
    assert err.startswith("python -m runner generate: error: ") and err.count("\n") == 1  # one line, no usage
    assert err.endswith(" (see: python -m runner generate --help)\n")


def test_bad_prompts_file_lines(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt_token_ids": [1, 2]}\n{"prompt": 3}\n')
    err = usage_error(["bench", "--prompts-file", str(f)], capsys)
    assert f"argument --prompts-file: {f}:2: prompt must be a string" in err
    f.write_text('{"prompt_token_ids": [1, 2]}\nnot json\n')
    assert f"{f}:2: not valid JSON" in usage_error(["generate", "--prompts-file", str(f)], capsys)
    f.write_text('{"prompt": "hello"}\n')
    assert "prompt 0 is text but model 'tiny-qwen3-moe' has no tokenizer" in usage_error(
        ["generate", "--prompts-file", str(f)], capsys)
    f.write_text('{"text": "x"}\n')
    assert 'expected {"prompt": str} or {"prompt_token_ids"' in usage_error(["generate", "--prompts-file", str(f)],
                                                                            capsys)


def test_defaults_and_vllm_names(tmp_path: Path) -> None:
    j = job(["generate", "--data-parallel-size", "2", "--enable-expert-parallel"])
    assert j.cfg.all2all_backend == "auto" and j.cfg.ep_size == 2  # default backend for DP + EP
    assert j.rank_processes and not job(["generate"]).rank_processes  # DP > 1 here: the CLI starts the ranks
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
    def req(i: int, *samples: list[int]) -> dict:
        return {"index": i, "outputs": [{"token_ids": s} for s in samples]}

    a, b = [req(0, [1, 2]), req(1, [3, 4])], [req(0, [1, 2]), req(1, [3, 5])]
    assert compare_outputs(a, a) is None
    assert compare_outputs(a, b) == "1 of 2 requests differ (first: request 1 at output token 1)"
    assert compare_outputs([req(0, [1], [2, 3])], [req(0, [1], [2, 4])]) == \
        "1 of 1 requests differ (first: request 0 sample 1 at output token 1)"


def test_generate_refuses_a_bad_token_id_prompt_before_any_rank_starts(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt_token_ids": [1, 2, 3]}\n{"prompt_token_ids": []}\n{"prompt_token_ids": [7]}\n')
    with pytest.raises(SystemExit) as info:
        main(["generate", "--prompts-file", str(f), "--max-tokens", "3"])
    assert info.value.code == 2
    assert "argument --prompts-file: prompt 1: the prompt is empty: at least one token is needed" in \
        capsys.readouterr().err
    f.write_text('{"prompt_token_ids": [1, 512]}\n')
    with pytest.raises(SystemExit):
        main(["generate", "--prompts-file", str(f)])
    assert "prompt 0: token id 512 at position 1 is outside the vocabulary [0, 512)" in capsys.readouterr().err
    f.write_text('{"prompt_token_ids": [1, 2, 3, 4]}\n')
    with pytest.raises(SystemExit):
        main(["generate", "--prompts-file", str(f), "--max-model-len", "4"])
    assert "prompt 0: the prompt has 4 tokens but max_model_len is 4" in capsys.readouterr().err


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
        (c,) = r["outputs"]
        assert len(c["token_ids"]) == 4 and c["finish_reason"] == "length" and r["error"] is None
        assert all(isinstance(t, int) and 0 <= t < 512 for t in c["token_ids"])
        assert c["text"] is None and r["prompt"] is None and len(r["prompt_token_ids"]) == 16  # no tokenizer
        assert f"[{r['index']}] length, 4 tokens: {' '.join(map(str, c['token_ids']))}" in proc.stdout
    assert "requests: 2 (0 errors)" in proc.stdout and "output tokens: 8" in proc.stdout


def test_torchrun_world_sets_dp(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    j = job(["generate", "--enable-expert-parallel"])
    assert (j.cfg.data_parallel_size, j.cfg.all2all_backend) == (2, "auto")
    assert not j.rank_processes  # this process is one SPMD rank: it starts no rank processes
    assert not job(["generate", "--distributed-executor-backend", "external_launcher"]).rank_processes
    assert "--data-parallel-size: 4 does not match torchrun's WORLD_SIZE=2" in usage_error(["generate", "-dp", "4"],
                                                                                             capsys)


def test_binary_prompts_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    f = tmp_path / "prompts.bin"
    f.write_bytes(b'{"prompt_token_ids": [1]}\n\x00\xff\xfe\n')
    err = usage_error(["generate", "--prompts-file", str(f)], capsys)
    assert f"argument --prompts-file: {f} is not a text file (byte 27 is not UTF-8)" in err, err


def test_output_paths_are_checked_before_any_rank_starts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert f"argument --output-json: '{tmp_path}' is a directory" in usage_error(
        ["generate", "--output-json", str(tmp_path)], capsys)
    assert "argument --output-csv: cannot write '/nonexistent/b.csv'" in usage_error(
        ["bench", "--output-csv", "/nonexistent/b.csv"], capsys)
    ok = tmp_path / "new.json"
    job(["generate", "--output-json", str(ok)])
    assert not ok.exists()  # the check leaves nothing behind
    kept = tmp_path / "old.json"
    kept.write_text("previous results\n")
    job(["generate", "--output-json", str(kept)])
    assert kept.read_text() == "previous results\n"  # ... and does not truncate an existing file


def test_results_that_cannot_be_written_at_the_end_keep_the_summary(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    from runner.entrypoints.report import report_bench, report_generate

    out = {"index": 0, "request_id": "0", "prompt": None, "prompt_token_ids": [5], "finished": True, "error": None,
           "outputs": [{"index": 0, "text": None, "token_ids": [1, 2], "cumulative_logprob": None, "logprobs": None,
                        "finish_reason": "length", "stop_reason": None}]}
    stats = {"num_steps": 2, "num_ubatched_steps": 0, "num_output_tokens": 2, "elapsed_s": 0.5}
    run = {"dbo": False, "outputs": [out], "stats": stats, "summary": "requests: 1 (0 errors) | ...", "trace": None}
    gone = tmp_path / "removed-during-the-run" / "o.json"
    assert report_generate({"runs": [run]}, str(gone)) == 1
    captured = capsys.readouterr()
    assert "requests: 1 (0 errors)" in captured.out
    assert f"error: could not write the results to --output-json {gone}: No such file or directory" in captured.err
    assert report_bench({"runs": [run, {**run, "dbo": True}]}, str(gone.with_suffix(".csv"))) == 1
    captured = capsys.readouterr()
    assert "token outputs DBO off vs on: identical (1 requests)" in captured.out
    assert "error: could not write the results to --output-csv" in captured.err


def test_no_request_succeeded_exits_1_with_each_error_text(capsys: pytest.CaptureFixture) -> None:
    assert main(["generate", "--num-kv-blocks", "1", "--num-prompts", "2", "--max-tokens", "4"]) == 1
    captured = capsys.readouterr()
    why = "request may grow to 20 tokens, which needs 2 KV-cache blocks of 16 tokens but the cache has only 1"
    assert f"[0] error: {why}" in captured.out and f"[1] error: {why}" in captured.out
    assert "requests: 2 (2 errors) | prompt tokens: 0 |" in captured.out
    assert "error: no request succeeded (2 of 2 failed)" in captured.err


def test_engine_errors_are_one_line_unless_debug(capsys: pytest.CaptureFixture) -> None:
    argv = ["generate", "--max-num-seqs", "10000000", "--num-prompts", "1", "--max-tokens", "1"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "error: KVCacheTooLargeError: the KV cache needs " in err, err
    assert "it is sized by --num-kv-blocks (default: enough blocks for --max-num-seqs requests of --max-model-len " \
           "tokens) and --block-size" in err
    assert "Traceback" not in err and "(run with --debug or UBATCH_DEBUG=1 for the full traceback)" in err
    assert main([*argv, "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "check_kv_cache_fits" in err


def test_help_states_the_real_max_model_len_default(capsys: pytest.CaptureFixture) -> None:
    from runner.worker.model_runner import DEFAULT_MAX_MODEL_LEN

    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert (f"--max-model-len N default: the model's max_position_embeddings, capped at {DEFAULT_MAX_MODEL_LEN}; "
            "a value above max_position_embeddings is rejected") in text, text


def test_every_flag_has_help_showing_its_default() -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for sub in ("generate", "bench"):
        sp = subparsers.choices[sub]
        for action in sp._actions:
            if action.dest in ("help", "subparser"):
                continue
            text = action.help or ""
            assert text, f"{sub} {action.option_strings}: no help text"
            assert "default" in text, f"{sub} {action.option_strings}: help shows no default: {text!r}"


def test_unwritable_trace_file_keeps_the_summary_and_the_other_files(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The trace path passed the check before the run but cannot be written at the end (a directory that
    vanished): the summary, the trace's metrics and --output-json are still there; exit 1 naming the flag."""
    import runner.entrypoints.cli as cli
    import runner.entrypoints.llm as llm_module

    gone = "/proc/no-such-dir/t.json"
    for module in (cli, llm_module):
        checked = module.output_path_error
        monkeypatch.setattr(module, "output_path_error", lambda p, checked=checked: None if p == gone else checked(p))
    out = tmp_path / "o.json"
    argv = ["generate", "--num-prompts", "2", "--max-tokens", "3", "--enable-dbo", "--dbo-decode-token-threshold",
            "1", "--dbo-prefill-token-threshold", "1", "--dbo-cost-model", "off", "--trace-file", gone,
            "--output-json", str(out)]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "requests: 2 (0 errors)" in captured.out
    assert "trace NOT written (could not write the trace to" in captured.out
    assert "DBO overlap, rank 0" in captured.out  # the metrics survived
    assert f"error: --trace-file: could not write the trace to {gone}: No such file or directory; only that file " \
           "is lost" in captured.err
    assert [len(r["outputs"][0]["token_ids"]) for r in json.loads(out.read_text())] == [3, 3]


def test_generate_with_a_tokenizer_prints_text_and_writes_vllm_fields(tmp_path: Path, tiny_chat_checkpoint,
                                                                      capsys: pytest.CaptureFixture,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    from ubatch.log_once import forget_logged

    forget_logged()
    ck = tiny_chat_checkpoint
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "The quick brown fox"}\n{"prompt_token_ids": [3, 298, 224]}\n')
    out = tmp_path / "o.json"
    assert main(["generate", "--model", str(ck.path), "--prompts-file", str(prompts), "--output-json", str(out),
                 "--temperature", "0", "--max-tokens", "12"]) == 0
    captured = capsys.readouterr()
    res = json.loads(out.read_text())
    assert res[0]["prompt"] == "The quick brown fox" and res[0]["prompt_token_ids"][0] == 3  # BOS
    assert res[1]["prompt"] is None and res[1]["prompt_token_ids"] == [3, 298, 224]
    first = res[0]["outputs"][0]
    assert first["token_ids"][-1] == ck.second_eos_token_id  # generation_config.json's EOS ended it
    assert (first["finish_reason"], first["stop_reason"]) == ("stop", ck.second_eos_token_id)
    assert isinstance(first["text"], str) and first["cumulative_logprob"] is None and first["logprobs"] is None
    line = f"[0] stop ({ck.second_eos_token_id}), {len(first['token_ids'])} tokens: {first['text']!r}"
    assert line in captured.out, captured.out
    said = [r.getMessage() for r in caplog.records if "generation_config.json" in r.getMessage()]
    assert len(said) == 1 and "default sampling parameters temperature=0.7, top_k=20, top_p=0.9" in said[0]
    # --n over the checkpoint's sampling defaults (temperature 0.7 there): one line per sample
    assert main(["generate", "--model", str(ck.path), "--prompts-file", str(prompts), "--n", "2", "--max-tokens",
                 "4", "--ignore-eos"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[")]
    assert [ln.split()[0] for ln in lines] == ["[0.0]", "[0.1]", "[1.0]", "[1.1]"]
