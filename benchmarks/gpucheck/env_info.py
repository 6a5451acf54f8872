"""The machine's GPU environment as one JSON object (``python -m gpucheck.env_info --out PATH``).

Run in a subprocess of its own: importing ``deep_ep``/``deep_gemm`` loads CUDA extensions that can abort the
process, and the check must outlive that. Every probe records its error instead of raising.
"""
from __future__ import annotations

import importlib
import json
import platform
import subprocess
import sys
from typing import Any


def probe_import(name: str, attrs: tuple[str, ...] = ()) -> dict[str, Any]:
    """Whether ``name`` imports; its version and which of ``attrs`` it has."""
    try:
        mod = importlib.import_module(name)
    except BaseException as exc:  # noqa: BLE001 - a broken extension raises anything, SystemExit included
        return {"imports": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    out: dict[str, Any] = {"imports": True, "version": str(getattr(mod, "__version__", "unknown"))}
    if attrs:
        out["has"] = {a: hasattr(mod, a) for a in attrs}
    return out


def nvidia_smi() -> dict[str, Any]:
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[:300]}"}
    rows = [[c.strip() for c in line.split(",")] for line in proc.stdout.strip().splitlines()]
    return {"gpus": [{"name": r[0], "driver": r[1], "memory": r[2]} for r in rows if len(r) == 3]}


def collect() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(),
                            "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                            "cuda_available": torch.cuda.is_available(), "nvidia_smi": nvidia_smi()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_count=torch.cuda.device_count(),
                    capability=f"{props.major}.{props.minor}", gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    multiprocessors=props.multi_processor_count)
    gpus = info["nvidia_smi"].get("gpus") or []
    info["driver"] = gpus[0]["driver"] if gpus else None
    for name in ("triton", "transformers", "greenlet", "numpy", "safetensors"):
        info[name] = probe_import(name)
    info["server_stack"] = {name: probe_import(name) for name in ("fastapi", "uvicorn", "zmq", "msgspec", "openai")}
    info["deep_ep"] = probe_import("deep_ep", ("Buffer", "ElasticBuffer"))
    info["deep_gemm"] = probe_import("deep_gemm")
    return info


def main() -> int:
    import argparse
    from pathlib import Path

    from common import write_json

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="where the JSON goes (it is printed too)")
    doc = collect()
    write_json(doc, p.parse_args().out)
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
