"""The process-state check of ``env_guard.py`` (autouse in this suite): a test or fixture that leaves
``TRITON_INTERPRET``, ``CUDA_VISIBLE_DEVICES`` or torch's default dtype changed fails, by name, and the tests
after it see the state as it was; changes made through monkeypatch pass. Run in a child pytest over a few
throwaway tests, with the plugin loaded on its own (``-p env_guard``)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from child_pytest import child_pytest_env
from env_guard import GUARDED_ENV, ProcessState

TESTS = Path(__file__).resolve().parent

LEAKY = """
import os

import pytest
import torch


def flipped(name):
    return "1" if os.environ.get(name) != "1" else "0"


def test_sets_triton_interpret():
    os.environ["TRITON_INTERPRET"] = flipped("TRITON_INTERPRET")


def test_sees_triton_interpret_as_it_was():
    assert os.environ.get("TRITON_INTERPRET") == os.environ["EXPECTED_TRITON_INTERPRET"]


def test_hides_the_gpus():
    os.environ["CUDA_VISIBLE_DEVICES"] = "7"


def test_sets_the_default_dtype():
    torch.set_default_dtype(torch.float64)


def test_sees_the_default_dtype_as_it_was():
    assert torch.get_default_dtype() == torch.float32 and "CUDA_VISIBLE_DEVICES" not in os.environ


def test_monkeypatch_is_put_back(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("TRITON_INTERPRET", flipped("TRITON_INTERPRET"))
"""

MODULE_FIXTURE = """
import os

import pytest


@pytest.fixture(scope="module")
def hidden_gpus():
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    yield


def test_uses_it(hidden_gpus):
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


def test_last_of_the_module(hidden_gpus):
    pass
"""


def test_a_leak_fails_the_test_that_made_it_and_is_put_back(tmp_path: Path) -> None:
    (tmp_path / "test_leaky.py").write_text(textwrap.dedent(LEAKY))
    (tmp_path / "test_module_fixture.py").write_text(textwrap.dedent(MODULE_FIXTURE))
    env = child_pytest_env(drop=("CUDA_VISIBLE_DEVICES",),
                           PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
                           TRITON_INTERPRET="1", EXPECTED_TRITON_INTERPRET="1",
                           COLUMNS="1000")  # COLUMNS: short summary lines untruncated
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rE", "-p", "no:cacheprovider", "-p", "env_guard",
                           "test_leaky.py", "test_module_fixture.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    errors = dict(re.findall(r"^ERROR (\S+) - (.*)$", proc.stdout, re.M))
    assert sorted(errors) == ["test_leaky.py::test_hides_the_gpus", "test_leaky.py::test_sets_the_default_dtype",
                              "test_leaky.py::test_sets_triton_interpret",
                              "test_module_fixture.py::test_last_of_the_module"], out
    assert "TRITON_INTERPRET='1' -> '0'" in errors["test_leaky.py::test_sets_triton_interpret"]
    assert "CUDA_VISIBLE_DEVICES=None -> '7'" in errors["test_leaky.py::test_hides_the_gpus"]
    assert "torch default dtype torch.float32 -> torch.float64" in errors["test_leaky.py::test_sets_the_default_dtype"]
    assert "fixture of test_module_fixture.py" in errors["test_module_fixture.py::test_last_of_the_module"]
    assert "CUDA_VISIBLE_DEVICES=None -> ''" in errors["test_module_fixture.py::test_last_of_the_module"]
    assert re.search(r"\b8 passed, 4 errors\b", proc.stdout), out  # every test's call passed; leaks fail in teardown


def test_state_changes_are_named_and_restored(monkeypatch) -> None:
    before = ProcessState.now()
    assert [name for name, _ in before.env] == list(GUARDED_ENV)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    torch.set_default_dtype(torch.float16)
    try:
        assert ProcessState.now().changes_since(before) == [
            f"CUDA_VISIBLE_DEVICES={dict(before.env)['CUDA_VISIBLE_DEVICES']!r} -> '3'",
            "torch default dtype torch.float32 -> torch.float16"]
    finally:
        before.restore()
    assert ProcessState.now() == before
