"""The offline ``LLM``'s default: the engine core in a process of its own for one rank too (vLLM's
``VLLM_ENABLE_V1_MULTIPROCESSING=1``), the front process detokenizing and checking stop strings meanwhile.

- Tokens, finish reasons, text and logprobs are identical between that default, the in-process client
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with the same loop, and the in-process synchronous loop: greedy, seeded
  sampling, penalties, stop strings and stop tokens, ``n > 1``, logprobs, prompt logprobs, with DBO on, on the
  emulated device (whose default loop is the pipelined one). DP=2 over rank processes is
  ``tests/test_offline_dp.py``'s, on the same client.
- No engine process is left behind: after ``close()``, after the ``LLM`` is garbage-collected, after the script
  exits, or after the script is killed (SIGTERM, SIGKILL); a script without a ``__main__`` guard works. A killed
  core makes the next call raise naming it.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runner.engine.core_client import MULTIPROCESSING_ENV, multiprocessing_enabled
from runner.engine.sync_client import SyncMPClient
from runner.entrypoints.llm import LLM
from runner.sampling_params import SamplingParams
from tiny_checkpoint import TinyCheckpoint

ROOT = Path(__file__).resolve().parents[1]
ENGINE: dict[str, Any] = dict(  # LLM's keyword arguments
    device="cpu", max_num_seqs=6, emulate_device="step_us=300", enable_dbo=True, dbo_decode_token_threshold=2,
    dbo_prefill_token_threshold=4, dbo_cost_model="off", dist_timeout_s=60.0)
TEXTS = ["The quick brown fox", "Hello world! How are", "Dual batch overlap hides", "One, two, three:",
         "Caf\u00e9 cr\u00e8me", "the lazy dog jumps over the quick brown fox again and again"]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, prompt_logprobs=2),
          SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=18),
          SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.5, frequency_penalty=0.4,
                         presence_penalty=0.3, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=5, max_tokens=24, stop=["e", "o"], ignore_eos=True),
          SamplingParams(temperature=1.0, top_k=20, seed=3, n=2, max_tokens=12, logprobs=2, ignore_eos=True),
          SamplingParams(temperature=0.7, min_p=0.05, max_tokens=22, stop_token_ids=[5, 9], ignore_eos=True)]


@contextlib.contextmanager
def multiprocessing(enabled: bool) -> Iterator[None]:
    """``VLLM_ENABLE_V1_MULTIPROCESSING`` set for the block (the test session runs with 0: tests/conftest.py)."""
    before = os.environ.get(MULTIPROCESSING_ENV)
    os.environ[MULTIPROCESSING_ENV] = "1" if enabled else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(MULTIPROCESSING_ENV)
        else:
            os.environ[MULTIPROCESSING_ENV] = before


def _lp(entries: Any) -> Any:
    """Log-probability entries as their token ids and ranks, by position (the values are float32 either way)."""
    return None if entries is None else [None if e is None else sorted((t, lp.rank) for t, lp in e.items())
                                         for e in entries]


def workload(llm: LLM) -> list[Any]:
    outs = llm.generate(TEXTS, PARAMS, use_tqdm=False)
    return [(o.prompt_token_ids, _lp(o.prompt_logprobs),
             [(c.token_ids, c.finish_reason, c.stop_reason, c.text, _lp(c.logprobs)) for c in o.outputs])
            for o in outs]


@pytest.fixture(scope="module")
def in_process(tiny_chat_checkpoint: TinyCheckpoint) -> dict[str, list[Any]]:
    """The workload's outputs in process: the default loop (pipelined on the emulated device) and the
    synchronous one."""
    got = {}
    with multiprocessing(False):
        loops: dict[str, dict[str, Any]] = {"default": {}, "sync": dict(disable_overlap_schedule=True)}
        for name, loop in loops.items():
            llm = LLM(model=str(tiny_chat_checkpoint.path), **ENGINE, **loop)
            try:
                got[name] = workload(llm)
            finally:
                llm.close()
    return got


def test_the_switch_reads_vllm_s_variable() -> None:
    with multiprocessing(True):
        assert multiprocessing_enabled()
    with multiprocessing(False):
        assert not multiprocessing_enabled()
    os.environ[MULTIPROCESSING_ENV], before = "yes", os.environ.get(MULTIPROCESSING_ENV, "0")
    try:
        with pytest.raises(ValueError, match="VLLM_ENABLE_V1_MULTIPROCESSING='yes' must be 0 or 1"):
            multiprocessing_enabled()
    finally:
        os.environ[MULTIPROCESSING_ENV] = before


@pytest.mark.slow
def test_engine_process_tokens_equal_in_process_and_synchronous_loop(
        tiny_chat_checkpoint: TinyCheckpoint, in_process: dict[str, list[Any]]) -> None:
    with multiprocessing(True):
        llm = LLM(model=str(tiny_chat_checkpoint.path), **ENGINE)
    try:
        client = llm.engine_client
        assert isinstance(client, SyncMPClient)  # the engine core runs in a process of its own
        pids = client.pids
        assert len(pids) == 1 and client.forward_thread_id is None  # the core steps elsewhere
        got = workload(llm)
        again = workload(llm)  # a second call on the same engine process
        stats = llm.last_stats
        assert stats is not None and stats.num_ubatched_steps > 0 and stats.num_steps > 0  # DBO really ran there
    finally:
        llm.close()
    assert got == in_process["default"] == in_process["sync"]
    assert again == got
    finishes = {c[1] for o in got for c in o[2]}
    assert finishes == {"length", "stop"}  # the stop strings and stop tokens did end requests
    assert got[0][1] is not None and got[4][2][0][4] is not None and len(got[4][2]) == 2
    assert _all_gone(pids)


SCRIPT = '''
import gc, json, os, signal, sys, time
from runner.entrypoints.llm import LLM
from runner.sampling_params import SamplingParams
from runner.engine.protocol import EngineDeadError

# no __main__ guard: the engine process must not run this script again
settings = dict(model="tiny-qwen3-moe", device="cpu", dist_timeout_s=60.0, cache_dir=sys.argv[2])
params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

def report(**kw):
    print(json.dumps(kw), flush=True)

def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

def gone(pids, timeout_s=15.0):
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(alive(p) for p in pids)

mode = sys.argv[1]
llm = LLM(**settings)
tokens = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids
pids = llm.engine_client.pids
if mode == "lifecycle":
    llm.close()
    closed = gone(pids)
    llm = LLM(**settings)
    collected_pids = llm.engine_client.pids
    del llm
    gc.collect()
    collected = gone(collected_pids)
    llm = LLM(**settings)
    killed_pids = llm.engine_client.pids
    os.kill(killed_pids[0], signal.SIGKILL)
    try:
        while True:
            llm.generate([[1, 2]], params, use_tqdm=False)
    except EngineDeadError as e:
        dead = str(e)
    llm.close()
    llm = LLM(**settings)  # left open: interpreter exit ends it
    report(tokens=tokens, closed=closed, collected=collected, dead=dead, pids=llm.engine_client.pids)
else:
    report(tokens=tokens, pids=pids)
    time.sleep(300)  # killed here by the test
'''


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _all_gone(pids: list[int], timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(_alive(p) for p in pids)


def _script(tmp_path: Path, mode: str) -> subprocess.Popen[str]:
    script = tmp_path / "engine_process.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1", MULTIPROCESSING_ENV: "1"}
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return subprocess.Popen([sys.executable, str(script), mode, str(tmp_path / "cache")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_no_engine_process_outlives_close_gc_or_exit_and_a_dead_core_is_named(tmp_path: Path) -> None:
    proc = _script(tmp_path, "lifecycle")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    got = json.loads(out.strip().splitlines()[-1])
    assert len(got["tokens"]) == 4
    assert got["closed"] and got["collected"]
    assert "rank 0 exited with signal SIGKILL" in got["dead"]
    assert len(got["pids"]) == 1 and _all_gone(got["pids"])  # ended at interpreter exit
    assert "Exception ignored" not in err, err[-3000:]  # the LLM collected after exit's close closes nothing twice


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_no_engine_process_outlives_a_killed_script(tmp_path: Path, signum: int) -> None:
    proc = _script(tmp_path, "wait")
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-3000:] if proc.stderr else "no output"
        pids = json.loads(line)["pids"]
        assert len(pids) == 1 and _alive(pids[0])
        os.kill(proc.pid, signum)
        proc.wait(timeout=60)
        assert _all_gone(pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
