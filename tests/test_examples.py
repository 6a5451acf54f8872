"""The examples run as a user would run them (subprocesses from the repository root) and print what they promise."""
from __future__ import annotations

import hashlib
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from devices import device_args

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str, **extra_env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           **extra_env}
    return subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def _digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def test_trace_dbo_step_writes_outside_the_repository_by_default(tmp_path: Path) -> None:
    tracked = [ROOT / "docs" / "dbo_timeline.png", ROOT / "docs" / "dbo_trace.json"]
    before = [_digest(p) for p in tracked]
    proc = run_example("trace_dbo_step.py", TMPDIR=str(tmp_path))  # the default: a new temporary directory
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [_digest(p) for p in tracked] == before  # docs/ untouched
    trace_line = re.search(r"rank-0 Chrome trace: (\S+)", proc.stdout)
    png_line = re.search(r"timeline: (\S+)", proc.stdout)
    assert trace_line is not None and png_line is not None, proc.stdout
    trace, png = Path(trace_line.group(1)), Path(png_line.group(1))
    assert trace.parent == png.parent and trace.parent.parent == tmp_path, proc.stdout
    assert trace.stat().st_size > 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert re.search(r"layer\s+compute_ms\s+comm_ms\s+hidden_ms", proc.stdout), proc.stdout
    out = tmp_path / "chosen"
    proc = run_example("trace_dbo_step.py", "--out-dir", str(out), "--steps", "1", "--warmup", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["dbo_timeline.png", "dbo_trace.json"]


def test_wrap_your_model() -> None:
    proc = run_example("wrap_your_model.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "outputs match" in proc.stdout
    yields = re.findall(r"yields per ubatch = \[(\d+), (\d+)\]", proc.stdout)
    assert len(yields) == 2 and all(a == b and int(a) > 0 for a, b in yields), proc.stdout


def test_offline_generate_over_two_dp_ranks() -> None:
    proc = run_example("offline_generate.py", *device_args(2))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
    assert [ln.split("]")[0] for ln in lines] == [f"[{i}" for i in range(6)]  # every prompt, in input order
    m = re.search(r"ubatched steps: (\d+)/(\d+) \(DBO\)", proc.stdout)
    assert m and int(m.group(1)) > 0, proc.stdout


def test_wrap_transformers_model() -> None:
    proc = run_example("wrap_transformers_model.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "logits match the unpatched model" in proc.stdout
    diffs = [float(d) for d in re.findall(r"max \|logits - unpatched\| = ([0-9.e+-]+)", proc.stdout)]
    assert len(diffs) == 6 and max(diffs) <= 1e-5, proc.stdout  # 1 rank and 2 EP ranks, DBO off and on
    yields = re.findall(r"yields per ubatch = \[(\d+), (\d+)\]", proc.stdout)
    assert len(yields) == 3 and all(a == b and int(a) > 0 for a, b in yields), proc.stdout


def readme_python_api_block() -> str:
    """The first ```python block under README's "### Python API" heading."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Python API"):]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block is not None, "README's Python API section has no python block"
    return block.group(1)


def test_readme_python_api_is_vllm_code_that_runs(tmp_path: Path, tiny_chat_checkpoint) -> None:
    """README's Python API block, run as it stands: vLLM's calls (only the import differs), with
    ``Qwen/Qwen3-30B-A3B`` a local directory, here the tiny transformers-written checkpoint under that name."""
    code = readme_python_api_block()
    assert "from runner import LLM, SamplingParams" in code
    assert "outs = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32))" in code
    assert "out.outputs[0].text" in code
    (tmp_path / "Qwen").mkdir()
    (tmp_path / "Qwen" / "Qwen3-30B-A3B").symlink_to(tiny_chat_checkpoint.path, target_is_directory=True)
    (tmp_path / "readme_api.py").write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "readme_api.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("Hello, my name is -> ") and lines[1].startswith("The capital of France is -> ")
    assert all(ln.rsplit(" ", 1)[1] in ("length", "stop") for ln in lines[:2])
    assert lines[2].startswith("[1, ")  # the chat template's first token, <|im_start|>, then the rest


@pytest.mark.slow
def test_readme_torchrun_example_ubatches() -> None:
    """README's single-node torchrun line, run as written (plus this host's test device): every step ubatched."""
    text = (ROOT / "README.md").read_text()
    m = re.search(r"^torchrun --nproc-per-node 2 (-m runner generate .*?)(?<!\\)$", text, re.S | re.M)
    assert m is not None, "README has no single-node torchrun line"
    args = shlex.split(m.group(1).replace("\\\n", " "))
    assert "--enable-dbo" in args
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "2",
                           "--master-port", str(_free_port()), *args, *device_args(2)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ubatched steps: 16/16 (DBO)" in proc.stdout, proc.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
