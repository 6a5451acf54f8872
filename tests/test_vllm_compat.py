"""vLLM scripts and flags run as written: vLLM's engine arguments this engine has no use for are accepted at their
no-op values and refused otherwise, naming the argument and what to use instead (``LLM(...)`` and the CLI)."""
from __future__ import annotations

from typing import Any

import pytest

from fake_runner import FakeRunner
from runner.config import ConfigError
from runner.entrypoints.cli import build_parser, job_from_args, main
from runner.entrypoints.llm import LLM
from runner.entrypoints.report import show_request
from runner.sampling_params import SamplingParams

VLLM_SCRIPT_ARGS = dict(trust_remote_code=True, tensor_parallel_size=1, pipeline_parallel_size=1, swap_space=4,
                        kv_cache_dtype="auto", disable_log_stats=True, enable_chunked_prefill=True,
                        revision=None, download_dir=None, quantization=None,
                        tokenizer_mode="auto", load_format="auto", disable_custom_all_reduce=False,
                        distributed_executor_backend="mp", seed=3)


def fake_llm(**kwargs: Any) -> LLM:
    return LLM("tiny-qwen3-moe", runner=FakeRunner(vocab_size=64, num_kv_blocks=64, max_model_len=128), **kwargs)


def test_a_vllm_script_with_the_usual_engine_arguments_runs() -> None:
    llm = fake_llm(**VLLM_SCRIPT_ARGS)
    plain = fake_llm(seed=3)
    assert llm.cfg == plain.cfg  # no-ops: the engine's settings are the same as without them
    (out,) = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert out.outputs[0].token_ids == plain.generate([[1, 2, 3]], SamplingParams(max_tokens=3))[0].outputs[0].token_ids


@pytest.mark.parametrize("name, value, instead", [
    ("tensor_parallel_size", 2, "use data_parallel_size=N (--data-parallel-size N) with enable_expert_parallel=True"),
    ("pipeline_parallel_size", 2, "use data_parallel_size=N"),
    ("quantization", "awq", "use an FP8 or unquantized checkpoint"),
    ("kv_cache_dtype", "fp8", "dtype=... sets the model's and the KV cache's dtype together"),
    ("enable_chunked_prefill", False, "raise max_num_batched_tokens to max_model_len"),
    ("revision", "main", "check the revision out into a local directory"),
    ("trust_remote_code", "yes", "pass a bool"),
])
def test_a_value_the_engine_cannot_honour_is_refused_naming_it(name: str, value: object, instead: str) -> None:
    with pytest.raises(ConfigError) as info:
        fake_llm(**{name: value})
    assert str(info.value).startswith(f"{name}={value!r} is not supported by this engine (accepted: ")
    assert instead in str(info.value) and info.value.field == name


def test_an_unknown_argument_is_still_a_type_error() -> None:
    with pytest.raises(TypeError, match="unknown engine argument 'tensor_paralel_size'"):
        fake_llm(tensor_paralel_size=1)


def test_the_cli_takes_vllm_flags_at_their_no_op_values() -> None:
    parser = build_parser()
    argv = ["generate", "--trust-remote-code", "-tp", "1", "--pipeline-parallel-size", "1", "--swap-space", "4",
            "--kv-cache-dtype", "auto", "--disable-log-stats", "--enable-chunked-prefill",
            "--tokenizer-mode", "auto", "--load-format", "safetensors",
            "--disable-custom-all-reduce", "--distributed-executor-backend", "mp", "--num-prompts", "1"]
    args = parser.parse_args(argv)
    job = job_from_args(args, args.subparser)
    plain = parser.parse_args(["generate", "--num-prompts", "1"])
    assert job.cfg == job_from_args(plain, plain.subparser).cfg


