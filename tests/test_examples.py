"""The examples run as a user would run them (subprocesses from the repository root) and print what they promise."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, str(ROOT / "examples" / name)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_wrap_your_model() -> None:
    proc = run_example("wrap_your_model.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "outputs match" in proc.stdout
    yields = re.findall(r"yields per ubatch = \[(\d+), (\d+)\]", proc.stdout)
    assert len(yields) == 2 and all(a == b and int(a) > 0 for a, b in yields), proc.stdout


def test_offline_generate_over_two_dp_ranks() -> None:
    proc = run_example("offline_generate.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
    assert [ln.split("]")[0] for ln in lines] == [f"[{i}" for i in range(6)]  # every prompt, in input order
    m = re.search(r"ubatched steps: (\d+)/(\d+) \(DBO\)", proc.stdout)
    assert m and int(m.group(1)) > 0, proc.stdout
