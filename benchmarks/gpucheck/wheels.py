"""``make gpu-wheels``: download into ``.whl/`` the cp312 wheels a lent GPU machine lacks.

The GPU machines run Python 3.12 with torch, Triton, numpy, transformers, pytest, hypothesis, httpx, jinja2 and
prometheus-client installed, and reach no package index. What this project needs beyond that: ``greenlet``
(``setup.cfg``'s install_requires) and the server's stack (``python -m runner serve`` / ``bench-serve``:
FastAPI, uvicorn with httptools as the serve extra installs it, pyzmq, msgspec, the OpenAI client, and aiohttp,
bench-serve's streaming client). ``TOP`` pins them at the versions the project is
tested with; pip resolves their dependencies for CPython 3.12 on manylinux x86-64, so the folder holds the
whole closure, one version of each. Wheels of packages the image already has (anyio, click, ...) come along
at the versions these pins need; nothing that would shadow the image's torch, CUDA or numpy may.

On the GPU machine: ``python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade
--target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD`` (docs/gpu_check.md).
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TOP = ("greenlet==3.5.6", "fastapi==0.165.0", "uvicorn==0.54.0", "pyzmq==27.3.0", "msgspec==0.22.0",
       "openai==3.57.0", "aiohttp==3.14.5", "httptools==0.9.0", "nvidia-ml-py==13.615.71")
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_26_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux1_x86_64", "any")
NEVER = re.compile(r"^(torch|triton|numpy|nvidia[-_](?!ml[-_]py$).*|cuda[-_].*)$")  # the GPU image's own stack
MAX_BYTES = 32 * 2**20  # the device tool carries 64 MiB in all, the working tree included


def wheel_name(filename: str) -> str:
    """The distribution name of a wheel file, normalised (``pydantic_core-2.50.5-...whl`` -> ``pydantic-core``)."""
    return re.sub(r"[-_.]+", "-", filename.split("-", 1)[0]).lower()


def check(files: list[Path]) -> list[str]:
    """Problems with a downloaded set: a package in it twice, or one of the GPU image's own."""
    problems: list[str] = []
    seen: dict[str, str] = {}
    for f in files:
        name = wheel_name(f.name)
        if name in seen:
            problems.append(f"{name} twice: {seen[name]} and {f.name}")
        seen[name] = f.name
        if NEVER.match(name):
            problems.append(f"{f.name} would shadow the GPU image's own {name}")
    total = sum(f.stat().st_size for f in files)
    if total > MAX_BYTES:
        problems.append(f"{total / 2**20:.1f} MiB of wheels, over the {MAX_BYTES // 2**20} MiB this folder may use")
    return problems


def download(dest: Path) -> list[Path]:
    """Download ``TOP`` and its dependencies into a fresh folder, then replace ``dest`` with it."""
    tmp = Path(tempfile.mkdtemp(prefix="gpu-wheels-"))
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none",
           *(a for p in PLATFORMS for a in ("--platform", p)), "-d", str(tmp), *TOP]
    try:
        subprocess.run(cmd, check=True)
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sorted(dest.glob("*.whl"))


def main() -> int:
    dest = Path(__file__).resolve().parents[2] / ".whl"
    files = download(dest)
    for f in files:
        print(f"{f.stat().st_size / 2**20:6.2f} MiB  {f.name}")
    print(f"{len(files)} wheels, {sum(f.stat().st_size for f in files) / 2**20:.1f} MiB in {dest}")
    problems = check(files)
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
