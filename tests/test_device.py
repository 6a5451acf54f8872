"""``--device auto|cuda|cpu`` on a machine without a GPU, with CUDA *reported* present where the choice matters.

The decision (``runner/distributed/device.py``, the launcher's backend and GPU check, the config's validation) is tested
directly with ``torch.cuda.is_available``/``device_count`` monkeypatched. Real runs check that the setting
reaches the ranks and that nothing touches CUDA under ``device='cpu'``: this torch has no CUDA, so any
``torch.cuda.set_device``, CUDA stream or CUDA tensor would raise. In-process that is a monkeypatch; the
spawned DP=2 ranks are new interpreters, which a monkeypatch cannot reach, so there the report comes from a
``sitecustomize`` hook on their ``PYTHONPATH`` (it logs every process it patched, which the test counts).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from runner.config import ConfigError, RunnerConfig
from runner.distributed.device import DeviceUnavailableError, backend_for, check_world_backend, resolve_device_type
from runner.distributed.launch import LaunchError, default_backend, init_distributed, launch

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ["generate", "--enable-expert-parallel", "--enable-dbo", "--dbo-decode-token-threshold", "2",
            "--dbo-prefill-token-threshold", "8", "--dbo-cost-model", "off", "--num-prompts", "4",
            "--random-prompt-len", "8", "--max-tokens", "4", "--ignore-eos", "--dist-timeout-s", "60"]
# Imported first by every Python process started with this directory on PYTHONPATH: the CLI parent, each
# spawned rank. It reports one GPU and logs the process, so the test knows which processes saw it.
CUDA_PRESENT_HOOK = """
import os
import torch
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
with open(os.environ["UBATCH_TEST_HOOK_LOG"], "a") as log:
    log.write(f"{os.getpid()}\\n")
