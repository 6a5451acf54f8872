"""benchmarks/tune_moe.py on the CPU: the dry run writes a table the experts' loader reads back, the sweep's
search space, and the refusal to tune without a GPU."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ubatch.modular_moe.experts.backend_choice import load_choice_table
from ubatch.modular_moe.experts.triton_configs import choice_file_name, default_config, load_table, table_file_names

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "tune_moe.py"
sys.path.insert(0, str(REPO / "benchmarks"))

from tune_moe import DRY_RUN_CONFIGS, DRY_RUN_SHAPE, DRY_RUN_TOKENS, parse_shape, search_space  # noqa: E402


def test_dry_run_writes_a_table_the_loader_reads(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    summary = tmp_path / "summary" / "tuned.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out-dir", str(tmp_path / "tables"), "--json",
                           str(summary)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    name = table_file_names(*DRY_RUN_SHAPE, "cpu", "float32", None)[0]
    choice_name = choice_file_name(*DRY_RUN_SHAPE, "cpu", "float32", None)
    assert sorted(p.name for p in (tmp_path / "tables").iterdir()) == sorted([name, choice_name])
    table = load_table(tmp_path / "tables" / name)
    assert sorted(table.entries) == list(DRY_RUN_TOKENS)
    assert all(config in DRY_RUN_CONFIGS for config in table.entries.values())
    assert f"wrote {tmp_path / 'tables' / name}" in proc.stdout
    doc = json.loads(summary.read_text())  # what gpu-check's tune_moe part reports
    assert doc["device_name"] == "cpu" and [t["shape"] for t in doc["tables"]] == [list(DRY_RUN_SHAPE)]
    rows = doc["tables"][0]["rows"]
    assert doc["tables"][0]["path"] == str(tmp_path / "tables" / name)
    assert [r["tokens"] for r in rows] == list(DRY_RUN_TOKENS) and all(r["tried"] == len(DRY_RUN_CONFIGS) for r in rows)
    assert [r["config"] for r in rows] == [table.entries[t].to_json() for t in DRY_RUN_TOKENS]
    assert all(r["ms"] > 0 and r["default_ms"] > 0 for r in rows)
    assert all(list(r["other_backends_ms"]) == ["torch"] and r["other_backends_ms"]["torch"] > 0 for r in rows)
    # the backend-choice table beside it: torch's time recorded, never chosen (it cannot be mixed per bucket)
    assert doc["tables"][0]["choice_path"] == str(tmp_path / "tables" / choice_name)
    assert f"wrote {tmp_path / 'tables' / choice_name}" in proc.stdout
    choices = load_choice_table(tmp_path / "tables" / choice_name)
    assert sorted(choices.entries) == list(DRY_RUN_TOKENS) and choices.backends == ("triton",)
    for r in rows:
        entry = choices.entries[r["tokens"]]
        assert entry.ms == {"triton": r["ms"], "torch": r["other_backends_ms"]["torch"]}
        assert r["backend"] == entry.backend == "triton"


def test_exits_2_and_says_why_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--shape", "128,768,2048"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr and "--dry-run" in proc.stderr and "Traceback" not in proc.stderr


def test_search_space_starts_at_the_default_and_caps_row_blocks() -> None:
    for tokens in (1, 64, 4096):
        space = search_space(tokens, 128)
        assert space[0] == default_config(tokens, 128)
        assert len(set(space)) == len(space)
        assert max(c.block_m for c in space) == {1: 16, 64: 64, 4096: 256}[tokens]
    assert search_space(64, 128) == search_space(64, 128)  # seeded: reruns sweep the same order
    assert {c.block_m for c in search_space(1, 128)} == {16}


def test_shape_argument() -> None:
    assert parse_shape("128,768,2048") == (128, 768, 2048)
    with pytest.raises(argparse.ArgumentTypeError, match=r"'128,768' is not E,N,K"):
        parse_shape("128,768")