@pytest.mark.parametrize("flags, message", [
    (["--tensor-parallel-size", "2"], "argument --tensor-parallel-size: tensor_parallel_size=2 is not supported"),
    (["-q", "awq"], "argument --quantization: quantization='awq' is not supported"),
])
def test_the_cli_refuses_an_unhonourable_vllm_flag_with_exit_2(flags: list[str], message: str,
                                                               capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main(["generate", *flags])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_prefix_caching_and_num_gpu_blocks_override_are_vllms_settings() -> None:
    """enable_prefix_caching (on by default, as vLLM V1) and num_gpu_blocks_override (this engine's num_kv_blocks)
    set the engine, from LLM(...) and the CLI alike."""
    assert fake_llm().cfg.enable_prefix_caching is True
    assert fake_llm(enable_prefix_caching=False).cfg.enable_prefix_caching is False
    assert fake_llm(num_gpu_blocks_override=24).cfg.num_kv_blocks == 24
    assert fake_llm(num_gpu_blocks_override=24, num_kv_blocks=24).cfg.num_kv_blocks == 24
    with pytest.raises(ConfigError, match="num_gpu_blocks_override=24 and num_kv_blocks=32 set the same thing"):
        fake_llm(num_gpu_blocks_override=24, num_kv_blocks=32)
    parser = build_parser()
    for command in ("generate", "bench", "serve"):
        model = ["tiny-qwen3-moe"] if command == "serve" else []
        args = parser.parse_args([command, *model, "--no-enable-prefix-caching", "--num-gpu-blocks-override", "40"])
        assert (args.enable_prefix_caching, args.num_gpu_blocks_override) == (False, 40)
    args = parser.parse_args(["generate", "--no-enable-prefix-caching", "--num-gpu-blocks-override", "40",
                              "--num-prompts", "1"])
    cfg = job_from_args(args, args.subparser).cfg
    assert (cfg.enable_prefix_caching, cfg.num_kv_blocks) == (False, 40)
    args = parser.parse_args(["generate", "--enable-prefix-caching", "--num-prompts", "1"])
    assert job_from_args(args, args.subparser).cfg.enable_prefix_caching is True


def test_cli_refuses_num_gpu_blocks_override_against_num_kv_blocks(capsys: pytest.CaptureFixture) -> None:
    err = cli_error(["generate", "--num-gpu-blocks-override", "40", "--num-kv-blocks", "30"], capsys)
    assert "argument --num-gpu-blocks-override: num_gpu_blocks_override=40 and num_kv_blocks=30 set the same " \
        "thing" in err


def test_a_stop_on_the_models_own_eos_shows_no_stop_reason() -> None:
    """README: the stop token id or stop string in parentheses; an EOS stop (stop_reason None, vLLM's) shows none."""
    request: dict[str, Any] = {"index": 0, "error": None, "outputs": [
        {"index": 0, "finish_reason": "stop", "stop_reason": None, "token_ids": [5, 6], "text": "ab"}]}
    assert show_request(request) == ["[0] stop, 2 tokens: 'ab'"]
    request["outputs"][0]["stop_reason"] = 7
    assert show_request(request) == ["[0] stop (7), 2 tokens: 'ab'"]


# ---------------------------------------------------------------------------------------------- the CLI
def cli_error(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


def test_prompt_flags_are_exact_and_repeatable(tiny_chat_checkpoint, tmp_path, capsys: pytest.CaptureFixture) -> None:
    import json

    out = tmp_path / "o.json"
    assert main(["generate", str(tiny_chat_checkpoint.path), "--prompt", "Hello world!", "--prompt", "The quick",
                 "--max-tokens", "2", "--dtype", "float32", "--output-json", str(out)]) == 0
    assert [r["prompt"] for r in json.loads(out.read_text())] == ["Hello world!", "The quick"]
    capsys.readouterr()
    assert cli_error(["generate", "--prompts", "Hello"], capsys) == (  # not --prompts-file: no prefix matching
        "python -m runner generate: error: unrecognized arguments: --prompts (see: python -m runner generate --help)\n")
    assert "generate: error: unrecognized arguments: --max-tok" in cli_error(["generate", "--max-tok", "3"], capsys)
    err = cli_error(["generate", "--prompt", "Hi", "--prompts-file", str(out)], capsys)
    assert "argument --prompt: give prompts with --prompt or --prompts-file, not both" in err
    err = cli_error(["generate", "--prompt", "Hi"], capsys)  # the built-in tiny model has no tokenizer
    assert "argument --prompt: model 'tiny-qwen3-moe' has no tokenizer to encode text prompts" in err


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_every_subcommand_takes_a_positional_model(command: str, capsys: pytest.CaptureFixture) -> None:
    parser = build_parser()
    args = parser.parse_args([command, "tiny-deepseek-v3", "--num-prompts", "1"])
    assert job_from_args(args, args.subparser).cfg.model == "tiny-deepseek-v3"
    err = cli_error([command, "tiny-deepseek-v3", "--model", "tiny-qwen3-moe"], capsys)
    assert "argument --model: 'tiny-qwen3-moe' differs from the positional MODEL 'tiny-deepseek-v3'" in err


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_experts_not_divisible_by_the_ep_ranks_is_refused_before_any_rank_starts(
        command: str, capsys: pytest.CaptureFixture) -> None:
    err = cli_error([command, "tiny-qwen3-moe", "-dp", "3", "--enable-expert-parallel", "--device", "cpu"], capsys)
    assert ("argument --data-parallel-size: the model's 8 experts cannot be spread evenly over 3 expert-parallel "
            "ranks (num_experts=8 is not divisible by ep_size=3); use a --data-parallel-size that divides it "
            "(2, 4, 8), or drop --enable-expert-parallel") in err


@pytest.mark.parametrize("backend", ["deepep_v2", "deepep_low_latency", "auto_deepep_v1"])
def test_a_deepep_backend_without_deepep_is_refused_before_any_rank_starts(backend: str,
                                                                           capsys: pytest.CaptureFixture) -> None:
    import importlib.util

    if importlib.util.find_spec("deep_ep") is not None:
        pytest.skip("DeepEP is installed here")
    err = cli_error(["generate", "-dp", "2", "--enable-expert-parallel", "--all2all-backend", backend,
                     "--device", "cpu"], capsys)
    assert f"argument --all2all-backend: all2all_backend {backend!r} needs DeepEP (the 'deep_ep' package)" in err


def test_serve_help_shows_the_model_as_required(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: tiny-qwen3-moe" not in text
    assert "required, here or as the positional MODEL (default: none)" in text
    assert "the following arguments are required: MODEL (or --model)" in cli_error(["serve"], capsys)


def _bad_prompt_on_rank_1(device: str) -> str:
    """Rank body: prompt 1 (run by rank 1) is empty; every rank must raise the same error, none may hang."""
    llm = LLM(model="tiny-qwen3-moe", data_parallel_size=2, device=device, dist_timeout_s=60.0)
    try:
        llm.generate([[1, 2], []], SamplingParams(max_tokens=2), use_tqdm=False)
    except ValueError as e:
        again = llm.generate([[1, 2], [3]], SamplingParams(max_tokens=2), use_tqdm=False)  # still in step
        return f"{e} | {[len(o.outputs[0].token_ids) for o in again]}"
    finally:
        llm.close()
    return "no error"


@pytest.mark.slow
def test_a_bad_prompt_raises_on_every_dp_rank() -> None:
    from devices import device_for
    from runner.distributed.launch import launch

    per_rank = launch(_bad_prompt_on_rank_1, 2, args=(device_for(2),), timeout_s=180, device=device_for(2))
    assert per_rank == ["prompt 1: the prompt is empty: at least one token is needed | [2, 2]"] * 2
