"""``generation_config.json``: the checkpoint's EOS ids and recommended sampling defaults, applied as vLLM's
default ``--generation-config auto`` applies them.

- **Sampling defaults** (vLLM's ``ModelConfig.get_diff_sampling_param``): the file's ``repetition_penalty``,
  ``temperature``, ``top_k``, ``top_p``, ``min_p`` and ``max_new_tokens`` (as ``max_tokens``) become the
  defaults of a request that gives no sampling parameters (``LLM.generate(prompts)``; the CLI's sampling flags
  that are not given). Values the file leaves unset keep vLLM's defaults. vLLM reads the file through
  transformers' ``GenerationConfig.to_diff_dict()``; with transformers 5 every field defaults to None, so that
  is exactly the fields the file sets, which is what is read here (no transformers needed).
- **EOS ids** (vLLM's ``SamplingParams.update_from_generation_config``): the model's own EOS (``config.json``'s
  ``eos_token_id``, which the scheduler checks) is joined by the file's ``eos_token_id`` list. The ids the model
  does not already stop on are added to each request's ``stop_token_ids`` (unless ``ignore_eos``), so a request
  ending on one has ``finish_reason`` "stop" and that id as ``stop_reason``, as in vLLM; all of them go into
  ``all_stop_token_ids``, which ``min_tokens`` holds back. Qwen3 instruct checkpoints list two EOS ids there;
  without this, generation runs past the end of the answer.

``generation_config`` (the RunnerConfig field, vLLM's flag): ``auto`` reads the model directory's file,
``vllm`` ignores it (vLLM's documented meaning; its code still takes the EOS ids from the file in that mode,
which this engine does not), and a directory reads that directory's ``generation_config.json``.
"""
from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.sampling_params import SamplingParams, SamplingParamsError

FILE_NAME = "generation_config.json"
# generation_config.json field -> SamplingParams field (vLLM's list in get_diff_sampling_param)
SAMPLING_FIELDS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_k": "top_k",
                   "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}


class GenerationConfigError(ValueError):
    """A ``generation_config.json`` that cannot be used; the message names the file and the field."""


@dataclass
class GenerationConfig:
    """What one model's generation config contributes to every request. ``source``: the file read (None:
    none, or ignored with ``--generation-config vllm``)."""

    model_eos_token_ids: frozenset[int] = frozenset()
    extra_eos_token_ids: tuple[int, ...] = ()  # the file's EOS ids the model does not already stop on
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # SamplingParams field -> value
    source: Path | None = None

    def default_sampling_params(self) -> SamplingParams:
        """vLLM's ``LLM.get_default_sampling_params()``: SamplingParams with the file's defaults."""
        return SamplingParams(**self.sampling_defaults)

    def apply(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the EOS ids applied (a copy when anything changes; ``params`` is never modified)."""
        all_stop = set(params.all_stop_token_ids) | self.model_eos_token_ids | set(self.extra_eos_token_ids)
        stop_ids = params.stop_token_ids or ()
        extra = [] if params.ignore_eos else [t for t in self.extra_eos_token_ids if t not in stop_ids]
        if not extra and all_stop == params.all_stop_token_ids:
            return params
        out = copy.copy(params)
        out.stop_token_ids = extra + list(params.stop_token_ids or ())
        out.all_stop_token_ids = all_stop | set(out.stop_token_ids)
        return out

    def describe(self) -> str | None:
        """One line saying what came from the checkpoint (None when nothing did)."""
        if self.source is None or not (self.extra_eos_token_ids or self.sampling_defaults):
            return None
        parts = []
        if self.sampling_defaults:
            shown = ", ".join(f"{k}={v}" for k, v in self.sampling_defaults.items())
            parts.append(f"default sampling parameters {shown} (for requests that give none)")
        if self.extra_eos_token_ids:
            parts.append(f"EOS token ids {sorted(self.model_eos_token_ids | set(self.extra_eos_token_ids))} end "
                         "every request unless ignore_eos")
        return f"{self.source}: " + "; ".join(parts) + " (--generation-config vllm ignores the file)"


def model_eos_token_ids(model_config: Any) -> list[int]:  # third-party: a config.json as transformers reads it
    """``config.json``'s ``eos_token_id`` (an id, a list of them, or none) as a list: what the scheduler stops on."""
    eos = getattr(model_config, "eos_token_id", None)
    return [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]


def _eos_ids(value: Any, file: Path) -> list[int]:  # a JSON value, as the file has it
    if value is None:
        return []
    ids = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
        raise GenerationConfigError(f"{file}: eos_token_id must be a token id or a list of them, got {value!r}")
    return ids


def load_generation_config(model_dir: str | Path, mode: str = "auto",
                           model_eos_token_ids: Iterable[int] = ()) -> GenerationConfig:
    """The generation config of the model in ``model_dir`` under ``mode`` (module docstring)."""
    model_eos = frozenset(model_eos_token_ids)
    if mode == "vllm":
        return GenerationConfig(model_eos)
    file = (Path(model_dir) if mode == "auto" else Path(mode)) / FILE_NAME
    if not file.is_file():
        if mode != "auto":
            raise GenerationConfigError(f"--generation-config {mode}: no {FILE_NAME} in that directory")
        return GenerationConfig(model_eos)
    try:
        d = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GenerationConfigError(f"{file}: cannot read it as JSON ({e})") from None
    if not isinstance(d, dict):
        raise GenerationConfigError(f"{file}: must hold a JSON object, got {type(d).__name__}")
    extra = tuple(t for t in dict.fromkeys(_eos_ids(d.get("eos_token_id"), file)) if t not in model_eos)
    defaults = {ours: d[theirs] for theirs, ours in SAMPLING_FIELDS.items() if d.get(theirs) is not None}
    try:
        SamplingParams(**defaults)
    except SamplingParamsError as e:
        theirs = next((k for k, v in SAMPLING_FIELDS.items() if v == e.field), e.field)
        raise GenerationConfigError(f"{file}: {theirs}: {e}") from None
    return GenerationConfig(model_eos, extra, defaults, file)
