"""Log-probabilities as arrays (``runner.core.logprob_rows``): what goes in comes out, row for row, through
picking, joining, scattering and the rank -> client link; mismatched arrays are refused naming their sizes."""
from __future__ import annotations

import numpy as np
import pytest

from runner.core.logprob_rows import LogprobRows, LogprobTokens, StepLogprobs, TokenLogprobs
from runner.core.messages import ENCODER, OUTPUT_DECODER, CoreStats, Outputs
from runner.core.requests import EngineCoreOutputs

ENTRIES = [TokenLogprobs(5, -0.5, 1, [5, 9, 2], [-0.5, -1.25, -3.0]),
           TokenLogprobs(9, -1.75, 3, [2, 4, 9], [-0.75, -1.0, -1.75]),
           TokenLogprobs(0, -30.0, 64, [7, 1, 3], [-0.125, -2.0, -2.5])]


def test_rows_give_back_their_entries_and_lists() -> None:
    rows = LogprobRows.of_entries(ENTRIES)
    assert len(rows) == 3 and rows.num_top == 3
    assert list(rows) == ENTRIES and rows[-1] == ENTRIES[2]
    lists = rows.lists()
    assert lists.token_ids == [5, 9, 0] and lists.ranks == [1, 3, 64]
    assert lists.top_token_ids[1] == [2, 4, 9] and lists.top_logprobs[2] == [-0.125, -2.0, -2.5]
    with pytest.raises(IndexError):
        rows[3]


def test_take_picks_rows_and_cuts_columns() -> None:
    rows = LogprobRows.of_entries(ENTRIES)
    picked = rows.take(np.array([2, 0]), num_top=1)
    assert list(picked) == [TokenLogprobs(0, -30.0, 64, [7], [-0.125]), TokenLogprobs(5, -0.5, 1, [5], [-0.5])]
    assert list(rows.take(slice(1, None))) == ENTRIES[1:]
    assert list(rows.take(slice(0, 0))) == []


def test_concat_joins_one_width_and_refuses_two() -> None:
    a, b = LogprobRows.of_entries(ENTRIES[:1]), LogprobRows.of_entries(ENTRIES[1:])
    assert list(LogprobRows.concat([a, b])) == ENTRIES
    with pytest.raises(ValueError, match=r"top widths \[1, 3\]"):
        LogprobRows.concat([a, b.take(slice(0, 2), num_top=1), b])


def test_mismatched_arrays_are_refused() -> None:
    with pytest.raises(ValueError, match="3 tokens do not agree"):
        LogprobRows.of(np.arange(3), np.zeros(2), np.ones(3), np.zeros((3, 1)), np.zeros((3, 1)))
    with pytest.raises(ValueError, match="2 request ids and 2 counts for 3"):
        LogprobTokens.of(np.arange(2), np.ones(2), LogprobRows.of_entries(ENTRIES))
    with pytest.raises(ValueError, match="different top widths"):
        LogprobRows.of_entries([ENTRIES[0], TokenLogprobs(1, -1.0, 2, [], [])])


def test_step_rows_scatter_to_their_chunks() -> None:
    """Sampled rows 0 and 2 of three asked (for 3 and 1 alternatives); the step's chunks 1, 4 and 5 sampled."""
    step = StepLogprobs(np.array([0, 2]), np.array([3, 1]), LogprobRows.of_entries([ENTRIES[0], ENTRIES[2]]), 3)
    assert list(step) == [ENTRIES[0], None, TokenLogprobs(0, -30.0, 64, [7], [-0.125])]
    chunks = step.scattered(np.array([1, 4, 5]), 6)
    assert (chunks.index() >= 0).tolist() == [False, True, False, False, False, True]
    assert chunks.index().tolist() == [-1, 0, -1, -1, -1, 1]
    assert chunks[5] == step[2] and chunks[0] is None
    assert StepLogprobs.of_entries([ENTRIES[1], None]) == StepLogprobs(np.array([0]), np.array([3]),
                                                                       LogprobRows.of_entries([ENTRIES[1]]), 2)


def test_the_client_reads_the_step_arrays_the_rank_sent() -> None:
    block = LogprobTokens.of(np.array([11, 4, 2**40]), np.array([3, 1, 2]), LogprobRows.of_entries(ENTRIES))
    sent = EngineCoreOutputs((), np.array([1, 2]), np.array([7, 8]), [block])
    msg = OUTPUT_DECODER.decode(ENCODER.encode(Outputs.of(0, sent, CoreStats())))
    assert isinstance(msg, Outputs)
    got = msg.engine_core_outputs()
    assert got.logprob_tokens == [block] and got.num_new_tokens == 5
    assert [(o.request_id, o.new_token_ids, None if o.new_logprobs is None else list(o.new_logprobs))
            for o in got] == [(1, [7], None), (2, [8], None), (11, [5], [ENTRIES[0]]),
                              (4, [9], [TokenLogprobs(9, -1.75, 3, [2], [-0.75])]),
                              (2**40, [0], [TokenLogprobs(0, -30.0, 64, [7, 1], [-0.125, -2.0])])]
