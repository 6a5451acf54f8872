"""The engine-core outputs on the rank -> client link (``runner.core.requests.EngineCoreOutput``, array-like): what
a client decodes equals what the rank's engine core made, field for field, whatever fields are set."""
from __future__ import annotations

import pytest

from runner.core.logprob_rows import LogprobRows, TokenLogprobs
from runner.core.messages import ENCODER, OUTPUT_DECODER, CoreStats, Outputs
from runner.core.requests import EngineCoreOutput

FIELDS = ("request_id", "new_token_ids", "new_logprobs", "finish_reason", "stop_reason", "error",
          "num_prompt_tokens", "new_prompt_logprobs", "prompt_logprobs_start", "num_cached_tokens", "finished")

CASES = [
    EngineCoreOutput(7, [1234], num_prompt_tokens=16),
    EngineCoreOutput(2**40, [5, 6], finish_reason="length", num_prompt_tokens=3),
    EngineCoreOutput(0, [2], finish_reason="stop", stop_reason=2, num_prompt_tokens=1),
    EngineCoreOutput(3, finish_reason="error", error="prompt token id 99 is outside the vocabulary"),
    EngineCoreOutput(4, finish_reason="abort", error="the engine is shutting down"),
    EngineCoreOutput(5, [9], LogprobRows.of_entries([TokenLogprobs(9, -0.25, 1, [9, 4], [-0.25, -1.5])]),
                     num_prompt_tokens=4),
    EngineCoreOutput(6, num_prompt_tokens=8,
                     new_prompt_logprobs=LogprobRows.of_entries([TokenLogprobs(3, -2.0, 5, [], [])]),
                     prompt_logprobs_start=1),
    EngineCoreOutput(8),
    EngineCoreOutput(9, [3], num_prompt_tokens=300, num_cached_tokens=288),
]


@pytest.mark.parametrize("sent", CASES, ids=range(len(CASES)))
def test_a_client_reads_what_the_rank_made(sent: EngineCoreOutput) -> None:
    msg = OUTPUT_DECODER.decode(ENCODER.encode(Outputs(1, [sent], CoreStats(num_running=2))))
    assert isinstance(msg, Outputs) and msg.rank == 1 and msg.stats.num_running == 2
    (got,) = msg.outputs
    assert {f: getattr(got, f) for f in FIELDS} == {f: getattr(sent, f) for f in FIELDS}


def test_a_one_token_output_is_a_few_bytes() -> None:
    """Values only, without the fields' names: a one-token output of a running request (its num_cached_tokens
    came with its first output: here it is None, one byte)."""
    one = len(ENCODER.encode(Outputs(0, [CASES[0]] * 100, CoreStats())))
    none = len(ENCODER.encode(Outputs(0, [], CoreStats())))
    assert (one - none) / 100 <= 15
