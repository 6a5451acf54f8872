"""The offline ``LLM`` with ``data_parallel_size=2`` in a plain script (no torchrun): it starts its rank processes
itself (``runner/engine/sync_client.py``), returns transformers' greedy tokens in prompt order with expert
parallelism and DBO, and leaves no process behind, whether closed by ``del`` or by interpreter exit. A rank that
dies is named by the error of the next call, and its peer is stopped.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from runner.core.requests import EngineCoreOutputs
from runner.engine.engine_core_client import OnOutputs, RunReport
from runner.engine.protocol import EngineDeadError
from runner.engine.sync_client import SyncMPClient
from runner.entrypoints.llm import LLM
from runner.sampling_params import SamplingParams
from tiny_checkpoint import PROMPT

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = '''
import json, os, sys
from runner.entrypoints.llm import LLM
from runner.sampling_params import SamplingParams

def children():
    """[pid, command line] of the processes whose parent is this one (read from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                        with open(f"/proc/{entry}/cmdline", "rb") as cmd:
                            found.append([int(entry), cmd.read().replace(b"\\0", b" ").decode()])
            except (OSError, IndexError):
                pass
    return found

if __name__ == "__main__":
    settings = dict(data_parallel_size=2, enable_expert_parallel=True, enable_dbo=True, device="cpu",
                    dbo_decode_token_threshold=1, dbo_prefill_token_threshold=2, dbo_cost_model="off",
                    dist_timeout_s=60.0)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(sys.argv[1], **settings)  # never closed: interpreter exit ends its ranks
    outs = llm.generate([sys.argv[2]] * 3, params, use_tqdm=False)
    print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "ubatched": llm.last_stats.num_ubatched_steps,
                      "pids": llm.engine_client.pids, "children": children()}))
