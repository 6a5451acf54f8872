"""``config.json``'s ``architectures[0]`` -> (model class, config class).

Classes are imported lazily so that parsing a config (or listing what is supported) does not import the
MoE kernel stack.
"""
from __future__ import annotations

import importlib
from typing import Any

from runner.models.base import MoECausalLM
from runner.models.configs import BaseMoEConfig, DeepseekV2Config, Glm4MoeConfig, GptOssConfig
from runner.models.standard_configs import (
    LlamaConfig,
    MixtralConfig,
    OlmoeConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

# architecture -> (module, class name, config class)
_MODELS: dict[str, tuple[str, str, type[BaseMoEConfig]]] = {
    "Qwen3MoeForCausalLM": ("runner.models.qwen3_moe", "Qwen3MoeForCausalLM", Qwen3MoeConfig),
    "DeepseekV2ForCausalLM": ("runner.models.deepseek_v2", "DeepseekV2ForCausalLM", DeepseekV2Config),
    "DeepseekV3ForCausalLM": ("runner.models.deepseek_v2", "DeepseekV3ForCausalLM", DeepseekV2Config),
    "MixtralForCausalLM": ("runner.models.mixtral", "MixtralForCausalLM", MixtralConfig),
    "Qwen2MoeForCausalLM": ("runner.models.qwen2_moe", "Qwen2MoeForCausalLM", Qwen2MoeConfig),
    "OlmoeForCausalLM": ("runner.models.olmoe", "OlmoeForCausalLM", OlmoeConfig),
    "LlamaForCausalLM": ("runner.models.dense", "LlamaForCausalLM", LlamaConfig),
    "Qwen2ForCausalLM": ("runner.models.dense", "Qwen2ForCausalLM", Qwen2Config),
    "Qwen3ForCausalLM": ("runner.models.dense", "Qwen3ForCausalLM", Qwen3Config),
    "GptOssForCausalLM": ("runner.models.gpt_oss", "GptOssForCausalLM", GptOssConfig),
    "Glm4MoeForCausalLM": ("runner.models.glm4_moe", "Glm4MoeForCausalLM", Glm4MoeConfig),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def architecture_of(config_dict: dict[str, Any]) -> str:
    archs = config_dict.get("architectures") or []
    if not archs:
        raise ValueError(f"no 'architectures' entry (the model class); supported: "
                         f"{', '.join(supported_architectures())}")
    if not isinstance(archs, list) or not isinstance(archs[0], str):
        raise ValueError(f"'architectures' must be a list of model class names, e.g. [\"Qwen3MoeForCausalLM\"]; "
                         f"got {archs!r}")
    return archs[0]


def _entry(arch: str) -> tuple[str, str, type[BaseMoEConfig]]:
    if arch not in _MODELS:
        raise ValueError(f"unknown model architecture {arch!r}; supported: {', '.join(supported_architectures())}")
    return _MODELS[arch]


def get_model_class(arch: str) -> type[MoECausalLM]:
    module, name, _ = _entry(arch)
    cls: type[MoECausalLM] = getattr(importlib.import_module(module), name)
    return cls


def parse_config(config_dict: dict[str, Any]) -> BaseMoEConfig:
    """Pick the config class from ``architectures[0]`` and parse (unknown keys ignored)."""
    return _entry(architecture_of(config_dict))[2].from_dict(config_dict)
