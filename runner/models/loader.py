"""Load a model from a local HF-format directory or a built-in tiny model; never touches the network.

Checkpoints are read lazily with ``safe_open``: a tensor is materialised only if this rank keeps it, and a
fused expert tensor is sliced to this rank's expert rows before it is read, so an EP rank's memory holds only
its own experts. Built-in tiny models (seeded random weights) are written once, atomically, to
``<root>/models/<name>`` where ``root`` is ``cache_dir`` if given, else ``$UBATCH_CACHE_DIR``, else
``~/.cache/ubatch``; concurrent ranks racing to create one end up reading the same files.

Every problem with a checkpoint is a :class:`CheckpointError` naming the file and what is wrong with it (a
config that is not a JSON object, an unknown architecture, a missing field, a corrupt or truncated
safetensors file, a missing tensor); for a cached built-in model it says which cache entry to delete. A cache
directory that cannot be written is a :class:`CacheDirError`, so the CLI can blame ``--cache-dir``.

FP8 checkpoints (``quantization_config``, ``runner/models/quantization/``) load with their weights kept in FP8;
``quantization='fp8'`` quantises an unquantised checkpoint while it is read.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.overrides import TorchFunctionMode

from runner.config import ConfigError
from runner.models.base import MoECausalLM
from runner.models.configs import BaseMoEConfig
from runner.models.dummy_weights import dummy_weights
from runner.models.quantization.convert import Fp8Plan, apply_fp8, plan_from_checkpoint, plan_online, quantize_online
from runner.models.quantization.dense_fp8_gemm import select_dense_fp8_gemm
from runner.models.quantization.scheme import FP8_METHOD, Fp8Scheme, check_quantization_arg
from runner.models.registry import architecture_of, get_model_class, parse_config, supported_architectures
from runner.models.weights import FUSED_RE, canonical_name, expand_fused
from ubatch.modular_moe.config import MoEParallelConfig

logger = logging.getLogger("ubatch.models")

TINY_MODELS: dict[str, dict[str, Any]] = {
    "tiny-qwen3-moe": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": None, "eos_token_id": None,
        "torch_dtype": "float32",
    },
    "tiny-deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "rope_interleave": True, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "hidden_act": "silu", "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32",
        "num_nextn_predict_layers": 0,
    },
}
TINY_MODELS.update({
    "tiny-gpt-oss": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"] * 2, "attention_bias": True, "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128},
        "hidden_act": "silu", "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32",
    },
    "tiny-glm4-moe": {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4,
        "topk_group": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "attention_bias": True, "use_qk_norm": True, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": None,
        "eos_token_id": None, "torch_dtype": "float32", "num_nextn_predict_layers": 0,
    },
})
# Benchmark models, built the same way (seeded random weights, written to the cache on first use), so that the
# CLI and the server load them by name: a 120M-parameter Qwen3-MoE for the CPU benchmarks (docs/benchmarks.md,
# "The engine's DBO") and a 1.2B one with Qwen3-30B-A3B-like layers for the GPU ones.
BENCH_MODELS: dict[str, dict[str, Any]] = {
    "bench-qwen3-moe-120m": {
        **TINY_MODELS["tiny-qwen3-moe"], "vocab_size": 4096, "hidden_size": 1024, "intermediate_size": 2048,
        "moe_intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 4,
        "head_dim": 64, "num_experts": 16, "num_experts_per_tok": 4},
    "bench-qwen3-moe-1b": {
        **TINY_MODELS["tiny-qwen3-moe"], "vocab_size": 8192, "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "num_experts": 64, "num_experts_per_tok": 8},
}
TINY_MODELS.update(BENCH_MODELS)
TINY_SEED = 1234
# config.json fields without which the model is undefined (the dataclass defaults are only for tests' configs).
REQUIRED_CONFIG_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}


class CheckpointError(ValueError):
    """A model file that cannot be used; the message is ``<file>: <problem>``."""

    def __init__(self, path: str | os.PathLike, problem: str) -> None:
        self.path = Path(path)
        super().__init__(f"{path}: {problem}")


class CacheDirError(OSError):
    """The cache directory for built-in models cannot be created or written."""


def _cache_hint(model_dir: Path) -> str:
    """For a cached built-in model, how to get a fresh copy; empty otherwise."""
    if model_dir.name in TINY_MODELS and model_dir.parent.name == "models":
        return (f"; this is the cached built-in model {model_dir.name!r}: delete {str(model_dir)!r} and it will be "
                "written again")
    return ""


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("UBATCH_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "ubatch"


def _tiny_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Seeded init with O(1) activations (norm weights near 1, fan-in-scaled matrices) so greedy decoding is
    not a sea of near-ties; on ``gen``'s device (benchmarks write large built-in models from a GPU)."""
    x = torch.randn(shape, generator=gen, device=gen.device, dtype=dtype)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * x
    if name.endswith("e_score_correction_bias"):
        return 0.05 * x
    if name.endswith("embed_tokens.weight"):
        return x
    return x / (shape[-1] ** 0.5)


