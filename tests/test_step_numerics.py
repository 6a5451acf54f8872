"""The comparison rules of ``step_numerics.py``: the same path bit-equal, different kernels or shapes within a
tolerance derived from float32's epsilon, and a 16-bit comparison refused (compare in float32), through the
helpers and through the replay check a bf16 runner would have taken."""
from __future__ import annotations

import pytest
import torch

import runner.worker.cuda_graphs as manager
from cudagraph.backends import EagerReplayBackend
from step_numerics import STEP_ULPS, assert_bit_equal, assert_steps_close, step_tolerance
from test_cudagraph_dispatch import DecodeBatches, check_replay_equals_eager, make_runner

EPS = torch.finfo(torch.float32).eps


def test_the_float32_tolerance_is_step_ulps_of_epsilon() -> None:
    assert step_tolerance(torch.float32) == STEP_ULPS * EPS and 1e-5 < step_tolerance(torch.float32) < 2e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_any_other_dtype_is_refused_naming_it(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match=rf"computed in {dtype}.*compare in float32"):
        step_tolerance(dtype)
    with pytest.raises(ValueError, match="compare in float32"):
        assert_steps_close(torch.ones(2, dtype=dtype), torch.ones(2, dtype=dtype))


def test_bit_equal_fails_on_one_unit_in_the_last_place() -> None:
    x = torch.linspace(-2, 2, 9)
    assert_bit_equal(x.clone(), x)
    with pytest.raises(AssertionError, match="the fallback not bit-equal"):
        assert_bit_equal(torch.nextafter(x, torch.full_like(x, 9.0)), x, "the fallback")


def test_steps_close_allows_reduction_order_and_catches_a_wrong_row() -> None:
    x = torch.linspace(-2, 2, 27).view(3, 9)
    assert_steps_close(x * (1 + 8 * EPS), x)  # what two summation orders do
    wrong = x.clone()
    wrong[1] = x[2]  # a row read from the wrong slot
    with pytest.raises(AssertionError, match="3 tokens"):
        assert_steps_close(wrong, x, "3 tokens")
    assert_steps_close(x + 1e-3, x, tol=2e-3)  # an explicit tolerance wins


def test_the_replay_check_refuses_a_bf16_runner() -> None:
    """A bf16 model (``dtype="auto"`` on a GPU) must not be compared replay against eager: refused, naming it."""
    r = make_runner(dtype="bfloat16", enable_dbo=False)
    try:
        batches = DecodeBatches(r, num_reqs=2)
        gr = manager.make_graph_runner(r, sizes=[1, 2], backend=EagerReplayBackend(), num_warmups=0, progress=False)
        gr.capture()
        with pytest.raises(ValueError, match=r"computed in torch\.bfloat16.*dtype='float32'"):
            check_replay_equals_eager(r, batches, gr, dbo=False, link=None, sizes=(1, 2))
    finally:
        r.close()
