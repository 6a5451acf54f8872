"""Bad checkpoints: every error names the file and the problem, with no traceback unless asked for.

Through the loader (what ``LLM(...)`` and every rank see) and through the CLI, which checks the config and
the checkpoint files' headers before any rank starts (exit 2), and reports a problem found by the ranks
themselves -- a missing tensor -- once, however many ranks hit it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from devices import device_args
from runner.entrypoints.cli import build_parser, job_from_args, main
from runner.models.loader import CheckpointError, load_model, resolve_model_path

ROOT = Path(__file__).resolve().parents[1]
MISSING = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A private copy of the built-in tiny Qwen3-MoE checkpoint, to break."""
    src = resolve_model_path("tiny-qwen3-moe", tmp_path / "cache")
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def cli_error(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    parser = build_parser()
    args = parser.parse_args(argv)
    with pytest.raises(SystemExit) as info:
        job_from_args(args, args.subparser)
    assert info.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    return line.removesuffix(f" (see: {args.subparser.prog} --help)")  # the pointer every CLI error ends with


ConfigEdit = Callable[[dict[str, Any]], dict[str, Any]]


def edit_config(model_dir: Path, edit: ConfigEdit) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(edit(config)))


@pytest.mark.parametrize("edit,problem", [
    (lambda c: {**c, "architectures": ["JambaForCausalLM"]},
     "unknown model architecture 'JambaForCausalLM'; supported: DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, "
     "Glm4MoeForCausalLM, GptOssForCausalLM, LlamaForCausalLM, MixtralForCausalLM, OlmoeForCausalLM, "
     "Qwen2ForCausalLM, Qwen2MoeForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM"),
    (lambda c: [c], "must hold a JSON object with the model's settings, got an array"),
    (lambda c: {k: v for k, v in c.items() if k != "vocab_size"},
     "no 'vocab_size' field (a Qwen3MoeForCausalLM config needs vocab_size, hidden_size, num_hidden_layers, "
     "num_attention_heads)"),
    (lambda c: {**c, "vocab_size": "512"}, "'vocab_size' must be a positive integer, got '512'"),
    (lambda c: {**c, "architectures": "Qwen3MoeForCausalLM"}, "'architectures' must be a list of model class names"),
], ids=["unknown-architecture", "list", "no-vocab-size", "vocab-size-string", "architectures-string"])
def test_bad_config_names_the_file(model_dir: Path, edit: ConfigEdit, problem: str,
                                   capsys: pytest.CaptureFixture) -> None:
    edit_config(model_dir, edit)
    where = f"{model_dir / 'config.json'}: "
    with pytest.raises(CheckpointError) as info:
        load_model(str(model_dir))
    assert str(info.value).startswith(where + problem), str(info.value)
    assert f"error: argument --model: {where}{problem}" in cli_error(["generate", "--model", str(model_dir)], capsys)


def test_config_that_is_not_json(model_dir: Path) -> None:
    (model_dir / "config.json").write_text('{"vocab_size": 512,')
    with pytest.raises(CheckpointError, match=r"config.json: not valid JSON \(Expecting property name enclosed in "
                                              r"double quotes at line 1\)"):
        load_model(str(model_dir))


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_safetensors_names_the_file(model_dir: Path, damage: str, capsys: pytest.CaptureFixture) -> None:
    f = model_dir / "model.safetensors"
    if damage == "truncated":
        os.truncate(f, f.stat().st_size - 100)
    else:
        f.write_bytes(b"\x07" * 64)
    expected = f"{f}: corrupt or truncated safetensors file (Error while deserializing header: "
    with pytest.raises(CheckpointError) as info:
        load_model(str(model_dir))
    assert str(info.value).startswith(expected) and "delete" not in str(info.value), str(info.value)
    assert f"error: argument --model: {expected}" in cli_error(["generate", "--model", str(model_dir)], capsys)


def test_corrupt_cached_builtin_model_says_which_entry_to_delete(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    cache = tmp_path / "cache"
    entry = resolve_model_path("tiny-qwen3-moe", cache)
    good, _ = load_model("tiny-qwen3-moe", cache_dir=cache)
    os.truncate(entry / "model.safetensors", 4096)
    hint = f"this is the cached built-in model 'tiny-qwen3-moe': delete '{entry}' and it will be written again"
    with pytest.raises(CheckpointError) as info:
        load_model("tiny-qwen3-moe", cache_dir=cache)
    assert str(info.value).startswith(f"{entry / 'model.safetensors'}: corrupt or truncated") and \
        str(info.value).endswith(hint), str(info.value)
    assert cli_error(["generate", "--cache-dir", str(cache)], capsys).endswith(hint)
    shutil.rmtree(entry)  # what the hint says to do: the entry is written again, identical
    again, _ = load_model("tiny-qwen3-moe", cache_dir=cache)
    assert all((a == b).all() for a, b in zip(good.state_dict().values(), again.state_dict().values(), strict=True))


def test_missing_tensor_names_the_checkpoint(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture) -> None:
    tensors = load_file(str(model_dir / "model.safetensors"))
    del tensors[MISSING]
    save_file(tensors, str(model_dir / "model.safetensors"))
    message = f"{model_dir}: missing weights: '{MISSING}' (checkpoint files: model.safetensors)"
    with pytest.raises(CheckpointError) as info:
        load_model(str(model_dir))
    assert str(info.value) == message
    argv = ["generate", "--model", str(model_dir), "--num-prompts", "1"]
    monkeypatch.delenv("UBATCH_DEBUG", raising=False)
    assert main(argv) == 1  # found by the engine (in this process): one line, no traceback
    err = capsys.readouterr().err
    assert f"error: CheckpointError: {message}" in err and "Traceback" not in err, err
    monkeypatch.setenv("UBATCH_DEBUG", "1")  # the environment's spelling of --debug
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and f"error: CheckpointError: {message}" in err


def test_missing_tensor_over_two_ranks_is_one_summary(model_dir: Path) -> None:
    tensors = load_file(str(model_dir / "model.safetensors"))
    del tensors[MISSING]
    save_file(tensors, str(model_dir / "model.safetensors"))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("UBATCH_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "runner", "generate", "--model", str(model_dir), "-dp", "2",
                           "--enable-expert-parallel", "--num-prompts", "2", *device_args(2)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    assert errors == [f"error: rank 0 and rank 1 exited with code 1: CheckpointError: {model_dir}: missing weights: "
                      f"'{MISSING}' (checkpoint files: model.safetensors)"], proc.stderr
    assert proc.stderr.count("(run with --debug or UBATCH_DEBUG=1 for the full traceback)") == 1
    assert "Traceback" not in proc.stderr
