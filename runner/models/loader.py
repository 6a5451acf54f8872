"""Load a model from a local HF-format directory or a built-in tiny model; never touches the network.

Checkpoints are read lazily with ``safe_open``: a tensor is materialised only if this rank keeps it, and a
fused expert tensor is sliced to this rank's expert rows before it is read, so an EP rank's memory holds only
its own experts. Built-in tiny models (seeded random weights) are written once, atomically, to
``<root>/models/<name>`` where ``root`` is ``cache_dir`` if given, else ``$UBATCH_CACHE_DIR``, else
``~/.cache/ubatch``; concurrent ranks racing to create one end up reading the same files.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from runner.models.configs import BaseMoEConfig
from runner.models.registry import get_model_class, parse_config
from runner.models.weights import FUSED_RE, expand_fused
from ubatch.modular_moe.config import MoEParallelConfig

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
TINY_SEED = 1234


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("UBATCH_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "ubatch"


def _tiny_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Seeded init with O(1) activations (norm weights near 1, fan-in-scaled matrices) so greedy decoding is
    not a sea of near-ties."""
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("e_score_correction_bias"):
        return 0.05 * torch.randn(shape, generator=gen)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) / (shape[-1] ** 0.5)


def _write_tiny(name: str, final: Path) -> None:
    config = TINY_MODELS[name]
    cfg = parse_config(config)
    model = get_model_class(config["architectures"][0])(cfg, None, torch.float32)
    gen = torch.Generator().manual_seed(TINY_SEED)
    tensors = {n: _tiny_tensor(n, s, gen).contiguous() for n, s in sorted(model.weight_spec().all_names())}
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=final.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        try:
            os.rename(tmp, final)  # atomic; fails if another process won the race
        except OSError:
            if not (final / "config.json").exists():
                raise
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


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{index.name} lists {f.name}, which is missing from {str(path)!r}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {str(path)!r}")
    return files


def iter_checkpoint(path: Path, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor this rank keeps, read lazily."""
    spec = model.weight_spec()
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as fh:
            for key in fh.keys():
                if FUSED_RE.match(key):
                    sl = fh.get_slice(key)
                    yield from expand_fused(spec, key, tuple(sl.get_shape()), lambda a, b, sl=sl: sl[a:b])
                elif model.wants_weight(key):
                    yield key, fh.get_tensor(key)


def load_model(model: str, parallel: MoEParallelConfig | None = None, dtype: torch.dtype | None = None,
               cache_dir: str | os.PathLike | None = None,
               device: torch.device | str = "cpu") -> tuple[nn.Module, BaseMoEConfig]:
    """Build the model for ``config.json``'s architecture and load this rank's weights.

    ``dtype`` defaults to the config's ``torch_dtype``/``dtype``, else float32.
    """
    path = resolve_model_path(model, cache_dir)
    config = parse_config(json.loads((path / "config.json").read_text()))
    dtype = dtype or config.dtype or torch.float32
    cls = get_model_class(config.architectures[0])
    with torch.device("meta"), skip_weight_init():  # every parameter is overwritten by the checkpoint
        net = cls(config, parallel, dtype)
    check_spec_covers_parameters(net)
    net.to_empty(device=device)
    net.load_weights(iter_checkpoint(path, net))
    return net.eval(), config


_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                   "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                   "sparse_")


@contextlib.contextmanager
def skip_weight_init() -> Iterator[None]:
    """``torch.nn.init`` functions do nothing inside the block (transformers' ``no_init_weights`` idea).

    Building on the meta device already allocates nothing, but ``nn.Linear``/``nn.Embedding`` still run
    their random init there, and on meta tensors that goes through torch's reference ops, whose first use
    imports TorchDynamo: seconds of start-up for values the checkpoint overwrites anyway.
    """
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS if hasattr(nn.init, name)}
    for name in saved:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def check_spec_covers_parameters(net: nn.Module) -> None:
    """Every parameter must be written by the loader, since the model is built without initial values.

    The loader fills the names of the model's ``WeightSpec`` (after its renames) and the experts' fused
    tensors of its MoE layers, and already fails on a checkpoint that lacks one of those; a parameter that is
    in neither set would stay uninitialised memory, so it is a bug in the model's spec.
    """
    spec = net.weight_spec()
    filled = {spec.rename.get(n, n) for n in spec.shapes}
    moe_ids = {id(m) for m in spec.moe_layers.values()}
    for prefix, module in net.named_modules():
        if id(module) in moe_ids:  # the expert loads fill the fused expert tensors, nothing else
            filled |= {f"{prefix}.w13_weight", f"{prefix}.w2_weight"}
    missing = [n for n, _ in net.named_parameters() if n not in filled]
    if missing:
        raise RuntimeError(f"internal: {type(net).__name__} has parameters its checkpoint spec never loads: "
                           f"{missing[:5]}")


def load_tokenizer(model: str, cache_dir: str | os.PathLike | None = None) -> Any:
    """A ``tokenizers.Tokenizer`` if the model directory has ``tokenizer.json``, else None."""
    path = resolve_model_path(model, cache_dir)
    if not (path / "tokenizer.json").is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(f"{path / 'tokenizer.json'} needs the 'tokenizers' package (pip install tokenizers)") from e
    return Tokenizer.from_file(str(path / "tokenizer.json"))
