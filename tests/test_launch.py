"""Built-in spawner: results in rank order, single-threaded children on loopback, a dead, failing or silent rank
named promptly, ranks failing alike reported once. The rank bodies here move CPU tensors, so they run with
``device="cpu"`` (gloo) on any host; the device choice itself is tests/test_device.py's."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from runner.distributed.launch import (
    LaunchInterrupted,
    RankFailedError,
    describe_exception,
    describe_exit,
    launch,
    torchrun_env_present,
)
from runner.distributed.rendezvous import loopback_env, loopback_interface


def gather_rank_info(tag: str) -> list:
    import torch
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, (dist.get_rank(), tag, os.environ["OMP_NUM_THREADS"], torch.get_num_threads(),
                                 os.environ.get("GLOO_SOCKET_IFNAME")))
    return out


def stop_rank_1() -> None:
    import torch
    import torch.distributed as dist

    t = torch.zeros(1)
    dist.all_reduce(t)
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(t)  # rank 0 waits here for the stopped peer (the collective timeout is far away)


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


def test_results_in_rank_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    lo = loopback_interface()
    res = launch(gather_rank_info, 2, args=("x",), timeout_s=30, device="cpu")
    assert res[0] == res[1] == [(0, "x", "1", 1, lo), (1, "x", "1", 1, lo)]  # gloo pinned to loopback
    assert "GLOO_SOCKET_IFNAME" not in os.environ  # set for the children only


def test_loopback_interface_and_a_users_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    if sys.platform.startswith("linux"):
        assert loopback_interface() == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    assert loopback_env() == {"NCCL_SOCKET_IFNAME": loopback_interface()}  # the user's GLOO_SOCKET_IFNAME wins


@pytest.mark.parametrize("mode,expected", [("kill", "rank 1 exited with signal SIGKILL"),
                                           ("raise", "rank 1 exited with code 1: ValueError: boom on purpose")])
def test_dead_rank_is_named_and_peers_stopped(mode: str, expected: str, capfd: pytest.CaptureFixture) -> None:
    import multiprocessing

    children = set(multiprocessing.active_children())
    with pytest.raises(RankFailedError) as info:
        launch(die_or_fail, 2, args=(mode,), timeout_s=30, grace_s=2, device="cpu")
    # promptly, not by a timeout: no collective timed out, and the surviving peer (which would sleep 60 s) was stopped
    assert not any("Timed out" in detail for _, detail in info.value.failures), info.value.failures
    assert set(multiprocessing.active_children()) <= children
    assert str(info.value).startswith(expected), str(info.value)
    assert info.value.failures[0][0] == 1
    if mode == "raise":
        assert "[rank 1] ValueError: boom on purpose" in capfd.readouterr().err
        assert info.value.tracebacks[1].rstrip().endswith("ValueError: boom on purpose")


def test_silent_rank_is_named_before_the_collective_timeout() -> None:
    import multiprocessing

    children = set(multiprocessing.active_children())
    with pytest.raises(RankFailedError) as info:
        launch(stop_rank_1, 2, timeout_s=120, silence_s=2.0, grace_s=2, device="cpu")
    rank, detail = info.value.failures[0]
    assert rank == 1 and detail.startswith("stopped responding: no heartbeat for "), info.value.failures
    assert "its process is stopped (SIGSTOP or a debugger)" in detail
    assert len(info.value.failures) == 1  # rank 0 was only waiting for it: stopped, not blamed
    assert set(multiprocessing.active_children()) <= children


def test_failure_messages() -> None:
    alike = RankFailedError([(1, "exited with code 1: E: bad file"), (0, "exited with code 1: E: bad file"),
                             (2, "exited with signal SIGKILL")])
    assert str(alike) == "rank 0 and rank 1 exited with code 1: E: bad file; rank 2 exited with signal SIGKILL"
    assert describe_exception(RuntimeError()) == "RuntimeError"  # never a blank error
    assert describe_exception(ValueError(" x ")) == "ValueError: x"
    assert str(LaunchInterrupted(signal.SIGTERM, [0, 1, 2])) == "interrupted by SIGTERM: stopped rank 0, rank 1 and " \
                                                                "rank 2"
    assert isinstance(LaunchInterrupted(signal.SIGHUP), KeyboardInterrupt)


def test_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    assert describe_exit(-9) == "exited with signal SIGKILL" and describe_exit(3) == "exited with code 3"
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, "1")
    assert torchrun_env_present()
    monkeypatch.delenv("MASTER_PORT")
    assert not torchrun_env_present()


def test_nccl_needs_a_gpu_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from runner.distributed.launch import check_gpus

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_gpus("gloo", 4)  # CPU ranks share the machine
    check_gpus("nccl", 1)
    with pytest.raises(RuntimeError, match="2 ranks on this host need 2 GPUs with NCCL, found 1; .*--device cpu"):
        check_gpus("nccl", 2)


# A rank stand-in without the Linux death signal: only the heartbeat thread's parent check can end it.
_ORPHAN = """
import sys, time
from runner.distributed.liveness import start_heartbeat
start_heartbeat([0.0] * 3, 0, int(sys.argv[1]), interval_s=0.05)
print("beating", flush=True)
time.sleep(60)
"""
# Its parent: starts it, reports its pid once it beats, then exits without stopping it.
_MIDDLE = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)  # holds none of our pipes
assert child.stdout.readline().strip() == "beating"
print(child.pid, flush=True)
os._exit(0)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads process states with ps (Linux)")
def test_watchdog_ends_a_rank_whose_parent_is_gone() -> None:
    import subprocess

    from proc_sockets import alive_per_ps

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    middle = subprocess.run([sys.executable, "-c", _MIDDLE, _ORPHAN], env=env, capture_output=True, text=True,
                            timeout=60)
    assert middle.returncode == 0, middle.stderr
    orphan = int(middle.stdout.strip())
    deadline = time.monotonic() + 5.0
    while (left := alive_per_ps({orphan})) and not left[orphan].split()[0].startswith("Z") and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left or left[orphan].split()[0].startswith("Z"), f"the orphan still runs: {left}"  # Z: dead, unreaped