def _write_tiny(name: str, final: Path) -> None:
    config = TINY_MODELS[name]
    cfg = parse_config(config)
    model = get_model_class(config["architectures"][0])(cfg, None, torch.float32)
    gen = torch.Generator().manual_seed(TINY_SEED)
    tensors = {n: _tiny_tensor(n, s, gen).contiguous() for n, s in sorted(model.weight_spec().all_names())}
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=final.parent))
    except OSError as e:
        raise CacheDirError(f"cannot create {str(final.parent)!r} to write the built-in model {name!r}: "
                            f"{e.strerror or e}") from None
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        try:
            os.rename(tmp, final)  # atomic; fails if another process won the race
        except OSError:
            if not (final / "config.json").exists():
                raise
    except OSError as e:
        raise CacheDirError(f"cannot write the built-in model {name!r} into {str(final.parent)!r}: "
                            f"{e.strerror or e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_model_path(model: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """A local directory as is; a built-in name -> its cache directory (created on first use)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {str(path)!r} has no config.json")
        return path
    if model in TINY_MODELS:
        final = cache_root(cache_dir) / "models" / model
        if not (final / "config.json").is_file():
            _write_tiny(model, final)
        return final
    raise FileNotFoundError(
        f"model {model!r} is neither a local directory nor a built-in model ({', '.join(sorted(TINY_MODELS))}); "
        "downloads are not supported: fetch the checkpoint yourself and pass its directory")


def load_config(path: Path) -> BaseMoEConfig:
    """Parse ``path/config.json``; every problem is a :class:`CheckpointError` naming the file."""
    file = path / "config.json"
    try:
        d = json.loads(file.read_text())
    except OSError as e:
        raise CheckpointError(file, f"cannot read it: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(file, f"not UTF-8 text (byte {e.start}){_cache_hint(path)}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(file, f"not valid JSON ({e.msg} at line {e.lineno}){_cache_hint(path)}") from None
    if not isinstance(d, dict):
        raise CheckpointError(file, f"must hold a JSON object with the model's settings, got "
                                    f"{_JSON_TYPES.get(type(d), type(d).__name__)}")
    try:
        arch = architecture_of(d)  # first: an unknown architecture explains any other mismatch
        if arch not in supported_architectures():
            raise ValueError(f"unknown model architecture {arch!r}; supported: {', '.join(supported_architectures())}")
        for key in REQUIRED_CONFIG_FIELDS:
            value = d.get(key)
            if key not in d:
                raise ValueError(f"no {key!r} field (a {arch} config needs {', '.join(REQUIRED_CONFIG_FIELDS)})")
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key!r} must be a positive integer, got {value!r}")
        return parse_config(d)
    except KeyError as e:
        raise CheckpointError(file, f"missing field {e.args[0]!r}") from None
    except (ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(file, str(e)) from None


def model_config(model: str, cache_dir: str | os.PathLike | None = None) -> BaseMoEConfig:
    """The parsed config of a local directory or built-in model, without reading any weight."""
    return load_config(resolve_model_path(model, cache_dir))


def check_max_model_len(max_model_len: int | None, config: BaseMoEConfig) -> None:
    """A ``max_model_len`` above the model's ``max_position_embeddings`` is rejected: positions past what the
    model was trained on give garbage silently (vLLM rejects it too)."""
    limit = config.max_position_embeddings
    if max_model_len is not None and max_model_len > limit:
        raise ConfigError("max_model_len", f"max_model_len {max_model_len} is above the model's "
                                           f"max_position_embeddings ({limit}); use at most {limit}")
    if max_model_len is not None:
        try:
            config.check_context_length(max_model_len)  # e.g. a sliding window shorter than the context
        except ValueError as e:
            raise ConfigError("max_model_len", str(e)) from None


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [path / f for f in sorted(set(weight_map.values()))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(index, f"not a valid safetensors index ({type(e).__name__}: {e}); it must map "
                                         "'weight_map' names to file names") from None
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{index.name} lists {f.name}, which is missing from {str(path)!r}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {str(path)!r}")
    return files


@contextlib.contextmanager
def open_checkpoint_file(file: Path) -> Iterator[Any]:
    """``safe_open`` whose errors (corrupt header, truncated file, bad tensor) name the file."""
    try:
        with safe_open(str(file), framework="pt", device="cpu") as fh:
            yield fh
    except SafetensorError as e:
        raise CheckpointError(file, f"corrupt or truncated safetensors file ({e}){_cache_hint(file.parent)}") \
            from None


def check_checkpoint_files(path: Path) -> list[Path]:
    """Open every checkpoint file's header (cheap: nothing is read past it); raise on a corrupt one."""
    files = checkpoint_files(path)
    for file in files:
        with open_checkpoint_file(file) as fh:
            fh.keys()
    return files


def _read_rows(sl: Any, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of a safetensors slice (read lazily: only those rows leave the file)."""
    return sl[start:stop]


def iter_checkpoint(path: Path, model: MoECausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor this rank keeps, read lazily."""
    spec = model.weight_spec()
    for file in checkpoint_files(path):
        with open_checkpoint_file(file) as fh:
            for key in fh.keys():  # noqa: SIM118  (safe_open handles are not iterable)
                if FUSED_RE.match(canonical_name(spec, key)):
                    sl = fh.get_slice(key)
                    yield from expand_fused(spec, canonical_name(spec, key), tuple(sl.get_shape()),
                                            functools.partial(_read_rows, sl))
                elif model.wants_weight(key):
                    yield key, fh.get_tensor(key)


def auto_dtype(checkpoint_dtype: torch.dtype | None, device: torch.device | str) -> torch.dtype:
    """``--dtype auto``: the checkpoint's ``torch_dtype`` (float32 when it names none), except that a float32
    checkpoint runs in bfloat16 on a GPU, as vLLM's ``auto`` serves it in 16 bits there: the GPU kernels
    (``grouped_mm`` experts, flash attention) are 16-bit ones, and fp32 doubles the bytes every step reads."""
    dtype = checkpoint_dtype or torch.float32
    if torch.device(device).type == "cuda" and dtype == torch.float32:
        return torch.bfloat16
    return dtype


def checkpoint_tensor_names(path: Path) -> list[str]:
    """Every tensor name in the checkpoint (headers only: no tensor is read)."""
    names: list[str] = []
    for file in checkpoint_files(path):
        with open_checkpoint_file(file) as fh:
            names.extend(fh.keys())
    return names


def fp8_scheme(config: BaseMoEConfig, quantization: str | None, path: Path) -> Fp8Scheme | None:
    """The FP8 scheme the model runs with: the checkpoint's own, or block-wise online quantisation for
    ``quantization='fp8'`` on an unquantised checkpoint (vLLM's ``--quantization fp8``); logged either way."""
    check_quantization_arg(quantization)
    scheme = config.quantization
    if scheme is not None:
        logger.info("%s: %s as the checkpoint holds them%s", path, scheme.describe(),
                    " (--quantization fp8 has nothing to do)" if quantization == FP8_METHOD else "")
        return scheme
    if quantization == FP8_METHOD:
        scheme = Fp8Scheme(online=True)
        logger.info("%s: quantising the unquantised checkpoint online to %s (--quantization fp8)", path,
                    scheme.describe())
        return scheme
    return None


def load_model(model: str, parallel: MoEParallelConfig | None = None, dtype: torch.dtype | None = None,
               cache_dir: str | os.PathLike | None = None, device: torch.device | str = "cpu",
               quantization: str | None = None, deep_gemm_module: ModuleType | None = None,
               load_format: str = "auto", seed: int = 0) -> tuple[MoECausalLM, BaseMoEConfig]:
    """Build the model for ``config.json``'s architecture and load this rank's weights.

    ``dtype`` defaults to :func:`auto_dtype` of the config's ``torch_dtype``/``dtype`` on ``device``; it is the
    compute dtype, and that of every weight an FP8 checkpoint does not quantise. ``quantization``: ``None`` or
    ``'fp8'`` (:func:`fp8_scheme`). ``deep_gemm_module``: a module with DeepGEMM's API for the dense FP8 linears
    instead of the real package (the tests' CPU stand-in; :func:`select_dense_fp8_gemm`). ``load_format``
    ``'dummy'``: random weights (``runner/models/dummy_weights.py``, drawn from ``seed``), no file but
    ``config.json`` read.
    """
    path = resolve_model_path(model, cache_dir)
    config = load_config(path)
    scheme = fp8_scheme(config, quantization, path)
    dummy = load_format == "dummy"
    if dummy and scheme is not None and not scheme.online:
        raise CheckpointError(path / "config.json", "load_format='dummy' draws the weights of an unquantised model, "
                              "but this config declares an FP8 checkpoint (quantization_config), whose weights and "
                              "scales come from its files; to benchmark FP8 weights, drop quantization_config and "
                              "pass quantization='fp8'")
    dtype = dtype or auto_dtype(config.dtype, device)
    cls = get_model_class(config.architectures[0])
    with torch.device("meta"), skip_weight_init():  # every parameter is overwritten by the checkpoint
        net = cls(config, parallel, dtype)
    try:
        plan: Fp8Plan | None = None
        if scheme is not None:
            plan = plan_online(net, scheme) if scheme.online else plan_from_checkpoint(
                net, scheme, checkpoint_tensor_names(path))
            apply_fp8(net, plan, select_dense_fp8_gemm(torch.device(device), deep_gemm_module))
        check_spec_covers_parameters(net)
        net.to_empty(device=device)
        weights = dummy_weights(net, dtype, device, seed) if dummy else iter_checkpoint(path, net)
        if plan is not None and plan.scheme.online:
            weights = quantize_online(weights, net, plan)
        net.load_weights(weights)
    except CheckpointError:
        raise
    except ValueError as e:  # weights.py: a missing, unexpected or mis-shaped tensor
        if dummy:
            raise CheckpointError(path, f"{e} (random weights: load_format='dummy')") from None
        files = ", ".join(f.name for f in checkpoint_files(path))
        raise CheckpointError(path, f"{e} (checkpoint files: {files}){_cache_hint(path)}") from None
    return net.eval(), config


class _SkipInit(TorchFunctionMode):
    """A torch-function mode under which ``torch.nn.init``'s initialisers leave tensors as they are."""

    # nn.init functions that dispatch through torch functions themselves, and the in-place fills every other one
    # of them ends in (zeros_ -> zero_, ones_ -> fill_, xavier_*/kaiming_normal_/trunc_normal_ -> uniform_/normal_)
    SKIPPED = frozenset({nn.init.uniform_, nn.init.normal_, nn.init.constant_, nn.init.kaiming_uniform_,
                         torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.fill_, torch.Tensor.zero_})

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if func in self.SKIPPED:
            return args[0] if args else (kwargs or {})["tensor"]  # the tensor being initialised
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def skip_weight_init() -> Iterator[None]:
    """``torch.nn.init`` functions do nothing inside the block (transformers' ``no_init_weights`` idea).

    Building on the meta device already allocates nothing, but ``nn.Linear``/``nn.Embedding`` still run
    their random init there, and on meta tensors that goes through torch's reference ops, whose first use
    imports TorchDynamo: seconds of start-up for values the checkpoint overwrites anyway.

    It is a torch-function mode, not a patch of ``torch.nn.init``: modes are per thread, so rank threads that
    load at once skip only their own inits, and a thread that builds a model meanwhile, outside any block, still
    gets its random init. Inside the block the in-place fills (``fill_``, ``zero_``, ``uniform_``, ``normal_``)
    are skipped too, as the initialisers are made of them.
    """
    with _SkipInit():
        yield


def check_spec_covers_parameters(net: MoECausalLM) -> None:
    """Every parameter must be written by the loader, since the model is built without initial values.

    The loader fills the names of the model's ``WeightSpec`` (after its renames) and the experts' fused
    tensors of its MoE layers, and already fails on a checkpoint that lacks one of those; a parameter that is
    in neither set would stay uninitialised memory, so it is a bug in the model's spec.
    """
    spec = net.weight_spec()
    filled = {spec.rename.get(n, n) for n in spec.shapes}
    moe_ids = {id(m) for m in spec.moe_layers.values()}
    for prefix, module in net.named_modules():
        if id(module) in moe_ids:  # the expert loads fill the fused expert tensors (and biases), nothing else
            filled |= {f"{prefix}.w13_weight", f"{prefix}.w2_weight"}
            if spec.expert_scale is not None:
                filled |= {f"{prefix}.w13_weight_scale_inv", f"{prefix}.w2_weight_scale_inv"}
            if spec.expert_bias:
                filled |= {f"{prefix}.w13_bias", f"{prefix}.w2_bias"}
    missing = [n for n, _ in net.named_parameters() if n not in filled]
    if missing:
        raise RuntimeError(f"internal: {type(net).__name__} has parameters its checkpoint spec never loads: "
                           f"{missing[:5]}")