"""


def report_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


# ---- the decision -------------------------------------------------------------------------------------
def test_auto_follows_cuda_and_cpu_ignores_it(monkeypatch: pytest.MonkeyPatch) -> None:
    report_gpus(monkeypatch, 1)
    assert resolve_device_type("auto") == "cuda" and resolve_device_type("cuda") == "cuda"
    assert resolve_device_type("cpu") == "cpu"
    assert default_backend("auto") == "nccl" and default_backend("cpu") == "gloo"
    report_gpus(monkeypatch, 0)
    assert resolve_device_type("auto") == "cpu" and default_backend("auto") == "gloo"
    with pytest.raises(DeviceUnavailableError, match="device 'cuda' was requested but CUDA is not available"):
        resolve_device_type("cuda")
    with pytest.raises(ValueError, match="device must be one of auto, cuda, cpu; got 'gpu'"):
        resolve_device_type("gpu")
    assert backend_for("cuda") == "nccl" and backend_for("cpu") == "gloo"
    with pytest.raises(ValueError, match="device type must be 'cuda' or 'cpu', got 'mps'"):
        backend_for("mps")


def test_config_validates_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert RunnerConfig().device == "auto" and RunnerConfig(device="cpu").device == "cpu"
    with pytest.raises(ConfigError, match="device must be one of auto, cuda, cpu; got 'gpu'") as err:
        RunnerConfig(device="gpu")
    assert err.value.flag == "--device"
    report_gpus(monkeypatch, 0)
    with pytest.raises(ConfigError, match="device 'cuda' was requested but CUDA is not available") as err:
        RunnerConfig(device="cuda")
    assert err.value.flag == "--device"
    report_gpus(monkeypatch, 1)
    assert RunnerConfig(device="cuda").device == "cuda"


def _never_called() -> None:
    raise AssertionError("a rank started")


def test_launch_refuses_more_nccl_ranks_than_gpus_before_any_rank_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    report_gpus(monkeypatch, 1)
    children = set(multiprocessing.active_children())
    with pytest.raises(LaunchError, match=r"2 ranks on this host need 2 GPUs with NCCL, found 1; lower "
                                          r"--data-parallel-size, or run the ranks on the CPU over gloo with "
                                          r"--device cpu"):
        launch(_never_called, 2, device="auto")
    report_gpus(monkeypatch, 0)
    with pytest.raises(DeviceUnavailableError, match="device 'cuda' was requested"):
        launch(_never_called, 2, device="cuda")
    with pytest.raises(ValueError, match="got 'gpu'"):
        launch(_never_called, 2, device="gpu")
    assert set(multiprocessing.active_children()) == children


def test_torchrun_world_takes_the_backend_of_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    joined: list[str] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: joined.append(backend))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
                       "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    report_gpus(monkeypatch, 1)
    assert init_distributed(device="cpu") == (0, 2) and joined == ["gloo"]  # no set_device: it would raise here
    with pytest.raises(LaunchError, match="2 ranks on this host need 2 GPUs with NCCL, found 1.*--device cpu"):
        init_distributed(device="auto")
    assert joined == ["gloo"]
    with pytest.raises(RuntimeError, match="uses the NCCL backend, which cannot move CPU tensors"):
        check_world_backend("nccl", "cpu")
    check_world_backend("gloo", "cpu")
    check_world_backend("nccl", "cuda")


# ---- the setting reaches the runner ------------------------------------------------------------------
PROMPTS = [[(3 * i + 7 * j) % 500 for j in range(5 + i)] for i in range(6)]
ENGINE = dict(model="tiny-qwen3-moe", enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=4,
              dbo_cost_model="off", device="cpu")


def _generate(**settings: Any) -> tuple[list[list[int]], Any]:
    from runner.entrypoints.llm import LLM
    from runner.sampling_params import SamplingParams

    llm = LLM(**settings)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
        assert llm.last_stats is not None
        assert llm.last_stats.num_ubatched_steps > 0  # the wrapper and its streams really ran
        return [o.outputs[0].token_ids for o in outs], llm.runner
    finally:
        llm.close()


def test_llm_on_cpu_touches_no_cuda_when_cuda_is_reported(monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    from ubatch.streams import NullStream

    reference, _ = _generate(**ENGINE, cache_dir=str(tmp_path))
    report_gpus(monkeypatch, 1)  # from here any real CUDA call raises (this torch has no CUDA)
    tokens, runner = _generate(**ENGINE, cache_dir=str(tmp_path))
    assert runner.device == torch.device("cpu") and runner.wrapper.device == torch.device("cpu")
    assert isinstance(runner.wrapper.comm_stream, NullStream)
    assert tokens == reference


def test_cli_flag_reaches_the_config_and_the_launcher(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    import runner.distributed.launch
    from runner.entrypoints.cli import build_parser, job_from_args, main

    def job(argv: list[str]) -> Any:
        args = build_parser().parse_args(argv)
        return job_from_args(args, args.subparser)

    assert job(["generate"]).cfg.device == "auto" and job(["generate", "--device", "cpu"]).cfg.device == "cpu"
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["generate", "--device", "gpu"])
    assert info.value.code == 2 and "argument --device: invalid choice: 'gpu'" in capsys.readouterr().err
    report_gpus(monkeypatch, 0)
    with pytest.raises(SystemExit) as info:
        job(["generate", "--device", "cuda"])
    assert info.value.code == 2
    assert "argument --device: device 'cuda' was requested but CUDA is not available" in capsys.readouterr().err

    calls: list[dict[str, Any]] = []

    def rank_group(fn: Any, n: int, **kw: Any) -> Any:  # what starts the engine client's rank processes
        calls.append({"n": n, **kw})
        raise runner.distributed.launch.LaunchError("recorded, not started")

    monkeypatch.setattr(runner.distributed.launch, "RankGroup", rank_group)
    assert main(["generate", "-dp", "2", "--device", "cpu", "--num-prompts", "1"]) == 1
    assert "error: recorded, not started" in capsys.readouterr().err
    assert calls[0]["n"] == 2 and calls[0]["device"] == "cpu"


def _cli(args: list[str], tmp_path: Path, hook: bool) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``python -m runner ARGS`` from the repository root; with ``hook``, CUDA reported present (one GPU).
    Returns the process and the pids the hook patched."""
    hook_dir, log = tmp_path / "hook", tmp_path / f"hook-{len(list(tmp_path.glob('hook-*')))}.log"
    hook_dir.mkdir(exist_ok=True)
    (hook_dir / "sitecustomize.py").write_text(CUDA_PRESENT_HOOK)
    path = [str(hook_dir)] if hook else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "UBATCH_TEST_HOOK_LOG": str(log),
           "PYTHONPATH": os.pathsep.join(filter(None, [*path, str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "runner", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    return proc, log.read_text().split() if log.exists() else []


@pytest.mark.slow
def test_dp2_on_cpu_with_cuda_reported_equals_a_plain_cpu_run(tmp_path: Path) -> None:
    out, ref = tmp_path / "dp2.json", tmp_path / "plain.json"
    proc, patched = _cli([*WORKLOAD, "-dp", "2", "--device", "cpu", "--output-json", str(out)], tmp_path, hook=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the parent and both ranks (and the launcher's helper process) saw CUDA "present"; none touched it
    assert len(set(patched)) >= 3, patched
    assert "ubatched steps: 4/4 (DBO)" in proc.stdout, proc.stdout
    plain, unpatched = _cli([*WORKLOAD, "--device", "cpu", "--output-json", str(ref)], tmp_path, hook=False)
    assert plain.returncode == 0 and unpatched == [], plain.stderr[-3000:]
    tokens = [r["outputs"][0]["token_ids"] for r in json.loads(out.read_text())]
    assert tokens == [r["outputs"][0]["token_ids"] for r in json.loads(ref.read_text())]
    assert len(tokens) == 4 and all(len(t) == 4 for t in tokens)

    # --device auto with the same one "GPU": refused before any rank starts, naming the way out
    proc, patched = _cli([*WORKLOAD, "-dp", "2"], tmp_path, hook=True)
    assert proc.returncode == 1
    assert "error: 2 ranks on this host need 2 GPUs with NCCL, found 1; lower --data-parallel-size, or run the " \
           "ranks on the CPU over gloo with --device cpu" in proc.stderr, proc.stderr
    assert len(patched) == 1, patched  # the CLI process only: no rank was spawned
