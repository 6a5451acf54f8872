"""Write the 1.2B benchmark model's checkpoint once (``python -m gpucheck.model_prep --cache-dir DIR``).

``bench-qwen3-moe-1b`` (``runner.models.loader.BENCH_MODELS``) is a built-in model: seeded random weights,
written as a checkpoint directory on first use. The engine's own writer (``runner.models.loader``) builds the model in
float32 on the CPU and draws 1.3 billion values there: minutes on a small machine. The check writes it
here instead, once, with the same init rule (``_tiny_tensor``) drawn on the GPU in bfloat16 (the dtype every
GPU run uses), into ``DIR/models/bench-qwen3-moe-1b``, where the engine finds a built-in model; the kernel
benchmark, the engine runs and the server then all read that directory. The values differ from the CPU
writer's (another generator), the distribution does not.

Writes (``--out``) and prints one JSON object: the directory, its size, and whether it was already there.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

SEED = 1234


def write_checkpoint(name: str, final: Path, device: str, dtype: torch.dtype) -> None:
    """The built-in model ``name``'s weights drawn on ``device`` in ``dtype``, written atomically to ``final``."""
    from safetensors.torch import save_file

    from runner.models.loader import TINY_MODELS, _tiny_tensor, skip_weight_init
    from runner.models.registry import get_model_class, parse_config

    config = {**TINY_MODELS[name], "torch_dtype": str(dtype).removeprefix("torch.")}
    with skip_weight_init(), torch.device("meta"):  # only the names and shapes are needed
        model = get_model_class(config["architectures"][0])(parse_config(config), None, dtype)
    gen = torch.Generator(device=device).manual_seed(SEED)
    tensors = {n: _tiny_tensor(n, s, gen, dtype).cpu().contiguous() for n, s in sorted(model.weight_spec().all_names())}
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=final.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache-dir", required=True, type=Path)
    p.add_argument("--model", default=None, help="a built-in model name (default: the 1.2B benchmark model)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="where the weights are drawn: cuda (bfloat16) or cpu (float32, exactly the engine's own "
                        "writer); auto: cuda when available")
    p.add_argument("--out", type=Path, required=True, help="where the JSON goes (it is printed too)")
    args = p.parse_args()
    from bench_gpu import MODEL
    from common import write_json
    from runner.models.loader import cache_root

    name = args.model or MODEL
    final = cache_root(args.cache_dir) / "models" / name
    existed = (final / "config.json").is_file()
    t0 = time.perf_counter()
    if not existed:
        cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        write_checkpoint(name, final, "cuda" if cuda else "cpu", torch.bfloat16 if cuda else torch.float32)
    size = sum(f.stat().st_size for f in final.iterdir() if f.is_file())
    doc = {"model": name, "path": str(final), "bytes": size, "existed": existed,
           "seconds": round(time.perf_counter() - t0, 1)}
    write_json(doc, args.out)
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
