"""``make gpu-check`` / ``python benchmarks/gpu_check.py``: arguments, the no-GPU exit, and the run.

Exit status: 2 without a CUDA GPU (nothing is written; the message says why); 1 when a part failed, timed
out or was skipped (the report still holds everything else); 0 when every part finished -- its goals may
still be MISS, which the report states: a MISS is a finding, not a failure of the check.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from gpucheck.goals import evaluate
from gpucheck.parts import SERVE_SECONDS, all_parts
from gpucheck.schedule import Context, run_parts, write_outputs

REPO = Path(__file__).resolve().parents[2]
TIME_LIMIT_S = 420  # 7 minutes: a lent GPU gives 10 minutes a command and 15 in all, machine start included
DEFAULT_OUT = "build/gpu-check"
DEFAULT_CACHE = Path(tempfile.gettempdir()) / "ubatch-gpu-check-cache"


def gpu_problem() -> str | None:
    """Why this machine cannot run the check, or None."""
    import torch

    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is not a CUDA build"
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return ("torch.cuda.is_available() is False: no NVIDIA GPU or driver is visible"
                + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""))
    return None


def commit(repo: Path) -> str | None:
    if os.environ.get("GPU_CHECK_COMMIT"):
        return os.environ["GPU_CHECK_COMMIT"]
    try:
        proc = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    names = [p.name for p in all_parts()]
    default = [p.name for p in all_parts() if not p.optional]
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("GPU_CHECK_OUT") or DEFAULT_OUT),
                   help=f"report directory (default: $GPU_CHECK_OUT or {DEFAULT_OUT})")
    p.add_argument("--time-limit-s", type=float, default=TIME_LIMIT_S,
                   help=f"the whole check's deadline; parts left when it passes are skipped (default {TIME_LIMIT_S})")
    p.add_argument("--parts", nargs="+", choices=names, default=default,
                   help="run only these parts, in check order (default: all but the optional "
                        f"{', '.join(sorted(set(names) - set(default)))})")
    p.add_argument("--tests", choices=["gpu", "full"], default="gpu",
                   help="gpu: the GPU-sensitive files and cuda-marked tests; full: what make test runs")
    p.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("GPU_CHECK_CACHE") or DEFAULT_CACHE),
                   help=f"where the 1.2B model's checkpoint is written (default: $GPU_CHECK_CACHE or {DEFAULT_CACHE})")
    p.add_argument("--serve-seconds", type=int, default=SERVE_SECONDS)
    args = p.parse_args(argv)
    if args.time_limit_s <= 0:
        p.error(f"argument --time-limit-s: must be > 0, got {args.time_limit_s}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    problem = gpu_problem()
    if problem is not None:
        print(f"gpu-check: needs one NVIDIA GPU with CUDA, and {problem}. It runs the GPU tests and times the "
              "kernels, the decode step and the engine on that GPU; a CPU run would prove none of it. "
              "Nothing was written.", file=sys.stderr)
        return 2
    start = time.monotonic()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "log.txt"
    log.write_text("")
    work = Path(tempfile.mkdtemp(prefix="gpu-check-work-"))
    chosen = [p for p in all_parts() if p.name in args.parts]
    ctx = Context(repo=REPO, out_dir=out, work_dir=work, log_path=log, cache_dir=args.cache_dir.resolve(),
                  python=sys.executable, options={"tests": args.tests, "serve_seconds": args.serve_seconds})
    results = {"started": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit(REPO),
               "time_limit_s": args.time_limit_s, "command": " ".join(["gpu_check.py", *(argv or sys.argv[1:])]),
               "work_dir": str(work), "parts": {}, "goals": evaluate({})}
    write_outputs(results, out)
    run_parts(chosen, ctx, results, deadline=start + args.time_limit_s, save=lambda r: write_outputs(r, out))
    results["elapsed_s"] = round(time.monotonic() - start, 1)
    write_outputs(results, out)
    print("\n".join(f"{g['verdict']}  {g['goal']}: {g['measured']}" for g in results["goals"]))
    print(f"gpu-check: report {out / 'report.md'}, figures {out / 'results.json'}, output {log}")
    return 0 if all(p["status"] in ("ok", "not available") for p in results["parts"].values()) else 1
