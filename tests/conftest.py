"""Test-wide settings that must be in place before torch or triton is imported, and the Triton mode markers."""
import os
import re
import subprocess
import sys

# fork-based multi-process tests are only safe when OpenMP pools stay single-threaded (set before torch loads).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The offline LLM and the CLI run their engine core in a process of their own by default (vLLM's
# VLLM_ENABLE_V1_MULTIPROCESSING=1); an engine process costs seconds to start, so tests run it in process unless
# they ask for the default (tests/test_mp_default.py does, and compares the two).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch

# Triton runs either in its CPU interpreter (TRITON_INTERPRET=1, CPU tensors) or compiled (CUDA tensors), and
# the choice is per *process*: Triton reads the variable when ``triton.language`` is first imported (its own
# helpers such as ``tl.zeros`` are ``@triton.jit`` functions decorated then), when a kernel is decorated and
# again during an interpreted launch. A process whose triton was imported compiled cannot interpret, and the
# other way round. So:
# - this process's mode is fixed here, before anything imports triton: TRITON_INTERPRET if the environment
#   sets it, else compiled on a CUDA machine and interpreted without one;
# - a test that runs Triton on CPU tensors is marked ``triton_interpreter``, a test that runs compiled Triton
#   kernels ``triton_compiled``. A marked test whose mode is not this process's runs in a child pytest
#   process with TRITON_INTERPRET set for it (``pytest_pyfunc_call`` below): on a GPU machine the CPU
#   Triton tests still use the interpreter, and the ``-m cuda`` tests the compiler.
# Fixtures of a delegated test are still set up here, so they must not launch kernels.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import pytest

from child_pytest import child_pytest_env
from env_guard import process_state_module, process_state_session, process_state_test  # noqa: F401
from stream_sanitizer_plugin import (  # noqa: F401  (--stream-sanitizer)
    pytest_addoption,
    stream_sanitizer_fresh_history,
    stream_sanitizer_session,
)
from tiny_checkpoint import tiny_chat_checkpoint  # noqa: F401  (a session fixture: a checkpoint with a tokenizer)
from ubatch.triton_runtime import interpreter_enabled

torch.set_num_threads(1)

TRITON_INTERPRETS = interpreter_enabled()
TRITON_MODE_MARKERS = {"triton_interpreter": True, "triton_compiled": False}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "triton_interpreter: runs Triton kernels on CPU tensors (TRITON_INTERPRET=1; "
                                       "in a child process where this one compiles Triton)")
    config.addinivalue_line("markers", "triton_compiled: runs compiled Triton kernels (TRITON_INTERPRET=0; "
                                       "in a child process where this one interprets Triton)")


def needed_triton_mode(item: pytest.Item) -> bool | None:
    """``True``: the test needs the interpreter; ``False``: the compiler; ``None``: it runs no Triton kernel."""
    modes = {interpret for name, interpret in TRITON_MODE_MARKERS.items() if item.get_closest_marker(name)}
    if len(modes) > 1:
        raise pytest.UsageError(f"{item.nodeid} is marked both triton_interpreter and triton_compiled")
    return modes.pop() if modes else None


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run a test whose Triton mode is not this process's in a child pytest with the mode it needs."""
    interpret = needed_triton_mode(pyfuncitem)
    if interpret is None or interpret == TRITON_INTERPRETS:
        return None
    env = child_pytest_env(TRITON_INTERPRET="1" if interpret else "0")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", pyfuncitem.nodeid]
    proc = subprocess.run(cmd, cwd=pyfuncitem.config.rootpath, env=env, capture_output=True, text=True,
                          timeout=600)
    output = proc.stdout + proc.stderr
    where = f"a TRITON_INTERPRET={env['TRITON_INTERPRET']} child process"
    pyfuncitem.add_report_section("call", "triton-mode child", f"ran in {where}: {' '.join(cmd[1:])}\n{output[-4000:]}")
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|skipped|failed|error)", output)}
    if proc.returncode == 0 and counts.get("passed") == 1:
        return True
    if proc.returncode == 0 and counts.get("skipped") == 1:
        pytest.skip(f"skipped in {where}")
    pytest.fail(f"failed in {where} (exit code {proc.returncode}):\n{output[-4000:]}", pytrace=False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Files holding a slow (multi-process or long) test run first, each file's order kept: pytest-xdist hands
    # out whole files in this order (make test), so the longest start early and no worker ends the run alone
    # on one of them.
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)
