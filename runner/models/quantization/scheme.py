"""``quantization_config`` as the FP8 checkpoints write it, parsed into an :class:`Fp8Scheme`; other schemes refused.

Keys read (vLLM's ``Fp8Config.from_config`` and transformers' ``FineGrainedFP8Config``; DeepSeek-V3 and the Qwen3
``-FP8`` checkpoints write them): ``quant_method`` (``"fp8"``), ``fmt`` (``"e4m3"``; absent means e4m3),
``activation_scheme`` (``"dynamic"``: activations are not quantised in the file), ``weight_block_size``
(``[128, 128]``: tensors ``<module>.weight_scale_inv`` with one scale per block; absent: per-tensor, one
``<module>.weight_scale`` scalar per matrix), and ``modules_to_not_convert`` (transformers) or ``ignored_layers``
(vLLM): module names, ``*`` matching one name component, whose weights stay in bf16.

Which modules are FP8 is read from the checkpoint itself (a module is FP8 exactly when it has a scale tensor), so
a checkpoint without ``modules_to_not_convert`` (DeepSeek-V3's bf16 router gates) loads as written; the list is
checked against it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from runner.config import QUANTIZATION_METHODS
from ubatch.fp8 import DEFAULT_BLOCK

FP8_METHOD = "fp8"


@dataclass(frozen=True)
class Fp8Scheme:
    """How a model's FP8 weights are scaled: ``block`` rows x columns per scale, ``None`` for per-tensor."""

    block: tuple[int, int] | None = DEFAULT_BLOCK
    modules_to_not_convert: tuple[str, ...] = ()
    online: bool = False  # quantised while loading a bf16 checkpoint (--quantization fp8), not read from one

    @property
    def scale_name(self) -> str:
        """The checkpoint's name for a module's scales: ``weight_scale_inv`` (block) or ``weight_scale``."""
        return "weight_scale_inv" if self.block is not None else "weight_scale"

    def describe(self) -> str:
        if self.block is None:
            return "FP8 e4m3 weights with one scale per tensor"
        return f"FP8 e4m3 weights with one scale per {self.block[0]}x{self.block[1]} block"

    def skips(self, module: str) -> bool:
        """Whether ``modules_to_not_convert`` names ``module`` (whole name components; ``*`` is one component)."""
        for pattern in self.modules_to_not_convert:
            body = re.escape(pattern).replace(r"\*", r"[^.]+")
            if re.search(rf"(^|\.){body}(\.|$)", module):
                return True
        return False


def _names(q: dict[str, Any]) -> tuple[str, ...]:
    for key in ("modules_to_not_convert", "ignored_layers"):
        value = q.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"quantization_config.{key} must be a list of module names, got {value!r}")
        return tuple(value)
    return ()


def parse_quantization_config(q: object) -> Fp8Scheme | None:
    """``config.json``'s ``quantization_config`` -> its scheme (``None`` when absent); ``ValueError`` naming the
    scheme or key for anything but FP8 e4m3 with dynamic activations."""
    if q is None or q == {}:
        return None
    if not isinstance(q, dict):
        raise ValueError(f"quantization_config must be a JSON object, got {q!r}")
    method = q.get("quant_method")
    if method != FP8_METHOD:
        raise ValueError(f"quantized checkpoints with quantization_config.quant_method={method!r} are not supported: "
                         "only FP8 ('fp8', per 128x128 block as DeepSeek-V3 and Qwen3-FP8 ship, or per tensor) "
                         "loads; use that or a bf16 checkpoint")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"FP8 quantized checkpoints with quantization_config.fmt={fmt!r} are not supported: only "
                         "'e4m3' (float8_e4m3fn weights)")
    if "activation_scheme" not in q:
        raise ValueError("FP8 quantized checkpoints need quantization_config.activation_scheme ('dynamic'), as vLLM "
                         "requires")
    act = q["activation_scheme"]
    if act != "dynamic":
        raise ValueError(f"FP8 quantized checkpoints with quantization_config.activation_scheme={act!r} are not "
                         "supported: only 'dynamic' (no input_scale tensors)")
    size = q.get("weight_block_size")
    block: tuple[int, int] | None = None
    if size is not None:
        if (not isinstance(size, list) or len(size) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size)):
            raise ValueError(f"quantization_config.weight_block_size must be two positive integers "
                             f"[rows, columns], got {size!r}")
        block = (size[0], size[1])
    return Fp8Scheme(block=block, modules_to_not_convert=_names(q))


def check_quantization_arg(value: object) -> None:
    """``--quantization`` / ``quantization=``: ``None`` or ``'fp8'``; ``ValueError`` naming anything else."""
    if value is not None and value not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={value!r} is not supported by this engine (accepted: None, or 'fp8': an FP8 "
                         "checkpoint runs as it is, a bf16 one is quantised per 128x128 block while loading)")
