"""Built-in spawner: results in rank order, single-threaded children, a dead or failing rank named promptly."""
from __future__ import annotations

import os
import signal
import time

import pytest

from runner.launch import RankFailedError, describe_exit, launch, torchrun_env_present


def gather_rank_info(tag: str) -> list:
    import torch
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, (dist.get_rank(), tag, os.environ["OMP_NUM_THREADS"], torch.get_num_threads()))
    return out


def die_or_fail(mode: str) -> None:
    import torch
    import torch.distributed as dist

    t = torch.zeros(1)
    dist.all_reduce(t)
    if dist.get_rank() == 1:
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError("boom on purpose")
    dist.all_reduce(t)  # rank 0 blocks here until the peer's connection closes or the parent terminates it
    time.sleep(60)


def test_results_in_rank_order() -> None:
    res = launch(gather_rank_info, 2, args=("x",), timeout_s=30)
    assert res[0] == res[1] == [(0, "x", "1", 1), (1, "x", "1", 1)]


@pytest.mark.parametrize("mode,expected", [("kill", "rank 1 exited with signal SIGKILL"),
                                           ("raise", "rank 1 exited with code 1: ValueError: boom on purpose")])
def test_dead_rank_is_named_and_peers_stopped(mode: str, expected: str, capfd: pytest.CaptureFixture) -> None:
    import multiprocessing

    children = set(multiprocessing.active_children())
    with pytest.raises(RankFailedError) as info:
        launch(die_or_fail, 2, args=(mode,), timeout_s=30, grace_s=2)
    # promptly, not by a timeout: no collective timed out, and the surviving peer (which would sleep 60 s) was stopped
    assert not any("Timed out" in detail for _, detail in info.value.failures), info.value.failures
    assert set(multiprocessing.active_children()) <= children
    assert str(info.value).startswith(expected), str(info.value)
    assert info.value.failures[0][0] == 1
    if mode == "raise":
        assert "[rank 1] ValueError: boom on purpose" in capfd.readouterr().err


def test_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    assert describe_exit(-9) == "exited with signal SIGKILL" and describe_exit(3) == "exited with code 3"
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, "1")
    assert torchrun_env_present()
    monkeypatch.delenv("MASTER_PORT")
    assert not torchrun_env_present()


def test_nccl_needs_a_gpu_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from runner.launch import check_gpus

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_gpus("gloo", 4)  # CPU ranks share the machine
    check_gpus("nccl", 1)
    with pytest.raises(RuntimeError, match="2 ranks on this host need 2 GPUs with NCCL, found 1"):
        check_gpus("nccl", 2)
