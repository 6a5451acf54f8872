"""``load_format="dummy"`` (vLLM's): random weights from ``config.json`` alone. The weights are those a checkpoint
written from them would load (same tokens), drawn per tensor name (the same on an expert-parallel rank as on one
rank), FP8 online quantisation applies to them, an FP8 checkpoint's config is refused, and the setting is checked
where it enters (``LLM``, the CLI)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from runner.config import ConfigError, RunnerConfig
from runner.entrypoints.cli import build_parser, job_from_args, main
from runner.entrypoints.llm import LLM
from runner.models.dummy_weights import HIGH, LOW, dummy_weights
from runner.models.loader import TINY_MODELS, CheckpointError, load_model
from runner.sampling_params import SamplingParams
from ubatch.fp8 import FP8_DTYPE

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9, 8, 7, 6, 5, 4, 3]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def config_dir(tmp_path: Path, name: str = "tiny-qwen3-moe", **overrides: Any) -> Path:
    """A directory holding only a built-in model's ``config.json``."""
    path = tmp_path / f"{name}-config"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**TINY_MODELS[name], **overrides}))
    return path


def generate(model: Path, **engine: Any) -> list[list[int]]:
    llm = LLM(model=str(model), device="cpu", **engine)
    try:
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.close()


def test_dummy_weights_are_what_a_checkpoint_of_them_loads(tmp_path: Path) -> None:
    model_dir = config_dir(tmp_path)
    net, _ = load_model(str(model_dir), load_format="dummy", seed=5)
    drawn = dict(dummy_weights(net, torch.float32, "cpu", seed=5))
    assert all(float(t.min()) >= LOW and float(t.max()) <= HIGH for t in drawn.values())
    assert len({float(t.flatten()[0]) for t in drawn.values()}) > len(drawn) // 2  # each tensor its own draw
    written = tmp_path / "written"
    written.mkdir()
    save_file({n: t.contiguous() for n, t in drawn.items()}, str(written / "model.safetensors"))
    (written / "config.json").write_text((model_dir / "config.json").read_text())
    dummy = generate(model_dir, load_format="dummy", seed=5)
    assert dummy == generate(written, seed=5)
    assert dummy != generate(model_dir, load_format="dummy", seed=6)  # the seed draws other weights


def test_each_tensor_is_drawn_from_its_name_not_from_the_loading_order(tmp_path: Path) -> None:
    net, _ = load_model(str(config_dir(tmp_path)), load_format="dummy")
    forward = dict(dummy_weights(net, torch.float32, "cpu"))
    spec = dataclasses.replace(net.weight_spec())
    names = list(spec.all_names())
    spec.all_names = lambda: iter(reversed(names))  # type: ignore[method-assign]
    net.weight_spec = lambda: spec  # type: ignore[method-assign]
    backward = list(dummy_weights(net, torch.float32, "cpu"))
    assert [n for n, _ in backward] == list(reversed(forward))
    assert all(torch.equal(t, forward[n]) for n, t in backward)


def test_expert_parallel_ranks_draw_the_same_experts_as_one_rank(tmp_path: Path) -> None:
    model_dir = config_dir(tmp_path)
    settings = dict(load_format="dummy", dist_timeout_s=60.0)
    assert generate(model_dir, data_parallel_size=2, enable_expert_parallel=True, **settings) \
        == generate(model_dir, **settings)


def test_online_fp8_quantises_the_random_weights(tmp_path: Path) -> None:
    model_dir = config_dir(tmp_path)
    net, _ = load_model(str(model_dir), load_format="dummy", quantization="fp8")
    fp8 = [n for n, p in net.named_parameters() if p.dtype == FP8_DTYPE]
    assert any(".experts." in n for n in fp8) and any("self_attn" in n for n in fp8)
    assert all(len(tokens) == GREEDY.max_tokens
               for tokens in generate(model_dir, load_format="dummy", quantization="fp8"))


def test_an_fp8_checkpoint_config_is_refused_naming_quantization_config(tmp_path: Path) -> None:
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    model_dir = config_dir(tmp_path, quantization_config=fp8)
    with pytest.raises(CheckpointError, match=r"load_format='dummy'.*quantization_config.*quantization='fp8'"):
        load_model(str(model_dir), load_format="dummy")


def test_the_setting_is_checked_where_it_enters(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ConfigError, match="load_format must be one of auto, safetensors, dummy; got 'pt'"):
        RunnerConfig(load_format="pt")
    assert RunnerConfig(load_format="safetensors").load_format == "auto"  # the same reader here
    parser = build_parser()
    args = parser.parse_args(["generate", "--load-format", "dummy", "--num-prompts", "1"])
    assert job_from_args(args, args.subparser).cfg.load_format == "dummy"
    with pytest.raises(SystemExit) as info:
        main(["generate", "--load-format", "npz"])
    assert info.value.code == 2 and "--load-format" in capsys.readouterr().err
