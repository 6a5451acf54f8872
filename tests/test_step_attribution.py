"""A traced engine step is explained by named phases: at most 5 % of a step is left unattributed.

One process, DBO on, the emulated link carrying the all-to-all (no gloo threads stealing the core). Steps
are cut at their DP votes; each step's unattributed share is its window minus the union of the named spans
on the CPU tracks (ubatch tracks, ``step``, ``scheduler``; handoff waits excluded, since while one ubatch
waits the other must explain the time). The median over steps is checked, so a step that lost the core to
another process cannot fail the run; and every phase the engine names must appear.
"""
from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest

from runner.models.loader import TINY_MODELS
from ubatch.trace_metrics import intersect, is_cpu_track, length, spans_from_chrome

WIDE = "test-wide-qwen3-moe"
# Wide enough that a step is mostly model work: on the 64-wide tiny model the fixed Python between spans
# (a few microseconds each, tracing included) is itself a few percent of a step.
WIDE_CONFIG = {**TINY_MODELS["tiny-qwen3-moe"], "hidden_size": 512, "intermediate_size": 512,
               "moe_intermediate_size": 128, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
               "vocab_size": 1024}
PHASES = {"schedule", "update", "dp_vote", "inputs", "sample", "ubatch_setup", "embed", "attention", "gate",
          "route", "dispatch_send", "experts", "combine_send", "handoff", "final_norm"}


@pytest.fixture(scope="module")
def traced_steps(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from runner.engine import LLM
    from runner.sampling import SamplingParams

    TINY_MODELS.setdefault(WIDE, WIDE_CONFIG)
    tmp = tmp_path_factory.mktemp("attribution")
    trace_file = tmp / "trace.json"
    llm = LLM(model=WIDE, cache_dir=str(tmp / "cache"), enable_dbo=True, dbo_cost_model="off",
              dbo_decode_token_threshold=4, dbo_prefill_token_threshold=16, max_num_seqs=64,
              emulate_link="latency_us=50,gbps=2", trace_file=str(trace_file))
    try:
        rng = random.Random(0)
        prompts = [[rng.randrange(1024) for _ in range(24)] for _ in range(48)]
        llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True), disable_progress=True)
        assert llm.last_stats.num_ubatched_steps == llm.last_stats.num_steps > 10
    finally:
        llm.close()
    return json.loads(Path(trace_file).read_text())


def test_every_named_phase_is_on_the_timeline(traced_steps: dict) -> None:
    _, spans = spans_from_chrome(traced_steps, 0)
    assert PHASES <= {s.name for s in spans}


def test_at_most_five_percent_of_a_step_is_unattributed(traced_steps: dict) -> None:
    _, spans = spans_from_chrome(traced_steps, 0)
    named = [(s.start, s.end) for s in spans if is_cpu_track(s.track) and s.cat != "wait"]
    starts = sorted(s.start for s in spans if s.name == "dp_vote")
    ends = starts[1:] + [max(s.end for s in spans)]
    shares = []
    for a, b in zip(starts, ends):
        shares.append(100 * (1 - length(intersect(named, [(a, b)])) / (b - a)))
    assert len(shares) > 10
    assert statistics.median(shares) <= 5.0, sorted(shares)
