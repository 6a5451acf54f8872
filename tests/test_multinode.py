"""Multi-node under torchrun, as two "nodes" on this machine: outputs identical to one ``-dp 2`` launch.

Two ``torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint localhost:PORT`` invocations
(the README's multi-node command, with loopback for the "private network") run DBO with expert parallelism;
whichever process becomes global rank 0 writes the results. They must equal, token for token, what the
built-in spawner gives with ``--data-parallel-size 2`` in one launch.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from devices import device_args

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ["generate", "--enable-expert-parallel", "--enable-dbo", "--dbo-decode-token-threshold", "2",
            "--dbo-prefill-token-threshold", "8", "--dbo-cost-model", "off", "--num-prompts", "6",
            "--random-prompt-len", "10", "--random-range-ratio", "0.5", "--max-tokens", "6", "--ignore-eos",
            "--dist-timeout-s", "60", *device_args(2)]  # both "nodes" are this host: 2 ranks

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_nodes_match_one_dp2_launch(tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"localhost:{_free_port()}", "--local-addr", "127.0.0.1", "-m", "runner", *WORKLOAD]
    nodes = [subprocess.Popen([*cmd, "--output-json", str(tmp_path / f"node{n}.json")], cwd=ROOT, env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in range(2)]
    outs = [n.communicate(timeout=240) for n in nodes]
    for node, (_out, err) in zip(nodes, outs, strict=True):
        assert node.returncode == 0, err[-3000:]
    written = sorted(tmp_path.glob("node*.json"))
    assert len(written) == 1, written  # one global rank 0 across the two invocations reports
    report = next(out for out, _ in outs if "requests:" in out)
    m = re.search(r"requests: 6 \(0 errors\).*ubatched steps: (\d+)/(\d+) \(DBO\)", report)
    assert m and int(m.group(1)) > 0, report  # DBO really split steps over the two nodes' EP ranks

    single = tmp_path / "dp2.json"
    proc = subprocess.run([sys.executable, "-m", "runner", *WORKLOAD, "--data-parallel-size", "2",
                           "--output-json", str(single)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    multi, one = json.loads(written[0].read_text()), json.loads(single.read_text())
    assert [r["index"] for r in multi] == list(range(6))
    assert [r["outputs"][0]["token_ids"] for r in multi] == [r["outputs"][0]["token_ids"] for r in one]
    assert all(len(r["outputs"][0]["token_ids"]) == 6 and r["error"] is None for r in multi)
