"""benchmarks/prefix_cache_miss_cpu.py on stand-in engines: the calls alternate sides on the same new prompts,
a call that finds cached tokens is refused, and the rows say whether both sides generated the same tokens."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from prefix_cache_miss_cpu import measure


class StandInLLM:
    """Answers each prompt with its first two tokens (+1 with ``shift``); reports ``cached`` tokens per output."""

    def __init__(self, side: str, calls: list[tuple[str, list[list[int]]]], cached: int = 0, shift: int = 0):
        self.side, self.calls, self.cached, self.shift = side, calls, cached, shift
        self.closed = False

    def generate(self, prompts: list[list[int]], params: object, use_tqdm: bool) -> list[SimpleNamespace]:
        self.calls.append((self.side, prompts))
        return [SimpleNamespace(num_cached_tokens=self.cached,
                                outputs=[SimpleNamespace(token_ids=[t + self.shift for t in p[:2]])])
                for p in prompts]

    def close(self) -> None:
        self.closed = True


def prompts_of(seed: int) -> list[list[int]]:
    return [[seed, seed + 1, seed + 2]]


def test_calls_alternate_on_new_prompts_and_rows_compare_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    calls: list[tuple[str, list[list[int]]]] = []
    llms: dict[bool, StandInLLM] = {}

    def make(on: bool) -> StandInLLM:
        llms[on] = StandInLLM("on" if on else "off", calls)
        return llms[on]

    rows = measure(make, prompts_of, max_tokens=2, repeats=3, progress=lambda line: None)
    timed = [(side, p[0][0]) for side, p in calls]
    assert timed == [("off", 10_000), ("on", 10_000), ("off", 0), ("on", 0), ("on", 1), ("off", 1),
                     ("off", 2), ("on", 2), ("off", 20_000), ("on", 20_000)]
    assert [(r["caching"], r["calls"], r["same_tokens_as_off"], r["cpu_tput_vs_off"] if r["caching"] == "off"
             else None) for r in rows] == [("off", 3, "-", 1.0), ("on", 3, "yes", None)]
    assert all(llm.closed for llm in llms.values())
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_different_tokens_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # restored after measure() sets it
    rows = measure(lambda on: StandInLLM("on" if on else "off", [], shift=int(on)), prompts_of, max_tokens=2,
                   repeats=1, progress=lambda line: None)
    assert rows[1]["same_tokens_as_off"] == "no"


def test_a_call_finding_cached_tokens_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # restored after measure() sets it
    llms: list[StandInLLM] = []

    def make(on: bool) -> StandInLLM:
        llms.append(StandInLLM("on" if on else "off", [], cached=16 if on else 0))
        return llms[-1]

    with pytest.raises(RuntimeError, match=r"caching on: a 0 %-hit call found cached tokens \[16\]"):
        measure(make, prompts_of, max_tokens=2, repeats=1, progress=lambda line: None)
    assert all(llm.closed for llm in llms)


def test_repeats_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        measure(lambda on: StandInLLM("x", []), prompts_of, max_tokens=2, repeats=0, progress=lambda line: None)
