"""Write small transformers models as FP8 checkpoints in the released layout, with their dequantised twin.

The layout is DeepSeek-V3's and Qwen3-FP8's: ``config.json`` with ``quantization_config`` (``quant_method: fp8``,
``fmt: e4m3``, ``activation_scheme: dynamic``, ``weight_block_size: [128, 128]`` or, per tensor, none), every
quantised ``<module>.weight`` as float8_e4m3fn beside its fp32 ``<module>.weight_scale_inv`` (``weight_scale``, a
scalar, per tensor), experts under per-expert names (``mlp.experts.{e}.gate_proj.weight`` ...), router gates,
norms, embeddings, ``lm_head`` and whatever ``modules_to_not_convert`` lists left in full precision, optionally
sharded over several files with a ``model.safetensors.index.json``.

The twin holds the same model with every quantised weight dequantised (fp32), the reference the FP8 model must
equal. Shapes in the tests are chosen so that blocks come out partial at the edges (192 = 1.5 blocks).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from ubatch.fp8 import dequantize_blocks, quantize_blocks

if TYPE_CHECKING:
    from transformers import PreTrainedModel

FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
NEVER_QUANTISED = re.compile(r"(norm|embed_tokens|\.mlp\.gate|shared_expert_gate)\.weight$|^lm_head\.weight$")


def per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's fused experts (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) under the released
    per-expert names; every other tensor as is."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        m = FUSED.match(name)
        if m is None:
            out[name] = t
            continue
        for e in range(t.shape[0]):
            if m.group(2) == "down_proj":
                out[f"{m.group(1)}.{e}.down_proj.weight"] = t[e]
            else:
                gate, up = t[e].chunk(2, dim=0)
                out[f"{m.group(1)}.{e}.gate_proj.weight"] = gate
                out[f"{m.group(1)}.{e}.up_proj.weight"] = up
    return out


def skipped(module: str, patterns: list[str]) -> bool:
    """transformers' ``modules_to_not_convert`` match: whole name components, ``*`` one component."""
    for p in patterns:
        body = re.escape(p).replace(r"\*", r"[^.]+")
        if re.search(rf"(^|\.){body}(\.|$)", module):
            return True
    return False


def quantised_names(state: dict[str, torch.Tensor], not_convert: list[str]) -> list[str]:
    return [n for n, t in state.items() if n.endswith(".weight") and t.dim() == 2 and n.startswith("model.layers.")
            and not NEVER_QUANTISED.search(n) and not skipped(n[: -len(".weight")], not_convert)]


def write_dir(path: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], shards: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    names = sorted(tensors)
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(path / "model.safetensors"))
        return
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    where = {n: files[i * shards // len(names)] for i, n in enumerate(names)}
    for f in files:
        save_file({n: tensors[n].contiguous() for n in names if where[n] == f}, str(path / f))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": where}))


@dataclass
class Fp8Pair:
    fp8: Path  # the FP8 checkpoint
    reference: Path  # the same model, quantised weights dequantised to fp32, no quantization_config
    quantised: list[str]  # the weight names stored in FP8
    reference_state: dict[str, torch.Tensor]  # the reference's tensors (per-expert names)


def write_fp8_pair(hf_model: PreTrainedModel, root: Path, block: tuple[int, int] | None = (128, 128),
                   not_convert: list[str] | None = None, shards: int = 1, scalar_scales: bool = True) -> Fp8Pair:
    """``hf_model`` written as an FP8 checkpoint under ``root/fp8`` and dequantised under ``root/reference``.

    ``block=None`` writes per-tensor scales (``weight_scale``, a 0-d tensor when ``scalar_scales``, else ``[1]``).
    """
    not_convert = list(not_convert or [])
    state = per_expert({n: t.detach().float() for n, t in hf_model.state_dict().items()})
    config = json.loads(hf_model.config.to_json_string())
    config["torch_dtype"] = "float32"
    config["architectures"] = [type(hf_model).__name__]
    names = quantised_names(state, not_convert)
    fp8: dict[str, torch.Tensor] = dict(state)
    reference: dict[str, torch.Tensor] = dict(state)
    for n in names:
        w = state[n]
        if block is not None:
            b = block
        else:  # per tensor: one block over the whole 2-D weight
            rows, cols = w.shape
            b = (rows, cols)
        q, scale = quantize_blocks(w, b)
        fp8[n] = q
        if block is not None:
            fp8[f"{n}_scale_inv"] = scale
        else:
            fp8[n.replace(".weight", ".weight_scale")] = scale.reshape(()) if scalar_scales else scale.reshape(1)
        reference[n] = dequantize_blocks(q, scale, b)
    quant: dict[str, str | list[int] | list[str]] = {"quant_method": "fp8", "fmt": "e4m3",
                                                     "activation_scheme": "dynamic"}
    if block is not None:
        quant["weight_block_size"] = list(block)
    if not_convert:
        quant["modules_to_not_convert"] = not_convert
    write_dir(root / "fp8", {**config, "quantization_config": quant}, fp8, shards)
    write_dir(root / "reference", config, reference, 1)
    return Fp8Pair(root / "fp8", root / "reference", names, reference)