'''


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped
    except OSError:
        return True


def rank_pids(llm: LLM) -> list[int]:
    """The ids of ``llm``'s rank processes (DP > 1: its client runs them)."""
    client = llm.engine_client
    assert isinstance(client, SyncMPClient)
    return client.pids


def _all_gone(pids: list[int], timeout_s: float = 15.0) -> bool:
    """Whether every one of ``pids`` has exited, waiting up to ``timeout_s`` for those on their way out (a
    process whose parent died ends once it notices)."""
    deadline = time.monotonic() + timeout_s
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return all(_gone(pid) for pid in pids)


@pytest.mark.slow
def test_dp2_ep_dbo_in_a_plain_script_equals_transformers_greedy_and_leaves_no_process(
        tmp_path: Path, tiny_chat_checkpoint) -> None:
    script = tmp_path / "offline_dp.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, str(script), str(tiny_chat_checkpoint.path), PROMPT], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["tokens"] == [tiny_chat_checkpoint.greedy_no_eos] * 3
    assert got["ubatched"] > 0  # DBO really split steps
    # the script's children while the LLM was open: its two ranks and multiprocessing's resource tracker (which
    # lives as long as the interpreter); interpreter exit ended all of them
    children = {pid for pid, _ in got["children"]}
    assert len(got["pids"]) == 2 and set(got["pids"]) <= children
    assert [cmd for pid, cmd in got["children"] if pid not in got["pids"] and "resource_tracker" not in cmd] == []
    assert _all_gone(list(children))


@pytest.mark.slow
@pytest.mark.parametrize("when", ["idle", "mid-run"])
def test_a_killed_rank_is_named_and_its_peer_stopped(when: str) -> None:
    llm = LLM("tiny-qwen3-moe", data_parallel_size=2, enable_expert_parallel=True, device="cpu",
              dist_timeout_s=60.0)
    client = llm.engine_client
    assert isinstance(client, SyncMPClient)  # two DP ranks: their processes' client
    pids = client.pids
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    assert [len(o.outputs[0].token_ids) for o in llm.generate([[1, 2], [3, 4]], params, use_tqdm=False)] == [2, 2]
    if when == "idle":
        os.kill(pids[1], signal.SIGKILL)
    else:  # at the first outputs of a run: both ranks are stepping, rank 0 then waits on its dead peer
        run = client.run

        def run_and_kill(on_outputs: OnOutputs, *, trace: bool = False) -> RunReport:
            def first_outputs_kill(outputs: EngineCoreOutputs) -> None:
                if not _gone(pids[1]):
                    os.kill(pids[1], signal.SIGKILL)
                on_outputs(outputs)
            return run(first_outputs_kill, trace=trace)

        client.run = run_and_kill  # type: ignore[method-assign]
    deadline = time.monotonic() + 30
    with pytest.raises(EngineDeadError, match="rank 1 exited with signal SIGKILL"):
        while time.monotonic() < deadline:  # idle: the supervisor notices within a heartbeat or two
            llm.generate([[5, 6]] * 4, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                         use_tqdm=False)
    assert client.pids == [] and _all_gone(pids)
    with pytest.raises(EngineDeadError, match="rank 1 exited with signal SIGKILL"):  # dead for good
        llm.generate([[5, 6]], params, use_tqdm=False)
    llm.close()


def _split(entries: list | None) -> tuple[list | None, list[float]]:
    """Log-probability entries as (tokens, ranks and texts; the values): a batch of another size (a request's
    samples split over two ranks) rounds float32 sums differently in the last bits, so the values are compared
    within a tolerance and the rest exactly."""
    if entries is None:
        return None, []
    exact = [None if e is None else {t: (lp.rank, lp.decoded_token) for t, lp in e.items()} for e in entries]
    return exact, [lp.logprob for e in entries if e is not None for lp in e.values()]


def _features(llm: LLM) -> list:
    """chat, n > 1 with seeded and unseeded sampling, logprobs, prompt logprobs and a stop string, as plain data."""
    outs = llm.chat([[{"role": "user", "content": "Hello world"}]] * 2,
                    SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    outs += llm.generate([PROMPT, "Hello world! How", PROMPT],
                         [SamplingParams(n=2, temperature=0.8, max_tokens=5, seed=7),
                          SamplingParams(n=3, temperature=1.0, max_tokens=4, logprobs=2, prompt_logprobs=1),
                          SamplingParams(temperature=0, max_tokens=12, stop=[" br"], ignore_eos=True)],
                         use_tqdm=False)
    return [(o.prompt, o.prompt_token_ids, _split(o.prompt_logprobs), o.error,
             [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, _split(c.logprobs)) for c in o.outputs])
            for o in outs]


def _exact(features: list) -> list:
    return [(p, ids, plp[0], err, [c[:5] + (c[5][0],) for c in comps]) for p, ids, plp, err, comps in features]


def _values(features: list) -> list[float]:
    return [v for _, _, plp, _, comps in features for v in plp[1] + [x for c in comps for x in c[5][1]]]


@pytest.mark.slow
def test_dp2_over_rank_processes_equals_one_rank_in_process(tmp_path: Path, tiny_chat_checkpoint) -> None:
    """Every offline feature gives the same outputs over two rank processes as in-process on one rank (seeds go
    by prompt index in both), the statistics and the trace cover both ranks, and ``del`` ends the ranks."""
    settings: dict[str, Any] = dict(  # LLM's keyword arguments
        model=str(tiny_chat_checkpoint.path), device="cpu", enable_dbo=True, dist_timeout_s=60.0,
        dbo_decode_token_threshold=1, dbo_prefill_token_threshold=2)
    one = LLM(**settings)
    expected = _features(one)
    experts_backend = one.model_runner.experts_backend
    one.close()
    assert expected[4][4][0][3:5] == ("stop", " br")  # the stop string was found (greedy text: "...L\x17 br...")
    trace = tmp_path / "trace.json"
    two = LLM(**settings, data_parallel_size=2, enable_expert_parallel=True, trace_file=str(trace))
    try:
        got = _features(two)
        assert _exact(got) == _exact(expected)
        assert _values(got) == pytest.approx(_values(expected), abs=1e-4) and len(_values(expected)) > 20
        stats = two.last_stats
        assert stats is not None and stats.num_requests == 3 and stats.num_steps > 0 and stats.num_ubatched_steps > 0
        assert {line.split(":")[0] for line in stats.dbo_decisions} == {"rank 0", "rank 1"}
        assert two.last_trace is not None and len(two.last_trace.metrics) == 2  # one timeline per rank
        assert len({e["pid"] for e in json.loads(trace.read_text())["traceEvents"]}) == 2
        with pytest.raises(RuntimeError, match="data_parallel_size=2 ranks in their own processes"):
            _ = two.runner
        info = two.engine_client.core_info  # what the CLI's bench report reads of the ranks' model
        assert (info.dtype, info.experts_backend) == ("float32", experts_backend)
    except BaseException:
        two.close()
        raise
    pids = rank_pids(two)  # no reference to the client kept past ``del``
    del two  # ends the ranks, as close() does
    assert len(pids) == 2 and _all_gone(pids)
